"""Hostile and malformed input, end to end over real sockets.

Every input here is answered with a 4xx and reaches nothing upstream (the demo upstream's
request count does not move), and afterwards nothing is held (``assert_idle``). Inputs that
break HTTP framing are turned away by uvicorn's parser (h11) before the gateway sees them:
those get uvicorn's plain-text ``400 Invalid HTTP request received.``, not a JSON body; the
table says which is which.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from .test_faults import (
    CHAT,
    HTTP_PARSERS,
    Stack,
    assert_idle,
    eventually,
    raw_client,
    request_bytes,
    rss,
    running,
)

pytestmark = pytest.mark.anyio

MAX_BODY = 1024 * 1024
PLAIN_400 = b"Invalid HTTP request received."
HTTPTOOLS_HEADER_LIMIT = (
    "known limit: uvicorn's httptools parser has no header size limit (h11's is 16 KiB incomplete): the server "
    "buffers the whole header block (here 1 MiB) and the request is served; use --http h11, or a front proxy's limit"
)


@pytest.fixture(scope="module", params=HTTP_PARSERS)
def parser_stack(request: pytest.FixtureRequest) -> Iterator[tuple[str, Stack]]:
    """The stack under each of uvicorn's HTTP parsers, and the parser's name."""
    with running(max_body_bytes=MAX_BODY, serve={"http": request.param}) as running_stack:
        yield request.param, running_stack


@pytest.fixture(scope="module")
def stack(parser_stack: tuple[str, Stack]) -> Stack:
    return parser_stack[1]


@dataclass(frozen=True)
class Hostile:
    """One hostile request (raw bytes) and the answer it must get.

    ``code``: the JSON ``error.code`` from the gateway, or None for uvicorn's plain-text 400.
    ``under``: a different ``code`` under one of uvicorn's parsers (``HTTP_PARSERS``): httptools
    refuses some requests h11 passes on, and passes on some that h11 refuses (the gateway refuses those).
    """

    request: bytes
    status: int
    code: str | None
    under: dict[str, str | None] = field(default_factory=dict)

    def code_under(self, parser: str) -> str | None:
        return self.under.get(parser, self.code)


def _chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


def bomb(mib: int, *, wbits: int = 31) -> bytes:
    """``mib`` MiB of zeros, compressed (gzip for wbits 31, zlib for 15) to about 1/1000 of that.

    Built from one compressed MiB repeated: after a full flush the compressor starts afresh, so
    each further MiB compresses to the same bytes. There is no end (no trailer): a reader that
    honours its limit never gets there.
    """
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = b"\0" * (1024 * 1024)
    first = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    return first + again * (mib - 1)


BOMB = bomb(64)  # 64 MiB in about 64 KiB, decoded against a 1 MiB limit
DEFLATE_BOMB = bomb(64, wbits=15)
GOOD = json.dumps(CHAT).encode()

HOSTILE: dict[str, Hostile] = {
    # The body, as the gateway sees it.
    "malformed-json": Hostile(request_bytes(b'{"model": '), 400, "invalid_json"),
    "malformed-json-no-content-type": Hostile(
        request_bytes(b'{"model": ').replace(b"content-type: application/json\r\n", b""), 400, "invalid_json"
    ),
    "invalid-utf8": Hostile(request_bytes(b'{"model": "\xff\xfe"}'), 400, "invalid_json"),
    "utf16-json": Hostile(request_bytes(json.dumps(CHAT).encode("utf-16")), 400, "invalid_json"),
    "nested-100k-unclosed": Hostile(request_bytes(b"[" * 100_000), 400, "invalid_json"),
    "nested-100k-closed": Hostile(request_bytes(b"[" * 100_000 + b"]" * 100_000), 400, "invalid_json"),
    "nested-100k-objects": Hostile(request_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000), 400, "invalid_json"),
    "gzip-bomb": Hostile(request_bytes(BOMB, headers=[("content-encoding", "gzip")]), 413, "request_too_large"),
    "deflate-bomb": Hostile(
        request_bytes(DEFLATE_BOMB, headers=[("content-encoding", "deflate")]), 413, "request_too_large"
    ),
    "corrupt-gzip": Hostile(
        request_bytes(b"not gzip", headers=[("content-encoding", "gzip")]), 400, "malformed_encoding"
    ),
    "gzip-then-garbage": Hostile(
        request_bytes(gzip.compress(GOOD) + b"trailing", headers=[("content-encoding", "gzip")]),
        400,
        "malformed_encoding",
    ),
    "brotli": Hostile(
        request_bytes(b"\x0b\x02\x80", headers=[("content-encoding", "br")]), 415, "unsupported_encoding"
    ),
    "stacked-encodings": Hostile(
        request_bytes(GOOD, headers=[("content-encoding", "gzip, gzip")]), 415, "unsupported_encoding"
    ),
    "declared-over-the-limit": Hostile(request_bytes(b"", content_length=MAX_BODY + 1), 413, "request_too_large"),
    "chunked-over-the-limit": Hostile(
        request_bytes(_chunked(b" " * (MAX_BODY + 1)), content_length=None, headers=[("transfer-encoding", "chunked")]),
        413,
        "request_too_large",
    ),
    # h11 frames by Transfer-Encoding; the gateway still holds the body to the Content-Length it was given.
    "chunked-and-content-length": Hostile(
        request_bytes(_chunked(GOOD), content_length=2, headers=[("transfer-encoding", "chunked")]),
        400,
        "conflicting_framing",  # RFC 9112 6.1: uvicorn passes both headers through; refused, connection closed
        under={"httptools": None},  # httptools refuses it itself
    ),
    # Framing: refused by h11 before the gateway sees a request.
    "content-length-negative": Hostile(request_bytes(GOOD, content_length="-1"), 400, None),
    "content-length-not-a-number": Hostile(request_bytes(GOOD, content_length="abc"), 400, None),
    "content-length-hex": Hostile(request_bytes(GOOD, content_length="0x10"), 400, None),
    "content-length-float": Hostile(request_bytes(GOOD, content_length="1e3"), 400, None),
    "content-length-conflicting": Hostile(request_bytes(GOOD, content_length="10, 12"), 400, None),
    "content-length-huge": Hostile(request_bytes(GOOD, content_length="9" * 30), 400, None),
    "transfer-encoding-gzip": Hostile(
        request_bytes(_chunked(GOOD), content_length=None, headers=[("transfer-encoding", "gzip, chunked")]),
        400,
        None,
        # httptools de-chunks it and passes it on, the body still gzip-coded: the gateway refuses it.
        under={"httptools": "invalid_transfer_encoding"},
    ),
    "bad-chunk-size": Hostile(
        request_bytes(b"zz\r\n{}\r\n0\r\n\r\n", content_length=None, headers=[("transfer-encoding", "chunked")]),
        400,
        None,
    ),
    "bare-cr-in-header": Hostile(request_bytes(GOOD, headers=[("x-session-id", "a\rx-injected: 1")]), 400, None),
    # h11 takes a bare LF for a line end (so "a\nx-b: 1" is two headers, see test_security.py);
    # what follows it here is no header line.
    "bare-lf-in-header": Hostile(request_bytes(GOOD, headers=[("x-session-id", "a\nb")]), 400, None),
    "nul-in-header": Hostile(request_bytes(GOOD, headers=[("x-session-id", "a\0b")]), 400, None),
    "space-in-header-name": Hostile(request_bytes(GOOD, headers=[("x session", "a")]), 400, None),
    # Routing.
    "method-not-allowed": Hostile(request_bytes(GOOD, method="TRACE"), 405, "method_not_allowed"),
    "unknown-path": Hostile(request_bytes(GOOD, path="/v2/chat/completions"), 404, "not_found"),
}


def _is_error_json(body: bytes, code: str) -> bool:
    error = json.loads(body)["error"]
    return set(error) == {"type", "code", "message"} and error["code"] == code and bool(error["message"])


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
async def test_hostile_request(parser_stack: tuple[str, Stack], case: Hostile) -> None:
    await _refused(*parser_stack, case)


async def _refused(parser: str, stack: Stack, case: Hostile) -> None:
    before = stack.counts()
    async with raw_client(stack.url) as client:
        with anyio.fail_after(5):
            await client.send(case.request)
            response = await client.response()
    assert response.status == case.status, response.body
    code = case.code_under(parser)
    if code is None:
        assert response.body == PLAIN_400
        assert response.headers["connection"] == "close"
    else:
        assert response.headers["content-type"] == "application/json"
        assert _is_error_json(response.body, code), response.body
        if code in ("conflicting_framing", "invalid_transfer_encoding"):  # the body is unread: nothing after it
            assert response.headers["connection"] == "close"  # may be parsed as a request
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    assert "upstream.requests" not in stack.since(before)


def _te(value: str, body: bytes = GOOD) -> bytes:
    return request_bytes(_chunked(body), content_length=None, headers=[("transfer-encoding", value)])


# Framing that uvicorn's two parsers treat differently (not in docs/reliability.md's table yet):
# whatever one of them lets through, the gateway refuses.
PARSER_CASES: dict[str, Hostile] = {
    "transfer-encoding-chunked-then-gzip": Hostile(_te("chunked, gzip"), 400, None),
    "transfer-encoding-identity-chunked": Hostile(
        _te("identity, chunked"), 400, None, {"httptools": "invalid_transfer_encoding"}
    ),
    "transfer-encoding-deflate-chunked": Hostile(
        _te("deflate, chunked"), 400, None, {"httptools": "invalid_transfer_encoding"}
    ),
    "transfer-encoding-x-chunked": Hostile(
        _te("x-custom, chunked"), 400, None, {"httptools": "invalid_transfer_encoding"}
    ),
    "transfer-encoding-two-lines": Hostile(
        request_bytes(
            _chunked(GOOD),
            content_length=None,
            headers=[("transfer-encoding", "gzip"), ("transfer-encoding", "chunked")],
        ),
        400,
        None,
        {"httptools": "invalid_transfer_encoding"},
    ),
    "http-0.9": Hostile(b"GET /v1/models\r\n\r\n", 400, None, {"httptools": "unsupported_http_version"}),
}


@pytest.mark.parametrize("case", PARSER_CASES.values(), ids=PARSER_CASES.keys())
async def test_framing_one_parser_lets_through_is_refused(parser_stack: tuple[str, Stack], case: Hostile) -> None:
    await _refused(*parser_stack, case)


async def test_gzip_bomb_is_stopped_at_the_limit_not_inflated(stack: Stack) -> None:
    compressed = bomb(4096)  # 4 GiB of zeros in about 4 MiB: decoding stops one step past MAX_BODY_BYTES
    before = rss()
    async with raw_client(stack.url) as client:

        async def upload() -> None:
            # The 413 comes with `connection: close` before the upload ends: the server stops reading.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await client.send(request_bytes(compressed, headers=[("content-encoding", "gzip")]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(upload)
            response = await client.response()
    assert response.status == 413 and _is_error_json(response.body, "request_too_large")
    assert response.headers.get("connection") == "close"
    assert rss() - before < 32 * 1024 * 1024
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)


async def test_content_length_larger_than_sent_then_close_is_aborted(stack: Stack) -> None:
    before = stack.counts()
    async with raw_client(stack.url) as client:
        await client.send(request_bytes(GOOD, content_length=len(GOOD) + 100))
        await eventually(lambda: stack.stats()["inflight_requests"] == 1)
    await eventually(lambda: stack.since(before).get("aborted") == 1)
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    assert "upstream.requests" not in stack.since(before)


async def test_content_length_larger_than_sent_then_silence_is_a_408(stack: Stack) -> None:
    before = stack.counts()
    async with raw_client(stack.url) as client:
        await client.send(request_bytes(GOOD, content_length=len(GOOD) + 100))
        response = await client.response()
    assert response.status == 408 and _is_error_json(response.body, "request_timeout")
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    changed = stack.since(before)
    assert changed["timed_out"] == 1 and "upstream.requests" not in changed


async def test_content_length_smaller_than_sent(parser_stack: tuple[str, Stack]) -> None:
    """h11 takes Content-Length bytes as the body and parses the rest as the next request.
    httptools does too, but when the rest arrives in the same read it fails the whole read: the
    first request is never run and the connection gets the plain 400."""
    parser, stack = parser_stack
    before = stack.counts()
    body = b'{"model": "demo", "messages": []}' + b"GARBAGE THAT IS NOT A REQUEST\r\n\r\n"
    async with raw_client(stack.url) as client:
        await client.send(request_bytes(body, content_length=10))
        first = await client.response()
        if parser == "httptools" and first.body == PLAIN_400:
            assert first.status == 400 and first.headers["connection"] == "close"
            second = first
        else:
            second = await client.response()
            assert first.status == 400 and _is_error_json(first.body, "invalid_json")  # '{"model": ' alone
    assert second.status == 400 and second.body == PLAIN_400  # the rest is no request
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    assert "upstream.requests" not in stack.since(before)


async def test_oversized_headers_are_refused_by_the_server(
    parser_stack: tuple[str, Stack], caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    """uvicorn (h11) refuses a header block still incomplete past 16 KiB (``h11_max_incomplete_event_size``)
    with its plain-text 400 and closes, before the gateway runs. A client still sending then may
    get the reset instead of the 400."""
    parser, stack = parser_stack
    if parser == "httptools":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=HTTPTOOLS_HEADER_LIMIT))
    before = stack.counts()
    data = request_bytes(GOOD, headers=[("x-padding", "a" * (1024 * 1024))])
    async with raw_client(stack.url) as client:
        with anyio.fail_after(5):
            for start in range(0, len(data), 64 * 1024):
                try:
                    await client.send(data[start : start + 64 * 1024])
                except (anyio.BrokenResourceError, OSError):
                    break  # the server already answered and closed
            response = await client.response()
    assert (response.status, response.body) in ((400, PLAIN_400), (0, b""))
    assert "Invalid HTTP request received." in caplog.messages
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    assert not stack.since(before)  # not even admitted


def test_reliability_doc_lists_every_case() -> None:
    """docs/reliability.md is written from this table: every case has its row."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    missing = [name for name in HOSTILE if f"| `{name}` |" not in doc]
    assert missing == []
