"""The one place JSON is parsed and serialized, so the codec can be swapped in one spot.

The codec is msgspec, with the standard library behind it for what msgspec refuses:

- ``loads`` builds Python objects straight from the UTF-8 bytes: no decoded copy of the
  body (``json.loads`` needs one, 1-4x the body), no intermediate document (orjson's
  parser holds one, about 1x the body, while it builds the objects).
- ``dumps`` writes UTF-8 bytes straight from the objects: no list of pieces, no joined
  ``str`` (2-4 bytes per character once one character is outside Latin-1), no ``encode``.

docs/benchmarks.md has the numbers. The results are the same Python values and valid JSON
as the standard library's. Where msgspec refuses a document the standard library accepts
(``NaN``, ``Infinity``, ``1e400``, lone surrogate escapes such as ``"\\ud800"``), ``loads``
parses it again with the standard library, so such a body is accepted as before; a plain
syntax error is not parsed twice (``loads_fast`` tells the two apart, ``StdlibMayAccept``).
Non-finite numbers are kept as ``_NonFinite`` floats, which msgspec refuses to write, so
``dumps`` writes them (through the standard library) as they came: ``NaN``, ``Infinity``.
A lone surrogate has no UTF-8 form: ``dumps`` writes it as the escape it came as
(``"\\ud800"``), so a rewritten body says what the received one said (RFC 8259 section 8.2
leaves such strings to the receiver: the upstream decides, as it does for an unchanged body).
``dumps`` also falls back for values msgspec cannot write (``True`` or ``None`` as a dict
key, ``str``/``float`` subclasses) and for a non-finite float anywhere in the value (msgspec
would write ``null``; a walk over the containers finds one, about a sixth of the cost of
serializing). Floats are written in their shortest round-trip form, which msgspec spells
differently at the extremes (``1e-05`` -> ``0.00001``, ``1e+16`` -> ``1e16``): the same
number either way.

``dumps_consuming`` writes the same bytes as ``dumps`` for a document with a conversation
list (``messages`` and the like) and drops each item of the list as soon as it is written,
so a changed body's parse shrinks while the new body grows instead of both being held
whole (the UTF-8 copies the encoder caches in non-ASCII strings go with their items).
"""

from __future__ import annotations

import codecs
import io
import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any, Final

import msgspec

__all__ = [
    "JSONDecodeFailure",
    "StdlibMayAccept",
    "check_unparsed",
    "dumps",
    "dumps_consuming",
    "loads",
    "loads_fast",
    "loads_stdlib",
]

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class JSONDecodeFailure(ValueError):
    """The bytes are not a JSON document this package will parse (bad syntax, bad UTF-8, too deep)."""


class _NonFinite(float):
    """``NaN`` / ``Infinity`` from a request: msgspec will not write it, so ``dumps`` falls back and keeps it."""

    __slots__ = ()


def _parse_constant(name: str) -> float:
    return _NonFinite(name)  # "NaN", "Infinity", "-Infinity": float() reads all three


def _parse_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(value)


def loads(raw: bytes) -> Any:
    """Parse a JSON document from UTF-8 bytes.

    Raises ``JSONDecodeFailure`` for invalid JSON, invalid UTF-8 and nesting deep enough
    to exhaust the recursion limit (hostile input must not crash the caller). The standard
    library parses again only what msgspec refused for a reason it does not share.
    """
    try:
        return loads_fast(raw)
    except StdlibMayAccept:
        return loads_stdlib(raw)


class StdlibMayAccept(JSONDecodeFailure):
    """msgspec refused the document for a reason the standard library does not share."""


def loads_fast(raw: bytes | memoryview) -> Any:
    """``loads`` without the standard library's second pass: ``StdlibMayAccept`` says it would be worth it."""
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError:  # "Number out of range" ("1e400"), "Integer value out of range"
        second = True
    except msgspec.DecodeError as exc:
        second = _stdlib_may_accept(raw, str(exc))
    except RecursionError:
        second = False
    if second:
        raise StdlibMayAccept("request body is not valid JSON for msgspec")
    raise JSONDecodeFailure("request body is not valid JSON")


_skimmer = msgspec.json.Decoder(msgspec.Raw)


_STEP: Final = 64 * 1024
_DIGITS_AS_ZERO: Final = bytes(0x30 if 0x30 <= b <= 0x39 else b for b in range(256))
# What only the standard library parses, each replaced by what msgspec skims alike, byte for byte as long:
# a value where it stood as one (``-Infinity`` first), a BMP escape for a surrogate's, and where either
# stood inside a string, string content still.
_STAND_INS: Final = (
    (b"-Infinity", b"[0       ]"),
    (b"Infinity", b"[0      ]"),
    (b"NaN", b"[0]"),
    (b"\\ud", b"\\u0"),
    (b"\\uD", b"\\u0"),
)


def check_unparsed(raw: bytes) -> bool:
    """Whether ``loads(raw)`` would succeed, told without building the document: ``JSONDecodeFailure``
    when it is not JSON; False when it cannot tell (``int()`` refuses a run of over 4300 digits,
    which is valid in a string or a float); True when it is JSON.

    msgspec's syntax skim (with ``NaN``, ``Infinity`` and surrogate escapes, which only the standard
    library parses, replaced by stand-ins in a copy of the body), and the UTF-8 of the strings in
    steps of ``_STEP`` bytes: for a body forwarded as received without its parse, "not JSON" must
    be exact.
    """
    try:
        _skimmer.decode(raw)
    except msgspec.DecodeError as exc:
        if not _stdlib_may_accept(raw, str(exc)):
            raise JSONDecodeFailure("request body is not valid JSON") from None
        _check_stand_in(raw)
    except RecursionError:
        raise JSONDecodeFailure("request body is not valid JSON: nested too deeply") from None
    view = memoryview(raw)
    if not raw.isascii():
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            for start in range(0, len(raw), _STEP):
                decoder.decode(view[start : start + _STEP])
            decoder.decode(b"", True)
        except UnicodeDecodeError:
            raise JSONDecodeFailure("request body is not valid JSON: not UTF-8") from None
    limit = sys.get_int_max_str_digits()
    if limit:
        # Linear: each step, with the ``limit`` bytes before it, its digits made "0" and searched
        # for one long run (a regex would retry every start inside every long run).
        run = b"0" * (limit + 1)
        for start in range(0, len(raw), _STEP):
            if run in raw[max(0, start - limit) : start + _STEP].translate(_DIGITS_AS_ZERO):
                return False
    return True


def _check_stand_in(raw: bytes) -> None:
    """``JSONDecodeFailure`` unless ``raw``, with what only the standard library parses replaced by
    ``_STAND_INS`` (one copy of the body at a time, two while replacing), passes msgspec's skim."""
    stand_in = raw
    for name, value in _STAND_INS:
        stand_in = stand_in.replace(name, value)
    try:
        _skimmer.decode(stand_in)
    except (msgspec.DecodeError, RecursionError):  # now nothing is left for the standard library
        raise JSONDecodeFailure("request body is not valid JSON") from None


def loads_stdlib(raw: bytes) -> Any:
    """The standard library's parse (``NaN``, ``Infinity``, huge numbers, lone surrogate escapes).

    Its working set is ``_parse.stdlib_extra`` more than ``_parse.parse_cost(raw)``: the decoded ``str``.
    """
    try:
        # Decode explicitly: json.loads(bytes) would also accept UTF-16/32 by sniffing.
        return json.loads(raw.decode("utf-8"), parse_constant=_parse_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise JSONDecodeFailure(f"request body is not valid JSON: {type(exc).__name__}") from None


_AT_BYTE: Final = re.compile(r"\(byte (\d+)\)")
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89abAB]")


def _stdlib_may_accept(raw: bytes | memoryview, message: str) -> bool:
    """Whether msgspec's ``DecodeError`` is about something the standard library parses.

    Those are ``NaN`` / ``Infinity`` (an invalid character ``N`` or ``I``) and lone surrogate
    escapes (msgspec says "invalid utf-16 surrogate pair", or "truncated" when the string
    ends right after one; its ``Raw`` skim says "unexpected end of hex escape"). A plain
    syntax error, bad UTF-8, or a truncated body without a surrogate escape is not parsed twice.
    """
    if "surrogate" in message:
        return True
    if "truncated" in message or "hex escape" in message:
        # The Raw skim (``check_unparsed``) says "unexpected end of hex escape" for a lone surrogate.
        return _SURROGATE_ESCAPE.search(raw) is not None
    if "invalid character" in message:
        found = _AT_BYTE.search(message)
        return found is not None and raw[int(found.group(1)) : int(found.group(1)) + 1] in (b"N", b"I")
    return False


def _has_non_finite(value: Any) -> bool:
    """Whether a float that is NaN or infinite is among the values (dict keys are not looked at)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


def dumps(value: Any) -> bytes:
    """Serialize compactly to UTF-8 bytes."""
    if not _has_non_finite(value):
        try:
            return _encoder.encode(value)
        except (TypeError, UnicodeEncodeError):  # a type msgspec cannot write, a lone surrogate
            pass
    # A lone surrogate (from a "\\ud800" escape) has no UTF-8 form: "backslashreplace" writes it
    # back as the same JSON escape. Outside strings json.dumps writes ASCII only, so nothing
    # else can be replaced.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "backslashreplace")


def _holds(value: Any, target: object) -> bool:
    """Whether ``target`` (by identity) is ``value`` or inside it."""
    stack = [value]
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


def _field(name: Any, value: Any) -> bytes:
    """``"name":value`` as ``dumps`` writes it inside an object."""
    if type(name) is str:
        return _encoder.encode(name) + b":" + _encoder.encode(value)
    return _encoder.encode({name: value})[1:-1]  # msgspec's own spelling of a non-str key


def dumps_consuming(
    doc: dict[str, Any], key: str, *, every: int = 0, progress: Callable[[], object] | None = None
) -> bytes:
    """``dumps(doc)``, byte for byte, emptying the list ``doc[key]`` as its items are written.

    Each item is serialized on its own and its slot set to ``None`` before the bytes are
    appended to an ``io.BytesIO`` (whose ``getvalue()`` hands over its buffer without a
    copy), so the items nobody else holds are freed one by one; the list is left empty.
    The other values of ``doc`` are written around it and left in place. ``progress``, if
    given, is called each time another ``every`` bytes were written (e.g. to give freed
    heap pages back to the OS). Whatever ``dumps`` would write through the standard
    library (non-finite floats, values msgspec refuses) or refuse is left to ``dumps``
    itself, with the list as it was (the items already written are read back).
    """
    items = doc.get(key)
    if (
        type(items) is not list
        or any(name != key and _holds(value, items) for name, value in doc.items())
        or _has_non_finite(doc)
    ):
        return dumps(doc)  # not a plain list, or shared with another value: nothing to consume
    out = io.BytesIO()
    write = out.write
    start = end = done = 0
    mark = every if progress is not None and every > 0 else -1
    try:
        write(b"{")
        for n, (name, value) in enumerate(doc.items()):
            if n:
                write(b",")
            if value is not items or name != key:
                write(_field(name, value))
                continue
            write(_encoder.encode(name) + b":[")
            start = end = out.tell()
            for i in range(len(items)):
                piece = _encoder.encode(items[i])
                items[i] = None  # before the copy into the buffer: the item and its piece never coexist with it
                if i:
                    write(b",")
                write(piece)
                del piece
                done, end = i + 1, out.tell()
                if progress is not None and 0 <= mark <= end:
                    mark = end + every
                    progress()
            write(b"]")
        write(b"}")
    except (TypeError, ValueError, OverflowError):  # what dumps falls back for, or raises too
        if done:  # put back what was written: dumps serializes (or refuses) the whole document
            items[:done] = _decoder.decode(b"[" + out.getbuffer()[start:end].tobytes() + b"]")
        del out
        return dumps(doc)
    items.clear()
    return out.getvalue()
