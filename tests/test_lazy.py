"""The lazy walk (``_lazy.shape``) against the full parse: the same verdict, or no answer at all."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_lifetime import _json, _lazy
from asgi_lifetime._fingerprint import _NODE_KEYS, text_comparable
from asgi_lifetime._lazy import Shape, lazy_cost, locate, shape
from asgi_lifetime.gateway._refold import Conversation

from .test_fingerprint import _NODES, CORPUS, _bodies, _twisted


def reference(raw: bytes) -> Shape | None:
    """What the full parse says (today's path): None when it refuses the body."""
    try:
        parsed = _json.loads(raw)
    except _json.JSONDecodeFailure:
        return None
    conversation = Conversation.of(parsed)
    return Shape(text_comparable(parsed), conversation.key if conversation is not None else None)


class _Refusing:
    """A decoder whose every decode fails validation: the walk takes its other path."""

    def decode(self, value: Any) -> Any:
        raise msgspec.ValidationError("refused")


_NEVER = _Refusing()

# Each path of the walk, forced: the typed top-level pass failing (the views of each key instead),
# arrays of objects failing (decoded whole, or as views), and nothing decoded whole.
CONFIGS: dict[str, dict[str, Any]] = {
    "typed": {},
    "views at the top": {"_tops": _NEVER},
    "no node lists": {"_nodes": _NEVER},
    "no piece whole": {"_nodes": _NEVER, "_SMALL": 0},
}


@contextmanager
def configured(name: str) -> Iterator[None]:
    with ExitStack() as stack:
        for attribute, value in CONFIGS[name].items():
            stack.enter_context(mock.patch.object(_lazy, attribute, value))
        yield


def splices(raw: bytes, key: str, span: tuple[int, int]) -> None:
    """What the gateway does with a span: an item inserted there lands first in the conversation the
    full parse reads, and nothing else changes."""
    start, end = span
    assert raw[start : start + 1] == b"[" and raw[end - 1 : end] == b"]"
    empty = raw[start + 1 : end - 1].strip(b" \t\n\r") == b""
    spliced = raw[: start + 1] + b'"inserted"' + (b"" if empty else b",") + raw[start + 1 :]
    before, after = _json.loads(raw), _json.loads(spliced)
    assert after.pop(key) == ["inserted", *before.pop(key)]
    assert after == before


def agrees(raw: bytes) -> list[Shape | None]:
    """``shape(raw)`` on each path; each answer is the full parse's, or None. Where the conversation
    is located (``locate``), an item spliced there lands in the conversation the parse reads."""
    expected = reference(raw)
    answers = []
    for name in CONFIGS:
        with configured(name):
            got = shape(raw)
        if got is not None:
            assert got == expected, (name, raw[:200])
        answers.append(got)
    if expected is not None and expected.conversation is not None:
        span = locate(raw, expected.conversation)
        if span is not None:
            splices(raw, expected.conversation, span)
    return answers


def compact(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


def _unique_compact(doc: Any) -> bool:
    """Whether ``doc`` encodes as msgspec writes it with a finite number everywhere (then the walk must answer)."""
    try:
        raw = msgspec.json.encode(doc)
    except (TypeError, UnicodeEncodeError, OverflowError):
        return False
    try:
        return bool(msgspec.json.decode(raw) == doc)
    except msgspec.DecodeError:
        return False


_SPELLINGS = st.sampled_from(["compact", "msgspec", "spaced", "ascii", "indent", "newline"])


def spell(doc: Any, how: str) -> bytes:
    if how == "msgspec":
        try:
            return msgspec.json.encode(doc)
        except (TypeError, UnicodeEncodeError, OverflowError, ValueError):
            return compact(doc)
    if how == "spaced":
        return json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if how == "ascii":
        return json.dumps(doc, separators=(",", ":")).encode()
    if how == "indent":
        return json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if how == "newline":
        return compact(doc) + b"\n"
    return compact(doc)


# Byte-level changes that the full parse judges differently or refuses: each must not fool the walk.
_MUTATIONS = (
    lambda raw, at: raw[:at] + b"\xff" + raw[at:],  # invalid UTF-8 (inside a string, or a syntax error)
    lambda raw, at: raw[:at] + b"\xed\xa0\x80" + raw[at:],  # a surrogate encoded in UTF-8
    lambda raw, at: raw[:at] + b"\\ud800" + raw[at:],  # a lone surrogate escape
    lambda raw, at: raw[:at] + b'\\"' + raw[at:],  # an escaped quote
    lambda raw, at: raw[:at] + b"NaN" + raw[at:],
    lambda raw, at: raw[:at] + b"1e400" + raw[at:],
    lambda raw, at: raw[:at] + b"1" * 25 + raw[at:],
    lambda raw, at: raw[:at] + b" \n\t" + raw[at:],
    lambda raw, at: raw[:at] + b"," + raw[at:],
    lambda raw, at: raw[:at] + raw[at + 1 :],
    lambda raw, at: raw[:at],
)


def duplicated(raw: bytes, rng: random.Random) -> bytes:
    """``raw`` with one object's first entry written twice, the copy with another value."""
    starts = [i for i, byte in enumerate(raw) if byte == ord("{") and raw[i + 1 : i + 2] == b'"']
    if not starts:
        return raw
    start = rng.choice(starts)
    colon = raw.find(b'":', start)
    if colon < 0:
        return raw
    key = raw[start + 1 : colon + 2]
    other = rng.choice([b'"x",', b"1,", b"null,", b'[{"type":"image"}],', b'"\xff",', b"1e400,"])
    return raw[: start + 1] + key + other + raw[start + 1 :]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_bodies(_NODES) | _twisted(), how=_SPELLINGS, seed=st.integers(0, 2**32))
def test_same_verdict_as_the_full_parse(doc: Any, how: str, seed: int) -> None:
    raw = spell(doc, how)
    answers = agrees(raw)
    if how in ("compact", "msgspec", "newline") and isinstance(doc, dict) and _unique_compact(doc):
        assert all(answer is not None for answer in answers), raw[:200]  # the walk answers what it should
    rng = random.Random(seed)
    at = rng.randrange(len(raw) + 1)
    agrees(rng.choice(_MUTATIONS)(raw, at))
    agrees(duplicated(raw, rng))


@pytest.mark.parametrize(("raw", "expected"), CORPUS)
def test_corpus(raw: bytes, expected: bool) -> None:
    for answer in agrees(raw):
        assert answer is None or answer.text_comparable is expected


@pytest.mark.parametrize(
    "raw",
    [
        # duplicate keys: the last one counts for both; the first is still checked by the full parse
        b'{"messages":[{"type":"image"}],"messages":[{"role":"user","content":"hi"}]}',
        b'{"messages":[{"role":"user","content":"hi"}],"messages":[{"type":"image"}]}',
        b'{"messages":"\xff","messages":[{"role":"user","content":"hi"}]}',
        b'{"messages":[{"role":"user","content":"hi","content":[{"type":"image"}]}]}',
        b'{"messages":[{"role":"user","content":"a\\"b\\\\"}]}',
        b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}',
        b'{"messages":[{"role":"user","content":"\\ud800"}]}',
        b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
        b'{"messages":[{"role":"user","content":"x"}],"n":1' + b"0" * 5000 + b"}",
        b'{"messages":[{"role":"user","content":"x"}],"t":1e400}',
        b'{"messages":[{"role":"user","content":"x"}],"t":NaN}',
        b' \n{"messages":[]}\n ',
        b'{ "messages" : [ ] }',
        b'{"\\u006dessages":[{"type":"image"}]}',
        b'[{"messages":[]}]',
        b'"messages"',
        b"",
        b"{}",
        b'{"messages":' + b"[" * 2000 + b"]" * 2000 + b"}",
        b'{"messages":' + b"[" * 500 + b'"x"' + b"]" * 500 + b"}",
    ],
)
def test_hostile_bodies(raw: bytes) -> None:
    agrees(raw)


def test_duplicate_keys_count_as_the_full_parse_counts_them() -> None:
    raw = b'{"messages":[{"type":"image"}],"messages":[{"role":"user","content":"hi"}]}'
    assert reference(raw) == Shape(True, "messages")  # the last one counts, as upstream parsers do
    assert all(answer == Shape(True, "messages") for answer in agrees(raw))
    assert locate(raw, "messages") == (raw.rindex(b"["), len(raw) - 1)


def test_the_walk_reads_the_keys_the_verdict_reads() -> None:
    assert frozenset(_lazy._Node.__struct_fields__) == _NODE_KEYS


def test_a_many_turn_body_is_answered_without_its_parse() -> None:
    messages = [{"role": "user", "content": "some words " * 2000}, {"role": "assistant", "content": "ok é ’"}] * 40
    raw = compact({"model": "m", "messages": messages})
    assert len(raw) > 2 * _lazy._SMALL
    assert shape(raw) == Shape(True, "messages")
    span = locate(raw, "messages")
    assert span is not None and raw[span[0] : span[1]] == compact(messages)


def test_commas_in_the_text_cost_nothing() -> None:
    """The walk holds views of what it reads, not one object per comma: a text full of commas is
    judged without the parse (the estimate from the commas left it to the full parse)."""
    raw = compact({"messages": [{"role": "user", "content": "word, " * 20_000}]})
    assert peak_of(raw) == (Shape(True, "messages"), peak_of(raw)[1])
    assert peak_of(raw)[1] < len(raw) // 4


def _large(value: Any, key: str = "input") -> bytes:
    """``{key: value}`` padded past ``_SMALL`` (so the walk, not the full parse, judges it)."""
    return compact({"model": "m", "pad": "x" * (2 * _lazy._SMALL), key: value})


# Arrays whose first leaf (down leading "[") is a number or a boolean, and arrays where it is not: the
# first are judged from that byte, the others walked as before. Spacing inside the leading "[" too.
# The flag: the walk answers for the large body (a float only the standard library reads: the full
# parse decides, as before).
FIRST_LEAF = [
    pytest.param(b'{"input":[[1734,290],[5]]}', True, id="token rows"),
    pytest.param(b'{"input":[ [ \n\t-0.5, 2] ]}', True, id="spaced negative float"),
    pytest.param(b'{"input":[[[true]]]}', True, id="boolean three deep"),
    pytest.param(b'{"input":[false,"a"]}', True, id="boolean then text"),
    pytest.param(b'{"input":[[],[1]]}', True, id="empty first row"),
    pytest.param(b'{"input":[[],[]]}', True, id="empty rows only"),
    pytest.param(b'{"input":["a",1]}', True, id="text then a number"),
    pytest.param(b'{"input":[null,[2]]}', True, id="null then a number"),
    pytest.param(b'{"input":[{"type":"text","text":"a"},[3]]}', True, id="object then a row"),
    pytest.param(b'{"messages":[{"role":"user","content":[[7,8]]}]}', True, id="ids in a message"),
    pytest.param(b'{"messages":[{"role":"user","content":[["a"],[7]]}]}', True, id="text row then ids in a message"),
    pytest.param(b'{"input":[[1e400]]}', False, id="a float only the standard library reads"),
]


@pytest.mark.parametrize(("raw", "answered"), FIRST_LEAF)
def test_arrays_are_judged_from_their_first_leaf_as_the_full_parse_judges_them(raw: bytes, answered: bool) -> None:
    doc = json.loads(raw)
    for body in (raw, _large(doc.get("input"), "input") if "input" in doc else _large(doc["messages"], "messages")):
        answers = agrees(body)
        if body is not raw and answered:  # large: the walk answers (token rows gave up at their views' cost)
            assert all(answer is not None for answer in answers), answers


def test_token_ids_are_judged_without_a_view_per_id() -> None:
    """Pre-tokenized input (the OpenAI SDK's embeddings ``input``): judged "not comparable" from its
    first id, where one view per id (64 bytes per 5 bytes of body) gave up and left it to the full parse,
    a Python int per id (about 6x the body)."""
    rng = random.Random(0)
    rows = [[rng.randrange(10_000, 100_000) for _ in range(512)] for _ in range(400)]
    raw = compact({"model": "text-embedding-3-small", "input": rows})
    found, peak = peak_of(raw)
    assert found == reference(raw) == Shape(False, "input")
    assert peak < len(raw) // 50, (peak, len(raw))


def peak_of(raw: bytes) -> tuple[Shape | None, int]:
    """``shape(raw)`` and tracemalloc's peak while it ran."""
    tracemalloc.start()
    try:
        found = shape(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return found, peak


DENSE = [
    b'{"messages":[' + b",".join([b"{}"] * 100_000) + b"]}",
    b'{"messages":[' + b",".join([b'{"content":[{"type":"text","text":""}]}'] * 30_000) + b"]}",
    b'{"messages":[{"content":[' + b",".join([b"[0]"] * 100_000) + b"]}]}",
    b'{"messages":[{"content":[' + b",".join([b'{"":{}}'] * 40_000) + b"]}]}",
    b'{"input":[' + b",".join([b"[]"] * 100_000) + b"]}",
]


@pytest.mark.parametrize("raw", DENSE)
def test_dense_bodies_are_left_to_the_full_parse_within_the_bound(raw: bytes) -> None:
    """The walk counts what it builds as it builds it and gives up at its budget (``lazy_cost``)."""
    found, peak = peak_of(raw)
    assert found is None or found == reference(raw)
    assert peak <= lazy_cost(raw), (peak, lazy_cost(raw), len(raw))


def test_the_bound_holds_for_what_the_walk_takes() -> None:
    """tracemalloc's peak of the walk stays under ``lazy_cost``, for shapes around the bound."""
    bodies = [
        compact({"messages": [{"role": "user", "content": "x" * 300}] * 3000}),
        compact({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab" * 200}] * 3}] * 2000}),
        compact({"messages": [{"role": "user", "content": "λ" * 200_000}], "model": "x" * 100_000}),
        compact({"messages": [[[[["x" * 70_000] * 3] * 2]]]}),
        compact({"input": [{"type": "message", "content": [[["x" * 10] * 20] * 30]}] * 300}),
    ]
    for raw in bodies:
        found, peak = peak_of(raw)
        assert found is not None and found == reference(raw)
        assert peak <= lazy_cost(raw), (peak, lazy_cost(raw), len(raw))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"messages":[1],"meta":{"messages":[1]}}', (12, 15)),
        (b'{"meta":{"messages":[1]},"messages":[1]}', (36, 39)),
        (b'{"meta":"\\"messages\\":[1]","messages":[1]}', (38, 41)),
        (b'{"messages":[1],"messages":[1]}', (27, 30)),
        (b'{"messages":[2],"messages":[1]}', (27, 30)),
        (b'{"messages":[1],"\\u006dessages":[1]}', None),
        (b'{"messages" : [1]}', None),
        (b'{"messages":"x"}', None),
        (b'{"messages":[ ]}', (12, 15)),
        (b'{"messages":[1]', None),
    ],
)
def test_locate_finds_the_top_level_array_the_parse_keeps(raw: bytes, expected: tuple[int, int] | None) -> None:
    assert locate(raw, "messages") == expected
    if expected is not None:
        splices(raw, "messages", expected)
