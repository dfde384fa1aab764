"""Upstream error bodies: bounded decoding, encodings kept when not decoded, honest when incomplete,
bounded by STALL_TIMEOUT, abandoned when the client leaves."""

from __future__ import annotations

import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
import pytest

from asgi_lifetime._settings import KiB, MiB
from asgi_lifetime.gateway._auth import KeyScrubber
from asgi_lifetime.gateway._error_body import BoundedDecoder, ErrorBody, decoder_for, read_error_body, replay

from ..reliability.test_faults import PATH, assert_idle, raw_client, request_bytes, running
from ._raw_upstream import HOLD, RawRequest, Script, raw_upstream, response

ERROR = b'{"error": {"type": "invalid_request_error", "message": "' + b"m" * 300 + b'"}}'


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "GZIP": gzip.compress,
    "deflate": zlib.compress,
    "deflate (raw)": raw_deflate,
}


def encoding_name(case: str) -> str:
    return case.split(" ")[0]


# --- unit: the decoder -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(ENCODERS))
@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_bounded_decoder_decodes_in_any_chunking(case: str, chunk: int) -> None:
    encoded = ENCODERS[case](ERROR)
    decoder = decoder_for(encoding_name(case))
    assert isinstance(decoder, BoundedDecoder)
    out = b"".join(decoder.feed(encoded[i : i + chunk], 1 * MiB) for i in range(0, len(encoded), chunk))
    assert out == ERROR and decoder.finished


@pytest.mark.parametrize("case", list(ENCODERS))
@pytest.mark.parametrize("room", [0, 1, 100, 64 * KiB])
def test_bounded_decoder_never_returns_more_than_room_plus_one(case: str, room: int) -> None:
    bomb = ENCODERS[case](b"\0" * (8 * MiB))
    decoder = decoder_for(encoding_name(case))
    assert isinstance(decoder, BoundedDecoder)
    assert len(decoder.feed(bomb, room)) == room + 1


@pytest.mark.parametrize("value", ["br", "zstd", "compress", "gzip, br", "gzip, gzip", "identity, gzip", "snappy"])
def test_encodings_we_cannot_decode(value: str) -> None:
    assert decoder_for(value) is False


@pytest.mark.parametrize("value", [None, "", "identity", " Identity "])
def test_identity(value: str | None) -> None:
    assert decoder_for(value) is None


@pytest.mark.parametrize(
    "data",
    [b"not compressed at all", gzip.compress(ERROR)[:20], b"\x1f\x8b\x08\x00garbage"],
    ids=["junk", "truncated", "bad-header"],
)
def test_corrupt_or_truncated_gzip_is_not_finished(data: bytes) -> None:
    decoder = BoundedDecoder("gzip")
    decoder.feed(data, 1 * MiB)
    assert not decoder.finished


# --- unit: reading and replaying -------------------------------------------------------------------


def upstream_response(status: int, chunks: list[bytes], headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(
        status, headers=headers, stream=_Stream(chunks), request=httpx.Request("POST", "http://u.test/")
    )


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.closed:
                return
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


async def read(status: int, chunks: list[bytes], headers: dict[str, str], limit: int = 64 * KiB) -> ErrorBody:
    return await read_error_body(upstream_response(status, chunks, headers), limit=limit, stall_timeout=5)


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(ENCODERS))
async def test_gzip_bomb_error_body_costs_the_limit_not_its_inflated_size(case: str) -> None:
    bomb = ENCODERS[case](b"\0" * (256 * MiB))
    assert len(bomb) < 300 * KiB
    chunks = [bomb[i : i + 64 * KiB] for i in range(0, len(bomb), 64 * KiB)]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        body = await read(400, chunks, {"content-encoding": encoding_name(case)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body.data) == 64 * KiB and body.decoded and not body.complete
    assert "longer than" in (body.problem or "")
    assert peak < 4 * MiB, f"decoding the error body peaked at {peak / MiB:.1f} MiB"


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, br"])
async def test_undecodable_error_body_keeps_its_encoding(encoding: str) -> None:
    raw = bytes(range(256)) * 4
    body = await read(400, [raw], {"content-encoding": encoding, "content-type": "application/json"})
    assert body.complete and not body.decoded and body.data == raw
    relayed = replay(upstream_response(400, [], {"content-encoding": encoding}), body, KeyScrubber(None))
    assert relayed.headers["content-encoding"] == encoding  # the bytes are still encoded: say so
    assert b"".join([chunk async for chunk in relayed.aiter_raw()]) == raw


@pytest.mark.anyio
async def test_undecodable_error_body_is_capped_in_raw_bytes() -> None:
    body = await read(500, [b"\x8b" * 1000] * 10, {"content-encoding": "br"}, limit=2500)
    assert len(body.data) == 2500 and not body.complete and not body.decoded
    relayed = replay(upstream_response(500, [], {"content-encoding": "br"}), body, KeyScrubber(None))
    error = json.loads(await relayed.aread())["error"]
    assert "content-encoding" not in relayed.headers and relayed.headers["content-type"] == "application/json"
    assert error["code"] == "upstream_error_incomplete" and "upstream_body" not in error


@pytest.mark.anyio
async def test_undecodable_error_body_is_withheld_when_it_could_quote_our_key() -> None:
    body = await read(401, [b"\x8b" * 100], {"content-encoding": "br"})
    relayed = replay(upstream_response(401, [], {"content-encoding": "br"}), body, KeyScrubber("sk-up"))
    assert relayed.status_code == 401
    assert json.loads(await relayed.aread())["error"]["code"] == "upstream_error_withheld"


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(ENCODERS))
async def test_encoded_error_body_is_decoded_and_relayed_whole(case: str) -> None:
    encoded = ENCODERS[case](ERROR)
    body = await read(400, [encoded[:10], encoded[10:]], {"content-encoding": encoding_name(case)})
    assert body.complete and body.data == ERROR
    relayed = replay(upstream_response(400, [], {"content-encoding": encoding_name(case)}), body, KeyScrubber(None))
    assert "content-encoding" not in relayed.headers and await relayed.aread() == ERROR
    assert relayed.headers["content-length"] == str(len(ERROR))


@pytest.mark.anyio
@pytest.mark.parametrize("cut", [5, 20, -8], ids=["header", "middle", "trailer"])
async def test_truncated_gzip_error_body_is_incomplete(cut: int) -> None:
    body = await read(400, [gzip.compress(ERROR)[:cut]], {"content-encoding": "gzip"})
    assert not body.complete and "ended early" in (body.problem or "")


# --- end to end ------------------------------------------------------------------------------------


def answering(*steps: bytes | str) -> Callable[[RawRequest], Script]:
    def answer(request: RawRequest) -> Script:
        return list(steps)

    return answer


@pytest.mark.anyio
async def test_gzip_bomb_through_the_gateway() -> None:
    bomb = gzip.compress(b"\0" * (256 * MiB))
    head = response(400, bomb, headers=(("content-encoding", "gzip"), ("content-type", "application/json")))
    with raw_upstream(answering(head)) as upstream, running(upstream_url=upstream.url) as stack:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                got = await client.post(PATH, json={})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await assert_idle(stack.app, stack.url)
    assert peak < 16 * MiB, f"the gateway peaked at {peak / MiB:.1f} MiB for a 254 KiB error body"
    assert got.status_code == 400 and got.json()["error"]["code"] == "upstream_error_incomplete"


@pytest.mark.anyio
async def test_br_error_body_through_the_gateway_keeps_its_encoding() -> None:
    raw = b"\x1b\x2a\x00\x00" + bytes(range(200))  # brotli-looking bytes: opaque to the gateway
    head = response(429, raw, headers=(("content-encoding", "br"), ("content-type", "application/json")))
    with raw_upstream(answering(head)) as upstream, running(upstream_url=upstream.url, max_attempts=1) as stack:
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.complete and got.status == 429
    assert got.headers["content-encoding"] == "br" and got.body == raw


@pytest.mark.anyio
async def test_stalled_error_body_is_bounded_by_the_stall_timeout() -> None:
    head = b"HTTP/1.1 400 X\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n" + ERROR[:100]
    with (
        raw_upstream(answering(head, HOLD)) as upstream,
        running(upstream_url=upstream.url, stall_timeout=0.5, headers_timeout=20) as stack,
    ):
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            got = await client.post(PATH, json={})
        elapsed = time.monotonic() - started
        await assert_idle(stack.app, stack.url)
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["code"] == "upstream_error_incomplete" and "within 0.5 seconds" in error["message"]
    assert error["upstream_body"] == ERROR[:100].decode()
    assert elapsed < 10, "bounded by STALL_TIMEOUT, not HEADERS_TIMEOUT"


class _Dripped(httpx.AsyncByteStream):
    """A byte every ``pace`` seconds (anyio's clock), ``count`` times: never a pause of ``STALL_TIMEOUT``."""

    def __init__(self, pace: float, count: int) -> None:
        self.pace, self.count = pace, count
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.count and not self.closed:
            await anyio.sleep(self.pace)
            self.sent += 1
            yield b" "

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.anyio
async def test_an_error_body_dripped_under_the_stall_timeout_is_bounded_by_it_as_a_whole() -> None:
    # The client gets none of the body until it is whole: a per-read bound would let 64 KiB dripped a
    # byte at a time under STALL_TIMEOUT hold it for days. Here 100 bytes would take 20 s.
    stream = _Dripped(pace=0.2, count=100)
    dripped = httpx.Response(400, stream=stream, request=httpx.Request("POST", "http://u.test/"))
    started = anyio.current_time()
    body = await read_error_body(dripped, limit=64 * KiB, stall_timeout=1.0)
    elapsed = anyio.current_time() - started
    assert body.problem == "the upstream did not send its whole error body within 1 seconds"
    assert 1.0 <= elapsed < 5.0 and 0 < stream.sent < 100 and stream.closed
    assert body.data == b" " * len(body.data) and len(body.data) <= stream.sent


@pytest.mark.anyio
async def test_a_relayed_error_body_dripped_under_the_stall_timeout_ends_at_it() -> None:
    # The same through the gateway under uvicorn: a 400 (nothing to retry) dripped a chunk every 0.2 s,
    # 20 s in all, STALL_TIMEOUT 1 s: the client has the status and an honest incomplete error by then.
    head = b"HTTP/1.1 400 X\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    def piece() -> bytes:
        time.sleep(0.2)  # the upstream's pace, in its own thread
        return b"1\r\n \r\n"

    def dripped(request: RawRequest) -> Script:
        return [head + b"1\r\n{\r\n", *[piece] * 100]

    with (
        raw_upstream(dripped) as upstream,
        running(upstream_url=upstream.url, stall_timeout=1.0, headers_timeout=20) as stack,
    ):
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            got = await client.post(PATH, json={})
        elapsed = time.monotonic() - started
        await assert_idle(stack.app, stack.url)
    assert got.status_code == 400 and len(upstream.requests) == 1
    error = got.json()["error"]
    assert error["code"] == "upstream_error_incomplete" and "within 1 seconds" in error["message"], error
    assert error["upstream_body"].startswith("{")
    assert elapsed < 10, "bounded by STALL_TIMEOUT as a whole, not per read (the body takes 20 s)"


@pytest.mark.anyio
async def test_client_leaving_during_an_error_body_read_closes_the_upstream() -> None:
    head = b"HTTP/1.1 400 X\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n" + ERROR[:100]
    with (
        raw_upstream(answering(head, HOLD)) as upstream,
        running(upstream_url=upstream.url, stall_timeout=60, headers_timeout=60) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            assert await anyio.to_thread.run_sync(upstream.held.wait, 10)
        # The client is gone: the gateway stops reading and closes the upstream connection.
        assert await anyio.to_thread.run_sync(upstream.released.wait, 10)
        await assert_idle(stack.app, stack.url)


@pytest.mark.parametrize("text", [b"x" * 5000, b"\x01" * 5000, "\u00e9".encode() * 2500, b"k" * 4000 + b'"\\' * 500])
@pytest.mark.parametrize("limit", [300, 1000, 4096])
def test_incomplete_error_answer_stays_within_the_limit(text: bytes, limit: int) -> None:
    body = ErrorBody(text[:limit], decoded=True, problem="cut")
    relayed = replay(upstream_response(400, [], {}), body, KeyScrubber(None), limit=limit)
    content = relayed.read()
    assert len(content) <= limit
    error = json.loads(content)["error"]
    assert error["upstream_body"] and text.decode("utf-8", "replace").startswith(error["upstream_body"])


SHAPED_REQUESTS = {
    "openai": ("/v1/chat/completions", {}),
    "anthropic": ("/v1/messages", {}),
    "anthropic (its SDK's header)": ("/v1/models", {"anthropic-version": "2023-06-01"}),
    "gemini": ("/v1beta/models/gemini-2.5-flash:streamGenerateContent", {}),
}


@pytest.mark.parametrize("case", list(SHAPED_REQUESTS))
@pytest.mark.parametrize("withheld", [False, True], ids=["incomplete", "withheld"])
def test_the_stand_in_error_takes_the_shape_of_the_api_called(case: str, withheld: bool) -> None:
    # It stands in for the upstream's error body: the client's SDK parses it as it would that one.
    path, headers = SHAPED_REQUESTS[case]
    request = httpx.Request("POST", f"http://u.test/base{path}", headers=headers)
    response = httpx.Response(529, headers={"content-encoding": "br"} if withheld else {}, request=request)
    body = ErrorBody(b"\x0b\x02" if withheld else b'{"error": {"mess', decoded=not withheld, problem="cut")
    content = replay(response, body, KeyScrubber("sk-upstream"), limit=4096).read()
    document = json.loads(content)
    code = "upstream_error_withheld" if withheld else "upstream_error_incomplete"
    shape = case.split(" ")[0]
    if shape == "anthropic":
        assert document["type"] == "error" and document["error"]["type"] == "overloaded_error"
        assert document["error"]["code"] == code
    elif shape == "gemini":
        assert document["error"]["code"] == 529 and document["error"]["status"] == "INTERNAL"
        assert document["error"]["details"][0]["reason"] == code
    else:
        assert document["error"]["type"] == "upstream_error" and document["error"]["code"] == code
    assert "HTTP 529" in document["error"]["message"]
    assert ("upstream_body" in document["error"]) is not withheld


@pytest.mark.parametrize(
    ("body", "readable"),
    [
        (ErrorBody(b"model length of 4096", decoded=True), b"model length of 4096"),
        (ErrorBody(b"model length of 40", decoded=True, problem="cut"), b"model length of "),
        (ErrorBody(b"role: developer", decoded=True, problem="cut"), b"role: "),
        (ErrorBody(b"role: developer ", decoded=True, problem="cut"), b"role: developer "),
        (ErrorBody(b'"of 1,000"', decoded=True, problem="cut"), b'"of 1,000"'),
        (ErrorBody(b"\x1f\x8b\x08", decoded=False), b""),
    ],
)
def test_the_matchers_read_no_last_word_of_a_cut_body(body: ErrorBody, readable: bytes) -> None:
    assert body.readable == readable
