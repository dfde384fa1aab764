from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tracemalloc
import weakref
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from blake3 import blake3
from starlette.types import Message

from asgi_lifetime._body import parse_content_length, read_body
from asgi_lifetime._exceptions import (
    BodyAborted,
    BodyIdleTimeout,
    BodyTimeout,
    BodyTooLarge,
    MalformedBody,
    UnsupportedEncoding,
)

MiB = 1024 * 1024


class Chunk(bytearray):
    """A body chunk that a weakref can follow (``bytes`` instances cannot be weakly referenced)."""


class Receive:
    """A raw ASGI receive: hands out messages in order and keeps none it has delivered.

    Each ``bytes`` part becomes an ``http.request`` message; every message body (also in messages
    given as dicts) is a fresh ``Chunk`` and ``refs`` holds a weakref to each, so a test can prove
    nobody kept one. After the last message it blocks forever (``then="block"``) or fails the test.
    """

    def __init__(
        self, parts: Sequence[bytes | Message], *, end: bool = True, then: str = "fail", delay: float = 0.0
    ) -> None:
        self.messages: deque[Message] = deque()
        self.refs: list[weakref.ref[Chunk]] = []
        for index, part in enumerate(parts):
            if isinstance(part, dict):
                message = dict(part)
            else:
                last = end and index == len(parts) - 1
                message = {"type": "http.request", "body": part, "more_body": not last}
            if "body" in message:
                message["body"] = chunk = Chunk(message["body"])
                self.refs.append(weakref.ref(chunk))
            self.messages.append(message)
        self.then = then
        self.delay = delay
        self.calls = 0
        self.blocked = anyio.Event()

    async def __call__(self) -> Message:
        self.calls += 1
        if self.delay:
            await anyio.sleep(self.delay)
        if self.messages:
            return self.messages.popleft()
        if self.then == "block":
            self.blocked.set()
            await anyio.sleep_forever()
        raise AssertionError("receive() called after the last message")

    def assert_released(self) -> None:
        """Drop the chunks never delivered, then every chunk must be gone: nothing else holds one."""
        self.messages.clear()
        alive = [index for index, ref in enumerate(self.refs) if ref() is not None]
        assert alive == [], f"chunks still referenced after settlement: {alive}"


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def deflate(data: bytes, wbits: int) -> bytes:
    compressor = zlib.compressobj(wbits=wbits)
    return compressor.compress(data) + compressor.flush()


@pytest.fixture(scope="session")
def bombs() -> dict[str, bytes]:
    """200 MiB of zeros as gzip and as zlib (about 200 KiB each), built without holding 200 MiB."""
    zeros = bytes(MiB)
    result = {}
    for encoding, wbits in [("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)]:
        compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
        result[encoding] = b"".join([*(compressor.compress(zeros) for _ in range(200)), compressor.flush()])
    return result


@contextmanager
def allocation_peak() -> Iterator[list[int]]:
    """Trace the block; on exit the yielded list holds the peak bytes allocated inside it (and still live)."""
    peak: list[int] = []
    tracemalloc.start()  # only blocks allocated from here on are traced
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


# --- success -------------------------------------------------------------------------------------------------

BODIES = [
    pytest.param([b"hello"], id="single"),
    pytest.param([b"a", b"bc", b"def", b"ghij"], id="many"),
    pytest.param([b"", b"ab", b"", b"", b"cd", b""], id="empty-interleaved"),
    pytest.param([b""], id="empty-body"),
    pytest.param(split(bytes(range(256)) * 1000, 4096), id="256k-in-4k"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("parts", BODIES)
@pytest.mark.parametrize("with_length", [False, True], ids=["chunked", "content-length"])
async def test_success(parts: list[bytes], with_length: bool) -> None:
    expected = b"".join(parts)
    receive = Receive(parts)
    with anyio.fail_after(5):
        body = await read_body(receive, max_bytes=len(expected), expected_length=len(expected) if with_length else None)
    assert type(body) is bytes
    assert body == expected
    assert receive.calls == len(parts)
    receive.assert_released()


@pytest.mark.anyio
async def test_missing_body_key() -> None:
    receive = Receive([{"type": "http.request", "more_body": True}, b"ab", {"type": "http.request"}])
    with anyio.fail_after(5):
        assert await read_body(receive, max_bytes=10, expected_length=2) == b"ab"
    with anyio.fail_after(5):
        assert await read_body(Receive([{"type": "http.request"}]), max_bytes=0) == b""


@pytest.mark.anyio
@pytest.mark.parametrize("with_length", [False, True], ids=["chunked", "content-length"])
async def test_body_of_exactly_max_bytes(with_length: bool) -> None:
    receive = Receive([b"x" * 6, b"y" * 4])
    with anyio.fail_after(5):
        body = await read_body(receive, max_bytes=10, expected_length=10 if with_length else None)
    assert body == b"x" * 6 + b"y" * 4


@pytest.mark.anyio
@pytest.mark.parametrize("with_length", [False, True], ids=["chunked", "content-length"])
async def test_single_copy_peak(with_length: bool) -> None:
    """The body exists once: growing the buffer (realloc) and getvalue() add no second copy."""
    size = 16 * MiB
    receive = Receive(split(b"z" * size, 64 * 1024))
    with allocation_peak() as peak, anyio.fail_after(5):
        body = await read_body(receive, max_bytes=size, expected_length=size if with_length else None)
    assert len(body) == size and body.count(b"z") == size
    # BytesIO over-allocates by at most 1/8 while growing; a copy would be 2x.
    assert peak[0] < 1.2 * size, peak[0] / size


@pytest.mark.anyio
async def test_declared_length_costs_nothing_until_sent() -> None:
    """A Content-Length is a claim, not bytes: memory follows what arrives (no preallocation)."""
    receive = Receive([b"abc", b"def"], end=False, then="block")
    with allocation_peak() as peak, anyio.fail_after(5), pytest.raises(BodyIdleTimeout):
        await read_body(receive, max_bytes=16 * MiB, expected_length=16 * MiB, idle_timeout=0.05)
    assert peak[0] < 256 * 1024, peak[0]
    receive.assert_released()


@pytest.mark.anyio
async def test_body_timeout_bounds_the_whole_body() -> None:
    """A sender that is never idle for long but never finishes is cut at the body deadline."""
    receive = Receive([b"ab"] * 1000, delay=0.02)  # 20 s in total, never 0.25 s without a chunk
    with anyio.fail_after(5), pytest.raises(BodyTimeout) as excinfo:
        await read_body(receive, max_bytes=1 << 20, idle_timeout=0.25, body_timeout=0.3)
    assert excinfo.value.status_code == 408
    assert excinfo.value.code == "request_body_timeout"
    assert excinfo.value.timeout == 0.3
    assert "0.3 seconds" in excinfo.value.message
    assert 5 < receive.calls < 1000
    receive.assert_released()


@pytest.mark.anyio
async def test_idle_timeout_still_applies_within_the_body_timeout() -> None:
    receive = Receive([b"abc"], end=False, then="block")
    with anyio.fail_after(5), pytest.raises(BodyIdleTimeout) as excinfo:
        await read_body(receive, max_bytes=100, idle_timeout=0.05, body_timeout=60)
    assert type(excinfo.value) is BodyIdleTimeout and excinfo.value.code == "request_timeout"


# --- limits --------------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", [None, "gzip"])
async def test_content_length_over_limit_never_receives(encoding: str | None) -> None:
    receive = Receive([b"x" * 11])
    with pytest.raises(BodyTooLarge) as excinfo:
        await read_body(receive, max_bytes=10, expected_length=11, content_encoding=encoding)
    assert receive.calls == 0
    assert excinfo.value.status_code == 413
    assert excinfo.value.limit == 10


@pytest.mark.anyio
async def test_streaming_over_limit_stops_at_crossing_chunk() -> None:
    receive = Receive([b"a" * 4, b"b" * 4, b"c" * 4, b"d" * 4])
    with anyio.fail_after(5), pytest.raises(BodyTooLarge) as excinfo:
        await read_body(receive, max_bytes=10)
    assert receive.calls == 3  # the third chunk crossed 10 bytes; nothing was read after it
    assert excinfo.value.__traceback__ is not None  # kept alive on purpose while checking release
    receive.assert_released()


# --- settlement paths: each must leave no chunk alive, even with the exception and its traceback kept ---------


@pytest.mark.anyio
@pytest.mark.parametrize("before_first", [False, True], ids=["after-a-chunk", "before-any-chunk"])
async def test_idle_timeout(before_first: bool) -> None:
    receive = Receive([] if before_first else [b"abc"], end=False, then="block")
    with anyio.fail_after(5), pytest.raises(BodyIdleTimeout) as excinfo:
        await read_body(receive, max_bytes=100, idle_timeout=0.05)
    assert excinfo.value.timeout == 0.05
    assert excinfo.value.status_code == 408
    assert receive.blocked.is_set()
    receive.assert_released()


@pytest.mark.anyio
async def test_idle_timeout_is_per_message_not_total() -> None:
    parts = [b"ab"] * 8
    receive = Receive(parts, delay=0.05)  # 0.4 s in total, never 0.25 s without a message
    with anyio.fail_after(5):
        assert await read_body(receive, max_bytes=100, idle_timeout=0.25) == b"ab" * 8


@pytest.mark.anyio
async def test_on_progress_sees_running_wire_total_and_its_wait_is_not_idle_time() -> None:
    totals: list[int] = []

    async def charge(total: int) -> None:
        totals.append(total)
        await anyio.sleep(0.1)  # e.g. waiting for admission budget: longer than the idle timeout

    receive = Receive([b"abc", b"", b"defg"])
    with anyio.fail_after(5):
        body = await read_body(receive, max_bytes=100, idle_timeout=0.05, on_progress=charge)
    assert body == b"abcdefg"
    assert totals == [3, 7]  # empty chunks charge nothing
    receive.assert_released()


@pytest.mark.anyio
async def test_on_progress_is_not_called_for_the_chunk_that_crosses_the_limit() -> None:
    totals: list[int] = []

    async def charge(total: int) -> None:
        totals.append(total)

    with pytest.raises(BodyTooLarge):
        await read_body(Receive([b"abcd", b"efgh"]), max_bytes=6, on_progress=charge)
    assert totals == [4]


@pytest.mark.anyio
@pytest.mark.parametrize("expected_length", [None, 10])
async def test_disconnect_before_end(expected_length: int | None) -> None:
    receive = Receive([b"abc", b"def", {"type": "http.disconnect"}, b"ghij"])
    with anyio.fail_after(5), pytest.raises(BodyAborted) as excinfo:
        await read_body(receive, max_bytes=100, expected_length=expected_length)
    assert str(excinfo.value) == "request aborted before body completed"
    assert excinfo.value.message == "request aborted before body completed"
    assert excinfo.value.status_code == 499
    assert receive.calls == 3
    receive.assert_released()


@pytest.mark.anyio
@pytest.mark.parametrize("idle_timeout", [None, 10.0])
@pytest.mark.parametrize("encoding", [None, "gzip"])
async def test_cancelled_from_outside(idle_timeout: float | None, encoding: str | None) -> None:
    data = b"abcdef" * 100
    wire = gzip.compress(data) if encoding else data
    receive = Receive(split(wire, 100), end=False, then="block")
    finished: list[bytes] = []

    async def reader() -> None:
        finished.append(
            await read_body(receive, max_bytes=10_000, idle_timeout=idle_timeout, content_encoding=encoding)
        )

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await receive.blocked.wait()
            tg.cancel_scope.cancel()
    assert finished == []
    assert tg.cancel_scope.cancelled_caught
    receive.assert_released()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("parts", "expected_length", "calls"),
    [
        pytest.param([b"abc", b"def", b"g"], 5, 2, id="longer"),
        pytest.param([b"abc", b"def"], 10, 2, id="shorter"),
        pytest.param([b""], 3, 1, id="empty-but-announced"),
    ],
)
async def test_length_mismatch(parts: list[bytes], expected_length: int, calls: int) -> None:
    receive = Receive(parts)
    with anyio.fail_after(5), pytest.raises(MalformedBody) as excinfo:
        await read_body(receive, max_bytes=100, expected_length=expected_length)
    assert excinfo.value.code == "content_length_mismatch"
    assert excinfo.value.message == "request body length does not match Content-Length"
    assert excinfo.value.status_code == 400
    assert receive.calls == calls
    receive.assert_released()


@pytest.mark.anyio
@pytest.mark.parametrize("delta", [-1, 1])
async def test_length_mismatch_counts_wire_bytes_when_encoded(delta: int) -> None:
    wire = gzip.compress(b"hello " * 50)
    with anyio.fail_after(5), pytest.raises(MalformedBody) as excinfo:
        await read_body(Receive([wire]), max_bytes=1000, expected_length=len(wire) + delta, content_encoding="gzip")
    assert excinfo.value.code == "content_length_mismatch"
    with anyio.fail_after(5):
        body = await read_body(Receive([wire]), max_bytes=1000, expected_length=len(wire), content_encoding="gzip")
    assert body == b"hello " * 50


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["websocket.receive", "lifespan.startup", "http.response.body"])
async def test_unexpected_message_type(kind: str) -> None:
    receive = Receive([b"abc", {"type": kind, "body": b"x"}, b"def"])
    with anyio.fail_after(5), pytest.raises(MalformedBody) as excinfo:
        await read_body(receive, max_bytes=100)
    assert excinfo.value.code == "unexpected_message"
    assert kind in excinfo.value.message
    assert receive.calls == 2
    receive.assert_released()


@pytest.mark.anyio
async def test_negative_max_bytes_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        await read_body(Receive([b""]), max_bytes=-1)


# --- content-encoding ----------------------------------------------------------------------------------------

PAYLOAD = b"The quick brown fox jumps over the lazy dog. " * 2000
ENCODINGS = [
    pytest.param("gzip", gzip.compress, id="gzip"),
    pytest.param("x-gzip", gzip.compress, id="x-gzip"),
    pytest.param(" GZip ", gzip.compress, id="gzip-case-space"),
    pytest.param("deflate", zlib.compress, id="deflate-zlib"),
    pytest.param("deflate", lambda data: deflate(data, -zlib.MAX_WBITS), id="deflate-raw"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("encoding", "compress"), ENCODINGS)
@pytest.mark.parametrize("chunk_size", [1, 7, 1 << 20], ids=["1B", "7B", "whole"])
async def test_decodes(encoding: str, compress: Any, chunk_size: int) -> None:
    wire = compress(PAYLOAD)
    receive = Receive(split(wire, chunk_size))
    hasher = blake3()
    with anyio.fail_after(5):
        body = await read_body(
            receive, max_bytes=len(PAYLOAD), expected_length=len(wire), content_encoding=encoding, hasher=hasher
        )
    assert type(body) is bytes
    assert body == PAYLOAD
    assert hasher.digest() == blake3(PAYLOAD).digest()
    receive.assert_released()


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", [None, "identity", "", "IDENTITY"])
async def test_identity(encoding: str | None) -> None:
    with anyio.fail_after(5):
        assert await read_body(Receive([b"\x1f\x8b raw"]), max_bytes=100, content_encoding=encoding) == b"\x1f\x8b raw"


@pytest.mark.anyio
async def test_empty_body_with_encoding_is_empty() -> None:
    with anyio.fail_after(5):
        assert await read_body(Receive([b""]), max_bytes=100, content_encoding="gzip") == b""


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_large_decoded_chunk_and_exact_limit(encoding: str) -> None:
    """One small wire chunk decoding to many pieces; the decoded limit is inclusive; one copy."""
    data = bytes(range(256)) * (8 * MiB // 256)
    wire = gzip.compress(data) if encoding == "gzip" else zlib.compress(data)
    receive = Receive([wire])
    with allocation_peak() as peak, anyio.fail_after(5):
        body = await read_body(receive, max_bytes=len(data), content_encoding=encoding)
    assert body == data
    assert peak[0] < 1.3 * len(data), peak[0] / len(data)
    with anyio.fail_after(5), pytest.raises(BodyTooLarge):
        await read_body(Receive([wire]), max_bytes=len(data) - 1, content_encoding=encoding)


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_decompression_bomb(encoding: str, bombs: dict[str, bytes]) -> None:
    wire = bombs[encoding]
    receive = Receive(split(wire, 64 * 1024))
    with allocation_peak() as peak, anyio.fail_after(5), pytest.raises(BodyTooLarge) as excinfo:
        await read_body(receive, max_bytes=MiB, content_encoding=encoding)
    assert excinfo.value.limit == MiB
    assert peak[0] < 8 * MiB, peak[0]
    receive.assert_released()


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1 :]


GZ = gzip.compress(PAYLOAD)
ZL = zlib.compress(PAYLOAD)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("encoding", "wire"),
    [
        pytest.param("gzip", GZ[:-5], id="gzip-truncated-trailer"),
        pytest.param("gzip", GZ[: len(GZ) // 2], id="gzip-truncated-half"),
        pytest.param("gzip", _flip(GZ, len(GZ) // 2), id="gzip-corrupt"),
        pytest.param("gzip", _flip(GZ, len(GZ) - 6), id="gzip-bad-crc"),
        pytest.param("gzip", b"this is not gzip at all", id="gzip-garbage"),
        pytest.param("gzip", GZ + b"trailing", id="gzip-trailing-data"),
        pytest.param("deflate", ZL[:-3], id="zlib-truncated"),
        pytest.param("deflate", b"\x78\x00" + ZL[2:], id="zlib-bad-header-check"),
        pytest.param("deflate", ZL + b"\x00", id="zlib-trailing-data"),
    ],
)
@pytest.mark.parametrize("chunk_size", [3, 1 << 20], ids=["3B", "whole"])
async def test_malformed_encoding(encoding: str, wire: bytes, chunk_size: int) -> None:
    receive = Receive(split(wire, chunk_size))
    with anyio.fail_after(5), pytest.raises(MalformedBody) as excinfo:
        await read_body(receive, max_bytes=len(PAYLOAD), content_encoding=encoding)
    assert excinfo.value.code == "malformed_encoding"
    assert excinfo.value.status_code == 400
    assert excinfo.value.__cause__ is None
    assert excinfo.value.__context__ is None or excinfo.value.__suppress_context__
    receive.assert_released()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "encoding", ["br", "zstd", "compress", "x-compress", "gzip, br", "gzip, gzip", "deflate, gzip", "gzip, identity"]
)
async def test_unsupported_encoding(encoding: str) -> None:
    """RFC 9110 15.5.16: a content coding the server cannot decode is 415, not a malformed body."""
    receive = Receive([b"abc"])
    with pytest.raises(UnsupportedEncoding) as excinfo:
        await read_body(receive, max_bytes=100, content_encoding=encoding)
    assert not isinstance(excinfo.value, MalformedBody)
    assert excinfo.value.code == "unsupported_encoding"
    assert excinfo.value.status_code == 415
    assert excinfo.value.to_dict()["error"]["type"] == "invalid_request_error"
    assert encoding in excinfo.value.message
    assert receive.calls == 0


@pytest.mark.anyio
async def test_hasher_sees_exactly_the_plain_body() -> None:
    parts = [b"", b"ab", b"cde", b"", b"f" * 1000]
    hasher = blake3()
    with anyio.fail_after(5):
        body = await read_body(Receive(parts), max_bytes=2000, hasher=hasher)
    assert hasher.digest() == blake3(b"".join(parts)).digest() == blake3(body).digest()


# --- parse_content_length ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([], None, id="no-headers"),
        pytest.param([(b"host", b"example.com")], None, id="absent"),
        pytest.param([(b"content-length", b"12")], 12, id="valid"),
        pytest.param([(b"content-length", b"0")], 0, id="zero"),
        pytest.param([(b"content-length", b"  12 ")], 12, id="whitespace"),
        pytest.param([(b"content-length", b"\t12")], 12, id="tab"),
        pytest.param([(b"content-length", b"1,1")], 1, id="list-equal"),
        pytest.param([(b"content-length", b"7, 7 ,7")], 7, id="list-equal-spaced"),
        pytest.param([(b"content-length", b"5"), (b"content-length", b"5")], 5, id="two-equal-headers"),
        pytest.param([(b"Content-Length", b"3")], 3, id="mixed-case-name"),
        pytest.param([(b"x-a", b"1"), (b"content-length", b"9"), (b"x-b", b"2")], 9, id="among-others"),
    ],
)
def test_parse_content_length(headers: list[tuple[bytes, bytes]], expected: int | None) -> None:
    assert parse_content_length(headers) == expected


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([(b"content-length", b"abc")], id="non-numeric"),
        pytest.param([(b"content-length", b"-1")], id="negative"),
        pytest.param([(b"content-length", b"+1")], id="plus-sign"),
        pytest.param([(b"content-length", b"")], id="empty"),
        pytest.param([(b"content-length", b"1.0")], id="decimal"),
        pytest.param([(b"content-length", b"0x10")], id="hex"),
        pytest.param([(b"content-length", "١٢".encode())], id="non-ascii-digits"),
        pytest.param([(b"content-length", b"9" * 5000)], id="too-many-digits"),
        pytest.param([(b"content-length", b"1,2")], id="list-conflicting"),
        pytest.param([(b"content-length", b"1,")], id="list-empty-item"),
        pytest.param([(b"content-length", b"1"), (b"content-length", b"2")], id="two-different-headers"),
    ],
)
def test_parse_content_length_invalid(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(MalformedBody) as excinfo:
        parse_content_length(headers)
    assert excinfo.value.code == "invalid_content_length"
    assert excinfo.value.status_code == 400


@pytest.mark.parametrize(
    "value",
    [b"gzip, chunked", b"chunked, gzip", b"identity", b"chunked, chunked", b"x-custom, chunked", b"", b"deflate"],
)
def test_a_transfer_encoding_other_than_chunked_is_refused(value: bytes) -> None:
    """Only ``chunked`` alone frames a body the middleware reads as plain bytes (httptools passes the rest on)."""
    with pytest.raises(MalformedBody) as excinfo:
        parse_content_length([(b"transfer-encoding", value)])
    assert excinfo.value.code == "invalid_transfer_encoding" and excinfo.value.status_code == 400
    # the same codings in two field lines
    with pytest.raises(MalformedBody):
        parse_content_length([(b"transfer-encoding", value), (b"Transfer-Encoding", b"chunked")])


@pytest.mark.parametrize("value", [b"chunked", b"Chunked", b" CHUNKED\t"])
def test_transfer_encoding_chunked_has_no_length(value: bytes) -> None:
    assert parse_content_length([(b"transfer-encoding", value)]) is None


# --- the end of a compressed stream ----------------------------------------------------------------------------

# ~330 bytes on the wire that decode past 256 KiB (one inflate step): the shape of issue 9 item 13.
ZEROS = bytes(300 * 1024)
STREAMS = {
    "gzip": ("gzip", gzip.compress(ZEROS, mtime=0)),
    "zlib": ("deflate", zlib.compress(ZEROS)),
    "raw": ("deflate", deflate(ZEROS, -zlib.MAX_WBITS)),
}
TRAILERS = {
    "junk": b"junk",
    "one-byte": b"\x00",
    "zeros": bytes(64),
    "gzip-magic-then-junk": b"\x1f\x8b\x08junk",
    "zlib-stream": zlib.compress(b"second"),
    "big": bytes(300 * 1024),
}


@pytest.mark.anyio
@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("trailer", list(TRAILERS))
@pytest.mark.parametrize("chunk_size", [1, 7, 333, 1 << 20], ids=["1B", "7B", "333B", "whole"])
async def test_data_after_the_end_of_the_stream_is_malformed(stream: str, trailer: str, chunk_size: int) -> None:
    encoding, wire = STREAMS[stream]
    receive = Receive(split(wire + TRAILERS[trailer], chunk_size))
    with anyio.fail_after(10), pytest.raises(MalformedBody) as excinfo:
        await read_body(receive, max_bytes=MiB, content_encoding=encoding)
    assert excinfo.value.code == "malformed_encoding"
    assert excinfo.value.status_code == 400
    receive.assert_released()


@pytest.mark.parametrize("stream", ["gzip", "zlib", "raw", "gzip-second-member"])
def test_small_body_with_trailing_data_cannot_spin(stream: str) -> None:
    """The 330-byte DoS, in a child process: the old loop never awaited, so only a kill could stop it."""
    script = f"""
import gzip, zlib, anyio
from asgi_lifetime._body import read_body
from asgi_lifetime._exceptions import MalformedBody
zeros = bytes(300 * 1024)
raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
wires = {{
    "gzip": ("gzip", gzip.compress(zeros, mtime=0) + b"junk"),
    "zlib": ("deflate", zlib.compress(zeros) + b"junk"),
    "raw": ("deflate", raw.compress(zeros) + raw.flush() + b"junk"),
    "gzip-second-member": ("gzip", gzip.compress(zeros, mtime=0) + gzip.compress(b"more", mtime=0)),
}}
encoding, wire = wires[{stream!r}]
assert len(wire) < 400
async def receive():
    return {{"type": "http.request", "body": wire, "more_body": False}}
async def main():
    try:
        body = await read_body(receive, max_bytes=1 << 20, content_encoding=encoding)
    except MalformedBody as exc:
        print("error", exc.code)
    else:
        print("body", len(body))
anyio.run(main)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    expected = "body 307204" if stream == "gzip-second-member" else "error malformed_encoding"
    assert done.stdout.strip() == expected


MEMBERS = [b"first member. " * 100, b"", b"third " * 50_000, b"4"]


@pytest.mark.anyio
@pytest.mark.parametrize("chunk_size", [1, 7, 20, 1 << 20], ids=["1B", "7B", "20B", "whole"])
async def test_concatenated_gzip_members_decode_as_one_body(chunk_size: int) -> None:
    """RFC 1952 2.2: a gzip file is a series of members; their contents concatenate."""
    wire = b"".join(gzip.compress(member, mtime=0) for member in MEMBERS)
    expected = b"".join(MEMBERS)
    receive = Receive(split(wire, chunk_size))
    hasher = blake3()
    with anyio.fail_after(10):
        body = await read_body(receive, max_bytes=len(expected), content_encoding="gzip", hasher=hasher)
    assert body == expected
    assert hasher.digest() == blake3(expected).digest()
    with anyio.fail_after(10), pytest.raises(BodyTooLarge):  # the limit is on all members together
        await read_body(Receive(split(wire, chunk_size)), max_bytes=len(expected) - 1, content_encoding="gzip")


@pytest.mark.anyio
@pytest.mark.parametrize("cut", [1, 10, 19], ids=["magic-only", "header", "before-trailer"])
async def test_truncated_second_gzip_member_is_malformed(cut: int) -> None:
    second = gzip.compress(b"second", mtime=0)
    receive = Receive([gzip.compress(b"first", mtime=0), second[:cut]])
    with anyio.fail_after(5), pytest.raises(MalformedBody) as excinfo:
        await read_body(receive, max_bytes=100, content_encoding="gzip")
    assert excinfo.value.code == "malformed_encoding"


@pytest.mark.anyio
async def test_empty_gzip_members_are_bounded_by_the_wire_limit() -> None:
    """Members that decode to nothing still cost wire bytes: a flood of them ends at max_bytes."""
    empty = gzip.compress(b"", mtime=0)
    wire = empty * 5000
    with anyio.fail_after(10), pytest.raises(BodyTooLarge):
        await read_body(Receive(split(wire, 4096)), max_bytes=len(wire) - 1, content_encoding="gzip")
    with anyio.fail_after(10):
        assert await read_body(Receive(split(wire, 4096)), max_bytes=len(wire), content_encoding="gzip") == b""


# --- the budget is reserved before the body grows --------------------------------------------------------------


class Ledger:
    """``on_progress`` and ``hasher`` together: checks every decoded byte was reserved before it was made."""

    def __init__(self) -> None:
        self.reserved = 0
        self.decoded = 0
        self.calls = 0

    async def reserve(self, total: int) -> None:
        assert total >= self.decoded
        self.reserved = max(self.reserved, total)
        self.calls += 1
        await anyio.lowlevel.checkpoint()

    def update(self, data: bytes) -> None:
        self.decoded += len(data)
        assert self.decoded <= self.reserved, (self.decoded, self.reserved)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("encoding", "compress"), ENCODINGS[:1] + ENCODINGS[3:] + [pytest.param(None, bytes, id="raw")]
)
@pytest.mark.parametrize("with_length", [False, True], ids=["chunked", "content-length"])
async def test_every_byte_is_reserved_before_it_is_decoded(
    encoding: str | None, compress: Any, with_length: bool
) -> None:
    data = bytes(range(256)) * (4 * MiB // 256)
    wire = compress(data)
    ledger = Ledger()
    receive = Receive(split(wire, 16 * 1024))
    with anyio.fail_after(10):
        body = await read_body(
            receive,
            max_bytes=len(data),
            expected_length=len(wire) if with_length else None,
            content_encoding=encoding,
            hasher=ledger,
            on_progress=ledger.reserve,
        )
    assert body == data and ledger.decoded == len(data)
    # Reserved step by step (256 KiB at most ahead), never past the limit.
    assert len(data) <= ledger.reserved <= len(data)
    assert ledger.calls >= len(data) // (256 * 1024)


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_bomb_waits_for_budget_before_it_inflates(encoding: str, bombs: dict[str, bytes]) -> None:
    """While the budget is not granted, decoding does not go on: memory stays at what was granted."""
    granted = anyio.Event()
    asked: list[int] = []
    decoded: list[int] = []

    class Counter:
        def update(self, data: bytes) -> None:
            decoded.append(len(data))

    async def reserve(total: int) -> None:
        asked.append(total)
        if total > MiB:
            await granted.wait()

    receive = Receive(split(bombs[encoding], 64 * 1024))
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: read_body(
                receive, max_bytes=8 * MiB, content_encoding=encoding, hasher=Counter(), on_progress=reserve
            )
        )
        await wait_for(lambda: bool(asked) and asked[-1] > MiB)
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert sum(decoded) <= MiB  # held back at the budget it had
        tg.cancel_scope.cancel()
    receive.assert_released()


async def wait_for(condition: Any, seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.lowlevel.checkpoint()
