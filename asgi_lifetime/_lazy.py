"""A body's verdict without its parse: what the fingerprint and the gateway need, decoded a piece at a time.

The fingerprint's verdict looks at a few fields of each message; building a Python object for
every string of a 64 MiB conversation (about 1.3x the body, up to 24x for pathological
shapes) only to drop it again is what ``shape`` avoids. It walks the body as ``msgspec.Raw``
views, one level at a time, and decodes whole only the values of at most ``_SMALL`` bytes, one
at a time, dropping each once judged::

    found = shape(raw)        # Shape(text_comparable=..., conversation="messages"), or None
    if found is None:         # only the full parse can tell: parse as before (_parse.parse_body)
        ...

``shape`` answers only when the full parse would have succeeded with msgspec (the same
decoder decodes every piece), and then its verdict is ``text_comparable`` of that parse: the
walk hands ``_fingerprint``'s own walk each decoded piece, and for a larger value a stand-in
it judges the same way (a long string is ``""``, a long array ``[]`` or ``[0]`` after its
elements were judged, a long object only the keys the walk reads). Whatever it cannot vouch
for returns ``None``: not an object at the top, invalid JSON or UTF-8, what only the standard
library accepts (``NaN``, lone surrogate escapes, huge numbers), and an object whose entries do
not add up to its bytes (a duplicate key, whose dropped value the full parse would still
have checked, whitespace between tokens, a key spelled with escapes).

Memory: the raw views of the levels being walked and one decoded piece: at most one
value per comma of the body (``_COMMA_COST`` each), and the piece's strings. ``lazy_cost`` bounds both before
anything is decoded; a body whose bound exceeds ``LAZY_RATIO`` times its size is left to
the full parse and its own bound (``_parse.parse_body``: over it, the middleware forwards the
body unparsed and not comparable, unless the app asked for the parse: 413 ``body_too_complex``).
"""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from . import _json
from ._exceptions import MalformedBody
from ._fingerprint import _CONVERSATION_KEYS, _NODE_KEYS, judge, text_comparable
from ._parse import PARSE_SLACK, charge_for, offload, parse_body

__all__ = ["LAZY_RATIO", "DeferredParse", "Shape", "inspect_body", "lazy_cost", "shape"]

LAZY_RATIO: Final = 4
"""A body and the lazy walk's working set together may take at most this many times its size (+ PARSE_SLACK)."""

_SMALL: Final = 64 * 1024
"""Values of at most this many bytes are decoded whole (one at a time); larger ones a level at a time."""
_COMMA_COST: Final = 256
"""Bytes per comma of the body: each one separates at most one value, which the walk holds as a view
(a ``Raw`` of 48 bytes and its list slot, or its dict entry and key) or as one object of a decoded
piece (192 for a dict with its keys); never both for the same comma."""
_TEXT_COST: Final = 5
"""Bytes per byte of a decoded piece's strings: 4 for ASCII text stored at 4 bytes per character, and
msgspec's scratch copy to unescape one."""
_DEPTH_COST: Final = 256 * 1024
"""Containers nested without a comma between them, down to msgspec's depth limit."""
_NAME: Final = 256
"""Strings up to this many bytes are decoded whatever ``_SMALL`` is: a part type's name must be read."""
_UTF8_STEP: Final = 64 * 1024
_TOP_KEYS: Final = frozenset({*_CONVERSATION_KEYS, "system"})
_WHITESPACE: Final = b" \t\n\r"
_QUOTE, _ARRAY, _OBJECT = ord('"'), ord("["), ord("{")

_objects = msgspec.json.Decoder(dict[str, msgspec.Raw])
_arrays = msgspec.json.Decoder(list[msgspec.Raw])


@dataclass(frozen=True, slots=True)
class Shape:
    """What the gateway needs of a JSON body before anything changes it."""

    text_comparable: bool
    """``_fingerprint.text_comparable`` of the full parse."""
    conversation: str | None
    """``Conversation.of``'s key: the first of ``messages``, ``input``, ``contents`` holding an array."""
    span: tuple[int, int] | None = None
    """Where that array is in the body: ``raw[start:end]`` is its JSON, ``[`` to ``]``."""


class DeferredParse:
    """A JSON body whose parse was not built (``handoff_parsed="on_demand"``): what the lazy walk
    found, and how to charge the parse to the request if someone needs it after all.

    It holds no part of the body: the caller passes the body to ``parse``.
    """

    __slots__ = ("conversation", "span", "shaped", "_charge")

    def __init__(self, found: Shape | None, charge: Callable[[int], Awaitable[None]]) -> None:
        self.shaped = found is not None
        """False for a body nobody looked into (its parse would cost too much): whether it has a
        conversation is unknown, and ``parse`` refuses it (413)."""
        self.conversation = found.conversation if found is not None else None
        """``Shape.conversation``: the key of the conversation array, if any."""
        self.span = found.span if found is not None else None
        """``Shape.span``: where that array is in the body."""
        self._charge = charge

    async def parse(self, raw: bytes) -> Any:
        """The full parse of ``raw`` (the body this was made for), bounded and charged as the first
        parse is (``_parse.parse_body``: 413 ``body_too_complex`` when it would take too much)."""
        try:
            return await parse_body(raw, charge=self._charge)
        except _json.JSONDecodeFailure:  # the walk vouched for it: a body that is not this one
            raise MalformedBody("request body is not valid JSON", code="invalid_json") from None

    def __repr__(self) -> str:
        return f"<DeferredParse conversation={self.conversation!r}>"


class _Unsure(Exception):
    """Only the full parse can tell."""


def lazy_cost(raw: bytes) -> int | None:
    """An upper bound of what ``shape(raw)`` allocates, or None when the body and that exceed
    ``LAZY_RATIO`` times its size (then the full parse decides, within its own bound)."""
    cost = _COMMA_COST * (raw.count(b",") + 2) + _TEXT_COST * min(_SMALL, len(raw)) + _DEPTH_COST
    return cost if len(raw) + cost <= LAZY_RATIO * len(raw) + PARSE_SLACK else None


def shape(raw: bytes) -> Shape | None:
    """The verdict and conversation key of ``raw``, if the full parse would succeed; else None."""
    try:
        top = _objects.decode(raw)
        lead, trail = _padding(raw)
        _check_entries(raw, top, lead + trail)
        spans = _spans(top, lead)
        kept: dict[str, Any] = {}
        while top:
            name, value = top.popitem()  # each view goes as soon as it is judged
            piece = _stand_in(value)
            if name in _TOP_KEYS:
                kept[name] = piece
    except (_Unsure, msgspec.DecodeError, _json.JSONDecodeFailure, UnicodeDecodeError, RecursionError):
        return None
    key = next((k for k in _CONVERSATION_KEYS if isinstance(kept.get(k), list)), None)
    return Shape(text_comparable=text_comparable(kept), conversation=key, span=spans.get(key) if key else None)


async def inspect_body(raw: bytes, *, charge: Callable[[int], Awaitable[None]]) -> Shape | None:
    """``shape(raw)`` within its bound, charged first (``charge(total)`` as in ``parse_body``), in a
    worker thread for a large body. None for a small body (its full parse costs as little) and
    for one the lazy walk cannot vouch for or bound: parse it."""
    size = len(raw)
    if size <= _SMALL:
        return None
    cost = await offload(size, lambda: lazy_cost(raw))
    if cost is None:
        return None
    await charge(charge_for(size, cost))
    return await offload(size, lambda: shape(raw))


def _padding(raw: bytes) -> tuple[int, int]:
    """Whitespace bytes before and after the top-level value (a trailing newline, say)."""
    start, end = 0, len(raw)
    while start < end and raw[start] in _WHITESPACE:
        start += 1
    while end > start and raw[end - 1] in _WHITESPACE:
        end -= 1
    return start, len(raw) - end


def _spans(entries: dict[str, msgspec.Raw], lead: int) -> dict[str, tuple[int, int]]:
    """Where the conversation keys' values are in a compact object (``_check_entries``) after ``lead`` bytes."""
    spans: dict[str, tuple[int, int]] = {}
    at = lead + 1
    for name, value in entries.items():
        at += len(_json.dumps(name)) + 1
        if name in _CONVERSATION_KEYS:
            spans[name] = (at, at + len(value))
        at += len(value) + 1
    return spans


def _check_entries(source: Any, entries: dict[str, msgspec.Raw], padding: int = 0) -> None:
    """``_Unsure`` unless ``source`` (an object's bytes) is exactly its entries, compactly: no
    duplicate key was dropped, no whitespace or escaped key hides one."""
    written = sum(len(_json.dumps(name)) + 1 + len(value) for name, value in entries.items())
    if 2 + written + max(0, len(entries) - 1) + padding != len(source):
        raise _Unsure


def _stand_in(value: msgspec.Raw) -> Any:
    """``value`` decoded, or for a large one a stand-in the verdict judges alike; validates it all."""
    view = memoryview(value)  # what _json's error handling can slice, unlike a Raw
    if len(view) <= _SMALL:
        return _json.loads_fast(view)
    first = view[0]
    if first == _QUOTE and len(view) > _NAME:
        _check_utf8(view)  # the skim checked the escapes, not the UTF-8
        return ""  # judged as any string: a leaf, and no text type's name
    if first == _ARRAY:
        items = _arrays.decode(value)
        items.reverse()
        comparable = True
        while items:
            piece = _stand_in(items.pop())
            comparable = comparable and judge(piece)
        return [] if comparable else [0]
    if first == _OBJECT:
        entries = _objects.decode(value)
        _check_entries(view, entries)
        kept: dict[str, Any] = {}
        while entries:
            name, item = entries.popitem()
            piece = _stand_in(item)
            if name in _NODE_KEYS:
                kept[name] = piece
        return kept
    return _json.loads_fast(view)  # a long number


def _check_utf8(view: memoryview) -> None:
    """``UnicodeDecodeError`` unless ``view`` is UTF-8, decoded ``_UTF8_STEP`` bytes at a time and dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    for start in range(0, len(view), _UTF8_STEP):
        decoder.decode(view[start : start + _UTF8_STEP])
    decoder.decode(b"", True)
