"""A hostile or broken upstream, end to end over real sockets: what still broke after issue 9.

The gateway (``create_app``) runs under uvicorn in front of a raw-socket upstream
(``tests/_raw_upstream.py``) that writes scripted bytes; the clients are httpx and raw sockets.
Every test ends with ``assert_idle`` (nothing held, no busy pooled connection).
"""

from __future__ import annotations

import gzip
import json
import tracemalloc
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from asgi_lifetime.gateway._sse import SSEParser

from ..gateway._raw_upstream import RawRequest, Script, raw_upstream
from .test_faults import PATH, assert_idle, running

pytestmark = pytest.mark.anyio

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"x"}}]}\n\n'
END = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
STREAM_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk: h11 hands each to the gateway as its own piece, however TCP groups them."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def answering(*steps: bytes | str) -> Any:
    def answer(request: RawRequest) -> Script:
        return list(steps)

    return answer


async def _stream_peak(body: bytes, **settings: Any) -> tuple[int, bytes, int]:
    """Stream ``body`` (the chunked body bytes after the head) through the gateway; the traced peak,
    what the client got, and how many requests the upstream saw."""
    with (
        raw_upstream(answering(SSE_HEAD + body)) as upstream,
        running(upstream_url=upstream.url, **{"stall_timeout": 30.0, **settings}) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            tracemalloc.start()
            try:
                got = bytearray()
                async with client.stream("POST", PATH, json=STREAM_BODY) as response:
                    assert response.status_code == 200
                    async for piece in response.aiter_raw():
                        got += piece
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        await assert_idle(stack.app, stack.url)
    return peak, bytes(got), len(upstream.requests)


async def test_an_event_dripped_in_tiny_chunks_is_held_at_its_size() -> None:
    # The unfinished event is held until its blank line. It was held as a list of the chunks it came
    # in: an upstream sending it in 2-byte HTTP chunks made every 2 bytes cost a bytes object and a
    # list slot (~40 bytes), so the 1 MiB hold could take ~64 MiB per request.
    size = 96 * 1024
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"a" * size + b'"}}]}'
    drip = b"".join(chunk(event[i : i + 2]) for i in range(0, len(event), 2))
    body = chunk(FIRST) + drip + chunk(b"\n\n" + END) + b"0\r\n\r\n"
    peak, got, requests = await _stream_peak(body)
    assert got == FIRST + event + b"\n\n" + END
    assert requests == 1
    assert peak < 16 * size, f"peak {peak} bytes while holding a {size}-byte event"


@pytest.mark.parametrize(
    "item",
    [b"{}", b"[]", b'{"a":1}', b"[[]]"],
    ids=["empty-objects", "empty-arrays", "small-objects", "nested-arrays"],
)
async def test_a_costly_event_is_not_parsed_whole(item: bytes) -> None:
    # The starvation guard parsed every event: an event of 512 KiB of "{},{},..." became ~14 MiB of
    # dicts (25-30x), per request, on the event loop. Events whose parse would cost more than a request
    # body of the same shape may (``parse_limit``) are not read; they count as output, like an
    # oversized event, and are relayed as they came.
    size = 512 * 1024
    items = b",".join([item] * (size // (len(item) + 1)))
    event = b'data: {"choices":[{"index":0,"delta":{"content":"y"}}],"x":[' + items + b"]}\n\n"
    peak, got, requests = await _stream_peak(chunk(FIRST) + chunk(event) + chunk(END) + b"0\r\n\r\n")
    assert got == FIRST + event + END
    assert requests == 1
    assert sse_errors(got) == []
    assert peak < 12 * size, f"peak {peak} bytes for a {size}-byte event"


async def test_a_costly_event_without_a_terminal_is_output_not_starvation() -> None:
    # Not read means not judged: the stream is output (no re-issue, no double billing), and a stream
    # that then ends without its terminal event ends cleanly, as an unrecognised format would.
    items = b",".join([b"{}"] * (128 * 1024))
    event = b'data: {"choices":[{"index":0,"delta":{"content":""}}],"x":[' + items + b"]}\n\n"
    _, got, requests = await _stream_peak(chunk(event) + b"0\r\n\r\n")
    assert got == event
    assert requests == 1


def sse_errors(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(event.data) for event in SSEParser().feed(body) if event.event == "error"]


# --- our upstream key, quoted by the upstream in a success body -------------------------------------

KEY = "sk-upstream-S3CRET/key+1"
SPELLINGS = {
    "bare": KEY.encode(),
    "json-escaped-slash": KEY.replace("/", "\\/").encode(),
    "unicode-escaped": "".join(f"\\u{ord(c):04x}" for c in KEY).encode(),
    "percent-encoded": quote(KEY, safe="").encode(),
}


def _no_key(data: bytes) -> None:
    for name, spelling in SPELLINGS.items():
        assert spelling not in data, f"the upstream key ({name}) reached the client"
    assert b"S3CRET" not in data


@pytest.mark.parametrize("spelling", list(SPELLINGS), ids=list(SPELLINGS))
@pytest.mark.parametrize("piece", [0, 1, 3], ids=["whole", "1-byte-chunks", "3-byte-chunks"])
async def test_the_upstream_key_never_reaches_the_client_in_an_event_stream(spelling: str, piece: int) -> None:
    # Only error bodies and headers were scrubbed: a 200 event stream quoting the key (an in-band
    # error event, an echoed request) handed UPSTREAM_API_KEY to the client, also split across chunks.
    quoted = SPELLINGS[spelling]
    error = b'event: error\ndata: {"error":{"message":"invalid key Bearer ' + quoted + b'"}}\n\n'
    if piece:
        body = chunk(FIRST) + b"".join(chunk(error[i : i + piece]) for i in range(0, len(error), piece))
    else:
        body = chunk(FIRST + error)
    with (
        raw_upstream(answering(SSE_HEAD + body + b"0\r\n\r\n")) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json=STREAM_BODY)
        await assert_idle(stack.app, stack.url)
    assert response.status_code == 200
    _no_key(response.content)
    assert response.content.startswith(FIRST)
    (event,) = sse_errors(response.content)
    assert event["error"]["message"].startswith("invalid key Bearer [redacted]")
    assert upstream.requests[0].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize("scheme", ["bearer", "x-api-key", "x-goog-api-key"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_the_upstream_key_never_reaches_the_client_in_a_json_answer(scheme: str, framing: str) -> None:
    # A 200 JSON answer echoing the request's headers: masked at the same length, so the
    # Content-Length the client was promised stays true.
    body = json.dumps({"echo": {"authorization": f"Bearer {KEY}", "x-api-key": KEY}, "after": "ok"}).encode()
    if framing == "content-length":
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        raw = head.encode() + body
    else:
        head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        raw = head.encode() + b"".join(chunk(body[i : i + 5]) for i in range(0, len(body), 5)) + b"0\r\n\r\n"
    with (
        raw_upstream(answering(raw)) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, upstream_auth=scheme) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json={"model": "m", "messages": []})
        await assert_idle(stack.app, stack.url)
    assert response.status_code == 200
    _no_key(response.content)
    echoed = response.json()
    assert echoed["after"] == "ok" and echoed["echo"]["x-api-key"].startswith("[redacted]")
    assert len(response.content) == len(body)


async def test_a_body_ending_in_the_start_of_the_key_is_relayed_whole() -> None:
    # Masking holds back what could begin the key until it knows: at the end it is all sent.
    body = b'{"text": "not the key"} sk-upstream-S'  # a start of KEY, then the end of the body
    head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    with (
        raw_upstream(answering(head + body)) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json={})
        await assert_idle(stack.app, stack.url)
    assert response.content == body


async def test_the_upstream_key_never_reaches_the_client_in_a_gzip_answer() -> None:
    body = gzip.compress(json.dumps({"echo": f"Bearer {KEY}"}).encode())
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    with (
        raw_upstream(answering(head.encode() + body)) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json={}, headers={"accept-encoding": "gzip"})
        await assert_idle(stack.app, stack.url)
    # The gateway asked for identity: an answer encoded anyway cannot be checked, so it is withheld.
    assert response.status_code == 502 and response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == "upstream_answer_withheld"
    _no_key(response.content)
