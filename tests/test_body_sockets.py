"""Reading bodies over real sockets: framing errors close the connection, the byte budget
follows bytes received and decoded, and the whole-body deadline holds.

The middleware runs in front of a tiny app under uvicorn (h11 and httptools) and under hypercorn
(asyncio and trio workers), each in its own thread; the clients are raw sockets on 127.0.0.1
driven from the test's own event loop (asyncio or trio).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import pytest
from starlette.types import Receive, Scope, Send

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings
from asgi_lifetime._settings import KiB, MiB
from asgi_lifetime.testing._serve import serve_in_thread

from ._servers import hypercorn_in_thread
from .reliability.test_faults import eventually

pytestmark = pytest.mark.anyio

SERVERS = ["uvicorn-h11", "uvicorn-httptools", "hypercorn-asyncio", "hypercorn-trio"]
# hypercorn's trio worker fails pipelined requests on its own (trio.BusyResourceError "another task
# is currently sending data on this SocketStream", good requests included): not part of that matrix.
PIPELINING = SERVERS[:3]
SECOND = b"POST /v1/second HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"


# --- the app and its servers ----------------------------------------------------------------------------------


@dataclass
class Served:
    """The middleware in front of an app that records each request it is given."""

    middleware: LifetimeMiddleware
    port: int = 0
    seen: list[str] = field(default_factory=list)

    @property
    def counters(self) -> Any:
        return self.middleware.lifetime.counters


def make_app(**changes: Any) -> Served:
    defaults: dict[str, Any] = {
        "paths": ("/v1/",),
        "admission_timeout": 0.5,
        "body_idle_timeout": 1.0,
        "max_body_bytes": 64 * KiB,
    }
    settings = LifetimeSettings(**defaults | changes)
    served: Served

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        served.seen.append(scope["path"])
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            more_body = message.get("more_body", False)
            # Counted and dropped: a body the app kept while it answers would be the app's memory,
            # not the middleware's (the memory tests below bound the middleware's).
            size += len(message.pop("body", b""))
            del message
        body = json.dumps({"size": size}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    served = Served(LifetimeMiddleware(app, settings=settings))
    return served


@contextmanager
def serving(served: Served, server: str) -> Iterator[Served]:
    if server.startswith("uvicorn-"):
        with serve_in_thread(served.middleware, http=server.split("-", 1)[1]) as url:
            served.port = int(url.rsplit(":", 1)[1])
            yield served
    else:
        with hypercorn_in_thread(served.middleware, server.split("-", 1)[1]) as port:
            served.port = port
            yield served


# --- raw clients ----------------------------------------------------------------------------------------------


@asynccontextmanager
async def connect(served: Served) -> AsyncIterator[anyio.abc.SocketStream]:
    stream = await anyio.connect_tcp("127.0.0.1", served.port)
    async with stream:
        yield stream


async def read_until_closed(stream: anyio.abc.SocketStream, seconds: float = 5.0) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection within ``seconds``."""
    data = bytearray()
    with anyio.move_on_after(seconds):
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return bytes(data), True
    return bytes(data), False


async def read_response(
    stream: anyio.abc.SocketStream, buffer: bytearray | None = None, seconds: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """One complete response with a Content-Length (what the middleware and the app send);
    bytes read past it stay in ``buffer`` for the next call."""
    data = bytearray() if buffer is None else buffer
    with anyio.fail_after(seconds):
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        head, _, _ = bytes(data).partition(b"\r\n\r\n")
        status, headers = parse_head(head)
        end = len(head) + 4 + int(headers.get("content-length", "0"))
        while len(data) < end:
            data += await stream.receive()
    body = bytes(data[len(head) + 4 : end])
    del data[:end]
    return status, headers, body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = (headers.get(name.strip().lower(), "") + "," + value.strip()).strip(",")
    return int(lines[0].split()[1]), headers


def request(body: bytes, *headers: str, path: str = "/v1/first") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", "content-type: application/octet-stream", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def gzip_tail_junk() -> bytes:
    return gzip.compress(b"ok", mtime=0) + b"junk"


# --- 7: an error sent before the body was read closes the connection -----------------------------------------

BAD = {
    # The framing is the server's to enforce; what each server does is asserted below.
    "cl-and-te": request(b"5\r\nhello\r\n0\r\n\r\n", "content-length: 5", "transfer-encoding: chunked"),
    "too-large-by-length": request(b"x" * (64 * KiB + 1), f"content-length: {64 * KiB + 1}"),
    "too-large-chunked": request(
        b"%x\r\n" % (64 * KiB + 1) + b"x" * (64 * KiB + 1) + b"\r\n0\r\n\r\n", "transfer-encoding: chunked"
    ),
    "unsupported-encoding": request(b"abcde", "content-length: 5", "content-encoding: br"),
    "stacked-encoding": request(b"abcde", "content-length: 5", "content-encoding: gzip, gzip"),
    "invalid-content-length": request(b"abcde", "content-length: 5, 6"),
    "malformed-gzip": request(gzip_tail_junk(), f"content-length: {len(gzip_tail_junk())}", "content-encoding: gzip"),
}
EXPECTED_STATUS = {
    "cl-and-te": 400,
    "too-large-by-length": 413,
    "too-large-chunked": 413,
    "unsupported-encoding": 415,
    "stacked-encoding": 415,
    "invalid-content-length": 400,
    "malformed-gzip": 400,
}


@pytest.mark.parametrize("server", PIPELINING)
@pytest.mark.parametrize("case", list(BAD))
async def test_error_before_the_body_is_read_closes_the_connection(server: str, case: str) -> None:
    """The bad request and a second one pipelined behind it, in one write: the second never reaches the app."""
    with serving(make_app(), server) as served:
        async with connect(served) as stream:
            await stream.send(BAD[case] + SECOND)
            data, closed = await read_until_closed(stream)
        assert closed, f"{server} kept the connection open after: {data[:200]!r}"
        assert "/v1/second" not in served.seen
        assert data.count(b"HTTP/1.1 ") == 1, data  # one answer, to the bad request only
        status, headers = parse_head(data.partition(b"\r\n\r\n")[0])
        assert status == EXPECTED_STATUS[case]
        assert headers.get("connection") == "close"
    assert served.counters.inflight_requests == 0 and served.counters.inflight_bytes == 0


@pytest.mark.parametrize("server", SERVERS)
async def test_idle_timeout_closes_the_connection_before_the_rest_is_read_as_a_request(server: str) -> None:
    with serving(make_app(body_idle_timeout=0.2), server) as served:
        async with connect(served) as stream:
            await stream.send(request(b"01234", "content-length: 20"))
            status, headers, body = await read_response(stream)
            assert status == 408 and headers.get("connection") == "close"
            assert json.loads(body)["error"]["code"] == "request_timeout"
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await stream.send(b"56789012345678901234" + SECOND)  # the rest, then a request
            data, closed = await read_until_closed(stream)
        assert closed and b"HTTP/1.1" not in data
        assert served.seen == []


@pytest.mark.parametrize("server", PIPELINING)
async def test_admission_503_closes_the_connection(server: str) -> None:
    with serving(make_app(max_inflight=1, admission_timeout=0.2, body_idle_timeout=5.0), server) as served:
        async with connect(served) as holder:
            await holder.send(request(b"0", "content-length: 10"))  # admitted, then holds its slot
            await eventually(lambda: served.counters.inflight_requests == 1)
            async with connect(served) as stream:
                await stream.send(request(b"abc", "content-length: 3") + SECOND)
                data, closed = await read_until_closed(stream)
            assert closed and data.count(b"HTTP/1.1 ") == 1
            status, headers = parse_head(data.partition(b"\r\n\r\n")[0])
            assert status == 503 and headers.get("connection") == "close" and "retry-after" in headers
            await holder.send(b"123456789")
            status, _, body = await read_response(holder)
            assert status == 200 and json.loads(body) == {"size": 10}
        assert served.seen == ["/v1/first"]


@pytest.mark.parametrize("server", PIPELINING)
async def test_a_good_request_keeps_the_connection_alive(server: str) -> None:
    """The close is only for errors: pipelined good requests are all served on one connection."""
    with serving(make_app(), server) as served:
        async with connect(served) as stream:
            await stream.send(request(b"abc", "content-length: 3") + SECOND)
            buffer = bytearray()
            first = await read_response(stream, buffer)
            second = await read_response(stream, buffer)
        assert first[0] == second[0] == 200 and "connection" not in first[1]
        assert json.loads(first[2]) == {"size": 3} and json.loads(second[2]) == {"size": 2}
        assert served.seen == ["/v1/first", "/v1/second"]


# --- 10, 11: the byte budget follows bytes received and decoded -------------------------------------------------

MEMORY_SERVERS = ["uvicorn-h11", "uvicorn-httptools", "hypercorn-trio"]


async def post(served: Served, body: bytes, *headers: str) -> tuple[int, dict[str, str], bytes]:
    async with connect(served) as stream:
        sender = stream.send(request(body, f"content-length: {len(body)}", *headers))
        async with anyio.create_task_group() as tg:

            async def send() -> None:
                # The server may answer and close before it has read everything (503): not our failure.
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await sender

            tg.start_soon(send)
            answer = await read_response(stream, seconds=30)
        return answer  # after the task group: mypy cannot tell that its exit never swallows an exception


@contextmanager
def traced() -> Iterator[list[int]]:
    """tracemalloc over the block (the servers' threads included): yields [peak] on exit."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("server", MEMORY_SERVERS)
async def test_gzip_bodies_are_charged_as_they_decode(server: str) -> None:
    """Ten 15 KiB gzip bodies decoding to 15 MiB each, 32 MiB of budget, sent a piece at a time
    to every connection in turn so all are mid-body at once: decoding waits for budget, so memory
    stays near the budget (issue 9 item 10 measured +138 MiB with the budget reading 30)."""
    budget = 32 * MiB
    wire = gzip.compress(bytes(15 * MiB), mtime=0)
    assert len(wire) < 20 * KiB
    pieces = [wire[offset : offset + 1024] for offset in range(0, len(wire), 1024)]
    # Generous timeouts: under load a round of pieces over ten connections can take seconds.
    app = make_app(
        max_body_bytes=16 * MiB, max_inflight_bytes=budget, max_inflight=10, admission_timeout=60, body_idle_timeout=60
    )
    with serving(app, server) as served, traced() as peak:
        results: list[tuple[int, dict[str, str], bytes]] = []
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(connect(served)) for _ in range(10)]
            for stream in streams:
                await stream.send(request(b"", f"content-length: {len(wire)}", "content-encoding: gzip"))
            await eventually(lambda: served.counters.admitted == 10)

            async def send_round(round_pieces: list[bytes]) -> None:
                for piece in round_pieces:
                    for stream in streams:
                        # A request turned away (503) is closed: the rest of its body goes nowhere.
                        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                            await stream.send(piece)

            await send_round(pieces[:-1])  # every body but its last KiB: none can finish yet
            # Until the budget is all in use, decoding goes on; the memory check fails fast if unbounded.
            await eventually(
                lambda: (
                    served.counters.inflight_bytes >= budget - 10 * 256 * KiB
                    or tracemalloc.get_traced_memory()[0] > 2 * budget
                ),
                seconds=30,
            )
            assert tracemalloc.get_traced_memory()[0] < 2 * budget, "decoding went on past the budget"
            await send_round(pieces[-1:])
            with anyio.fail_after(60):
                for stream in streams:
                    results.append(await read_response(stream, seconds=60))
        # Requests that all hold part of the budget and all wait for more are broken up at once:
        # the youngest get 503 (connection closed), the oldest finish.
        statuses = [status for status, _, _ in results]
        assert len(statuses) == 10 and set(statuses) <= {200, 503} and 200 in statuses, statuses
        for status, headers, body in results:
            if status == 200:
                assert json.loads(body) == {"size": 15 * MiB}
            else:
                assert headers.get("connection") == "close" and json.loads(body)["error"]["code"] == "overloaded"
        await eventually(lambda: served.counters.inflight_bytes == 0 and served.counters.inflight_requests == 0)
    # Held: at most the budget (BytesIO over-allocates up to 1/8) plus one inflate step per request,
    # plus the servers' own buffers (hypercorn's trio worker went 1.1 MiB past a 4 MiB allowance).
    assert peak[0] < budget * 1.25 + 10 * 256 * KiB + 8 * MiB, peak[0] / MiB


@pytest.mark.parametrize("server", MEMORY_SERVERS)
async def test_declared_length_holds_neither_memory_nor_budget(server: str) -> None:
    """Two clients declare 16 MiB and send a few bytes: they cost those bytes, and a small request
    still gets in (issue 9 item 11: +32 MiB after 6 bytes, and 503 for everyone else)."""
    app = make_app(max_body_bytes=16 * MiB, max_inflight_bytes=32 * MiB, admission_timeout=0.5, body_idle_timeout=30)
    with serving(app, server) as served:
        with traced() as peak:
            async with connect(served) as slow1, connect(served) as slow2:
                for slow in (slow1, slow2):
                    await slow.send(request(b"abc", f"content-length: {16 * MiB}"))
                await eventually(lambda: served.counters.inflight_requests == 2 and served.counters.inflight_bytes == 6)
                status, _, body = await post(served, b"small")
                assert status == 200 and json.loads(body) == {"size": 5}
                await eventually(lambda: served.counters.inflight_bytes == 6)  # the small one gave its bytes back
        assert peak[0] < 4 * MiB, peak[0] / MiB
        await eventually(lambda: served.counters.inflight_bytes == 0 and served.counters.inflight_requests == 0)


@pytest.mark.parametrize("server", MEMORY_SERVERS + ["hypercorn-asyncio"])
async def test_requests_stuck_mid_body_come_unstuck(server: str) -> None:
    """Three 1 MiB bodies, 1 MiB of budget, all a third in: each needs what the others hold.
    Without waiting for the admission timeout, the youngest are turned away with 503 (connection
    closed) and their bytes come back; the oldest completes and nothing stays held."""
    app = make_app(max_body_bytes=MiB, max_inflight_bytes=MiB, admission_timeout=30, body_idle_timeout=30)
    with serving(app, server) as served:
        body = b"x" * MiB
        third = 320 * KiB
        results: list[tuple[int, dict[str, str], bytes]] = []
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(connect(served)) for _ in range(3)]
            for stream in streams:
                await stream.send(request(body[:third], f"content-length: {MiB}"))
            await eventually(lambda: served.counters.inflight_bytes >= 3 * third)

            async def finish(stream: anyio.abc.SocketStream) -> None:
                async def send() -> None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        await stream.send(body[third:])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send)
                    results.append(await read_response(stream, seconds=30))
                await stream.aclose()  # as a client does once answered

            with anyio.fail_after(10):  # well below the admission timeout
                async with anyio.create_task_group() as tg:
                    for stream in streams:
                        tg.start_soon(finish, stream)
        statuses = sorted(status for status, _, _ in results)
        assert statuses == [200, 503, 503], statuses  # the oldest finishes, the others make way
        for status, headers, _ in results:
            if status == 503:
                assert headers.get("connection") == "close" and "retry-after" in headers
        await eventually(lambda: served.counters.inflight_bytes == 0 and served.counters.inflight_requests == 0)
        assert served.counters.rejected == statuses.count(503)
        status, _, reply = await post(served, body)  # and the whole budget is there for the next one
        assert status == 200 and json.loads(reply) == {"size": MiB}


@pytest.mark.parametrize("server", MEMORY_SERVERS)
async def test_body_timeout_cuts_a_sender_that_is_never_idle(server: str) -> None:
    app = make_app(body_timeout=0.5, body_idle_timeout=5.0)
    with serving(app, server) as served:
        async with connect(served) as stream:
            await stream.send(request(b"", "content-length: 1000"))
            async with anyio.create_task_group() as tg:

                async def trickle() -> None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        for _ in range(1000):
                            await stream.send(b"x")
                            await anyio.sleep(0.02)

                tg.start_soon(trickle)
                status, headers, body = await read_response(stream)
                tg.cancel_scope.cancel()
        assert status == 408 and headers.get("connection") == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_body_timeout" and "0.5 seconds" in error["message"]
        assert served.seen == []
        await eventually(lambda: served.counters.inflight_requests == 0 and served.counters.timed_out == 1)


@pytest.mark.parametrize("server", PIPELINING)
async def test_gateway_key_401_closes_the_connection(server: str) -> None:
    """A refused key is answered before the body is read: the body must not be parsed as the next request."""
    from asgi_lifetime.gateway._auth import GatewayAuth

    served = make_app()
    inner = served.middleware
    served.middleware = GatewayAuth(inner, gateway_keys=["right"], upstream_api_key="upstream")  # type: ignore[assignment]
    smuggled = b"POST /v1/second HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    with serving(served, server):
        async with connect(served) as stream:
            await stream.send(
                request(smuggled, f"content-length: {len(smuggled)}", "authorization: Bearer wrong") + SECOND
            )
            data, closed = await read_until_closed(stream)
    assert closed and data.count(b"HTTP/1.1 ") == 1, data
    status, headers = parse_head(data.partition(b"\r\n\r\n")[0])
    assert status == 401 and headers.get("connection") == "close"
    assert served.seen == []
