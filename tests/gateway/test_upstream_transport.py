"""UPSTREAM_TRANSPORT: aiohttp and httpcore behave alike where the gateway depends on it.

Each transport is driven against raw loopback sockets (nothing about aiohttp is assumed): the
same failures raise the same httpx exceptions (the retry loop maps those), the bytes go through
untouched both ways, a response closed half-read never goes back to the pool, a request abandoned
mid-body to an upstream that stopped reading closes its connection at once, and ``auto``
picks aiohttp on asyncio and httpcore on trio. aiohttp runs on asyncio only: on trio, asking for
it fails when the transport is chosen (the gateway's startup), which is tested too.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anyio
import httpx
import psutil
import pytest
from aiohttp.client_proto import ResponseHandler
from starlette.types import Message

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import _transport as transport_module
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._aiohttp import AiohttpTransport, _GuardedConnector
from asgi_lifetime.gateway._relay import relay
from asgi_lifetime.gateway._transport import GuardedTransport, UpstreamTransport

from ..reliability.test_faults import assert_idle, eventually, running
from ._raw_upstream import CLOSE, HOLD, Script, chunked, raw_upstream, response

pytestmark = pytest.mark.anyio

TRANSPORTS = ["httpcore", "aiohttp"]
LIMITS = httpx.Limits(max_connections=2, max_keepalive_connections=2)


def runs_here(choice: str, anyio_backend: str) -> bool:
    """False for aiohttp on trio, once it is checked that choosing it there fails (the gateway's
    startup error): the rest of the test has nothing to run on this loop."""
    if choice == "aiohttp" and anyio_backend == "trio":
        with pytest.raises(ValueError, match="UPSTREAM_TRANSPORT=aiohttp is invalid on trio"):
            UpstreamTransport(choice=choice, limits=LIMITS).choose()
        return False
    return True


@contextlib.asynccontextmanager
async def network(choice: str, **limits: Any) -> AsyncIterator[UpstreamTransport]:
    """The transport ``choice`` names, chosen in this loop, closed on the way out."""
    transport = UpstreamTransport(choice=choice, limits=httpx.Limits(**limits) if limits else LIMITS)
    transport.choose()
    try:
        yield transport
    finally:
        await transport.aclose()


@contextlib.contextmanager
def silent_listener(backlog: int = 0) -> Iterator[tuple[str, list[socket.socket]]]:
    """A listener that never accepts, its backlog already full: a connect to it hangs."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):  # fill the accept queue (its length is backlog + 1 on Linux) and the SYN queue
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            fillers.append(filler)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", fillers
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def refused_url() -> str:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    return url


# name -> (the upstream's script, the httpx error raised on the way to the headers or the body)
FAILURES: dict[str, tuple[Script, type[httpx.TransportError]]] = {
    "closed before answering": ([CLOSE], httpx.RemoteProtocolError),
    "not http": ([b"SSH-2.0-OpenSSH\r\n\r\n", CLOSE], httpx.RemoteProtocolError),
    "body cut short": (
        [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhello", CLOSE],
        httpx.RemoteProtocolError,
    ),
    "chunked body cut short": (
        [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", CLOSE],
        httpx.RemoteProtocolError,
    ),
    "silent after the request": ([HOLD], httpx.ReadTimeout),
}


@pytest.mark.parametrize("choice", TRANSPORTS)
@pytest.mark.parametrize("case", list(FAILURES))
async def test_failures_raise_the_same_httpx_errors(case: str, choice: str, anyio_backend: str) -> None:
    if not runs_here(choice, anyio_backend):
        return
    script, expected = FAILURES[case]
    with raw_upstream(lambda request: script) as upstream:
        async with network(choice) as transport:
            # A short read timeout only where it is the failure: a loaded machine is slow to answer.
            read = 0.3 if expected is httpx.ReadTimeout else 10
            async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(10, read=read)) as client:
                with pytest.raises(expected):
                    response = await client.post(upstream.url + "/v1/x", content=b"{}")
                    response.raise_for_status()
            assert transport.busy() == []


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_refused_is_a_connect_error(choice: str, anyio_backend: str) -> None:
    if not runs_here(choice, anyio_backend):
        return
    async with network(choice) as transport, httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(refused_url() + "/v1/x", content=b"{}")


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_a_connect_that_hangs_is_a_connect_timeout(choice: str, anyio_backend: str) -> None:
    if not runs_here(choice, anyio_backend):
        return
    with silent_listener() as (url, _):
        async with network(choice) as transport:
            timeout = httpx.Timeout(5, connect=0.3)
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
                with anyio.fail_after(5):
                    with pytest.raises(httpx.ConnectTimeout):
                        await client.post(url + "/v1/x", content=b"{}")


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_a_full_pool_is_a_pool_timeout(choice: str, anyio_backend: str) -> None:
    if not runs_here(choice, anyio_backend):
        return
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 10\r\n\r\nhello"
    with raw_upstream(lambda request: [head, HOLD]) as upstream:
        async with network(choice, max_connections=1, max_keepalive_connections=1) as transport:
            timeout = httpx.Timeout(5, pool=0.3)
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
                held = await client.send(
                    client.build_request("POST", upstream.url + "/v1/a", content=b"{}"), stream=True
                )
                try:
                    with anyio.fail_after(5), pytest.raises(httpx.PoolTimeout):
                        await client.post(upstream.url + "/v1/b", content=b"{}")
                finally:
                    await held.aclose()
            assert transport.busy() == []
    assert upstream.targets() == ["/v1/a"]


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_bytes_go_through_untouched(choice: str, anyio_backend: str) -> None:
    """No decompression, no header of the transport's own, names in their case, duplicates kept."""
    if not runs_here(choice, anyio_backend):
        return
    body = gzip.compress(b'{"answer": "' + b"x" * 4000 + b'"}')
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        b"X-Dup: one\r\nx-dup: two\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    with raw_upstream(lambda request: [head + body]) as upstream:
        async with network(choice) as transport:
            request = httpx.Request(
                "POST",
                upstream.url + "/v1/x?q=%2F%7e",
                headers=[
                    (b"Host", b"upstream.test"),
                    (b"X-Custom-Case", b"Value"),
                    (b"x-twice", b"1"),
                    (b"x-twice", b"2"),
                    (b"X-Utf8", "caf\u00e9".encode()),
                    (b"Accept-Encoding", b"identity"),
                    (b"Content-Length", b"2"),
                ],
                content=b"{}",
            )
            response = await transport.handle_async_request(request)
            try:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
    assert raw == body  # still gzip: relayed as the upstream sent it
    assert response.headers.raw == [
        (b"Content-Type", b"application/json"),
        (b"Content-Encoding", b"gzip"),
        (b"X-Dup", b"one"),
        (b"x-dup", b"two"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
        (b"Content-Length", str(len(body)).encode()),
    ]
    (seen,) = upstream.requests
    assert seen.target == "/v1/x?q=%2F%7e" and seen.body == b"{}"
    assert seen.raw_head.split(b"\r\n")[1:] == [
        b"Host: upstream.test",
        b"X-Custom-Case: Value",
        b"x-twice: 1",
        b"x-twice: 2",
        b"X-Utf8: caf\xc3\xa9",
        b"Accept-Encoding: identity",
        b"Content-Length: 2",
    ]


@pytest.mark.parametrize("choice", TRANSPORTS)
@pytest.mark.parametrize("stop", ["client-gone", "cancelled"])
async def test_a_response_left_half_read_closes_its_connection(choice: str, stop: str, anyio_backend: str) -> None:
    """The client leaves (or the request is cancelled) mid-stream: the upstream connection is closed,
    never pooled with the rest of the answer still to come, and nothing stays acquired."""
    if not runs_here(choice, anyio_backend):
        return
    events = b"".join(b'data: {"n": %d}\n\n' % n for n in range(40))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    partial = chunked(events, size=32).removesuffix(b"0\r\n\r\n")
    with raw_upstream(lambda request: [head + partial, HOLD]) as upstream:
        async with network(choice) as transport:
            async with httpx.AsyncClient(transport=transport) as client:
                response = await client.send(client.build_request("POST", upstream.url + "/v1/s"), stream=True)
                sends = 0
                three = anyio.Event()

                async def send(message: Message) -> None:
                    nonlocal sends
                    sends += 1
                    if sends >= 3:
                        three.set()
                        if stop == "client-gone":
                            raise OSError("the client is gone")
                        await anyio.sleep_forever()

                async def receive() -> Message:
                    await anyio.sleep_forever()
                    raise AssertionError

                async with anyio.create_task_group() as tg:

                    async def run() -> None:
                        result = await relay(
                            response, send=send, receive=receive, stall_timeout=10, keepalive_interval=30
                        )
                        assert result.outcome == "client_disconnected"

                    tg.start_soon(run)
                    await three.wait()
                    if stop == "cancelled":
                        tg.cancel_scope.cancel()
                assert response.is_closed
                await eventually(upstream.released.is_set, seconds=5)  # the upstream saw its connection closed
                assert transport.busy() == []


class _Slices(httpx.AsyncByteStream):
    """A request body of ``count`` 1 MiB slices; ``pulled`` counts those handed to the transport."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pulled = 0
        self.headers = {"content-length": str(count * 1024 * 1024)}  # as the gateway sends a body
        self._seen = (-1, 0.0)

    def waiting(self) -> bool:
        """At least one slice was pulled and no other for half a second: the transport's write waits."""
        now = time.monotonic()
        if self.pulled != self._seen[0]:
            self._seen = (self.pulled, now)
        return self.pulled > 0 and now - self._seen[1] >= 0.5

    def __aiter__(self) -> _Slices:
        return self  # not a generator: one abandoned mid-way is no unfinished async generator

    async def __anext__(self) -> bytes:
        if self.pulled >= self.count:
            raise StopAsyncIteration
        self.pulled += 1
        return b"x" * (1024 * 1024)


@contextlib.contextmanager
def deaf_upstream() -> Iterator[tuple[str, int]]:
    """An upstream that accepts one connection and never reads from it: its URL and port."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: nobody came
            accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        listener.close()
        thread.join(10)
        for sock in accepted:
            sock.close()


def connections_to(port: int) -> list[str]:
    """The states of this process's TCP connections to ``port`` (the client side)."""
    return [c.status for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_a_request_abandoned_mid_body_closes_its_connection(choice: str, anyio_backend: str) -> None:
    """The client leaves while its 64 MiB body is being sent to an upstream that stopped reading: the
    connection goes at once. (aiohttp closed it gracefully, and asyncio closes a transport only once
    its unsent bytes are written: the socket and the unsent slice stayed for good.)"""
    if not runs_here(choice, anyio_backend):
        return
    body = _Slices(64)
    with deaf_upstream() as (url, port):
        async with network(choice) as transport:
            async with httpx.AsyncClient(transport=transport, timeout=30) as client:
                async with anyio.create_task_group() as tg:
                    request = client.build_request("POST", url + "/v1/chat/completions", headers=body.headers)
                    request.stream = body
                    tg.start_soon(client.send, request)
                    # Sent until the write waits on the deaf upstream (the kernel's buffers take a few MiB,
                    # then nothing more is pulled): the transport holds unsent bytes when the client leaves.
                    await eventually(lambda: body.waiting() and connections_to(port) == ["ESTABLISHED"], seconds=20)
                    tg.cancel_scope.cancel()
                await eventually(lambda: connections_to(port) == [], seconds=5)
                assert body.pulled < body.count and transport.busy() == []


@pytest.mark.parametrize(("backend_name", "expected"), [("asyncio", "aiohttp"), ("trio", "httpcore")])
async def test_auto_uses_aiohttp_on_asyncio_and_httpcore_on_trio(
    backend_name: str, expected: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails if the gateway silently stops sending over aiohttp on asyncio (or tries it on trio)."""
    if backend_name != anyio_backend:
        return  # each backend checks its own row: the other row runs in the other parametrization
    body = b'{"ok": true}'
    with raw_upstream(lambda request: [response(200, body)]) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url,))
        app = create_app(settings)
        with caplog.at_level(logging.INFO):
            async with app.router.lifespan_context(app):
                upstream_client = app.state.upstream
                assert upstream_client.transport_name == expected  # chosen at startup
                chosen = upstream_client._client._transport._chosen
                assert isinstance(chosen, AiohttpTransport if expected == "aiohttp" else GuardedTransport)
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
                    answer = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
                assert answer.status_code == 200 and answer.content == body
                if isinstance(chosen, AiohttpTransport):  # the request did go through aiohttp's pool
                    assert chosen._session is not None and chosen._fallback is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no warning for falling back


async def test_explicit_aiohttp_on_trio_fails_at_startup(anyio_backend: str) -> None:
    settings = LifetimeSettings(upstream_url=("http://127.0.0.1:9",), upstream_transport="aiohttp")
    app = create_app(settings)
    if anyio_backend == "trio":
        with pytest.raises(ValueError, match="UPSTREAM_TRANSPORT=aiohttp is invalid on trio"):
            async with app.router.lifespan_context(app):
                pass
    else:
        async with app.router.lifespan_context(app):
            assert app.state.upstream.transport_name == "aiohttp"


def test_without_aiohttp_explicit_fails_at_construction_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(transport_module, "aiohttp_available", lambda: False)
    with pytest.raises(ValueError, match=r"UPSTREAM_TRANSPORT=aiohttp needs aiohttp: pip install"):
        create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",), upstream_transport="aiohttp"))
    with caplog.at_level(logging.DEBUG):
        transport = UpstreamTransport(choice="auto", limits=LIMITS)
        assert isinstance(transport.choose(), GuardedTransport) and transport.name == "httpcore"
    assert not caplog.records


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_the_gateway_over_each_transport(choice: str) -> None:
    """End to end (uvicorn runs the gateway on asyncio): the answer, every gauge back to zero, the pool idle."""
    with (
        raw_upstream(lambda request: [response(200, b'{"ok": 1}')]) as upstream,
        running(upstream_url=upstream.url, upstream_transport=choice) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for _ in range(3):
                answer = await client.post("/v1/chat/completions", json={"model": "m"})
                assert answer.status_code == 200 and answer.content == b'{"ok": 1}'
        await assert_idle(stack.app, stack.url)
        assert stack.app.state.upstream.transport_name == choice
        seen = upstream.requests[0].headers
    assert seen["accept-encoding"] == "identity"
    assert "user-agent" not in seen or "aiohttp" not in seen["user-agent"]
    assert {r.connection for r in upstream.requests} == {0}


async def test_aiohttp_connections_do_not_wait_for_nagle(anyio_backend: str) -> None:
    """TCP_NODELAY is on for every upstream connection (asyncio sets it on TCP sockets): without it
    the body would wait behind the head for the upstream's delayed ACK (40 ms on Linux)."""
    if not runs_here("aiohttp", anyio_backend):
        return
    with raw_upstream(lambda request: [response(200, b"ok")]) as upstream:
        async with network("aiohttp") as transport, httpx.AsyncClient(transport=transport) as client:
            assert (await client.post(upstream.url + "/v1/x", content=b"{}")).content == b"ok"
            chosen = transport.choose()
            assert isinstance(chosen, AiohttpTransport) and chosen._session is not None
            connector = chosen._session.connector
            assert isinstance(connector, _GuardedConnector)
            (pooled,) = [proto for conns in connector._conns.values() for proto, _ in conns]
            assert pooled.transport is not None
            sock = pooled.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_aiohttp_internals_the_guard_relies_on() -> None:
    """If aiohttp moves these, _aiohttp.py silently stops guarding its pool: fail here instead."""
    for name in ("set_response_params", "data_received", "feed_data", "should_close"):
        assert hasattr(ResponseHandler, name), name
    source = ResponseHandler.__init__.__code__.co_names + ResponseHandler.data_received.__code__.co_names
    assert "_payload" in source and "_should_close" in ResponseHandler.__init__.__code__.co_names
    init = aiohttp.BaseConnector.__init__.__code__.co_names
    assert "_factory" in init and "_acquired" in init and "_waiters" in init
    assert hasattr(aiohttp.StreamReader, "_read_nowait")
    assert hasattr(aiohttp.TCPConnector, "_create_connection") and issubclass(_GuardedConnector, aiohttp.TCPConnector)


@contextlib.asynccontextmanager
async def gateway(choice: str, upstream_url: str, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway over the ``choice`` transport (started: the transport is chosen), and a client for it.
    ``ASGITransport`` passes header bytes uvicorn would refuse itself; another ASGI server may too."""
    app = create_app(LifetimeSettings(upstream_url=(upstream_url,), upstream_transport=choice), **options)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
            yield client


@pytest.mark.parametrize("choice", TRANSPORTS)
@pytest.mark.parametrize("value", [b"SECRET\x00b", b"SECRET\r\nx-injected: 1", b"SECRET\x0cb", b" SECRET\vb"])
@pytest.mark.parametrize(("path", "shape"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
async def test_a_header_http11_cannot_carry_is_the_clients_400(
    choice: str, value: bytes, path: str, shape: str, anyio_backend: str
) -> None:
    # Before: h11 refused it on each attempt (LocalProtocolError, also on aiohttp, which hands such
    # fields to httpcore), retried MAX_ATTEMPTS times, then 502 "upstream unreachable".
    if not runs_here(choice, anyio_backend):
        return
    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        async with gateway(choice, upstream.url) as client:
            answer = await client.post(path, json={"model": "m"}, headers=[(b"x-trace", value)])
    assert upstream.requests == []
    assert answer.status_code == 400
    error = answer.json()["error"]
    if shape == "anthropic":
        assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"
    assert "x-trace" in error["message"] and "unreachable" not in error["message"]
    assert "SECRET" not in answer.text  # a value is never quoted: it may be a credential


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_a_request_our_own_client_refuses_is_a_502_not_retried(choice: str, anyio_backend: str) -> None:
    # A preparer (the gateway's side, not the client's) adds a header with a line break: httpx refuses
    # to send it on either transport. Before: retried MAX_ATTEMPTS times, then "upstream unreachable".
    if not runs_here(choice, anyio_backend):
        return

    def bad_header(draft: Any) -> None:
        draft.headers["x-routed"] = "a\nb"

    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        async with gateway(choice, upstream.url, preparers=[bad_header]) as client:
            answer = await client.post("/v1/chat/completions", json={"model": "m"})
    assert upstream.requests == []
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "request_unsendable" and "unreachable" not in error["message"]
    assert "not" in error["message"] and "retried" in error["message"]


@pytest.mark.parametrize("choice", TRANSPORTS)
async def test_spaces_and_tabs_around_a_header_value_are_dropped(choice: str, anyio_backend: str) -> None:
    # Not part of the value (RFC 9110 5.5): h11 refused them, aiohttp sent them; now both send the value.
    if not runs_here(choice, anyio_backend):
        return
    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        async with gateway(choice, upstream.url) as client:
            answer = await client.post(
                "/v1/chat/completions", json={"model": "m"}, headers=[(b"x-trace", b" \ta b\t ")]
            )
    assert answer.status_code == 200
    [request] = upstream.requests
    assert b"\r\nx-trace: a b\r\n" in request.raw_head
