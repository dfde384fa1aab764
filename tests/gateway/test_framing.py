"""Upstream message framing, relayed: the client never gets a body that looks complete and is not.

RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length, and a proxy must remove the
Content-Length before forwarding. Conflicting or invalid Content-Length values are an upstream
fault (h11 refuses them): the client gets the gateway's 502, never a guessed body. A body that
ends before its Content-Length ends broken for the client (or, for an error body, as an honest
gateway error), not as a complete response.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ..reliability.test_faults import HTTP_PARSERS, PATH, assert_idle, raw_client, request_bytes, running
from ._raw_upstream import CLOSE, RawRequest, Script, chunked, raw_upstream, response

pytestmark = pytest.mark.anyio


@pytest.fixture(params=HTTP_PARSERS)
def http(request: pytest.FixtureRequest) -> str:
    """uvicorn's HTTP implementation in front of the client (what the client gets is framed by it)."""
    return str(request.param)


BODY = b'{"id": "x", "choices": [{"message": {"content": "' + b"a" * 70 + b'"}}]}'  # 124 bytes


def answering(*steps: bytes | str) -> Any:
    def answer(request: RawRequest) -> Script:
        return list(steps)

    return answer


@pytest.mark.parametrize("transport", ["httpcore", "aiohttp"])
async def test_transfer_encoding_overrides_content_length(transport: str, http: str) -> None:
    # The case: Transfer-Encoding chunked and Content-Length 51, 124 bytes sent chunked.
    assert len(BODY) == 124
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ncontent-length: 51\r\n\r\n"
    )
    with (
        raw_upstream(answering(head + chunked(BODY))) as upstream,
        running(upstream_url=upstream.url, upstream_transport=transport, serve={"http": http}) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.complete and got.body == BODY
    assert got.headers.get("content-length") in (None, "124")
    # aiohttp's parser refuses both framings: that attempt fails, the retry goes through httpcore.
    assert len(upstream.requests) == (2 if transport == "aiohttp" else 1)


@pytest.mark.parametrize(
    "lengths",
    [("124, 124",), ("124", "124"), ("124,124", "124")],
    ids=["list", "repeated", "both"],
)
async def test_repeated_equal_content_lengths_are_one(lengths: tuple[str, ...], http: str) -> None:
    head = "HTTP/1.1 200 OK\r\n" + "".join(f"content-length: {v}\r\n" for v in lengths) + "\r\n"
    with (
        raw_upstream(answering(head.encode() + BODY)) as upstream,
        running(upstream_url=upstream.url, serve={"http": http}) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.complete and got.body == BODY and got.headers["content-length"] == "124"


@pytest.mark.parametrize(
    "lengths",
    [("51, 124",), ("51", "124"), ("-1",), ("+124",), ("0x7c",), ("12a",), ("1" * 40,), ("",)],
    ids=["conflicting-list", "conflicting-headers", "negative", "plus", "hex", "junk", "huge", "empty"],
)
async def test_content_length_h11_rejects_is_a_502_not_a_body(lengths: tuple[str, ...], http: str) -> None:
    head = "HTTP/1.1 200 OK\r\n" + "".join(f"content-length: {v}\r\n" for v in lengths) + "\r\n"
    with (
        raw_upstream(answering(head.encode() + BODY)) as upstream,
        running(upstream_url=upstream.url, serve={"http": http}) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            got = await client.post(PATH, json={})
        await assert_idle(stack.app, stack.url)
    assert got.status_code == 502 and got.json()["error"]["type"] == "upstream_error"
    assert got.headers["x-should-retry"] == "false"


async def test_head_response_keeps_its_length_and_has_no_body(http: str) -> None:
    with raw_upstream(answering(response(200, b"", headers=(("content-length", "124"),), length=False))) as upstream:
        with running(upstream_url=upstream.url, serve={"http": http}) as stack:
            async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
                got = await client.head(PATH)
            await assert_idle(stack.app, stack.url)
    assert got.status_code == 200 and got.content == b"" and got.headers["content-length"] == "124"
    assert upstream.requests[0].method == "HEAD"


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses_relay_no_body(status: int, http: str) -> None:
    with (
        raw_upstream(answering(response(status, b"smuggled"))) as upstream,
        running(upstream_url=upstream.url, serve={"http": http}) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.complete and got.status == status and got.body == b""


@pytest.mark.parametrize("transport", ["httpcore", "aiohttp"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_short_success_body_ends_broken(framing: str, transport: str, http: str) -> None:
    if framing == "content-length":
        cut = b"HTTP/1.1 200 OK\r\ncontent-length: 124\r\n\r\n" + BODY[:51]
    else:
        cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(BODY)[:60]
    with (
        raw_upstream(answering(cut, CLOSE)) as upstream,
        running(upstream_url=upstream.url, upstream_transport=transport, serve={"http": http}) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.status == 200 and not got.complete  # cut off, as the upstream's was
    assert len(got.body) < len(BODY)


async def test_a_long_body_is_relayed_to_its_length_only(http: str) -> None:
    long = b"HTTP/1.1 200 OK\r\ncontent-length: 51\r\n\r\n" + BODY
    with raw_upstream(answering(long)) as upstream, running(upstream_url=upstream.url, serve={"http": http}) as stack:
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(b"{}"))
            got = await client.response()
        await assert_idle(stack.app, stack.url)
    assert got.complete and got.body == BODY[:51] and got.headers["content-length"] == "51"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("status", [400, 401, 500])
async def test_a_short_error_body_is_not_relayed_as_complete(framing: str, status: int, http: str) -> None:
    error = b'{"error": {"message": "' + b"e" * 100 + b'"}}'
    if framing == "content-length":
        cut = f"HTTP/1.1 {status} X\r\ncontent-length: {len(error)}\r\n\r\n".encode() + error[:40]
    else:
        cut = f"HTTP/1.1 {status} X\r\ntransfer-encoding: chunked\r\n\r\n".encode() + chunked(error)[:50]
    with (
        raw_upstream(answering(cut, CLOSE)) as upstream,
        running(upstream_url=upstream.url, serve={"http": http}) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            got = await client.post(PATH, json={})
        await assert_idle(stack.app, stack.url)
    assert got.status_code == status
    detail = got.json()["error"]
    assert detail["code"] == "upstream_error_incomplete" and "broke off" in detail["message"]
    assert detail["upstream_body"].startswith('{"error": {"message": "eee')
