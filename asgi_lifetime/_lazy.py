"""A body's verdict without its parse: what the fingerprint and the gateway need, in one typed pass.

The fingerprint's verdict looks at a few fields of each message; building a Python object for
every string of a 64 MiB conversation (about 1.3x the body, up to 24x for pathological
shapes) only to drop it again is what ``shape`` avoids. One msgspec pass decodes the top-level
object into a struct that keeps only the conversation (``messages``, ``input``, ``contents``) as
a list of ``_Node`` structs and ``system``; each node holds the fields the verdict reads
(``_fingerprint._NODE_KEYS``) as ``msgspec.Raw`` views into the body, every other field is
skipped (checked, not built). A node's ``content`` that is a string or ``null`` is judged by
its first byte; an array or object is decoded the same way, one at a time::

    found = shape(raw)        # Shape(text_comparable=..., conversation="messages"), or None
    if found is None:         # only the full parse can tell: parse as before (_parse.parse_body)
        ...

``shape`` answers only when the full parse (``_json.loads``) would succeed, and then its
verdict is ``text_comparable`` of that parse: msgspec checks the syntax of every byte as it
skips, the UTF-8 of the whole body is checked once (``_utf8``, skipping ASCII runs), and a run
of digits longer than ``int()`` converts is left to the full parse (``_long_digit_run``).
Whatever it cannot vouch for returns ``None``: not an object at the top, invalid JSON or UTF-8,
what only the standard library accepts (``NaN``, lone surrogate escapes), a body nested past
msgspec's depth limit or within ``_DEPTH_MARGIN`` levels of it (that limit is what is left of the
recursion limit where the decode runs: the full parse, run a few calls deeper, could refuse it).
Duplicate keys are decoded as the full parse does: the last one counts, the others are checked
like any value.

Memory: the walk counts what it holds as it decodes it (``_Node.__post_init__``: a node and its
views; a piece decoded whole, what ``_parse.parse_cost`` says it takes) and gives up (``None``: the
full parse decides, within its own bound) past ``lazy_cost``, the budget charged before it runs.
Time: what it decodes again below the top level (an array or object inside a message, once per
level of nesting) is counted too (``_spend``); past ``_PASSES`` times the body it gives up the same way.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import operator
import re
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec
import msgspec.structs

from . import _json
from ._exceptions import MalformedBody
from ._fingerprint import _CONVERSATION_KEYS, _OPAQUE_TYPES, _TEXT_TYPES, judge
from ._parse import PARSE_SLACK, charge_for, offload, parse_body, parse_cost

T = TypeVar("T")

__all__ = ["LAZY_RATIO", "DeferredParse", "Shape", "inspect_body", "lazy_cost", "locate", "shape"]

LAZY_RATIO: Final = 2
"""A body and the lazy walk's working set together take at most this many times its size (+ PARSE_SLACK):
the walk gives up past ``lazy_cost``."""

_SMALL: Final = 64 * 1024
"""Bodies of at most this many bytes are parsed whole (it costs as little); inside a large body, an
array or object of at most this many bytes that is not a list of objects is decoded whole."""
_UNIT: Final = 48
"""What the walk counts in: a ``msgspec.Raw`` view as tracemalloc sees msgspec build it. A ``_Node``
(72) with its list slot takes two, and one more per view it holds."""
_VIEW_COST: Final = 64
"""Bytes per element of a large array that is not a list of objects, held as views: a ``msgspec.Raw``
(48) and its list slot, rounded up."""
_NAME: Final = 256
"""A part type's name is at most this many bytes (a text type's name, every character escaped)."""
_UTF8_STEP: Final = 4 * 1024
_MAX_CANDIDATES: Final = 16
_PASSES: Final = 8
"""The walk decodes again at most this many times the body's size (past the top-level pass), each
time in up to three scans (a list of nodes tried, its commas counted, its views): a conversation
nests a few levels (message, parts, a tool result's parts), each decoded once more."""
_DIGITS: Final = b"0123456789"
_SPACE: Final = re.compile(rb"[ \t\n\r]*")
_QUOTE, _ARRAY, _OBJECT, _NULL = ord('"'), ord("["), ord("{"), ord("n")
_SCALAR_STARTS: Final = frozenset(b"-0123456789tf")
"""First bytes of a number or a boolean: values that are not text."""
_DEPTH_MARGIN: Final = 32
"""The walk's top-level decode runs this many calls further down the stack than it was called from.
msgspec's depth limit is what is left of the recursion limit where it runs: a body nested within a
few levels of it decodes from one call site and not from another. The full parse may run a few calls
deeper (``parse_body``, ``DeferredParse.parse`` from a preparer): what decodes here with this much
less room decodes there too, so the walk never vouches for a body the full parse refuses as too deep
(nothing below the top level is decoded again when an array is judged by its first leaf)."""

_ABSENT: Final = msgspec.Raw(b"")
"""A field's default: no JSON value is empty, so a field still holding it was not in the object."""


class _Unsure(Exception):
    """Only the full parse can tell."""


class _Allowance(threading.local):
    """How many more ``_UNIT`` the walk may take, per thread (walks of several requests run at once):
    an iterator that runs dry past the budget, so that counting costs a node a few ``next()``."""

    units: Iterator[None] = itertools.repeat(None, 0)
    work = 0
    """Bytes the walk may still decode again (``_spend``)."""


_allowance: Final = _Allowance()


def _grant(nbytes: int) -> None:
    """Let the walk hold ``nbytes`` more (or give back what it no longer holds); ``_Unsure`` below 0."""
    if nbytes < 0:
        raise _Unsure
    _allowance.units = itertools.repeat(None, nbytes // _UNIT)


def _spend(nbytes: int) -> None:
    """Count ``nbytes`` more decoded again (an array or object inside a message): ``_Unsure`` past
    ``_PASSES`` times the body (the full parse decides, in one pass). Each level of nesting decodes
    what it holds once more: without this, a body nested 400 deep around one 8 MiB string took 2.8 s
    (its full parse, 4 ms)."""
    _allowance.work -= nbytes
    if _allowance.work < 0:
        raise _Unsure


def _left() -> int:
    return operator.length_hint(_allowance.units) * _UNIT


def _decode(decoder: msgspec.json.Decoder[T], value: msgspec.Raw | bytes) -> T:
    try:
        return decoder.decode(value)
    except StopIteration:  # _Node.__post_init__: over the budget
        raise _Unsure from None


class _Node(msgspec.Struct, gc=False):
    """An object the verdict may look into: the fields ``_fingerprint``'s walk reads, as views."""

    type: msgspec.Raw = _ABSENT
    audio: msgspec.Raw = _ABSENT
    content: msgspec.Raw = _ABSENT
    output: msgspec.Raw = _ABSENT
    parts: msgspec.Raw = _ABSENT
    text: msgspec.Raw = _ABSENT
    tool_calls: msgspec.Raw = _ABSENT

    def __post_init__(self) -> None:
        # msgspec calls this as it decodes each node: the walk's memory is counted as it grows
        # (StopIteration past the budget). The node, its slot and a view; then any other view.
        units = _allowance.units
        next(units), next(units), next(units)
        absent = _ABSENT
        if (
            self.type is not absent
            or self.audio is not absent
            or self.output is not absent
            or self.parts is not absent
            or self.text is not absent
            or self.tool_calls is not absent
        ):
            for _ in range(6 - msgspec.structs.astuple(self).count(absent)):
                next(units)


class _Top(msgspec.Struct, gc=False):
    """The top-level object, as the verdict reads it; any other key is skipped."""

    messages: list[_Node] | msgspec.UnsetType = msgspec.UNSET
    input: list[_Node] | msgspec.UnsetType = msgspec.UNSET
    contents: list[_Node] | msgspec.UnsetType = msgspec.UNSET
    system: msgspec.Raw = _ABSENT


class _TopViews(msgspec.Struct, gc=False):
    """The same keys as views, whatever they hold (a string ``input``, a list of strings...)."""

    messages: msgspec.Raw = _ABSENT
    input: msgspec.Raw = _ABSENT
    contents: msgspec.Raw = _ABSENT
    system: msgspec.Raw = _ABSENT


_tops = msgspec.json.Decoder(_Top)
_top_views = msgspec.json.Decoder(_TopViews)
_nodes = msgspec.json.Decoder(list[_Node])
_node = msgspec.json.Decoder(_Node)
_views = msgspec.json.Decoder(list[msgspec.Raw])
_names = msgspec.json.Decoder(str)
_whole = msgspec.json.Decoder(msgspec.Raw)


@dataclass(frozen=True, slots=True)
class Shape:
    """What the gateway needs of a JSON body before anything changes it."""

    text_comparable: bool
    """``_fingerprint.text_comparable`` of the full parse."""
    conversation: str | None
    """``Conversation.of``'s key: the first of ``messages``, ``input``, ``contents`` holding an array."""


class DeferredParse:
    """A JSON body whose parse was not built (``handoff_parsed="on_demand"``): what the lazy walk
    found, and how to charge the parse to the request if someone needs it after all.

    It holds no part of the body: the caller passes the body to ``parse``.
    """

    __slots__ = ("conversation", "shaped", "_charge")

    def __init__(self, found: Shape | None, charge: Callable[[int], Awaitable[None]]) -> None:
        self.shaped = found is not None
        """False for a body nobody looked into (its parse would cost too much): whether it has a
        conversation is unknown, and ``parse`` refuses it (413)."""
        self.conversation = found.conversation if found is not None else None
        """``Shape.conversation``: the key of the conversation array, if any."""
        self._charge = charge

    async def parse(self, raw: bytes) -> Any:
        """The full parse of ``raw`` (the body this was made for), bounded and charged as the first
        parse is (``_parse.parse_body``: 413 ``body_too_complex`` when it would take too much)."""
        try:
            return await parse_body(raw, charge=self._charge)
        except _json.JSONDecodeFailure:  # the walk vouched for it: a body that is not this one
            raise MalformedBody("request body is not valid JSON", code="invalid_json") from None

    async def locate(self, raw: bytes) -> tuple[int, int] | None:
        """``locate(raw, conversation)``, in a worker thread for a large body."""
        key = self.conversation
        if key is None:
            return None
        return await offload(len(raw), lambda: locate(raw, key))

    def __repr__(self) -> str:
        return f"<DeferredParse conversation={self.conversation!r}>"


def lazy_cost(raw: bytes) -> int:
    """The most ``shape(raw)`` allocates: it gives up (None) rather than take more."""
    return (LAZY_RATIO - 1) * len(raw) + PARSE_SLACK


def shape(raw: bytes) -> Shape | None:
    """The verdict and conversation key of ``raw``, if the full parse would succeed; else None."""
    _grant(lazy_cost(raw))
    _allowance.work = _PASSES * len(raw)
    try:
        found = _deeper(_DEPTH_MARGIN, lambda: _look(raw))
        if not _utf8(raw) or _long_digit_run(raw):
            return None
    except (_Unsure, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    finally:
        _grant(0)
    return found


def _look(raw: bytes) -> Shape:
    """The verdict from the top-level decode (typed, else as views), as ``shape`` gives it."""
    try:
        return _typed(_decode(_tops, raw))
    except msgspec.ValidationError:  # a conversation that is not a list of objects, or not an object at all
        _grant(lazy_cost(raw))  # the nodes decoded so far are gone
        return _viewed(_decode(_top_views, raw))


def _deeper(calls: int, function: Callable[[], T]) -> T:
    """``function()``, ``calls`` calls further down the stack (``_DEPTH_MARGIN``). Each goes through
    ``functools.partial`` (C) into Python: it takes a level of the recursion limit msgspec counts
    against, on every Python version (from 3.12, Python-to-Python calls no longer take one)."""
    if calls <= 0:
        return function()
    return functools.partial(_deeper, calls - 1, function)()


async def inspect_body(raw: bytes, *, charge: Callable[[int], Awaitable[None]]) -> Shape | None:
    """``shape(raw)`` within its bound, charged first (``charge(total)`` as in ``parse_body``), in a
    worker thread for a large body. None for a small body (its full parse costs as little) and
    for one the lazy walk cannot vouch for: parse it."""
    size = len(raw)
    if size <= _SMALL:
        return None
    await charge(charge_for(size, lazy_cost(raw)))
    return await offload(size, lambda: shape(raw))


def _typed(top: _Top) -> Shape:
    """The verdict of a body whose conversation decoded as nodes (the common case)."""
    for key in _CONVERSATION_KEYS:
        nodes = getattr(top, key)
        if nodes is not msgspec.UNSET:
            comparable = _nodes_comparable(nodes) and (top.system is _ABSENT or _comparable(top.system))
            return Shape(text_comparable=comparable, conversation=key)
    return Shape(text_comparable=False, conversation=None)


def _viewed(top: _TopViews) -> Shape:
    """The verdict when some conversation key holds something else than a list of objects."""
    key = next((k for k in _CONVERSATION_KEYS if getattr(top, k) is not _ABSENT), None)
    conversation = next((k for k in _CONVERSATION_KEYS if _first(getattr(top, k)) == _ARRAY), None)
    if key is None:
        return Shape(text_comparable=False, conversation=conversation)
    comparable = _comparable(getattr(top, key)) and (top.system is _ABSENT or _comparable(top.system))
    return Shape(text_comparable=comparable, conversation=conversation)


def _first(value: msgspec.Raw) -> int:
    """The first byte of a value's JSON (``-1`` for an absent field)."""
    return memoryview(value)[0] if value is not _ABSENT else -1


def _nodes_comparable(nodes: list[_Node]) -> bool:
    """``text_comparable``'s walk over a list of objects; the common message (a string or null
    ``content``, no ``type`` or ``audio``) is judged here, the others by ``_node_comparable``."""
    for node in nodes:
        content = node.content
        if node.type is _ABSENT and node.audio is _ABSENT and content is not _ABSENT:
            first = memoryview(content)[0]
            if first == _QUOTE or first == _NULL:
                continue
        if not _node_comparable(node):
            return False
    return True


def _node_comparable(node: _Node) -> bool:
    """``text_comparable``'s walk from an object (``_fingerprint._comparable``, one branch per rule)."""
    if node.type is not _ABSENT:
        name = _name(node.type)
        if name not in _TEXT_TYPES:
            return False
        if name in _OPAQUE_TYPES:
            return True
    if node.audio is not _ABSENT and _first(node.audio) != _NULL:
        return False
    for child in (node.content, node.output, node.parts):
        if child is not _ABSENT:
            return _comparable(child)
    return _first(node.text) == _QUOTE or _first(node.tool_calls) == _ARRAY


def _name(value: msgspec.Raw) -> str | None:
    """A ``type`` value that may be a text type's name, decoded; None for any other."""
    if _first(value) != _QUOTE or len(value) > _NAME:
        return None
    return _names.decode(value)


def _comparable(value: msgspec.Raw) -> bool:
    """``text_comparable``'s walk from any value: strings and null are, numbers and booleans are not;
    an object or array is decoded (what it holds counted, and given back once judged)."""
    first = _first(value)
    if first == _QUOTE or first == _NULL:
        return True
    if first != _ARRAY and first != _OBJECT:
        return False
    if first == _ARRAY and _first_leaf(value) in _SCALAR_STARTS:
        # Its first item is (or begins, down nested arrays, with) a number or a boolean: not comparable,
        # whatever follows. Token ids (``[[1734, 290, ...], ...]``) are judged so without one view per id.
        return False
    _spend(len(value))
    left = _left()
    try:
        if first == _OBJECT:
            return _node_comparable(_decode(_node, value))
        try:
            return _nodes_comparable(_decode(_nodes, value))
        except msgspec.ValidationError:  # not only objects: a list of strings, of lists...
            pass
        if len(value) <= _SMALL:
            piece = bytes(value)
            _grant(left - len(piece) - parse_cost(piece))
            return judge(_json.loads_fast(piece))
        _grant(left - len(value))  # a copy, to count its commas: one view per element at most
        _grant(left - _VIEW_COST * (bytes(value).count(b",") + 1))
        for item in _views.decode(value):
            if not _comparable(item):
                return False
        return True
    except _json.JSONDecodeFailure:  # the standard library's numbers: the full parse decides
        raise _Unsure from None
    finally:
        _grant(left)  # what was decoded here is gone


def _first_leaf(value: msgspec.Raw) -> int:
    """The first byte of the first item of ``value`` (an array) that is not itself an array, down the
    leading ``[``; ``]`` if that array is empty. The top-level decode has checked the syntax."""
    view = memoryview(value)
    at = 0
    while view[at] == _ARRAY:
        at = _skip_space(view, at + 1)
    return view[at]


def _utf8(raw: bytes) -> bool:
    """Whether ``raw`` is UTF-8: ``UnicodeDecodeError`` if not. Runs of ``_UTF8_STEP`` ASCII bytes
    are skipped (``bytes.isascii`` is many times faster than decoding); the rest is decoded a step at
    a time, a character cut at a step's end carried into the next."""
    if raw.isascii():
        return True
    carry = b""
    for start in range(0, len(raw), _UTF8_STEP):
        step = raw[start : start + _UTF8_STEP]
        if carry:
            step = carry + step
        elif step.isascii():
            continue
        _, used = codecs.utf_8_decode(step, "strict", False)
        carry = step[used:]
    return not carry


def _long_digit_run(raw: bytes) -> bool:
    """Whether ``raw`` holds a run of more digits than ``int()`` converts (the full parse refuses
    such an integer; in a string it is harmless, but only the parse can tell the two apart).

    Every run of ``limit + 1`` digits covers a multiple of ``limit + 1``: only the runs through
    those bytes are measured (a few microseconds for a body without such runs)."""
    limit = sys.get_int_max_str_digits()
    if not limit:
        return False
    step = limit + 1
    for index, byte in enumerate(raw[::step]):
        if 0x30 <= byte <= 0x39:
            at = index * step
            before = raw[max(0, at - limit) : at]
            after = raw[at : at + step]
            if len(before) - len(before.rstrip(_DIGITS)) + len(after) - len(after.lstrip(_DIGITS)) > limit:
                return True
    return False


def locate(raw: bytes, key: str) -> tuple[int, int] | None:
    """Where the array under the top-level ``key`` is in ``raw`` (``raw[start:end]`` is its JSON,
    ``[`` to ``]``; of a key written twice, the last, which the parse keeps), or None when it cannot tell.

    Its bytes (a view, from a pass that builds nothing else) are looked for after each ``"key":``,
    the way such a key is written outside a string; the one found must be the top-level key (what
    precedes it, closed with one more entry, is a whole object) and the last one there. An escaped
    spelling, or whitespace before the colon: None (the caller parses); whitespace after it is skipped."""
    try:
        value = getattr(_top_views.decode(raw), key)
        if _first(value) != _ARRAY:
            return None
        marker = _json.dumps(key) + b":"
        at = raw.find(marker)
        for _ in range(_MAX_CANDIDATES):
            if at < 0:
                return None
            start = _skip_space(raw, at + len(marker))
            end = start + len(value)
            if raw.startswith(value, start) and _top_level(raw, at) and _last(raw, end, key):
                return start, end
            at = raw.find(marker, start)
    except (msgspec.DecodeError, RecursionError):
        return None
    return None


def _top_level(raw: bytes, at: int) -> bool:
    """Whether a key starting at ``raw[at]`` is one of the top-level object's own."""
    # The quote of an escape can end a key too: ``"x\"messages":[]`` (the key ``x"messages``) holds
    # the marker, and ``{"x\`` closed with ``"":0}`` is a whole object, so the check below would
    # pass it and the splice would go into that key's value. A key's own opening quote never follows
    # a backslash; any other quote inside a string makes the check below fail ("" after a string).
    if raw[at - 1 : at] == b"\\":
        return False
    try:
        # One copy of the prefix (``raw[:at] + ...`` makes two at once: 2x the body, past the budget).
        _whole.decode(b"".join((memoryview(raw)[:at], b'"":0}')))
    except msgspec.DecodeError:  # a container left open: the key was nested
        return False
    return True


def _last(raw: bytes, end: int, key: str) -> bool:
    """Whether no ``key`` follows in the top-level object after its value ending at ``raw[end]``."""
    comma = _skip_space(raw, end)
    if raw[comma : comma + 1] != b",":
        return True  # the closing brace
    # One copy of the rest (``lstrip``, a slice and ``+`` made three).
    return getattr(_top_views.decode(b"".join((b"{", memoryview(raw)[comma + 1 :]))), key) is _ABSENT


def _skip_space(raw: bytes | memoryview, at: int) -> int:
    """Where the JSON whitespace from ``raw[at]`` on ends."""
    found = _SPACE.match(raw, at)  # "[ \t\n\r]*" always matches
    return found.end() if found is not None else at
