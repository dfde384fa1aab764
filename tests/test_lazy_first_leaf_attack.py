"""Attacks on the lazy look's first-leaf shortcut (an array whose first item, down nested ``[``, is a
number or a boolean is judged not comparable from that byte).

- Verdict agreement (``agrees``: every walk path forced, each answer the full parse's or None): every
  kind of JSON whitespace between the ``[``, ``[`` inside strings, arrays under each field the verdict
  reads, ``[]`` before the numbers, scalars only the standard library reads, syntax errors after the
  first leaf, duplicate keys either way round, and generated documents with token-like rows under the
  conversation keys.
- Depth: a body nested within a few levels of the recursion limit decodes from one call site and not
  from a slightly deeper one. The look's top-level decode must have less room than the full parse's, or
  it vouches for a body the parse refuses (the shortcut no longer decodes the array again, deeper, as
  the walk did before it: that was what refused it).
- The gateway end to end (uvicorn on loopback, a recording upstream): the OpenAI SDK's token-id
  embeddings and completions, with and without a ``@without_parse`` preparer; hostile bodies (the key in
  a string, duplicate keys, a nested key of the same name), plain and gzip: the splice lands in the
  array the full parse keeps, the bookkeeper's fingerprint is the full parse's, and nothing is parsed.
- The middleware alone with ``handoff_parsed`` True and "on_demand": the verdict is the full parse's.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
import tracemalloc
from typing import Any, Literal

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from asgi_lifetime import _json, _lazy
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._lazy import DeferredParse, Shape, shape
from asgi_lifetime._middleware import LifetimeMiddleware, RequestLifetime
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._bookkeeping import Outcome
from asgi_lifetime.gateway._prepare import Draft, without_parse
from asgi_lifetime.testing._serve import serve_in_thread

from ._asgi import body_receive, json_scope
from .gateway.test_parse_e2e import Recorder
from .reliability.test_faults import FAST, PATH
from .test_lazy import agrees, compact, duplicated, reference

_PAD = "x" * (2 * _lazy._SMALL)


def padded(raw: bytes, *, after: bool = False) -> bytes:
    """``raw`` (an object) with a long string member before (or after) its own members: over ``_SMALL``."""
    assert raw.startswith(b"{")
    pad = b'"pad":"' + _PAD.encode() + b'"'
    if after:
        return raw[:-1] + (b"," if raw[1:-1].strip() else b"") + pad + b"}"
    return b"{" + pad + (b"," if raw[1:-1].strip() else b"") + raw[1:]


# (body, the full parse's verdict or None when it refuses the body, whether the walk must answer).
LEAVES = [
    # Whitespace of every JSON kind between the leading "[" (and none that JSON does not have).
    *[
        pytest.param(b'{"input":[' + ws + b"[" + ws + b"1" + ws + b"]" + ws + b"]}", False, True, id=f"ws-{ws!r}")
        for ws in (b" ", b"\t", b"\n", b"\r", b" \t\n\r \r\n")
    ],
    pytest.param(b'{"input":[\x0c1]}', None, False, id="form feed is not JSON whitespace"),
    pytest.param(b'{"input":[\x0b[1]]}', None, False, id="vertical tab is not JSON whitespace"),
    pytest.param(b'{"input":[\xc2\xa0[1]]}', None, False, id="no-break space is not JSON whitespace"),
    # "[" and digits inside strings: the first leaf is the string.
    pytest.param(b'{"input":["[1",2]}', False, True, id="bracket digit in a string, then a number"),
    pytest.param(b'{"input":["[1"]}', True, True, id="bracket digit in a string only"),
    pytest.param(b'{"input":[["[",["1"]]]}', True, True, id="nested strings of brackets"),
    pytest.param(b'{"note":"\\"input\\":[[1]]","input":["a"]}', True, True, id="the key and ids in a string"),
    pytest.param(b'{"input":["\\u005b1"]}', True, True, id="escaped bracket in a string"),
    # Empty arrays before the first leaf.
    pytest.param(b'{"input":[[],[1]]}', False, True, id="empty row then ids"),
    pytest.param(b'{"input":[[[]],[[]],1]}', False, True, id="empty nests then a number"),
    pytest.param(b'{"input":[[ ],"a"]}', True, True, id="spaced empty row then text"),
    pytest.param(b'{"input":[[[],[]]]}', True, True, id="only empty rows"),
    pytest.param(b'{"input":[]}', True, True, id="empty conversation"),
    # Each scalar kind as the first leaf.
    pytest.param(b'{"input":[-1]}', False, True, id="negative"),
    pytest.param(b'{"input":[-0.0e-0]}', False, True, id="negative zero float"),
    pytest.param(b'{"input":[[0]]}', False, True, id="zero"),
    pytest.param(b'{"input":[true]}', False, True, id="true"),
    pytest.param(b'{"input":[[false,"a"]]}', False, True, id="false then text"),
    pytest.param(b'{"input":[null,[true]]}', False, True, id="null then true"),
    pytest.param(b'{"input":[null]}', True, True, id="null alone"),
    pytest.param(b'{"input":[[null],["a"]]}', True, True, id="null rows"),
    # Not JSON, or JSON only the standard library reads: never an answer the parse does not give.
    pytest.param(b'{"input":[-]}', None, False, id="a lone minus"),
    pytest.param(b'{"input":[[-]]}', None, False, id="a lone minus nested"),
    pytest.param(b'{"input":[-a]}', None, False, id="minus then a letter"),
    pytest.param(b'{"input":[tru]}', None, False, id="truncated true"),
    pytest.param(b'{"input":[fals,1]}', None, False, id="truncated false"),
    pytest.param(b'{"input":[01]}', None, False, id="leading zero"),
    pytest.param(b'{"input":[+1]}', None, False, id="plus sign"),
    pytest.param(b'{"input":[.5]}', None, False, id="bare fraction"),
    pytest.param(b'{"input":[[1,]]}', None, False, id="trailing comma after the leaf"),
    pytest.param(b'{"input":[[1 2]]}', None, False, id="missing comma after the leaf"),
    pytest.param(b'{"input":[[1],}', None, False, id="unclosed after the leaf"),
    pytest.param(b'{"input":[[1,"\xff"]]}', None, False, id="bad UTF-8 after the leaf"),
    pytest.param(b'{"input":[[1],"\xed\xa0\x80"]}', None, False, id="encoded surrogate after the leaf"),
    pytest.param(b'{"input":[[1e400]]}', False, False, id="overflowing float"),
    pytest.param(b'{"input":[-1E+400,"a"]}', False, False, id="overflowing negative float"),
    pytest.param(b'{"input":[-Infinity]}', False, False, id="minus infinity"),
    pytest.param(b'{"input":[NaN,1]}', False, False, id="NaN first"),
    pytest.param(b'{"input":[[1,"\\ud800"]]}', False, False, id="lone surrogate after the leaf"),
    pytest.param(b'{"input":[[' + b"9" * 5000 + b"]]}", None, False, id="integer too long for int"),
    pytest.param(b'{"input":[[' + b"9" * 4300 + b"]]}", False, False, id="integer as long as int takes"),
    pytest.param(b'{"input":[[' + b"9" * 30 + b"]]}", False, False, id="integer past 64 bits"),
    pytest.param(b'{"input":[[-' + b"9" * 30 + b"]]}", False, False, id="negative integer past 64 bits"),
    # Arrays under each field the verdict reads.
    pytest.param(b'{"messages":[{"role":"user","content":[[1734,290]]}]}', False, True, id="content ids"),
    pytest.param(b'{"messages":[{"role":"user","content":[[],["a"]]}]}', True, True, id="content empty then text"),
    pytest.param(b'{"contents":[{"parts":[[true]]}]}', False, True, id="parts true"),
    pytest.param(b'{"input":[{"type":"function_call_output","output":[[7]]}]}', False, True, id="output ids"),
    pytest.param(b'{"input":[{"type":"function_call","arguments":[[7]]}]}', True, True, id="opaque call"),
    pytest.param(b'{"messages":[{"role":"assistant","tool_calls":[1,2]}]}', True, True, id="tool_calls ids"),
    pytest.param(b'{"messages":[{"role":"assistant","text":[1]}]}', False, True, id="text ids"),
    pytest.param(b'{"messages":[{"content":"a"}],"system":[[1]]}', False, True, id="system ids"),
    pytest.param(b'{"messages":[{"content":"a"}],"system":[[],["s"]]}', True, True, id="system text"),
    pytest.param(b'{"system":[[1]],"model":"m"}', False, True, id="system without a conversation"),
    pytest.param(b'{"input":[{"content":[{"content":[[false]]}]}]}', False, True, id="ids two objects deep"),
    pytest.param(b'{"input":[{"content":"a"},{"content":[[1]]}]}', False, True, id="text message then ids"),
    pytest.param(b'{"input":[{"type":"text","text":"a"},[3]]}', False, True, id="object then a row"),
    pytest.param(b'{"input":[{"type":"image"},[[1]]]}', False, True, id="image then a row"),
    pytest.param(b'{"input":[{"audio":null,"content":[[1]]}]}', False, True, id="null audio then ids"),
    # Duplicate keys: the last counts, at the top and in a message.
    pytest.param(b'{"input":[[1]],"input":["a"]}', True, True, id="top ids then text"),
    pytest.param(b'{"input":["a"],"input":[[1]]}', False, True, id="top text then ids"),
    pytest.param(b'{"input":[[1]],"input":"a"}', True, True, id="top ids then a string"),
    pytest.param(b'{"input":"a","input":[true]}', False, True, id="top string then true"),
    pytest.param(b'{"messages":[{"content":[[1]],"content":"a"}]}', True, True, id="content ids then text"),
    pytest.param(b'{"messages":[{"content":"a","content":[[1]]}]}', False, True, id="content text then ids"),
    pytest.param(b'{"messages":[{"content":[1],"content":null}]}', True, True, id="content ids then null"),
    pytest.param(b'{"input":[[1]],"messages":["a"]}', True, True, id="messages first whatever the order"),
    pytest.param(b'{"messages":[[1]],"input":["a"]}', False, True, id="messages ids beat input text"),
    pytest.param(b'{"system":[[1]],"messages":[],"system":"s"}', True, True, id="system ids then text"),
]


@pytest.mark.parametrize(("raw", "expected", "answered"), LEAVES)
@pytest.mark.parametrize("size", ["small", "padded before", "padded after"])
def test_the_first_leaf_agrees_with_the_full_parse(
    raw: bytes, expected: bool | None, answered: bool, size: str
) -> None:
    body = raw if size == "small" else padded(raw, after=size == "padded after")
    truth = reference(body)
    assert (truth.text_comparable if truth is not None else None) is expected
    answers = agrees(body)
    if answered:
        assert all(answer is not None for answer in answers), answers


# --- depth: the look must not vouch for a body the parse refuses as too deep -------------------------------


DEEP = {
    "input": (b'{"input":', b"}"),
    "padded input": (b'{"pad":"' + _PAD.encode() + b'","input":', b"}"),
    "content": (b'{"messages":[{"content":', b"}]}"),
    "parts": (b'{"contents":[{"parts":', b"}]}"),
    "system": (b'{"messages":[],"system":', b"}"),
    "a key nobody reads": (b'{"messages":[{"content":"a","x":', b"}]}"),
}


@pytest.mark.parametrize("leaf", [b"1", b"true", b"-2", b'"a"', b"[]"])
@pytest.mark.parametrize("where", sorted(DEEP))
def test_nesting_near_the_depth_limit_is_answered_only_when_the_parse_succeeds(where: str, leaf: bytes) -> None:
    """Around the recursion limit (1,000 by default) the full parse fails or not depending on how deep
    in the stack it runs. Every depth from well below to past it: the look agrees or says None."""
    before, after = DEEP[where]
    limit = sys.getrecursionlimit()
    refused = 0
    for depth in range(limit - 80, limit + 15):
        raw = before + b"[" * depth + leaf + b"]" * depth + after
        agrees(raw)
        refused += reference(raw) is None
    assert refused > 0  # the sweep reached the parse's limit


@pytest.mark.parametrize("depth", [2, 50, 400])
def test_deep_but_reasonable_token_rows_are_still_judged_without_a_parse(depth: int) -> None:
    rows = b"[" * (depth - 1) + b",".join([b"[" + b",".join([b"1734"] * 400) + b"]"] * 80) + b"]" * (depth - 1)
    raw = b'{"model":"m","input":' + rows + b"}"
    assert reference(raw) == Shape(False, "input")
    tracemalloc.start()
    try:
        assert shape(raw) == Shape(False, "input")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(raw) // 4, (peak, len(raw))


# --- generated documents: token-like rows under the conversation keys ------------------------------------


_SCALARS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet='ab "\\{}:é\n', max_size=4),
)
_ROWS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=12)
_PART = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["text", "image", "function_call", "function_call_output"]),
        "content": _ROWS,
        "output": _ROWS,
        "parts": _ROWS,
        "text": _ROWS,
        "tool_calls": _ROWS,
        "audio": st.none() | st.just({"id": "a"}),
    },
)
_VALUE = st.recursive(_ROWS | _PART, lambda inner: st.lists(inner, max_size=3) | _PART, max_leaves=10)
_DOCS = st.dictionaries(
    st.sampled_from(["messages", "input", "contents", "system", "model", "prompt"]), _VALUE, max_size=4
)
_WHITESPACE = [b"", b" ", b"\t", b"\n", b"\r", b" \r\n\t "]


def scattered(doc: Any, rng: random.Random) -> bytes:
    """``doc`` compact, with random JSON whitespace after each ``[`` and ``,`` (its strings hold neither)."""
    raw = compact(doc)
    out = bytearray()
    for byte in raw:
        out.append(byte)
        if byte in b"[,":
            out += rng.choice(_WHITESPACE)
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_DOCS, seed=st.integers(0, 2**32))
def test_generated_rows_get_the_full_parse_verdict(doc: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    raw = scattered(doc, rng)
    agrees(raw)
    agrees(padded(raw, after=rng.random() < 0.5))
    agrees(duplicated(raw, rng))


# --- the gateway end to end --------------------------------------------------------------------------------


_POLICY = {"role": "system", "content": "policy"}
_INSERTED = _json.dumps(_POLICY) + b","


@without_parse
def policy(draft: Draft) -> None:
    if draft.conversation is not None:
        draft.conversation.prepend(_POLICY)


class Book:
    """A bookkeeper that keeps each outcome's fingerprint."""

    def __init__(self) -> None:
        self.fingerprints: list[Any] = []

    def record(self, outcome: Outcome) -> None:
        self.fingerprints.append(outcome.fingerprint)


def _rows(n: int, width: int) -> list[list[int]]:
    return [[100 + (i * 7919 + j * 104729) % 90_000 for j in range(width)] for i in range(n)]


def _spy_all(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record the start of every full parse: the middleware's and ``DeferredParse.parse``'s
    (``parse_body``), and any other (``_json.loads``)."""
    from asgi_lifetime import _middleware

    parses: list[bytes] = []
    for module in (_middleware, _lazy):
        real = module.parse_body

        async def counting(raw: bytes, *, _real: Any = real, **kwargs: Any) -> Any:
            parses.append(raw[:16])
            return await _real(raw, **kwargs)

        monkeypatch.setattr(module, "parse_body", counting)
    real_loads = _json.loads

    def loads(raw: bytes) -> Any:
        parses.append(bytes(raw[:16]))
        return real_loads(raw)

    monkeypatch.setattr(_json, "loads", loads)
    return parses


def _top_level_input(raw: bytes, occurrence: int = -1) -> int:
    """Just after the ``[`` of the top-level ``input`` array (the last written, unless ``occurrence``)."""
    spans: list[int] = []
    at = raw.find(b'"input"')
    while at >= 0:
        colon = raw.find(b":", at) + 1
        bracket = colon + len(raw[colon:]) - len(raw[colon:].lstrip(b" \t\n\r"))
        if raw[bracket : bracket + 1] == b"[":
            spans.append(bracket + 1)
        at = raw.find(b'"input"', at + 1)
    return spans[occurrence]


@pytest.mark.parametrize("with_preparer", [False, True])
def test_the_sdk_token_inputs_are_spliced_byte_for_byte_without_a_parse(
    with_preparer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    parses = _spy_all(monkeypatch)
    upstream = Recorder()
    book = Book()
    sent: list[bytes] = []

    def record(request: Any) -> None:  # the SDK's own httpx
        sent.append(request.read())

    rows = _rows(40, 1500)  # about 400 KiB: the look runs in a worker thread
    with serve_in_thread(upstream) as upstream_url:
        settings_ = LifetimeSettings(upstream_url=(upstream_url,), **FAST)
        app = create_app(settings_, preparers=[policy] if with_preparer else [], bookkeeper=book)
        with (
            serve_in_thread(app) as url,
            openai.DefaultHttpxClient(event_hooks={"request": [record]}, timeout=30) as http,
        ):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, http_client=http)
            client.embeddings.with_raw_response.create(model="e", input=rows, encoding_format="float")
            client.completions.with_raw_response.create(model="m", prompt=rows[0] * 50, max_tokens=1)
    parsed_in_full = list(parses)
    assert len(sent) == len(upstream.bodies) == len(book.fingerprints) == 2
    embedded, completed = sent
    if with_preparer:
        at = _top_level_input(embedded)
        assert upstream.bodies[0] == embedded[:at] + _INSERTED + embedded[at:]
    else:
        assert upstream.bodies[0] == embedded
    assert upstream.bodies[1] == completed  # no conversation to add to: as sent
    assert book.fingerprints == [fingerprint(embedded), fingerprint(completed)]
    assert not book.fingerprints[0].text_comparable
    assert parsed_in_full == []  # neither body was parsed in full


# Hostile bodies around a large token array the preparer adds to: (body, whether it is spliced unparsed).
_IDS = compact(_rows(60, 1200))
HOSTILE = {
    "the key in a string before": (b'{"model":"m","note":"\\"input\\":[[1,2]] [[","input":' + _IDS + b"}", True),
    "a nested key of the same name": (b'{"meta":{"input":[[9]]},"input":' + _IDS + b"}", True),
    "ids then text under the same key": (b'{"input":' + _IDS + b',"model":"m","input":[["a"]]}', True),
    "text then ids under the same key": (b'{"input":[["a"]],"model":"m","input":' + _IDS + b"}", True),
    "spaced rows": (b'{"input":  [ \n[ ' + _IDS[2:] + b"}", True),
    "a space before the colon": (b'{"input" :' + _IDS + b"}", False),
}


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_token_bodies_are_spliced_where_the_parse_reads(
    name: str, encoding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw, unparsed = HOSTILE[name]
    parsed = json.loads(raw)
    expected = {**parsed, "input": [_POLICY, *parsed["input"]]}
    parses = _spy_all(monkeypatch)
    upstream = Recorder()
    book = Book()
    headers = {"content-type": "application/json"}
    content = raw
    if encoding == "gzip":
        headers["content-encoding"] = "gzip"
        content = gzip.compress(raw)
    with serve_in_thread(upstream) as upstream_url:
        settings_ = LifetimeSettings(upstream_url=(upstream_url,), **FAST)
        app = create_app(settings_, preparers=[policy], bookkeeper=book)
        with serve_in_thread(app) as url:
            response = httpx.post(f"{url}{PATH}", content=content, headers=headers, timeout=30)
    parsed_in_full = list(parses)
    assert response.status_code == 200, response.text
    (forwarded,) = upstream.bodies
    assert json.loads(forwarded) == expected
    if unparsed:
        at = _top_level_input(raw)
        assert forwarded == raw[:at] + _INSERTED + raw[at:]
        assert parsed_in_full == []
    assert book.fingerprints == [fingerprint(raw)]


@pytest.mark.anyio
@pytest.mark.parametrize("handoff", [True, "on_demand"])
async def test_the_middleware_hands_over_the_full_parse_verdict(handoff: bool | Literal["on_demand"]) -> None:
    raw = b'{"model":"e","input":' + _IDS + b"}"
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        lifetime: RequestLifetime = scope["state"]["lifetime"]
        seen.extend((lifetime.take_parsed(), lifetime.fingerprint))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(app, settings=LifetimeSettings(paths=("/v1/",)), handoff_parsed=handoff)
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await middleware(json_scope(raw), body_receive(raw), send)
    assert sent[0]["status"] == 204
    taken, fp = seen
    assert fp == fingerprint(raw) and not fp.text_comparable
    if handoff is True:
        assert taken == json.loads(raw)
    else:
        assert isinstance(taken, DeferredParse) and taken.shaped and taken.conversation == "input"
        assert await taken.locate(raw) == (_top_level_input(raw) - 1, len(raw) - 1)
    assert middleware.stats().idle
