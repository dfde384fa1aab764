"""The fault matrix, end to end over real sockets.

The gateway runs under uvicorn on a loopback port (``serve_in_thread(create_app(settings))``),
in front of the demo upstream (or a purpose-built one) on another loopback port. Every cell
drives one fault from the client side or the upstream side, checks the documented outcome
for the client, and then checks with ``assert_idle`` that nothing is left held: the gauges
of ``/lifetime/stats`` are back to zero, no upstream has a request in flight, and no
connection of the gateway's httpx pool is in the middle of a request.

The helpers here (``running``, ``assert_idle``, ``RawClient``...) are shared with
``test_hostile.py``, ``test_security.py`` and ``test_soak.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import h11
import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from asgi_lifetime._settings import KiB, LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._sse import SSEParser
from asgi_lifetime.testing import wait_idle
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import DemoStats, create_demo_upstream

from .._servers import threaded_server

pytestmark = pytest.mark.anyio

# Small timeouts keep every cell well under a few seconds.
FAST: dict[str, Any] = {
    "stall_timeout": 0.5,
    # Not 0.5 as the others: on a loaded host (2 cores, suites beside) the client thread waited that long
    # between a head and its body now and then, and an ordinary request got a 408.
    "body_idle_timeout": 2.0,
    "admission_timeout": 0.5,
    "headers_timeout": 2.0,
    "connect_timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
    "retry_after_cap": 0.05,
    "max_attempts": 3,
    "retry_deadline": 5.0,
    "keepalive_interval": 5.0,
}
PATH = "/v1/chat/completions"
CHAT: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
STREAM: dict[str, Any] = {**CHAT, "stream": True}
IDLE_TIMEOUT = 3.0
HTTP_PARSERS = ("h11", "httptools")
"""uvicorn's two HTTP/1.1 implementations (``serve={"http": ...}``): the hostile-input and framing
tests run under both, since ``http="auto"`` (and ``asgi-lifetime serve``) picks httptools when installed."""


# --- the stack under test ------------------------------------------------------------------------


@dataclass
class Stack:
    """A running gateway and the upstream behind it."""

    app: Starlette
    url: str
    upstream_url: str
    upstream: Starlette | None = None
    http: str = "auto"  # uvicorn's HTTP implementation (``serve={"http": ...}``)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def demo(self) -> DemoStats:
        assert self.upstream is not None, "this stack has no demo upstream"
        stats: DemoStats = self.upstream.state.stats
        return stats

    def stats(self) -> dict[str, int]:
        result: dict[str, int] = self.app.state.lifetime.stats().as_dict()
        return result

    def counts(self) -> dict[str, int]:
        """Every counter of the gateway, and the demo upstream's as ``upstream.<name>``."""
        counts = self.stats()
        if self.upstream is not None:
            counts.update({f"upstream.{k}": v for k, v in dataclasses.asdict(self.demo).items()})
        return counts

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """What changed since ``before = stack.counts()`` (a shared stack serves many tests)."""
        return {k: v - before.get(k, 0) for k, v in self.counts().items() if v != before.get(k, 0)}


@contextmanager
def running(
    *,
    upstream: ASGIApp | None = None,
    upstream_url: str | None = None,
    serve: dict[str, Any] | None = None,
    **changes: Any,
) -> Iterator[Stack]:
    """Serve the demo upstream (or ``upstream``, or use ``upstream_url``) and a gateway in front of it.

    ``changes`` override ``FAST`` settings; ``serve`` are uvicorn options for both servers.
    """
    with contextlib.ExitStack() as stack:
        demo: Starlette | None = None
        if upstream_url is None:
            if upstream is None:
                upstream = demo = create_demo_upstream(tokens_per_second=20_000, default_tokens=8)
            elif isinstance(upstream, Starlette):
                demo = upstream
            upstream_url = stack.enter_context(serve_in_thread(upstream, **(serve or {})))
        settings = LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, **changes})
        app = create_app(settings)
        url = stack.enter_context(serve_in_thread(app, **(serve or {})))
        http = str((serve or {}).get("http", "auto"))
        yield Stack(app=app, url=url, upstream_url=upstream_url, upstream=demo, http=http)


def busy_connections(app: Starlette) -> list[str]:
    """Connections of the gateway's upstream pool (httpcore's or aiohttp's, ``UPSTREAM_TRANSPORT``) that
    are in a request (idle keep-alive ones are fine), and requests waiting for one."""
    busy: list[str] = app.state.upstream._client._transport.busy()
    return busy


async def assert_idle(
    app: Starlette, base_url: str, *, seconds: float = IDLE_TIMEOUT, upstream: Starlette | None = None
) -> dict[str, Any]:
    """``wait_idle`` on ``/lifetime/stats`` (the gauges, every upstream's in-flight count) and,
    polled with them, the httpx pool and, with ``upstream`` (a demo upstream), its responses in
    progress. Returns the last stats."""

    def pool_and_upstream() -> list[str]:
        busy = busy_connections(app)
        if upstream is not None and upstream.state.stats.active_streams:
            busy.append(f"upstream active_streams={upstream.state.stats.active_streams}")
        return busy

    return await wait_idle(base_url, within=seconds, extra=pool_and_upstream)


async def eventually(condition: Callable[[], bool], *, seconds: float = 3.0) -> None:
    """Poll state that a server thread updates (there is no event to wait for across threads)."""
    deadline = anyio.current_time() + seconds
    while not condition():
        if anyio.current_time() > deadline:
            raise AssertionError(f"condition not met within {seconds}s")
        await anyio.sleep(0.01)


def rss() -> int:
    """Resident set size of this process (gateway, upstream and client all live in it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best we have
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def behaviour(text: str) -> dict[str, str]:
    return {"x-demo-behaviour": text}


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


def sse_error(body: bytes) -> dict[str, Any] | None:
    """The last in-band ``event: error`` of an SSE body, or None."""
    errors = [event for event in SSEParser().feed(body) if event.event == "error"]
    if not errors:
        return None
    error: dict[str, Any] = json.loads(errors[-1].data)["error"]
    return error


def sse_content(body: bytes) -> str:
    text = []
    for event in SSEParser().feed(body):
        if event.data != "[DONE]" and event.event == "message":
            for choice in json.loads(event.data).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


# --- raw HTTP/1.1 over a socket ------------------------------------------------------------------


def request_bytes(
    body: bytes = b"",
    *,
    method: str = "POST",
    path: str = PATH,
    headers: Sequence[tuple[str, str]] = (),
    content_length: int | str | None = -1,
) -> bytes:
    """An HTTP/1.1 request as bytes; ``content_length=-1`` means ``len(body)``, None leaves it out."""
    lines = [f"{method} {path} HTTP/1.1", "host: gateway.test", "content-type: application/json"]
    if content_length is not None:
        lines.append(f"content-length: {len(body) if content_length == -1 else content_length}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool  # the response ended properly (not cut off by a closed connection)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class RawClient:
    """A client on a plain socket: sends any bytes, parses the response with h11, hangs up at will."""

    stream: anyio.abc.SocketStream
    conn: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    closed: bool = False

    def __post_init__(self) -> None:
        self._prime()

    def _prime(self) -> None:
        # h11 only parses a response after a request: describe one (the real bytes are ours).
        self.conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
        self.conn.send(h11.EndOfMessage())

    def _next_cycle(self) -> None:
        """After a complete response: parse what follows as the next one (pipelined requests)."""
        data, closed = self.conn.trailing_data
        self.conn = h11.Connection(h11.CLIENT)
        self._prime()
        if data:
            self.conn.receive_data(data)
        if closed:
            self.conn.receive_data(b"")  # b"" is h11's end of stream

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def next_event(self) -> Any:
        """The next h11 event; ``h11.ConnectionClosed()`` when the server hung up (also mid-message)."""
        if self.conn.their_state is h11.DONE:
            self._next_cycle()
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                return h11.ConnectionClosed()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                data = b""
            self.conn.receive_data(data)

    async def head(self, *, seconds: float = 5.0) -> tuple[int, dict[str, str]]:
        with anyio.fail_after(seconds):
            while True:
                event = await self.next_event()
                if isinstance(event, h11.Response):
                    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                    return event.status_code, headers
                if isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the server closed the connection before responding")

    async def data(self, *, seconds: float = 5.0) -> bytes:
        """The next piece of the response body; b"" at its end."""
        with anyio.fail_after(seconds):
            while True:
                event = await self.next_event()
                if isinstance(event, h11.Data):
                    return bytes(event.data)
                if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return b""

    async def response(self, *, seconds: float = 5.0) -> RawResponse:
        """Read a whole response (what is left of it)."""
        status, headers, body, complete = 0, {}, bytearray(), False
        with anyio.fail_after(seconds):
            while True:
                event = await self.next_event()
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    complete = True
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    break
        return RawResponse(status, headers, bytes(body), complete)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.stream.aclose()


@asynccontextmanager
async def raw_client(url: str, *, rcvbuf: int | None = None) -> AsyncIterator[RawClient]:
    port = int(url.rsplit(":", 1)[1])
    if rcvbuf is None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        await anyio.wait_writable(sock)
        stream = await anyio.abc.SocketStream.from_socket(sock)
    client = RawClient(stream)
    try:
        yield client
    finally:
        await client.aclose()


# --- purpose-built upstreams ---------------------------------------------------------------------


class Firehose:
    """An upstream that streams ``total`` bytes of SSE as fast as the connection takes them.

    Nothing is allocated per chunk (one event is sent again and again), so the process's RSS
    shows what the gateway buffers. ``sent`` counts body bytes handed to the server.
    """

    def __init__(self, *, total: int, event_size: int = 16 * KiB, status: int = 200, sse: bool = True) -> None:
        payload = json.dumps({"choices": [{"index": 0, "delta": {"content": "x" * event_size}}]})
        self.event = f"data: {payload}\n\n".encode() if sse else b"x" * event_size
        self.total = total
        self.status = status
        self.sse = sse
        self.sent = 0
        self.finished = False
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        content_type = b"text/event-stream" if self.sse else b"application/json"
        headers = [(b"content-type", content_type)]
        if not self.sse:
            headers.append((b"content-length", str(self.total).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            while self.sent < self.total:
                chunk = self.event[: self.total - self.sent]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sent += len(chunk)
                await anyio.lowlevel.checkpoint()  # uvicorn's send returns at once once the peer is gone
            await send({"type": "http.response.body", "body": b""})
            self.finished = True
            tg.cancel_scope.cancel()


@contextmanager
def resetting_server() -> Iterator[tuple[str, list[int]]]:
    """A TCP server that accepts each connection and resets it at once (before any response).

    Yields its URL and a one-item list counting the connections it reset.
    """
    resets = [0]

    def reset(conn: socket.socket, _: int) -> None:
        resets[0] += 1  # before the reset: once the gateway sees it, it is counted
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        conn.close()

    with threaded_server(reset, name="resetting-server") as url:
        yield url, resets


class MaxJitter(random.Random):
    """Jitter seam: every backoff takes its full ceiling, so retry timing is deterministic."""

    def uniform(self, a: float, b: float) -> float:
        return b


# === client side ==================================================================================


@pytest.fixture(scope="module")
def shared() -> Iterator[Stack]:
    """One gateway and demo upstream with the ``FAST`` settings, for the cells that need nothing else."""
    with running() as stack:
        yield stack


async def test_disconnect_mid_body(shared: Stack) -> None:
    before = shared.counts()
    async with raw_client(shared.url) as client:
        await client.send(request_bytes(b'{"model": ', content_length=1000))
        await eventually(lambda: shared.stats()["inflight_requests"] == 1)
    await eventually(lambda: shared.since(before).get("aborted") == 1)
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)
    assert "upstream.requests" not in shared.since(before)  # nothing was forwarded


async def test_disconnect_while_waiting_for_admission() -> None:
    with running(max_inflight=1) as stack:
        body = json.dumps(STREAM).encode()
        async with raw_client(stack.url) as holder:
            # The holder takes the only slot for over a second (its upstream answers slowly).
            await holder.send(request_bytes(body, headers=[("x-demo-behaviour", "headers_delay=1")]))
            await eventually(lambda: stack.demo.requests == 1)
            async with raw_client(stack.url) as waiter:
                await waiter.send(request_bytes(body))
                await anyio.sleep(0.1)
            # The waiter is gone: its queued request sees the hang-up and leaves the queue at once,
            # while the holder still holds the slot (no wait for ADMISSION_TIMEOUT), nothing held.
            await eventually(lambda: stack.stats()["aborted"] == 1)
            assert stack.stats()["queued_requests"] == 0 and stack.stats()["rejected"] == 0
            response = await holder.response()
        assert response.status == 200 and response.complete and sse_content(response.body)
        await assert_idle(stack.app, stack.url, upstream=stack.upstream)
        assert stack.demo.requests == 1  # the waiter never reached the upstream
        assert stack.stats()["admitted"] == 1


async def test_admission_timeout_is_a_503_with_retry_after() -> None:
    with running(max_inflight=1) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=5) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post(PATH, json=CHAT, headers=behaviour("headers_delay=1")))
                await eventually(lambda: stack.demo.requests == 1)
                started = anyio.current_time()
                rejected = await client.post(PATH, json=CHAT)
                waited = anyio.current_time() - started
        assert rejected.status_code == 503 and error_code(rejected) == "overloaded"
        assert rejected.headers["retry-after"] == "1"
        assert 0.4 < waited < 1.0
        await assert_idle(stack.app, stack.url, upstream=stack.upstream)


@contextmanager
def slow_retries(**changes: Any) -> Iterator[Stack]:
    """A stack whose every backoff is exactly ``BACKOFF_BASE`` (the jitter seam takes the ceiling)."""
    with running(**changes) as stack:
        stack.app.state.upstream._random = MaxJitter()
        yield stack


async def test_disconnect_during_retry_backoff_stops_retrying() -> None:
    with slow_retries(max_attempts=4, backoff_base=1.0, backoff_max=1.0, retry_after_cap=0, retry_deadline=10) as stack:
        async with raw_client(stack.url) as client:
            headers = [("x-demo-behaviour", "fail=5"), ("x-session-id", "left-in-backoff")]
            await client.send(request_bytes(json.dumps(CHAT).encode(), headers=headers))
            await eventually(lambda: stack.demo.requests == 1)
            await anyio.sleep(0.1)  # now in the first 1 s backoff
        await assert_idle(stack.app, stack.url, seconds=0.6, upstream=stack.upstream)
        await anyio.sleep(1.0)
        assert stack.demo.requests == 1  # no attempt after the client left
        entry = stack.app.state.book.get("left-in-backoff")
        assert (entry.last_status, entry.last_outcome) == (499, "client_disconnected")


async def test_disconnect_while_waiting_for_upstream_headers_cancels_the_upstream_request(shared: Stack) -> None:
    before = shared.counts()
    async with raw_client(shared.url) as client:
        # headers_delay 1.5 s < HEADERS_TIMEOUT 2 s: the gateway would wait for these headers.
        behaviours = [("x-demo-behaviour", "headers_delay=1.5")]
        await client.send(request_bytes(json.dumps(CHAT).encode(), headers=behaviours))
        await eventually(lambda: shared.since(before).get("upstream.requests") == 1)
    # A non-streamed completion sends its headers only when it is done: the upstream must
    # learn at once that nobody waits for it any more.
    await eventually(lambda: shared.since(before).get("upstream.disconnects") == 1, seconds=0.5)
    await assert_idle(shared.app, shared.url, seconds=0.3, upstream=shared.upstream)


async def test_disconnect_mid_stream_cancels_the_upstream(shared: Stack) -> None:
    before = shared.counts()
    body = json.dumps({**STREAM, "max_tokens": 60}).encode()
    async with raw_client(shared.url) as client:
        await client.send(request_bytes(body, headers=[("x-demo-behaviour", "delay=0.05")]))
        status, _ = await client.head()
        assert status == 200
        assert await client.data()
    await eventually(lambda: shared.since(before).get("upstream.disconnects") == 1)
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)
    assert "upstream.completed" not in shared.since(before)


async def test_disconnect_right_after_the_last_byte(shared: Stack) -> None:
    before = shared.counts()
    for payload in (CHAT, STREAM):
        async with raw_client(shared.url) as client:
            await client.send(request_bytes(json.dumps(payload).encode()))
            response = await client.response()
        assert response.status == 200 and response.complete
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)
    changed = shared.since(before)
    assert changed["upstream.completed"] == 2 and "upstream.disconnects" not in changed
    assert changed["completed"] == 2


async def test_slow_client_body_is_a_408(shared: Stack) -> None:
    before = shared.counts()
    async with raw_client(shared.url) as client:
        await client.send(request_bytes(b"{", content_length=100))
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:

            async def trickle() -> None:  # each gap exceeds BODY_IDLE_TIMEOUT
                with contextlib.suppress(anyio.BrokenResourceError, OSError):
                    while True:
                        await anyio.sleep(FAST["body_idle_timeout"] + 1)
                        await client.send(b" ")

            tg.start_soon(trickle)
            response = await client.response()
            elapsed = anyio.current_time() - started
            tg.cancel_scope.cancel()
    assert response.status == 408 and response.json()["error"]["code"] == "request_timeout"
    assert elapsed >= FAST["body_idle_timeout"] * 0.9  # not sooner; how much later is the host's
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)
    changed = shared.since(before)
    assert changed["timed_out"] == 1 and "upstream.requests" not in changed


@asynccontextmanager
async def never_reading(port: int, firehose: Firehose) -> AsyncIterator[None]:
    """A client on ``port`` that asks for ``STREAM`` and never reads: entered once the upstream's output
    has stopped growing (pushed back through the gateway); the connection closes on exit."""
    # A plain socket, not an anyio stream: anyio's asyncio streams read eagerly into memory.
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window
        await anyio.to_thread.run_sync(sock.connect, ("127.0.0.1", port))
        await anyio.to_thread.run_sync(sock.sendall, request_bytes(json.dumps(STREAM).encode()))
        last, steady_since = -1, anyio.current_time()
        with anyio.fail_after(15):
            while anyio.current_time() - steady_since < 0.5:
                await anyio.sleep(0.05)
                if firehose.sent != last:
                    last, steady_since = firehose.sent, anyio.current_time()
        yield
    finally:
        sock.close()


async def test_client_that_never_reads_throttles_the_upstream() -> None:
    firehose = Firehose(total=512 * MiB)
    with running(upstream=firehose) as stack:
        before = rss()
        async with never_reading(stack.port, firehose):
            growth = rss() - before
            assert not firehose.finished
            assert firehose.sent < 64 * MiB, f"the upstream got {firehose.sent / MiB:.1f} MiB out"
            assert growth < 64 * MiB, f"RSS grew {growth / MiB:.1f} MiB"
            assert stack.stats()["inflight_requests"] == 1
        await eventually(lambda: firehose.disconnected)
        await assert_idle(stack.app, stack.url)


# === upstream side ================================================================================


@dataclass(frozen=True)
class Cell:
    """One upstream fault and what the client gets for it.

    ``status``: the HTTP status; ``code``: the JSON error code (``error.code``) of an error
    response, or of the in-band ``event: error`` for a 200 event stream; ``truncated``: the
    response is cut off (the client's HTTP library raises); ``outcome``: what the gateway's
    bookkeeper recorded; ``attempts``: requests the upstream saw.
    """

    behaviour: str
    stream: bool
    status: int
    code: str | None = None
    truncated: bool = False
    outcome: str = "complete"
    attempts: int = 1
    settings: tuple[tuple[str, Any], ...] = ()


CELLS: dict[str, Cell] = {
    "5xx-burst-recovers": Cell("fail=2", False, 200, attempts=3),
    "5xx-burst-recovers-stream": Cell("fail=2", True, 200, attempts=3),
    "5xx-burst-exhausts": Cell("fail=9", False, 503, attempts=3),
    "5xx-burst-exhausts-stream": Cell("fail=9", True, 503, attempts=3),
    "500-not-retried": Cell("status=500", False, 500),
    "429-recovers": Cell("fail=1,status=429", False, 200, attempts=2),
    "429-exhausts": Cell("status=429", True, 429, code="rate_limit_exceeded", attempts=3),
    "headers-slower-than-timeout": Cell(
        "headers_delay=1",
        False,
        504,
        code="upstream_timeout",
        outcome="error",
        attempts=1,  # the whole request was sent: the upstream may be generating, so no second one
        settings=(("headers_timeout", 0.3), ("max_attempts", 2)),
    ),
    "stall-after-headers": Cell("stall", False, 200, truncated=True, outcome="stalled"),
    "stall-after-headers-stream": Cell("stall", True, 200, code="upstream_stalled", outcome="stalled"),
    # Only event streams are judged for starvation: an empty 200 JSON body passes as it is.
    "starve": Cell("starve", False, 200),
    # The role event reached the client before the stream starved: not re-issued (no second answer).
    "starve-stream": Cell("starve", True, 200, code="upstream_starved", outcome="starved"),
    "malformed": Cell("malformed", False, 200),  # passed through as the upstream sent it
    "malformed-sse": Cell("malformed=2048", True, 200, code="upstream_starved", outcome="starved"),
    "reset-mid-body": Cell("reset", False, 200, truncated=True, outcome="upstream_error"),
    "reset-mid-stream": Cell("reset", True, 200, code="bad_gateway", outcome="upstream_error"),
    "gzip": Cell("gzip", False, 200),
    "gzip-stream": Cell("gzip", True, 200),
}


@contextmanager
def stack_for(shared: Stack, changes: dict[str, Any]) -> Iterator[Stack]:
    if not changes:
        yield shared
        return
    with running(**changes) as stack:
        yield stack


@pytest.mark.parametrize("cell", CELLS.values(), ids=CELLS.keys())
async def test_upstream_fault(shared: Stack, cell: Cell) -> None:
    with stack_for(shared, dict(cell.settings)) as stack:
        before = stack.counts()
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            payload = STREAM if cell.stream else CHAT
            session = uuid.uuid4().hex
            tagged = {**behaviour(f"{cell.behaviour},id={session}"), "x-session-id": session}  # own `fail` counter
            response = await client.send(client.build_request("POST", PATH, json=payload, headers=tagged), stream=True)
            try:
                assert response.status_code == cell.status
                if cell.truncated:
                    with pytest.raises(httpx.RemoteProtocolError):
                        await response.aread()
                    body = b""
                else:
                    body = await response.aread()
            finally:
                await response.aclose()
        if cell.truncated:
            pass
        elif cell.status >= 400:
            document = json.loads(body)
            assert set(document["error"]) >= {"type", "message"}
            if cell.code is not None:
                assert document["error"]["code"] == cell.code
        elif cell.stream:
            error = sse_error(body)
            if cell.code is None:
                assert error is None and sse_content(body) and body.endswith(b"data: [DONE]\n\n")
            else:
                assert error is not None and error["code"] == cell.code
        elif cell.behaviour == "starve":
            assert body == b""
        elif cell.behaviour == "malformed":
            assert body.startswith(b'{"choices"')
        else:
            assert json.loads(body)["choices"][0]["message"]["content"]
        await assert_idle(stack.app, stack.url, upstream=stack.upstream)
        changed = stack.since(before)
        assert changed["upstream.requests"] == cell.attempts
        entry = stack.app.state.book.get(session)
        assert (entry.last_status, entry.last_outcome) == (cell.status, cell.outcome)
        assert changed["completed"] == 1  # the request ended normally inside the gateway, whatever the client got


class RateLimited:
    """Answers 429 with ``Retry-After: 1`` to the first ``limited`` requests, then 200."""

    def __init__(self, limited: int) -> None:
        self.limited = limited
        self.arrivals: list[float] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        self.arrivals.append(time.monotonic())
        if len(self.arrivals) <= self.limited:
            status, headers, body = 429, [(b"retry-after", b"1")], b'{"error": {"message": "slow down"}}'
        else:
            status, headers, body = 200, [], json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def test_429_retry_after_is_honoured_and_passed_on() -> None:
    upstream = RateLimited(limited=1)
    with running(upstream=upstream, retry_after_cap=2.0, max_attempts=2) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json=CHAT)
            assert response.status_code == 200
            assert upstream.arrivals[1] - upstream.arrivals[0] >= 1.0  # waited as asked
            # Still limited after the last attempt: the client gets the 429 and its Retry-After.
            upstream.limited = 10
            response = await client.post(PATH, json=CHAT)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        await assert_idle(stack.app, stack.url)


async def test_upstream_connection_refused() -> None:
    with running(upstream_url=f"http://127.0.0.1:{free_port()}") as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json=CHAT)
        assert response.status_code == 502 and error_code(response) == "upstream_unreachable"
        assert "ConnectError" in response.json()["error"]["message"]
        stats = await assert_idle(stack.app, stack.url)
        assert stats["upstreams"][0]["requests"] == FAST["max_attempts"]


async def test_upstream_resets_before_headers() -> None:
    with resetting_server() as (url, resets), running(upstream_url=url) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for payload in (CHAT, STREAM):
                response = await client.post(PATH, json=payload)
                assert response.status_code == 502 and error_code(response) == "upstream_unreachable"
        await assert_idle(stack.app, stack.url)
        assert resets[0] == 2 * FAST["max_attempts"]


async def test_huge_upstream_error_body_is_not_buffered() -> None:
    # 128 MiB of error body, streamed by an upstream that allocates nothing per chunk.
    firehose = Firehose(total=128 * MiB, event_size=64 * KiB, status=500, sse=False)
    with running(upstream=firehose) as stack:
        before = rss()
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            async with client.stream("POST", PATH, json=CHAT) as response:
                assert response.status_code == 500
                with contextlib.suppress(httpx.RemoteProtocolError):
                    async for _ in response.aiter_raw():
                        pass
        growth = rss() - before
        assert growth < 64 * MiB, f"RSS grew {growth / MiB:.1f} MiB"
        await assert_idle(stack.app, stack.url)


async def test_huge_upstream_error_body_reaches_the_client_capped(shared: Stack) -> None:
    async with httpx.AsyncClient(base_url=shared.url, timeout=10) as client:
        response = await client.post(PATH, json=CHAT, headers=behaviour(f"error_body={10 * MiB}"))
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)
    assert response.status_code == 500
    assert len(response.content) <= LifetimeSettings().error_body_limit


async def test_gzip_response_passes_through_encoded(shared: Stack) -> None:
    async with httpx.AsyncClient(base_url=shared.url, timeout=10) as client:
        for payload in (CHAT, STREAM):
            async with client.stream("POST", PATH, json=payload, headers=behaviour("gzip")) as response:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            assert response.headers["content-encoding"] == "gzip"
            assert raw[:2] == b"\x1f\x8b"
            decoded = gzip.decompress(raw)
            if payload is STREAM:
                assert sse_content(decoded) and decoded.endswith(b"data: [DONE]\n\n")
            else:
                assert json.loads(decoded)["choices"][0]["message"]["content"]
    await assert_idle(shared.app, shared.url, upstream=shared.upstream)


def test_reliability_doc_lists_every_cell() -> None:
    """docs/reliability.md is written from these tables: every cell has its row."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    missing = [name for name in CELLS if f"| `{name}` |" not in doc]
    assert missing == []
