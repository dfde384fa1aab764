"""Bounded, single-copy reading of an ASGI request body.

``read_body`` assembles the body exactly once into an ``io.BytesIO`` and drops each
chunk as soon as it is copied. Whatever way it settles (success, error, cancellation),
it holds nothing afterwards: not in its frame, not in the traceback of what it raised.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import anyio
from starlette.types import Message, Receive

from ._exceptions import BodyAborted, BodyIdleTimeout, BodyTooLarge, MalformedBody

__all__ = ["parse_content_length", "read_body"]

# Decoded bytes produced per zlib call, and compressed bytes fed per call: bounds the
# transient memory on top of the assembled body, and keeps unconsumed_tail copies small.
_STEP = 256 * 1024
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_WBITS = -zlib.MAX_WBITS


class Hasher(Protocol):
    """Anything with ``update(data)``: ``blake3.blake3``, ``hashlib`` objects."""

    def update(self, data: bytes, /) -> object: ...


def _mismatch() -> MalformedBody:
    return MalformedBody("request body length does not match Content-Length", code="content_length_mismatch")


def _malformed_encoding(encoding: str) -> MalformedBody:
    return MalformedBody(f"request body is not valid {encoding} data (corrupt or truncated)", code="malformed_encoding")


def _encoding(content_encoding: str | None) -> str | None:
    """Normalize Content-Encoding to ``None`` (raw), ``"gzip"`` or ``"deflate"``."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return "gzip"
    if encoding == "deflate":
        return "deflate"
    raise MalformedBody(f"unsupported Content-Encoding {encoding!r}", code="unsupported_encoding")


def _wbits(encoding: str, first: int) -> int:
    if encoding == "gzip":
        return _GZIP_WBITS
    # "deflate" is meant to be zlib-wrapped but is often sent raw. A zlib stream starts with
    # CM=8 and CINFO<=7; a raw stream could only start so with a stored block whose padding
    # bits are set, which no encoder emits. A bad zlib header still fails inside zlib.
    return _ZLIB_WBITS if first & 0x0F == 8 and first >> 4 <= 7 else _RAW_WBITS


async def _receive(receive: Receive, idle_timeout: float | None) -> Message:
    if idle_timeout is None:
        return await receive()
    # move_on_after rather than fail_after: a TimeoutError raised by receive() itself must not
    # be mistaken for our idle timeout. Cancellation from outside still propagates.
    with anyio.move_on_after(idle_timeout):
        return await receive()
    raise BodyIdleTimeout(idle_timeout)


async def read_body(
    receive: Receive,
    *,
    max_bytes: int,
    expected_length: int | None = None,
    idle_timeout: float | None = None,
    content_encoding: str | None = None,
    hasher: Hasher | None = None,
    on_progress: Callable[[int], Awaitable[object]] | None = None,
) -> bytes:
    """Read the whole request body from ``receive`` and return it decoded.

    ``max_bytes`` bounds both the wire and the decoded size (``BodyTooLarge``);
    ``expected_length`` is the Content-Length (wire bytes, so compressed if encoded);
    ``idle_timeout`` is the longest wait for one message (``BodyIdleTimeout``);
    ``content_encoding`` may be identity, gzip, x-gzip or deflate (zlib or raw).
    ``hasher.update`` is fed the decoded body piece by piece.
    ``on_progress`` is awaited with the running count of wire bytes after each chunk that
    passed the limits (the admission byte budget charges there); its wait is not idle time.
    Raises ``BodyAborted`` on ``http.disconnect`` and ``MalformedBody`` for bad framing or encoding.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
    if expected_length is not None and expected_length > max_bytes:
        raise BodyTooLarge(max_bytes)
    encoding = _encoding(content_encoding)

    buf = io.BytesIO()
    message: Message | None = None
    chunk: Any = None
    view: memoryview | None = None
    data: Any = None
    piece: bytes | None = None
    decoder: Any = None  # zlib.Decompress (not nameable at runtime before 3.12)
    try:
        if expected_length and encoding is None:
            # Preallocate: the chunks overwrite these zeros, and getvalue() then hands back
            # BytesIO's own bytes object without a copy, so the body exists once in memory.
            buf.seek(expected_length - 1)
            buf.write(b"\0")
            buf.seek(0)
        wire = decoded = 0
        more_body = True
        while more_body:
            message = await _receive(receive, idle_timeout)
            kind = message["type"]
            if kind == "http.disconnect":
                raise BodyAborted()
            if kind != "http.request":
                raise MalformedBody(
                    f"unexpected ASGI message {kind!r} while reading the request body", code="unexpected_message"
                )
            chunk = message.get("body", b"")
            more_body = bool(message.get("more_body", False))
            message = None
            wire += len(chunk)
            # Checked before copying anything, so the chunk that crosses a limit is never buffered.
            if expected_length is not None and wire > expected_length:
                raise _mismatch()
            if wire > max_bytes:
                raise BodyTooLarge(max_bytes)
            if not chunk:
                continue
            if on_progress is not None:
                await on_progress(wire)
            if encoding is None:
                buf.write(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                chunk = None
                continue
            if decoder is None:
                decoder = zlib.decompressobj(_wbits(encoding, chunk[0]))
            view = memoryview(chunk)
            for start in range(0, len(view), _STEP):
                data = view[start : start + _STEP]
                while True:
                    limit = min(max_bytes - decoded + 1, _STEP)
                    try:
                        piece = decoder.decompress(data, limit)
                    except zlib.error:
                        raise _malformed_encoding(encoding) from None
                    data = decoder.unconsumed_tail
                    decoded += len(piece)
                    if decoded > max_bytes:
                        raise BodyTooLarge(max_bytes)
                    buf.write(piece)
                    if hasher is not None:
                        hasher.update(piece)
                    # A full piece may leave output pending inside zlib even with no input left.
                    if not data and len(piece) < limit:
                        break
                if decoder.eof and decoder.unused_data:
                    raise MalformedBody(
                        "request body has data after the end of the compressed stream", code="malformed_encoding"
                    )
            data = piece = None
            view.release()
            view = chunk = None
        if expected_length is not None and wire != expected_length:
            raise _mismatch()
        # An empty body with a Content-Encoding header is accepted as empty.
        if decoder is not None and not decoder.eof:
            raise _malformed_encoding(str(encoding))
        return buf.getvalue()
    finally:
        # The traceback of whatever we raise keeps this frame, so its locals, alive.
        message = chunk = data = piece = decoder = None
        if view is not None:
            view.release()
            view = None
        buf.close()


def parse_content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """Return the Content-Length from ASGI headers, or ``None`` if absent.

    Repeated identical values (``12, 12`` or two headers) are accepted per RFC 9110;
    anything else not a plain non-negative decimal raises ``MalformedBody``.
    """
    lengths: set[int] = set()
    for name, value in headers:
        if name.lower() != b"content-length":
            continue
        for raw in value.split(b","):
            item = raw.strip(b" \t")
            if not item.isdigit():  # bytes.isdigit is ASCII-only: rejects "+1", "-1", "1.0", ""
                raise MalformedBody("invalid Content-Length header", code="invalid_content_length")
            try:
                lengths.add(int(item))
            except ValueError:  # more digits than int() will convert
                raise MalformedBody("invalid Content-Length header", code="invalid_content_length") from None
    if len(lengths) > 1:
        raise MalformedBody("conflicting Content-Length headers", code="invalid_content_length")
    return lengths.pop() if lengths else None
