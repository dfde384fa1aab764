"""Attacks on bodies too costly to parse, now that one nobody needs the parse of is forwarded unparsed.

The gateway runs under uvicorn on a loopback port in front of a recording upstream. Covered here:

- "forwarded unparsed" must mean "valid JSON": a body over the parse bound that is not JSON
  (bad UTF-8 inside a string, trailing data, a syntax error after a ``NaN`` or a lone surrogate
  escape, where msgspec's skim stops) is a 400 ``invalid_json`` with nothing forwarded, as a small
  one is, and one only the standard library parses (``NaN``, ``Infinity``, lone surrogate escapes,
  huge numbers) is forwarded as received, as any valid one; an integer too long for ``int()``
  cannot be told from a digit run in a string without the parse: 413; gzip changes nothing;
- the default refold and role remap re-parse the outbound body: a body the lazy look forwarded
  unparsed (nesting in every message, 40x when parsed) is not parsed there either: the upstream's
  rejection goes to the client, and no parse ran;
- what holds: valid token-id-like bodies go through (plain and gzip), the admission budget is
  exact afterwards, a too-costly body with a preparer is still refused before any preparer runs,
  and 100k levels of nesting are a 400.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from asgi_lifetime import _json
from asgi_lifetime._lazy import lazy_cost
from asgi_lifetime._parse import too_costly
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway._prepare import Draft

from .._asgi import body_receive, json_scope
from ..gateway.test_parse_e2e import JSON, OVERFLOW, ROLE, Recorder, gateway, policy
from .test_faults import PATH, assert_idle, error_code, eventually

pytestmark = pytest.mark.anyio

# Over the parse bound (a million-value shape, 2.4 MiB here): what goes before the closing brace varies.
_EMPTY = b'{"model":"m","messages":[' + b",".join([b"{}"] * 300_000) + b"]"
VALID = _EMPTY + b"}"

NOT_JSON = {
    "bad_utf8_in_a_string": _EMPTY + b',"x":"\xff\xfe"}',
    "trailing_garbage": _EMPTY + b"}x",
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    # msgspec's skim stops at what only the standard library parses: the rest must be checked too.
    "syntax_error_after_nan": _EMPTY + b',"x":NaN,}',
    "syntax_error_after_infinity": _EMPTY + b',"x":-Infinity,"y":Nope}',
    "syntax_error_after_lone_surrogate": _EMPTY + b',"x":"\\ud800",}',
    "control_character_after_lone_surrogate": _EMPTY + b',"x":"\\ud800","y":"\x01"}',
}
# Valid JSON only the standard library parses: forwarded as received, as the rest.
STDLIB_ONLY = {
    "nan": _EMPTY + b',"x":NaN}',
    "infinity": _EMPTY + b',"x":-Infinity,"y":Infinity}',
    "lone_surrogate": _EMPTY + b',"x":"\\ud800","y":"\\\\udfff"}',
    "huge_number": _EMPTY + b',"x":1e400,"y":' + b"9" * 4000 + b"}",
}
# Over 4300 digits int() refuses, but such a run is valid in a string or a float: without the parse it
# cannot be told, so it is refused as too complex (nothing forwarded).
LONG_DIGITS = _EMPTY + b',"x":1' + b"1" * 5000 + b"}"


def test_the_bodies_are_what_the_tests_say() -> None:
    for raw in (VALID, LONG_DIGITS, *NOT_JSON.values(), *STDLIB_ONLY.values()):
        assert too_costly(raw) or raw == NOT_JSON["deep_nesting"]
    for raw in (LONG_DIGITS, *NOT_JSON.values()):
        with pytest.raises(_json.JSONDecodeFailure):
            _json.loads(raw)
    for raw in (VALID, *STDLIB_ONLY.values()):
        _json.loads(raw)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
@pytest.mark.parametrize("name", sorted(NOT_JSON))
async def test_a_body_too_costly_that_is_not_json_is_refused_and_not_forwarded(name: str, encoding: str) -> None:
    raw = NOT_JSON[name]
    headers = dict(JSON)
    content = raw
    if encoding == "gzip":
        headers["content-encoding"] = "gzip"
        content = gzip.compress(raw, compresslevel=1)
    upstream = Recorder()
    with gateway(upstream) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=content, headers=headers)
            assert response.status_code == 400 and error_code(response) == "invalid_json", response.text
        assert upstream.bodies == []
        stats = await assert_idle(app, url)
        assert stats["inflight_bytes"] == 0


async def test_a_body_too_costly_with_an_integer_too_long_is_refused() -> None:
    upstream = Recorder()
    with gateway(upstream) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=LONG_DIGITS, headers=JSON)
            assert response.status_code == 413 and error_code(response) == "body_too_complex", response.text
        assert upstream.bodies == []
        await assert_idle(app, url)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
@pytest.mark.parametrize("name", ["valid", *sorted(STDLIB_ONLY)])
async def test_a_valid_body_too_costly_is_forwarded_as_received_and_the_budget_comes_back(
    name: str, encoding: str
) -> None:
    raw = STDLIB_ONLY.get(name, VALID)
    headers = dict(JSON)
    content = raw
    if encoding == "gzip":
        headers["content-encoding"] = "gzip"
        content = gzip.compress(raw, compresslevel=1)
    upstream = Recorder()
    # A budget that admits the body but not its parse (8x): nothing of an estimate may be kept.
    budget = 4 * len(raw)
    with gateway(upstream, max_body_bytes=budget, max_inflight_bytes=budget) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for _ in range(3):
                response = await client.post(PATH, content=content, headers=headers)
                assert response.status_code == 200, response.text
        assert upstream.bodies == [raw] * 3
        stats = await assert_idle(app, url)
        assert stats["inflight_bytes"] == 0 and stats["too_large"] == 0


async def test_a_valid_body_too_costly_with_a_preparer_that_raises_is_refused_before_it_runs() -> None:
    ran: list[str] = []

    def raising(draft: Draft) -> None:
        ran.append(draft.path)
        raise RuntimeError("never reached for this body")

    upstream = Recorder()
    with gateway(upstream, preparers=[policy, raising]) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=VALID, headers=JSON)
            assert response.status_code == 413 and error_code(response) == "body_too_complex"
        assert upstream.bodies == [] and ran == []
        await assert_idle(app, url)


# --- the refold and the role ladder re-parse the outbound body -----------------------------------------

# Each message nests 80 lists: the lazy look judges it piece by piece (no comma, little to hold), the
# full parse builds a list per two bytes (about 40x the body).
_NESTED = b'{"role":"user","content":' + b"[" * 80 + b"]" * 80 + b"}"
NESTED = b'{"model":"m","messages":[{"role":"developer","content":"be brief"},' + b",".join([_NESTED] * 12_000) + b"]}"


def test_the_nested_body_is_judged_lazily_and_too_costly_to_parse() -> None:
    assert lazy_cost(NESTED) is not None and too_costly(NESTED)


@pytest.mark.parametrize("with_preparer", [False, True])
@pytest.mark.parametrize("rejection", ["overflow", "role"])
async def test_a_refold_or_role_remap_does_not_parse_a_body_too_costly(
    rejection: str, with_preparer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the context-overflow refold (and the role remap) parsed the 2 MiB body on the event
    loop into about 90 MB, uncharged, and sent the refolded body. Now the rejection is relayed."""
    parsed: list[int] = []
    real = _json.loads

    def spying(raw: bytes) -> Any:
        parsed.append(len(raw))
        return real(raw)

    monkeypatch.setattr(_json, "loads", spying)
    error = OVERFLOW if rejection == "overflow" else ROLE
    upstream = Recorder(rejections=[error])
    with gateway(upstream, preparers=[policy] if with_preparer else []) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=NESTED, headers=JSON)
        assert response.status_code == 400 and response.content == error
        (forwarded,) = upstream.bodies
        assert forwarded == NESTED if not with_preparer else len(forwarded) > len(NESTED)
        assert not [size for size in parsed if size >= len(NESTED)]  # no parse of the body anywhere
        stats = await assert_idle(app, url)
        assert stats["inflight_bytes"] == 0


async def test_a_refold_of_an_ordinary_large_body_still_happens() -> None:
    """The bound keeps what it should: a large conversation within it is refolded as before."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 1000} for i in range(301)]
    raw = json.dumps({"model": "m", "messages": turns}).encode()
    upstream = Recorder(rejections=[OVERFLOW])
    with gateway(upstream) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=raw, headers=JSON)
        assert response.status_code == 200
        first, second = upstream.bodies
        assert first == raw and len(second) < len(raw)
        await assert_idle(app, url)


# --- the checks themselves ---------------------------------------------------------------------------------


CHECK_CORPUS = [
    b"[NaN, Nope]",
    b"[NaN,1NaN]",
    b"[NaN]",
    b'{"a":NaN}',
    b"{NaN:1}",
    b"[-Infinity,Infinity]",
    b"[--Infinity]",
    b"[+Infinity]",
    b"[-NaN]",
    b'["\\ud800", NaN]',
    b'["\\ud800",]',
    b'["\\ud800"]',
    b'["\\\\ud800"]',
    b'["\\uD800\\udfff"]',
    b'["a\x01b", NaN]',
    b'["\\udzz0", NaN]',
    b'["\\ud"]',
    b"[1e400]",
    b'["\xff", NaN]',
    b"[" * 1000 + b"NaN" + b"]" * 1000,
    b"[" * 3000 + b"NaN" + b"]" * 3000,
    b"[1" + b"0" * 4300 + b"]",
]


@pytest.mark.parametrize("raw", CHECK_CORPUS, ids=range(len(CHECK_CORPUS)))
def test_check_unparsed_agrees_with_the_parse(raw: bytes) -> None:
    """Never vouches (True) for what the parse refuses; refuses (``JSONDecodeFailure``) only what it refuses."""
    try:
        _json.loads(raw)
    except _json.JSONDecodeFailure:
        try:
            vouched = _json.check_unparsed(raw)
        except _json.JSONDecodeFailure:
            return
        assert vouched is False  # the one it cannot tell: an integer over 4300 digits
        assert raw == CHECK_CORPUS[-1]
    else:
        assert _json.check_unparsed(raw) is True


def test_check_unparsed_does_not_vouch_for_a_digit_run_int_refuses_and_stays_linear() -> None:
    assert _json.check_unparsed(b'["a",1' + b"1" * 4300 + b"]") is False
    assert _json.check_unparsed(b'["1' + b"1" * 4300 + b'"]') is False  # valid, but not told apart
    # Many runs just under the limit: a regex would retry every start inside each (quadratic).
    many = b"[" + b",".join([b'"' + b"1" * 4300 + b'"'] * 2000) + b"]"
    assert _json.check_unparsed(many) is True


@pytest.mark.anyio
async def test_a_body_the_standard_library_refuses_gives_back_its_parse_charge() -> None:
    """msgspec refuses it (NaN), the standard library's parse is charged and fails (a syntax error
    after the NaN): the app then runs charged for the body only, not for a parse that does not exist."""
    from asgi_lifetime._middleware import LifetimeMiddleware
    from asgi_lifetime._settings import LifetimeSettings

    raw = b'{"t":NaN,"m":[' + b",".join([b'"' + b"some words " * 20 + b'"'] * 2_000) + b"],}"
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(middleware.lifetime.stats().inflight_bytes)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(app, settings=LifetimeSettings(paths=("/v1/",)))
    messages: list[Any] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await middleware(json_scope(raw), body_receive(raw), send)
    assert messages[0]["status"] == 204
    assert seen == [len(raw)]
    assert middleware.lifetime.stats().inflight_bytes == 0


# --- the SDKs: pre-tokenized inputs and many-block messages, with and without a preparer ---------------------


@pytest.mark.parametrize("with_preparer", [False, True])
def test_sdk_bodies_too_costly_to_parse_are_forwarded_without_preparers_and_refused_with_one(
    with_preparer: bool,
) -> None:
    """Without preparers the gateway forwards them as sent; with one (even ``@without_parse``) a body the
    lazy look cannot vouch for within its budget (a message of 100,000 one-letter blocks) would have to
    be parsed first, which is too costly: a 413 the SDK raises, nothing forwarded. Token ids are judged
    by the look from their first id (not text), without a view per id: the embeddings input is an
    ``input`` array to the preparer, as in a small body (the policy's message goes first), and the
    completion's prompt (no conversation to add to) is forwarded as sent."""
    import anthropic
    import openai

    from asgi_lifetime.gateway import create_app
    from asgi_lifetime.testing._serve import serve_in_thread

    from .test_attack_sdk import _EchoSize, _tokens
    from .test_faults import FAST

    upstream = _EchoSize()
    tokens = _tokens()
    blocks = [{"type": "text", "text": "a"} for _ in range(100_000)]
    conversation: Any = [{"role": "user", "content": blocks}]
    with serve_in_thread(upstream) as upstream_url:
        settings = LifetimeSettings(upstream_url=(upstream_url,), **FAST)
        app = create_app(settings, preparers=[policy] if with_preparer else [])
        with serve_in_thread(app) as url:
            with (
                openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
                anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as ant,
            ):

                def embeddings() -> Any:
                    return oai.embeddings.with_raw_response.create(model="e", input=tokens, encoding_format="float")

                def completions() -> Any:
                    return oai.completions.with_raw_response.create(model="m", prompt=tokens[0] * 62, max_tokens=1)

                def messages() -> Any:
                    return ant.messages.with_raw_response.create(model="claude", max_tokens=1, messages=conversation)

                for call in (embeddings, completions, messages):
                    if with_preparer and call is messages:
                        with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as raised:
                            call()
                        error: Any = raised.value
                        assert error.status_code == 413 and "body_too_complex" in error.response.text
                    else:
                        assert call().status_code == 200
                assert len(upstream.bodies) == (2 if with_preparer else 3)
                policy_first = [{"role": "system", "content": "policy"}] if with_preparer else []
                assert json.loads(upstream.bodies[0])["input"] == policy_first + tokens
                assert json.loads(upstream.bodies[1])["prompt"] == tokens[0] * 62
                if not with_preparer:
                    assert json.loads(upstream.bodies[2])["messages"][0]["content"] == blocks
            stats = httpx.get(f"{url}/lifetime/stats").json()
            assert stats["inflight_requests"] == 0 and stats["inflight_bytes"] == 0


async def test_sessions_and_gateway_keys_see_a_body_too_costly_as_any_other() -> None:
    """A stranger is refused before the body is read (401); a keyed client's session gets ``on_change``
    per wire hash, with the verdict "not comparable", as a body that is not JSON would."""
    from asgi_lifetime._fingerprint import Fingerprint
    from asgi_lifetime.gateway import create_app
    from asgi_lifetime.testing._serve import serve_in_thread

    from .test_faults import FAST

    changes: list[tuple[str, Fingerprint]] = []
    upstream = Recorder()
    other = _EMPTY + b',"x":1}'
    with serve_in_thread(upstream) as upstream_url:
        # Gateway keys are checked when the gateway injects an upstream key.
        settings = LifetimeSettings(upstream_url=(upstream_url,), **FAST).replace(
            gateway_keys=("gk",), upstream_api_key="sk-upstream"
        )
        app = create_app(settings, on_change=lambda sid, fp: changes.append((sid, fp)))
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                stranger = await client.post(PATH, content=b"{}", headers=JSON)
                assert stranger.status_code == 401 and upstream.bodies == []
                keyed = {**JSON, "authorization": "Bearer gk", "x-session-id": "s1"}
                for raw in (VALID, VALID, other):
                    assert (await client.post(PATH, content=raw, headers=keyed)).status_code == 200
            assert upstream.bodies == [VALID, VALID, other]
            await eventually(lambda: len(changes) == 2)  # bookkeeping runs after the response was sent
            assert [(sid, fp.size, fp.text_comparable) for sid, fp in changes] == [
                ("s1", len(VALID), False),
                ("s1", len(other), False),
            ]
            await eventually(lambda: app.state.lifetime.stats().inflight_requests == 0)
            assert app.state.lifetime.stats().inflight_bytes == 0
