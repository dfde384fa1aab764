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
parses it again with the standard library, so such a body is accepted as before; its
non-finite numbers are kept as ``_NonFinite`` floats, which msgspec refuses to write, so
``dumps`` writes them (through the standard library) as they came: ``NaN``, ``Infinity``.
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

import io
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["JSONDecodeFailure", "dumps", "dumps_consuming", "loads"]

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
    to exhaust the recursion limit (hostile input must not crash the caller).
    """
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # ValidationError ("1e400") is a DecodeError
        pass
    # What msgspec refused, the standard library may still accept (see the module docstring).
    # Only bodies that are invalid or use those extensions take this second pass.
    try:
        # Decode explicitly: json.loads(bytes) would also accept UTF-16/32 by sniffing.
        return json.loads(raw.decode("utf-8"), parse_constant=_parse_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise JSONDecodeFailure(f"request body is not valid JSON: {type(exc).__name__}") from None


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
        except TypeError:
            pass
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


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
