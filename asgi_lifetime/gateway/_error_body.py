"""Upstream error bodies: read with bounds, decode with bounds, relay honestly.

An error body is buffered (for the refold and role matchers, and so no error page streams
through unbounded), so every part of that is bounded:

- **wire and decoded size**: ``ERROR_BODY_LIMIT``; gzip/deflate are inflated by
  ``BoundedDecoder`` in steps (zlib's ``max_length``), so a 254 KiB gzip bomb costs at most
  the limit plus one step, never the 256 MiB it inflates to;
- **time**: the whole body must arrive within ``STALL_TIMEOUT`` of the read's start, however
  steadily its bytes drip (the client gets none of them meanwhile, so a per-read bound would let
  an upstream dripping under it hold the client for hours); a read for a retry's wait also ends at
  ``RETRY_DEADLINE`` (``until``).

What cannot be decoded here (``br``, ``zstd``, several codings, anything unknown) is kept as
it came, ``Content-Encoding`` included, capped at the limit in raw bytes.

An error body that did not arrive whole (cut at the limit, stalled, broken off, corrupt) is
never relayed as if it were complete. The client gets the upstream's status and headers with a
complete, honest gateway JSON error saying so (code ``upstream_error_incomplete``) and the
decoded start of the upstream's body in ``upstream_body`` (as much as keeps the whole answer
within ``ERROR_BODY_LIMIT``). Ending the response broken
instead would make SDKs treat it as a connection error and retry it (a retry multiplied by
the gateway's own), and would lose the status the SDK maps to an error class.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from .._exceptions import error_body, error_shape
from ._auth import KeyScrubber
from ._transport import stop_reading

__all__ = ["BoundedDecoder", "ErrorBody", "decoder_for", "read_error_body", "replay"]

# Decoded bytes per zlib call: bounds the transient memory on top of the captured body.
_STEP = 64 * 1024
# A replayed error body is complete as relayed: framing headers are ours.
_FRAMING = frozenset({"content-length", "transfer-encoding"})
# What a word or a number of an error message is made of (a cut one may be the start of a longer one).
_WORD = b"0123456789,_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class BoundedDecoder:
    """gzip / deflate (zlib-wrapped or raw) decoding that never produces more than asked for."""

    __slots__ = ("_encoding", "_zlib", "error")

    def __init__(self, encoding: str) -> None:
        self._encoding = encoding
        self._zlib: Any = None  # zlib.Decompress, chosen from the first byte for deflate
        self.error = False

    def feed(self, data: bytes, room: int) -> bytes:
        """Decode ``data``; return at most ``room`` + 1 bytes (one more says: over the limit)."""
        if not data or self.error:
            return b""
        if self._zlib is None:
            if self._encoding == "gzip":
                wbits = 16 + zlib.MAX_WBITS
            else:
                # zlib-wrapped starts with CM=8, CINFO<=7; else assume raw deflate (as _body.py does).
                wbits = zlib.MAX_WBITS if data[0] & 0x0F == 8 and data[0] >> 4 <= 7 else -zlib.MAX_WBITS
            self._zlib = zlib.decompressobj(wbits)
        out = bytearray()
        pending = data
        try:
            while len(out) <= room:
                asked = min(_STEP, room + 1 - len(out))
                piece = self._zlib.decompress(pending, asked)
                out += piece
                pending = self._zlib.unconsumed_tail
                # A full piece may leave output inside zlib even with no input left: go round again.
                if self._zlib.eof or (not pending and len(piece) < asked):
                    break
        except zlib.error:
            self.error = True
        return bytes(out[: room + 1])

    @property
    def finished(self) -> bool:
        """The compressed stream ended properly (no data for it counts as an empty body)."""
        return not self.error and (self._zlib is None or self._zlib.eof)


def decoder_for(content_encoding: str | None) -> BoundedDecoder | None | bool:
    """``None`` for identity, a ``BoundedDecoder`` for gzip/deflate, ``False`` for what we cannot decode."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return BoundedDecoder("gzip")
    if encoding == "deflate":
        return BoundedDecoder("deflate")
    return False  # br, zstd, compress, several codings, unknown: relayed as they came


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """What was read of an error body. ``data`` is decoded unless ``decoded`` is False (then it
    is in the response's ``Content-Encoding``); ``problem`` says why it is not complete."""

    data: bytes
    decoded: bool
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.problem is None

    @property
    def readable(self) -> bytes:
        """The decoded text the refold and role matchers may read (nothing of an undecoded body). A body
        cut anywhere (at the limit, by the time bound) may end inside a word or a number, the start of a
        longer one ("of 40" of "of 4096", "developer" of "developer_v2"): that last word is dropped."""
        if not self.decoded:
            return b""
        return self.data if self.complete else self.data.rstrip(_WORD)


async def read_error_body(
    response: httpx.Response, *, limit: int, stall_timeout: float, until: float = math.inf
) -> ErrorBody:
    """Read up to ``limit`` bytes of ``response``'s body (decoded where we can), within ``stall_timeout``
    and by ``until`` (anyio's clock) at the latest; always closes it."""
    whole_by = anyio.current_time() + stall_timeout
    deadline = min(whole_by, until)
    decoder = decoder_for(response.headers.get("content-encoding"))
    captured = bytearray()
    problem: str | None = None
    ended = False  # the chain of stream generators finished (by its end, an error or a cancellation)
    iterator = response.aiter_raw()
    try:
        while True:
            ended = True  # a cancellation or error inside __anext__ ends every generator it passes
            with anyio.CancelScope(deadline=deadline) as scope:
                try:
                    chunk = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                except httpx.HTTPError as exc:
                    problem = f"the upstream connection broke off ({type(exc).__name__})"
                    break
            if scope.cancelled_caught:
                if until < whole_by:
                    problem = "the gateway's retry deadline passed while it was read"
                else:
                    problem = f"the upstream did not send its whole error body within {stall_timeout:g} seconds"
                break
            ended = False
            room = limit - len(captured)
            if isinstance(decoder, BoundedDecoder):
                piece = decoder.feed(chunk, room)
                if decoder.error:
                    problem = f"the body is not valid {response.headers.get('content-encoding', '').strip()} data"
            else:
                piece = chunk
            del chunk
            captured += piece[:room]
            if len(piece) > room:
                problem = f"the body is longer than the gateway's limit of {limit} bytes"
            if problem is not None:
                break
        if problem is None and isinstance(decoder, BoundedDecoder) and not decoder.finished:
            problem = f"the {response.headers.get('content-encoding', '').strip()} data ended early"
    finally:
        await stop_reading(response, iterator, finished=ended)
    return ErrorBody(bytes(captured), decoded=decoder is not False, problem=problem)


def replay(
    response: httpx.Response, body: ErrorBody, scrubber: KeyScrubber, *, limit: int | None = None
) -> httpx.Response:
    """The upstream's error as the client gets it: status and headers, and the body (or an honest
    gateway error when the body is incomplete, or undecodable while it may quote our key; with
    ``limit``, that error's ``upstream_body`` is shortened to keep it within ``limit`` bytes)."""
    headers = [(k, v) for k, v in response.headers.raw if k.lower().decode("latin-1") not in _FRAMING]
    content = body.data
    withheld = not body.decoded and bool(scrubber)
    if body.complete and not withheld:
        if body.decoded:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
            content = scrubber.scrub(content)
    else:
        headers = [(k, v) for k, v in headers if k.lower() not in (b"content-encoding", b"content-type")]
        headers.append((b"content-type", b"application/json"))
        content = _incomplete(response, body, scrubber, withheld, limit)
    headers.append((b"content-length", str(len(content)).encode()))
    ours = {k: v for k, v in response.extensions.items() if k.startswith("asgi_lifetime.")}
    # A stream, not content=: the relay streams it with aiter_raw(), which a pre-read response refuses.
    return httpx.Response(
        response.status_code,
        headers=headers,
        stream=httpx.ByteStream(content),
        request=response.request,
        extensions=ours,
    )


def _incomplete(
    response: httpx.Response, body: ErrorBody, scrubber: KeyScrubber, withheld: bool, limit: int | None
) -> bytes:
    status = response.status_code
    if withheld:
        encoding = response.headers.get("content-encoding", "").strip()
        code = "upstream_error_withheld"
        message = (
            f"the upstream answered HTTP {status} with a {encoding!r}-encoded error body the gateway "
            "cannot decode, so cannot check for its upstream key; the body was withheld"
        )
    else:
        code = "upstream_error_incomplete"
        message = f"the upstream answered HTTP {status} but its error body is incomplete: {body.problem}"
    # It stands in for the upstream's own error body: in the shape of the API the request went to,
    # which the client's SDK parses (the path and the SDK's own header were forwarded as sent).
    request = response.request
    document = error_body(error_shape(request.url.path, request.headers.raw), status, "upstream_error", code, message)
    if body.decoded and not withheld:
        return _within(document, scrubber.cut(body.data).decode("utf-8", "replace"), limit)
    return json.dumps(document, ensure_ascii=False).encode()


def _within(document: dict[str, Any], text: str, limit: int | None) -> bytes:
    """``document`` with the longest start of ``text`` as ``upstream_body`` that fits in ``limit`` bytes."""

    def encode(size: int) -> bytes:
        document["error"]["upstream_body"] = text[:size]
        return json.dumps(document, ensure_ascii=False).encode()

    encoded = encode(len(text))
    if limit is None or len(encoded) <= limit:
        return encoded
    # Escapes make a character cost 1 to 6 bytes: search for the longest prefix that fits.
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if len(encode(middle)) <= limit:
            low = middle
        else:
            high = middle - 1
    return encode(low)
