"""Bodies a hostile client crafts against the lazy walk (``_lazy.shape``) and the splice's ``locate``:
each answer is the full parse's or None, an item spliced at the located array lands first in the
conversation the parse keeps, and the working set stays within ``lazy_cost``."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest

from asgi_lifetime import _lazy
from asgi_lifetime._lazy import Shape, lazy_cost, locate, shape

from .test_lazy import agrees, peak_of, reference, splices

PAD = b'"pad":"' + b"x" * 70_000 + b'"'
"""Makes a body larger than ``_lazy._SMALL``: smaller ones are parsed whole, never walked."""
HI = b'[{"role":"user","content":"hi"}]'


def large(*entries: bytes) -> bytes:
    return b"{" + b",".join((*entries, PAD)) + b"}"


# Keys that end in an escaped quote followed by the conversation's name hold the marker ``"messages":``
# verbatim; the real key is written so that the marker does not find it (spaces, an escape).
FAKE_KEYS = {
    "spaced real, fake after": b"{" + PAD + b',"messages" :[],"x\\"messages":[]}',
    "escaped real, fake after": b"{" + PAD + b',"m\\u0065ssages":[],"x\\"messages":[]}',
    "spaced real with items": b"{" + PAD + b',"messages" :' + HI + b',"x\\"messages":' + HI + b"}",
    "fake nested after": b"{" + PAD + b',"messages" :[],"o":{"x\\"messages":[]}}',
    "fake before real": b'{"x\\"messages":[],' + PAD + b',"messages" :[]}',
    "backslashes then fake": b"{" + PAD + b',"messages" :[],"x\\\\\\"messages":[]}',
    "input fake": b"{" + PAD + b',"input" :[],"x\\"input":[]}',
}


@pytest.mark.parametrize("raw", FAKE_KEYS.values(), ids=FAKE_KEYS.keys())
def test_a_key_ending_in_an_escaped_quote_is_not_the_conversation(raw: bytes) -> None:
    """The splice goes into the array the parse keeps, never into another key's value that merely
    looks like ``"messages":[...]`` from its escaped quote on (the added system message would be lost)."""
    expected = reference(raw)
    assert expected is not None and expected.conversation is not None
    assert all(answer is None or answer == expected for answer in agrees(raw))
    span = locate(raw, expected.conversation)
    if span is not None:
        splices(raw, expected.conversation, span)


def test_a_key_after_an_escaped_backslash_is_located() -> None:
    """An even run of backslashes ends a string: the key after it is the conversation (found)."""
    raw = b'{"a":"x\\\\","messages":' + HI + b"," + PAD + b"}"
    span = locate(raw, "messages")
    assert span == (raw.index(HI), raw.index(HI) + len(HI))
    splices(raw, "messages", span)


@pytest.mark.parametrize("after", [b" ", b"\n\t ", b"  \r\n"])
def test_whitespace_after_the_colon_is_located(after: bytes) -> None:
    """``json.dumps``' default spelling (``"messages": [``) is spliced, not parsed."""
    raw = large(b'"model":"m"', b'"messages":' + after + HI)
    span = locate(raw, "messages")
    assert span == (raw.index(HI), raw.index(HI) + len(HI))
    splices(raw, "messages", span)


def _peak(function: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        function()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


MANY_KEYS = b",".join(b'"k%d":[1,2,{}]' % i for i in range(60_000))


@pytest.mark.parametrize(
    "raw",
    [
        b"{" + MANY_KEYS + b',"messages":' + HI + b"}",  # the array last: its prefix is checked
        b'{"messages":' + HI + b"," + MANY_KEYS + b"}",  # the array first: the rest is checked
        b'{"messages":' + HI + b"," + MANY_KEYS + b',"messages":' + HI + b"}",
    ],
    ids=["last", "first", "twice"],
)
def test_locate_stays_within_the_lazy_budget(raw: bytes) -> None:
    """``locate`` copies the prefix (or the rest) of the body once to check it, not twice: the
    charge made for the lazy look (``lazy_cost``: 1x the body more) covers it."""
    found = shape(raw)
    assert found == reference(raw) == Shape(True, "messages")
    span = locate(raw, "messages")
    assert span is not None
    splices(raw, "messages", span)
    peak = _peak(lambda: locate(raw, "messages"))
    assert peak <= lazy_cost(raw), (peak, lazy_cost(raw), len(raw))


# What held: the walk answers as the parse does, or not at all.
HOSTILE = {
    "dup: list then string": large(b'"messages":' + HI, b'"messages":"x"'),
    "dup: string then list": large(b'"messages":"x"', b'"messages":' + HI),
    "dup: list then null": large(b'"messages":' + HI, b'"messages":null'),
    "dup: list then image": large(b'"messages":' + HI, b'"messages":[{"type":"image"}]'),
    "dup: escaped last": large(b'"messages":[]', b'"m\\u0065ssages":' + HI),
    "dup: escaped first": large(b'"m\\u0065ssages":[{"type":"image"}]', b'"messages":' + HI),
    "dup: input then messages": large(b'"input":"x"', b'"messages":' + HI, b'"messages":5'),
    "nested first": large(b'"o":{"messages":[{"type":"image"}]}', b'"messages":' + HI),
    "nested only": large(b'"o":{"messages":' + HI + b"}"),
    "in a list first": large(b'"o":[{"messages":[]}]', b'"messages":' + HI),
    "spaces everywhere": b' \n{ "messages" \n: [ { "content" : "x" } ] ,' + PAD + b" } \n\t",
    "empty array spaced": large(b'"messages":[ \n ]'),
    "bom": b"\xef\xbb\xbf" + large(b'"messages":' + HI),
    "lookalike in content": large(b'"messages":[{"content":"\\"messages\\":[{\\"type\\":\\"image\\"}]"}]'),
    "lookalike before": large(b'"c":"\\"messages\\":[", "messages":' + HI),
    "backslash before lookalike": large(b'"c":"\\\\\\"messages\\":[]"', b'"messages":' + HI),
    "lone surrogate skipped": large(b'"z":"\\ud800"', b'"messages":' + HI),
    "lone surrogate in content": large(b'"messages":[{"content":"\\udc00"}]'),
    "pair in content": large(b'"messages":[{"content":"\\ud83d\\ude00"}]'),
    "surrogate in UTF-8": large(b'"messages":[{"content":"\xed\xa0\x80"}]'),
    "overlong slash": large(b'"messages":[{"content":"\xc0\xaf"}]'),
    "overlong 3": large(b'"messages":[{"content":"\xe0\x80\xaf"}]'),
    "past U+10FFFF": large(b'"messages":[{"content":"\xf4\x90\x80\x80"}]'),
    "NaN": large(b'"t":NaN', b'"messages":' + HI),
    "-Infinity in content": large(b'"messages":[{"content":-Infinity}]'),
    "1e400": large(b'"t":1e400', b'"messages":' + HI),
    "big int": large(b'"t":-123456789012345678901234567890', b'"messages":' + HI),
    "deep at the top": large(b'"z":' + b"[" * 999 + b"]" * 999, b'"messages":' + HI),
    "deeper at the top": large(b'"z":' + b"[" * 5000 + b"]" * 5000, b'"messages":' + HI),
    "deep in a message": large(b'"messages":[{"content":"x","z":' + b"{" * 3000 + b"}" * 3000 + b"}]"),
    "deep content": large(b'"messages":[{"content":' + b"[" * 900 + b'"x"' + b"]" * 900 + b"}]"),
    "deep content objects": large(b'"messages":[' + b'{"content":' * 900 + b'"x"' + b"}" * 900 + b"]"),
    "messages not objects": large(b'"messages":["a",null,["b"],1]'),
    "messages strings": large(b'"messages":["a","b"]'),
    "messages true": large(b'"messages":[true]'),
    "type escaped": large(b'"messages":[{"type":"t\\u0065xt","text":"x"}]'),
    "type image escaped": large(b'"messages":[{"type":"im\\u0061ge","text":"x"}]'),
    "type text twice": large(b'"messages":[{"type":"image","type":"text","text":"x"}]'),
    "type null": large(b'"messages":[{"type":null,"content":"x"}]'),
    "type number": large(b'"messages":[{"type":1,"content":"x"}]'),
    "type list": large(b'"messages":[{"type":["text"],"content":"x"}]'),
    "type long": large(b'"messages":[{"type":"' + b"\\u0074" * 300 + b'","content":"x"}]'),
    "type escaped all": large(
        b'"messages":[{"type":"' + b"".join(b"\\u%04x" % ord(c) for c in "function_call_output") + b'","output":"x"}]'
    ),
    "content null": large(b'"messages":[{"content":null}]'),
    "content number": large(b'"messages":[{"content":1}]'),
    "content parts odd": large(b'"messages":[{"content":[{"type":"Text","text":"x"}]}]'),
    "content parts null": large(b'"messages":[{"content":[null,"x",{"text":"y"}]}]'),
    "content escaped key": large(b'"messages":[{"c\\u006fntent":[{"type":"image"}],"text":"x"}]'),
    "audio escaped": large(b'"messages":[{"\\u0061udio":{"id":"a"},"content":"x"}]'),
    "audio null": large(b'"messages":[{"audio":null,"content":"x"}]'),
    "system image": large(b'"messages":' + HI, b'"system":[{"type":"image"}]'),
    "system escaped": large(b'"messages":' + HI, b'"syst\\u0065m":5'),
    "system twice": large(b'"system":5', b'"messages":' + HI, b'"system":"ok"'),
    "trailing garbage": large(b'"messages":' + HI) + b"x",
    "two documents": large(b'"messages":' + HI) + b"{}",
    "control char": large(b'"messages":[{"content":"a\x01b"}]'),
    "not an object": b"[" + PAD[6:] + b"]",
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_bodies_get_the_full_parse_s_answer_or_none(raw: bytes) -> None:
    agrees(raw)


_BAD_UTF8 = [b"\xff", b"\x80", b"\xc3", b"\xe2\x82", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]


@pytest.mark.parametrize("bad", _BAD_UTF8)
def test_bad_utf8_next_to_the_ascii_steps_is_seen(bad: bytes) -> None:
    """Invalid UTF-8 just before, at and after each boundary of the ASCII skip (``_UTF8_STEP``),
    after an ASCII step and after a non-ASCII one."""
    head = b'{"messages":[{"content":"'
    step = _lazy._UTF8_STEP
    for lead in (b"", "é".encode()):
        for offset in range(-5, 6):
            filler = b"a" * (20 * step + offset - len(head) - len(lead))
            for raw in (
                head + lead + filler + bad + b'"}]}',
                head + lead + filler + bad + b"b" * 70_000 + "’".encode() + b'"}]}',
            ):
                assert reference(raw) is None
                assert shape(raw) is None


@pytest.mark.parametrize("length", [4300, 4301, 4302, 8601, 8602])
@pytest.mark.parametrize("spelling", [b"%s", b"-%s", b"%s.5", b"%se5", b"-%sE-3", b'"%s"'])
def test_digit_runs_at_every_offset_of_the_sampling(length: int, spelling: bytes) -> None:
    """A run of digits placed at each offset modulo the sampling step (``int()``'s limit + 1):
    an integer ``int()`` refuses is never vouched for; a float or a string of digits is fine either way."""
    limit = sys.get_int_max_str_digits()
    assert limit == 4300
    digits = b"1" * length
    for offset in range(0, limit + 1, 61):
        raw = large(b'"p":"' + b"x" * offset + b'"', b'"messages":' + HI, b'"z":' + spelling % digits)
        expected = reference(raw)
        found = shape(raw)
        assert found is None or found == expected
        if spelling == b"%s" and length > limit:
            assert expected is None and found is None


def test_a_long_integer_is_caught_at_every_offset() -> None:
    """Exhaustively, a 4301-digit integer at each of the 4301 offsets of the sampling."""
    for offset in range(0, 4302):
        raw = large(b'"p":"' + b"x" * offset + b'"', b'"z":' + b"7" * 4301)
        assert _lazy._long_digit_run(raw), offset


def _series(item: bytes, count: int) -> bytes:
    return b",".join([item] * count)


ADVERSARIAL = {
    "tiny messages": b'{"messages":[' + _series(b'{"content":""}', 100_000) + b"]}",
    "tiny typed messages": b'{"messages":[' + _series(b'{"type":"text","text":""}', 100_000) + b"]}",
    "every field": b'{"messages":['
    + _series(b'{"type":"text","audio":null,"output":1,"parts":1,"text":1,"tool_calls":1,"content":""}', 30_000)
    + b"]}",
    "empty objects": b'{"messages":[' + _series(b"{}", 100_000) + b"]}",
    "tiny parts": b'{"messages":[{"content":[' + _series(b'{"text":""}', 100_000) + b"]}]}",
    "tiny string parts": b'{"messages":[{"content":[' + _series(b'""', 100_000) + b"]}]}",
    "lists of lists": b'{"messages":[{"content":[' + _series(b'[[""]]', 50_000) + b"]}]}",
    "large lists": b'{"messages":[{"content":[' + _series(b"[" + _series(b'""', 30_000) + b"]", 3) + b"]}]}",
    "long keys": b'{"messages":[' + _series(b'{"' + b"k" * 1000 + b'":1,"content":""}', 100) + b"]}",
    "many skipped fields": b"{" + MANY_KEYS + b',"messages":[]}',
    "skipped in a message": b'{"messages":[{"content":"","x":{' + MANY_KEYS + b"}}]}",
    "system parts": b'{"messages":[],"system":[' + _series(b'{"text":""}', 100_000) + b"]}",
    "input strings": b'{"input":[' + _series(b'"a"', 100_000) + b"]}",
    "content chains": b'{"messages":[' + _series(b'{"content":{"content":{"content":{"content":""}}}}', 20_000) + b"]}",
    "twice": b'{"messages":['
    + _series(b'{"content":""}', 50_000)
    + b'],"messages":['
    + _series(b'{"content":""}', 50_000)
    + b"]}",
    "twice, then a string": b'{"messages":['
    + _series(b'{"content":""}', 50_000)
    + b'],"messages":"x","input":['
    + _series(b'{"content":""}', 50_000)
    + b"]}",
    "a list of objects in a list": b'{"messages":[[' + _series(b'{"content":""}', 100_000) + b"]]}",
    "small lists of parts": b'{"messages":[{"content":[' + _series(b'[{"text":""},{"text":""}]', 30_000) + b"]}]}",
    "nested large lists": b'{"messages":[' + b"[" * 50 + _series(b'""', 40_000) + b"]" * 50 + b"]}",
}


@pytest.mark.parametrize("raw", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_the_walk_stays_within_its_budget(raw: bytes) -> None:
    found, peak = peak_of(raw)
    assert found is None or found == reference(raw)
    assert peak <= lazy_cost(raw), (peak, lazy_cost(raw), len(raw))


class _Counting:
    """A decoder that adds the size of each value it decodes to ``total``."""

    def __init__(self, decoder: Any, total: list[int]) -> None:
        self.decoder, self.total = decoder, total

    def decode(self, value: Any) -> Any:
        self.total[0] += len(value)
        return self.decoder.decode(value)


_BIG = b'"' + b"x" * 1_000_000 + b'"'
NESTED = {
    "arrays in messages": b'{"messages":[' + b"[" * 300 + _BIG + b"]" * 300 + b"]}",
    "arrays in content": b'{"messages":[{"content":' + b"[" * 300 + _BIG + b"]" * 300 + b"}]}",
    "content in content": b'{"messages":[' + b'{"content":' * 300 + _BIG + b"}" * 300 + b"]}",
    "parts in output": b'{"input":[' + b'{"output":{"parts":' * 150 + _BIG + b"}}" * 150 + b"]}",
    "lists of messages": b'{"messages":' + b"[" * 300 + b'{"content":' + _BIG + b"}" + b"]" * 300 + b"}",
    "system": b'{"messages":[],"system":' + b"[" * 300 + _BIG + b"]" * 300 + b"}",
    "mixed": b'{"messages":[' + b'[{"content":' * 150 + _BIG + b"}]" * 150 + b"]}",
}


@pytest.mark.parametrize("raw", NESTED.values(), ids=NESTED.keys())
def test_nesting_does_not_make_the_walk_decode_the_body_again_and_again(raw: bytes) -> None:
    """Each level of nesting inside a message is decoded once more: 300 levels around a 1 MB
    string were 300 passes over the body (2.8 s for 8 MiB nested 400 deep; its parse takes 4 ms).
    The walk gives up past a few passes (the full parse decides)."""
    total = [0]
    decoders = {name: _Counting(getattr(_lazy, name), total) for name in ("_node", "_nodes", "_views", "_whole")}
    with ExitStack() as stack:
        for name, counting in decoders.items():
            stack.enter_context(mock.patch.object(_lazy, name, counting))
        found = shape(raw)
    assert found is None or found == reference(raw)
    assert total[0] <= 24 * len(raw), total[0] / len(raw)
