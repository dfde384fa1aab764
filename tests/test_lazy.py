"""The lazy walk (``_lazy.shape``) against the full parse: the same verdict, or no answer at all."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_lifetime import _json, _lazy
from asgi_lifetime._fingerprint import text_comparable
from asgi_lifetime._lazy import Shape, lazy_cost, shape
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


@contextmanager
def small(limit: int) -> Iterator[None]:
    """Decode whole only values of at most ``limit`` bytes: small bodies take the piecewise walk too."""
    with mock.patch.object(_lazy, "_SMALL", limit):
        yield


LIMITS = (0, 4, 16, 64, 1 << 20)


def agrees(raw: bytes) -> list[Shape | None]:
    """``shape(raw)`` at each limit; each answer is the full parse's, or None."""
    expected = reference(raw)
    answers = []
    for limit in LIMITS:
        with small(limit):
            got = shape(raw)
        if got is not None:
            assert expected is not None, (limit, raw[:200])
            assert (got.text_comparable, got.conversation) == (expected.text_comparable, expected.conversation)
            if got.span is not None:  # where the conversation array is: what a preparer splices into
                assert got.conversation is not None
                assert _json.loads(raw[got.span[0] : got.span[1]]) == _json.loads(raw)[got.conversation]
            else:
                assert got.conversation is None
        answers.append(got)
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


def test_duplicate_keys_leave_the_decision_to_the_full_parse() -> None:
    raw = b'{"messages":[{"type":"image"}],"messages":[{"role":"user","content":"hi"}]}'
    with small(0):
        assert shape(raw) is None
    assert reference(raw) == Shape(True, "messages")  # the last one counts, as upstream parsers do


def test_a_many_turn_body_is_answered_without_its_parse() -> None:
    messages = [{"role": "user", "content": "some words " * 2000}, {"role": "assistant", "content": "ok é ’"}] * 40
    raw = compact({"model": "m", "messages": messages})
    assert len(raw) > 2 * _lazy._SMALL
    found = shape(raw)
    assert found is not None and (found.text_comparable, found.conversation) == (True, "messages")
    assert found.span is not None and raw[found.span[0] : found.span[1]] == compact(messages)
    assert lazy_cost(raw) is not None


def test_a_comma_per_few_bytes_is_left_to_the_full_parse() -> None:
    """Each comma may separate two values the walk holds a view of: it cannot tell the text's commas apart."""
    raw = compact({"messages": [{"role": "user", "content": "word, " * 20_000}]})
    assert lazy_cost(raw) is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages":[' + b",".join([b"{}"] * 100_000) + b"]}",
        b'{"messages":[' + b",".join([b"0"] * 100_000) + b"]}",
        b"{" + b",".join(b'"k%d":0' % i for i in range(50_000)) + b"}",
    ],
)
def test_dense_bodies_are_left_to_the_full_parse_and_its_bound(raw: bytes) -> None:
    assert lazy_cost(raw) is None


def test_the_bound_holds_for_what_the_walk_takes() -> None:
    """tracemalloc's peak of the walk stays under ``lazy_cost``, for shapes around the bound."""
    import tracemalloc

    bodies = [
        compact({"messages": [{"role": "user", "content": "x" * 300}] * 3000}),
        compact({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab" * 200}] * 3}] * 2000}),
        compact({"messages": [{"role": "user", "content": "λ" * 200_000}], "model": "x" * 100_000}),
        compact({"messages": [[[[["x" * 70_000] * 3] * 2]]]}),
    ]
    for raw in bodies:
        cost = lazy_cost(raw)
        assert cost is not None
        tracemalloc.start()
        try:
            assert shape(raw) is not None
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= cost, (peak, cost, len(raw))
