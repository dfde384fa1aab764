"""Bounded, single-copy reading of an ASGI request body.

``read_body`` assembles the body exactly once into an ``io.BytesIO`` and drops each
chunk as soon as it is copied. Whatever way it settles (success, error, cancellation),
it holds nothing afterwards: not in its frame, not in the traceback of what it raised.

Decoding is a decoder object fed one chunk at a time and drained one bounded step at a
time (as httpx's ``_decoders.py``): before each step the reader reserves the bytes that
step may add (``on_progress``), so the admission budget is charged before memory grows.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import anyio
from starlette.types import Message, Receive

from ._exceptions import BodyAborted, BodyIdleTimeout, BodyTimeout, BodyTooLarge, MalformedBody, UnsupportedEncoding
from ._settings import check_argument, non_negative

__all__ = ["parse_content_length", "read_body"]

# Decoded bytes produced per zlib call, and compressed bytes fed per call: bounds the
# transient memory on top of the assembled body, and keeps unconsumed_tail copies small.
_STEP = 256 * 1024
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_WBITS = -zlib.MAX_WBITS
_GZIP_MAGIC = 0x1F
# gzip members one body may have. Each costs a zlib stream and a copy of the chunk after its end
# (zlib's ``unused_data``, up to _STEP): 20-byte empty members made decoding cost ~0.15 s of CPU per
# MiB sent, 50x ordinary gzip (10 s for 64 MiB). Clients send one member; concatenated files a few.
# At most 8192 x _STEP bytes copied: well under a second, 40 ms with a server's 64 KiB chunks.
MAX_GZIP_MEMBERS = 8192


class Hasher(Protocol):
    """Anything with ``update(data)``: ``blake3.blake3``, ``hashlib`` objects."""

    def update(self, data: bytes, /) -> object: ...


def _mismatch() -> MalformedBody:
    return MalformedBody("request body length does not match Content-Length", code="content_length_mismatch")


def _malformed_encoding(encoding: str) -> MalformedBody:
    return MalformedBody(f"request body is not valid {encoding} data (corrupt or truncated)", code="malformed_encoding")


def _trailing_data() -> MalformedBody:
    return MalformedBody("request body has data after the end of the compressed stream", code="malformed_encoding")


class _Decoder(Protocol):
    """Turns wire chunks into body pieces, one bounded step at a time.

    ``feed`` hands over a chunk (only once ``ready()`` is false); while ``ready()``, each
    ``step(limit)`` returns the next piece, at most ``bound(limit)`` bytes, and makes progress
    (consumes input, produces output, or raises), so draining always ends. ``finish`` checks
    the stream is complete once the wire has ended; ``close`` drops every reference.
    """

    def feed(self, chunk: bytes) -> None: ...
    def ready(self) -> bool: ...
    def bound(self, limit: int) -> int: ...
    def step(self, limit: int) -> bytes: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class _IdentityDecoder:
    """No content coding: each chunk is one piece, copied once into the body by the reader."""

    __slots__ = ("_chunk",)

    def __init__(self) -> None:
        self._chunk: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        self._chunk = chunk

    def ready(self) -> bool:
        return self._chunk is not None

    def bound(self, limit: int) -> int:
        return len(self._chunk or b"")  # already received and checked against the wire limit

    def step(self, limit: int) -> bytes:
        chunk, self._chunk = self._chunk, None
        return chunk or b""

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self._chunk = None


class _ZlibDecoder:
    """gzip (up to ``MAX_GZIP_MEMBERS`` members, RFC 1952 2.2) or deflate (zlib-wrapped or raw), step by step.

    Input is a window into the current chunk; each zlib call gets at most ``_STEP`` of it and
    returns at most ``limit`` bytes, and the window advances by what zlib consumed. A step that
    neither consumes nor produces is an error, not a retry: no input can make draining spin.
    After the end of the stream, more input is a further gzip member (a bounded number) or an error.
    """

    __slots__ = ("encoding", "_zlib", "_input", "_offset", "_output_pending", "_members")

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._zlib: Any = None  # zlib.Decompress (not nameable at runtime before 3.12)
        self._input = memoryview(b"")
        self._offset = 0
        self._output_pending = False  # the last call filled its limit: zlib may hold more output
        self._members = 0

    def feed(self, chunk: bytes) -> None:
        self._input.release()
        self._input = memoryview(chunk)
        self._offset = 0

    def ready(self) -> bool:
        return self._offset < len(self._input) or self._output_pending

    def bound(self, limit: int) -> int:
        return limit

    def step(self, limit: int) -> bytes:
        if self._zlib is None or self._zlib.eof:
            self._start()
        data = self._input[self._offset : self._offset + _STEP]
        size = len(data)
        try:
            piece: bytes = self._zlib.decompress(data, limit)
        except zlib.error:
            raise _malformed_encoding(self.encoding) from None
        finally:
            data.release()
        # What zlib did not consume: in unconsumed_tail, except at the end of the stream, where it is
        # in unused_data (and unconsumed_tail may still hold a stale copy of it: never feed that back).
        left = self._zlib.unused_data if self._zlib.eof else self._zlib.unconsumed_tail
        consumed = size - len(left)
        self._offset += consumed
        self._output_pending = len(piece) == limit and not self._zlib.eof
        if not piece and not consumed and size:
            raise _malformed_encoding(self.encoding)  # no progress: never loop on it
        return piece

    def _start(self) -> None:
        """Start a stream (first, or a further gzip member) on the input at the window."""
        first = self._input[self._offset]
        if self._zlib is not None and (self.encoding != "gzip" or first != _GZIP_MAGIC):
            raise _trailing_data()
        self._members += 1
        if self._members > MAX_GZIP_MEMBERS:
            raise MalformedBody(
                f"request body has more than {MAX_GZIP_MEMBERS} gzip members", code="malformed_encoding"
            )
        self._zlib = zlib.decompressobj(self._wbits(first))

    def _wbits(self, first: int) -> int:
        if self.encoding == "gzip":
            return _GZIP_WBITS
        # "deflate" is meant to be zlib-wrapped but is often sent raw. A zlib stream starts with
        # CM=8 and CINFO<=7; a raw stream could only start so with a stored block whose padding
        # bits are set, which no encoder emits. A bad zlib header still fails inside zlib.
        return _ZLIB_WBITS if first & 0x0F == 8 and first >> 4 <= 7 else _RAW_WBITS

    def finish(self) -> None:
        # No bytes at all is an empty body (accepted); anything else must have reached the end.
        if self._zlib is not None and not self._zlib.eof:
            raise _malformed_encoding(self.encoding)

    def close(self) -> None:
        self._input.release()
        self._zlib = None


def _decoder(content_encoding: str | None) -> _Decoder:
    """The decoder for a Content-Encoding: identity, gzip (x-gzip) or deflate; anything else is 415."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return _IdentityDecoder()
    if encoding in ("gzip", "x-gzip"):
        return _ZlibDecoder("gzip")
    if encoding == "deflate":
        return _ZlibDecoder("deflate")
    raise UnsupportedEncoding(
        f"unsupported Content-Encoding {encoding!r}: send the body as identity, gzip or deflate (one coding)",
        code="unsupported_encoding",
    )


class _Reader:
    """One body being read: the receive loop, its limits and the assembled buffer.

    ``on_progress(total)`` is awaited before the body may grow to ``total`` bytes (on arrival
    of a raw chunk, before each inflate step of an encoded one), so whoever charges a budget
    there is charged before the memory is taken, and can hold the body back while it waits.
    """

    def __init__(
        self,
        receive: Receive,
        decoder: _Decoder,
        *,
        max_bytes: int,
        expected_length: int | None,
        idle_timeout: float | None,
        body_timeout: float | None,
        hasher: Hasher | None,
        on_progress: Callable[[int], Awaitable[object]] | None,
    ) -> None:
        self.receive = receive
        self.decoder = decoder
        self.max_bytes = max_bytes
        self.expected_length = expected_length
        self.idle_timeout = idle_timeout
        self.deadline = None if body_timeout is None else anyio.current_time() + body_timeout
        self.body_timeout = body_timeout
        self.hasher = hasher
        self.on_progress = on_progress
        # No preallocation from Content-Length: memory follows the bytes that arrive (a
        # declared length costs nothing until it is sent). Growth by realloc stays near 1x.
        self.buf = io.BytesIO()
        self.wire = 0
        self.decoded = 0

    async def read(self) -> bytes:
        more_body = True
        while more_body:
            chunk, more_body = await self._next_chunk()
            if chunk:
                self.decoder.feed(chunk)
            chunk = None  # the decoder holds it until drained
            await self._drain()
        if self.expected_length is not None and self.wire != self.expected_length:
            raise _mismatch()
        self.decoder.finish()
        return self.buf.getvalue()

    async def _next_chunk(self) -> tuple[Any, bool]:
        message = await self._receive()
        kind = message["type"]
        chunk = message.get("body", b"")
        more_body = bool(message.get("more_body", False))
        del message  # the traceback of what this raises keeps this frame
        if kind == "http.disconnect":
            chunk = None
            raise BodyAborted()
        if kind != "http.request":
            chunk = None
            raise MalformedBody(
                f"unexpected ASGI message {kind!r} while reading the request body", code="unexpected_message"
            )
        self.wire += len(chunk)
        # Checked before copying anything, so the chunk that crosses a limit is never buffered
        # (nor kept by the traceback, which holds this frame).
        if self.expected_length is not None and self.wire > self.expected_length:
            chunk = None
            raise _mismatch()
        if self.wire > self.max_bytes:
            chunk = None
            raise BodyTooLarge(self.max_bytes)
        return chunk, more_body

    async def _receive(self) -> Message:
        wait, error = self.idle_timeout, None
        if self.deadline is not None:
            remaining = self.deadline - anyio.current_time()
            if wait is None or remaining < wait:
                wait, error = max(remaining, 0.0), BodyTimeout(self.body_timeout or 0.0)
        if wait is None:
            return await self.receive()
        # move_on_after rather than fail_after: a TimeoutError raised by receive() itself must not
        # be mistaken for our timeout. Cancellation from outside still propagates.
        with anyio.move_on_after(wait):
            return await self.receive()
        raise error or BodyIdleTimeout(wait)

    async def _drain(self) -> None:
        """Step the decoder until it needs more input, reserving each step's bytes first."""
        while self.decoder.ready():
            # One byte over the limit is enough to know the body is too large.
            limit = min(self.max_bytes - self.decoded + 1, _STEP)
            if self.on_progress is not None:
                await self.on_progress(min(self.decoded + self.decoder.bound(limit), self.max_bytes))
            self._append(self.decoder.step(limit))

    def _append(self, piece: bytes) -> None:
        self.decoded += len(piece)
        if self.decoded > self.max_bytes:
            del piece  # the traceback keeps this frame
            raise BodyTooLarge(self.max_bytes)
        self.buf.write(piece)
        if self.hasher is not None:
            self.hasher.update(piece)

    def close(self) -> None:
        # The traceback of whatever read_body raises keeps its frame, so this object, alive.
        self.decoder.close()
        self.buf.close()


async def read_body(
    receive: Receive,
    *,
    max_bytes: int,
    expected_length: int | None = None,
    idle_timeout: float | None = None,
    body_timeout: float | None = None,
    content_encoding: str | None = None,
    hasher: Hasher | None = None,
    on_progress: Callable[[int], Awaitable[object]] | None = None,
) -> bytes:
    """Read the whole request body from ``receive`` and return it decoded.

    ``max_bytes`` bounds both the wire and the decoded size (``BodyTooLarge``);
    ``expected_length`` is the Content-Length (wire bytes, so compressed if encoded);
    ``idle_timeout`` is the longest wait for one message (``BodyIdleTimeout``) and
    ``body_timeout`` the time for the whole body, from this call (``BodyTimeout``);
    ``content_encoding`` may be identity, gzip, x-gzip (up to ``MAX_GZIP_MEMBERS`` members) or deflate
    (zlib or raw); any other coding raises ``UnsupportedEncoding`` (415) before reading.
    ``hasher.update`` is fed the decoded body piece by piece.
    ``on_progress`` is awaited with the size the body is about to grow to, before it grows
    (on each raw chunk, before each bounded inflate step): the admission budget charges there.
    Its wait is not idle time, but counts against ``body_timeout``.
    Raises ``BodyAborted`` on ``http.disconnect`` and ``MalformedBody`` for bad framing or
    encoding, including data after the end of a compressed stream.
    """
    check_argument("max_bytes", max_bytes, non_negative, integer=True)
    if expected_length is not None and expected_length > max_bytes:
        raise BodyTooLarge(max_bytes)
    reader = _Reader(
        receive,
        _decoder(content_encoding),
        max_bytes=max_bytes,
        expected_length=expected_length,
        idle_timeout=idle_timeout,
        body_timeout=body_timeout,
        hasher=hasher,
        on_progress=on_progress,
    )
    try:
        return await reader.read()
    finally:
        reader.close()


def parse_content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """Return the Content-Length from ASGI headers, or ``None`` if absent.

    Repeated identical values (``12, 12`` or two headers) are accepted per RFC 9110;
    anything else not a plain non-negative decimal raises ``MalformedBody``, and so does a
    Content-Length beside a Transfer-Encoding (RFC 9112 6.1: the framing is ambiguous, the
    shape of request smuggling; some servers pass both through), and a Transfer-Encoding
    other than ``chunked`` alone (uvicorn's httptools parser de-chunks ``gzip, chunked`` and
    hands over a body still gzip-coded, labelled as plain; h11 refuses it).
    """
    lengths: set[int] = set()
    codings: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            codings += [item.strip(b" \t").lower() for item in value.split(b",")]
            continue
        if lowered != b"content-length":
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
    if codings and lengths:
        raise MalformedBody("request has both Content-Length and Transfer-Encoding", code="conflicting_framing")
    if codings and codings != [b"chunked"]:
        raise MalformedBody("only 'Transfer-Encoding: chunked' is understood", code="invalid_transfer_encoding")
    return lengths.pop() if lengths else None
