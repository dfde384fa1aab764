"""The first parse of a request body, bounded, charged and off the event loop.

Parsing multiplies memory: each JSON value becomes a Python object, and a million empty
objects (``{},{},...``, 3 bytes each) are 72 MiB of dicts from 2.9 MiB of body. So before
a body is parsed, ``parse_cost`` estimates what the parse will allocate (an upper bound,
from a scan at bytes-method speed); a body whose body + parse would exceed ``PARSE_RATIO``
times its size (plus ``PARSE_SLACK``) is refused with 413 ``body_too_complex``, and the
estimate is charged to the request's admission ticket before the parse runs::

    parsed = await parse_body(raw, charge=ticket.grow_to)   # JSONDecodeFailure, BodyTooComplex

Bodies from ``THREAD_THRESHOLD`` bytes on are scanned, parsed and fingerprinted in a worker
thread, so the event loop serves other requests meanwhile, as far as the GIL lets it: the
scan (short C calls, about 16 KiB each) and the fingerprint walk (Python) hand the GIL back
every few milliseconds, but one ``msgspec`` decode is a single C call that holds it to the
end (about 55 ms for a 64 MiB conversation, about 0.9 s for 64 MiB of token ids on the
2-core target). Refusing what exceeds the bound is what bounds that time.

The estimate counts, outside strings, the structural characters (``{`` ``[`` ``,`` ``:``),
literals and small integers; inside strings, their number and content at the widest
character size present (CPython stores a string at 1, 2 or 4 bytes per character), and
msgspec's scratch buffer for the longest string when a string has escapes. Object sizes
are CPython 3.11+ 64-bit, measured with ``tracemalloc`` (tests/test_parse.py checks the
bound on pathological and realistic shapes). Legitimate LLM bodies are mostly string
content and cost about 1-2x; token-id arrays about 4-7x; arrays of empty objects, short
strings or tiny numbers 9-40x.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio.to_thread

from . import _json
from ._exceptions import BodyTooComplex

__all__ = [
    "PARSE_RATIO",
    "PARSE_SLACK",
    "THREAD_THRESHOLD",
    "Raised",
    "charge_for",
    "in_thread",
    "in_thread_caught",
    "offload",
    "parse_body",
    "parse_cost",
    "parse_limit",
    "too_costly",
]

T = TypeVar("T")

PARSE_RATIO: Final = 8
"""A body and its parse together may take at most this many times the body's size..."""
PARSE_SLACK: Final = 64 * 1024
"""...plus this much (a small body's parse is mostly fixed overhead)."""
THREAD_THRESHOLD: Final = 256 * 1024
"""Bodies of at least this many bytes are scanned and parsed in a worker thread."""

# Bytes per value, as tracemalloc sees msgspec build them (a little above, never below):
_SLOT: Final = 9  # a list slot, with the list's growth slack (msgspec appends)
_DICT: Final = 192  # a dict with its first keys table (up to 5 keys)
_EMPTY_DICT: Final = 72
_KEY: Final = 56  # each key's share of a grown keys table
_LIST: Final = 104  # a list object and its first allocation of slots
_STR: Final = 80  # a str header (49-76 bytes, with NUL and rounding)
_INT: Final = 32  # an int up to 2**60 (28-32 bytes) or a float (24)
_SMALL_INT: Final = 28  # an int below 2**30 (at most 9 digits) or a float
_FIXED: Final = 512  # the top-level value, msgspec's decoder state

# The scan splits each chunk into its string pieces: a list of up to one piece per byte, 30x the
# chunk at worst (``["","",...]``). 16 KiB keeps that under 1 MiB whatever the body; 1 MiB chunks
# cost 33 MiB per parse, uncharged, 30x a 1 MiB body. Smaller chunks scan no slower.
_CHUNK: Final = 16 * 1024
# Outside strings: digits -> "0", number punctuation -> "x", anything else -> " ", so that
# " 0 " and " 00 " are the small integers CPython caches (-5..256; these are 0..99).
_NUMBER_CHARS: Final = bytes(0x30 if 0x30 <= b <= 0x39 else 0x78 if b in b"+-.eE" else 0x20 for b in range(256))
_BELOW_ASTRAL: Final = bytes(range(0xF0))
_ASTRAL_ESCAPE: Final = re.compile(rb"\\u[dD][89abAB]")


def parse_limit(size: int) -> int:
    """The most a body of ``size`` bytes and its parse may take together."""
    return PARSE_RATIO * size + PARSE_SLACK


def too_costly(raw: bytes) -> bool:
    """Whether ``raw`` and its parse would take more than ``parse_limit`` (``[{},{},...]``):
    the bound for any JSON the gateway parses, request bodies and upstream answers alike."""
    return len(raw) + parse_cost(raw) > parse_limit(len(raw))


def _width(chunk: bytes) -> int:
    """Bytes per character of the strings in ``chunk``, at most (1, 2 or 4)."""
    if chunk.isascii():
        if b"\\u" not in chunk:
            return 1
    elif chunk.translate(None, _BELOW_ASTRAL):  # a 4-byte UTF-8 sequence
        return 4
    return 4 if b"\\u" in chunk and _ASTRAL_ESCAPE.search(chunk) else 2


class _Tally:
    """Counts over the chunks of one body, in the order they come."""

    __slots__ = (
        "inside",
        "carry",
        "carry_width",
        "longest",
        "escaped",
        "quotes",
        "empty_strings",
        "text",
        "commas",
        "colons",
        "dicts",
        "lists",
        "empty_dicts",
        "empty_lists",
        "literals",
        "cached",
        "long_numbers",
    )

    def __init__(self) -> None:
        self.inside = False  # whether the next chunk starts inside a string
        self.carry = 0  # bytes of the string still open at the end of the last chunk...
        self.carry_width = 1  # ...and the width they were counted at
        self.longest = 0
        self.escaped = False
        self.quotes = self.empty_strings = self.text = 0
        self.commas = self.colons = self.dicts = self.lists = self.empty_dicts = self.empty_lists = 0
        self.literals = self.cached = self.long_numbers = 0

    def add(self, chunk: bytes) -> None:
        width = _width(chunk)
        escaped = b"\\" in chunk
        if escaped:
            self.escaped = True
            # Drop escaped backslashes, then escaped quotes: what is left of a string is "[^"]*".
            # Each dropped pair is one character, counted at the widest size below.
            stripped = chunk.replace(b"\\\\", b"").replace(b'\\"', b"")
            self.text += 4 * ((len(chunk) - len(stripped)) // 2)
            chunk = stripped
        pieces = chunk.split(b'"')
        quotes = len(pieces) - 1
        strings, outside = (pieces[0::2], pieces[1::2]) if self.inside else (pieces[1::2], pieces[0::2])
        del pieces
        ends_inside = self.inside ^ bool(quotes & 1)
        if strings:
            first = len(strings[0])
            if self.inside:
                # A string open since an earlier chunk is as wide as its widest part: count the
                # narrower part again at the wider size.
                wider = max(width, self.carry_width)
                self.text += (wider - self.carry_width) * self.carry + (wider - width) * first
                first += self.carry
            else:
                wider = width
            self.longest = max(self.longest, first, max(map(len, strings)))
            if ends_inside:
                if self.inside and len(strings) == 1:
                    self.carry, self.carry_width = first, wider
                else:
                    self.carry, self.carry_width = len(strings[-1]), width
            if not escaped:  # after dropping escapes, "" may have held one
                # A piece cut at the chunk's end may look empty: never count more empties than whole strings.
                self.empty_strings += max(0, strings.count(b"") - 2)
        self.inside = ends_inside
        self.quotes += quotes
        skeleton = b"".join(outside)
        del outside, strings
        self.text += width * (len(chunk) - quotes - len(skeleton))
        skeleton = skeleton.translate(None, b" \t\n\r")  # so that "{ }" is empty and " 0 " a small int
        self.commas += skeleton.count(b",")
        self.colons += skeleton.count(b":")
        self.dicts += skeleton.count(b"{")
        self.lists += skeleton.count(b"[")
        self.empty_dicts += skeleton.count(b"{}")
        self.empty_lists += skeleton.count(b"[]")
        self.literals += skeleton.count(b"true") + skeleton.count(b"false") + skeleton.count(b"null")
        # Spaces doubled, so that neighbours (" 0 0 ") do not share the space a count needs.
        numbers = skeleton.translate(_NUMBER_CHARS).replace(b" ", b"  ")
        self.cached += numbers.count(b" 0 ") + numbers.count(b" 00 ")
        if b"0000000000" in numbers:  # an int past 2**30 (or a long float): charge its digits too
            self.long_numbers += len(skeleton)

    def cost(self) -> int:
        strings = (self.quotes + 1) // 2
        containers = self.dicts + self.lists
        values = self.commas + containers - self.empty_dicts - self.empty_lists + 1
        scalars = max(0, values - containers - max(0, strings - self.colons) - self.literals - self.cached)
        scratch = 2 * self.longest if self.escaped else 0  # msgspec unescapes into a growing buffer
        number = _INT if self.long_numbers else _SMALL_INT
        return (
            _FIXED
            + _SLOT * values
            + _DICT * (self.dicts - self.empty_dicts)
            + _EMPTY_DICT * self.empty_dicts
            + _KEY * self.colons
            + _LIST * self.lists
            + _STR * max(0, strings - self.empty_strings)
            + self.text
            + scratch
            + number * scalars
            + self.long_numbers // 2
        )


def _cut(raw: bytes, start: int) -> int:
    """Where the chunk from ``start`` ends: at a comma past ``_CHUNK`` bytes (it cuts no number,
    literal or escape), else past ``_CHUNK`` bytes where the 6 bytes before hold no backslash."""
    at = start + _CHUNK
    if at >= len(raw):
        return len(raw)
    comma = raw.find(b",", at, at + _CHUNK)
    if comma >= 0:
        return comma
    while at < len(raw):
        backslash = raw.rfind(b"\\", at - 6, at)
        if backslash < 0:
            return at
        at = backslash + 7
    return len(raw)


def parse_cost(raw: bytes) -> int:
    """An upper bound of the bytes ``_json.loads_fast(raw)`` allocates (tracemalloc's peak).

    Linear in ``len(raw)``, in chunks of about 16 KiB (``_cut``): each chunk costs a few
    passes of bytes methods and a list of its string pieces (under 1 MiB). The estimate holds for any
    input: for invalid JSON the parse stops early and allocates less.
    """
    tally = _Tally()
    start = 0
    while start < len(raw):
        end = _cut(raw, start)
        tally.add(raw[start:end])
        start = end
    return tally.cost()


def stdlib_extra(raw: bytes, cost: int) -> int:
    """What ``_json.loads_stdlib`` needs beyond ``cost = parse_cost(raw)``: the decoded ``str``,
    and half again for its objects (no key cache; ``NaN`` and ``Infinity`` are float subclasses)."""
    return _width(raw) * len(raw) + cost // 2


async def offload(size: int, function: Callable[[], T]) -> T:
    """``function()``, in a worker thread when it works on ``size`` bytes from ``THREAD_THRESHOLD`` on."""
    if size < THREAD_THRESHOLD:
        return function()
    return await in_thread(function)


async def in_thread(function: Callable[[], T]) -> T:
    """``function()`` in a worker thread; what it raises is raised here, its traceback whole.

    It is caught in the thread and handed back as a value: raised through anyio's (or trio's)
    machinery, the exception is kept in a reference cycle (anyio's future, trio's outcome closures),
    with the frames of its traceback and so the body, after the request settled, until the
    collector found it."""
    result = await in_thread_caught(function)
    if isinstance(result, Raised):
        raise result.take()
    return result


async def in_thread_caught(function: Callable[[], T]) -> T | Raised:
    """``function()`` in a worker thread; what it raises comes back as a ``Raised``, for a caller that
    raises it later with ``take()`` (see ``in_thread``)."""
    return await anyio.to_thread.run_sync(_capture, function)


class Raised:
    """An exception raised in a worker thread, handed back to be raised in the event loop."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error: Exception | None = error

    def take(self) -> Exception:
        error, self.error = self.error, None  # held by nobody here once raised: no cycle through this
        assert error is not None  # taken once
        return error


def _capture(function: Callable[[], T]) -> T | Raised:
    try:
        return function()
    except Exception as exc:
        return Raised(exc)


async def parse_body(raw: bytes, *, charge: Callable[[int], Awaitable[None]]) -> Any:
    """Parse a request body within its budget: refuse, charge, parse (in a thread if large).

        ``charge(total)`` grows the request's admission ticket to ``total`` bytes (body + parse,
    less ``PARSE_SLACK``);
        ``BodyTooComplex`` is raised, before anything is parsed, for a body whose parse would
        exceed ``parse_limit`` (``valid`` when ``_json.check_unparsed`` vouched for it). Raises
        ``_json.JSONDecodeFailure`` for what is not JSON.
    """
    size = len(raw)
    cost = await offload(size, lambda: parse_cost(raw))
    if size + cost > parse_limit(size):
        # What is not JSON at all (bad syntax, bad UTF-8, 100k levels deep) is that first: 400, not
        # 413. Only a body checked to be JSON is ``valid``: it may be forwarded unparsed.
        valid = await offload(size, lambda: _json.check_unparsed(raw))
        raise BodyTooComplex(size, cost, valid=valid)
    await charge(charge_for(size, cost))
    try:
        return await offload(size, lambda: _json.loads_fast(raw))
    except _json.StdlibMayAccept:
        pass
    # NaN, Infinity, huge numbers, lone surrogates: the standard library decodes a str first.
    cost += stdlib_extra(raw, cost)
    if size + cost > parse_limit(size):
        valid = await offload(size, lambda: _json.check_unparsed(raw))
        raise BodyTooComplex(size, cost, valid=valid) from None
    await charge(charge_for(size, cost))
    return await offload(size, lambda: _json.loads_stdlib(raw))


def charge_for(size: int, cost: int) -> int:
    """What ``charge`` is asked for a body of ``size`` bytes and a working set of ``cost``."""
    # The first PARSE_SLACK bytes of a parse are, like the rest of a request's fixed overhead,
    # covered by MAX_INFLIGHT: a small body is charged its size, as before.
    return size + max(0, cost - PARSE_SLACK)
