"""Pooled upstream connections never carry one response's leftovers into the next request.

A raw-socket upstream misbehaves in its answer to a first request (a second response after it,
a body on a HEAD/204/304, a Content-Length counted in characters, more bytes than its
Content-Length, plain garbage); a second client request follows on what would be the same
pooled connection. The second client must get the upstream's real answer to ITS request, on
another connection, on both transports (``UPSTREAM_TRANSPORT``).

With httpcore the first client gets the first response and the upstream sees each request
once. aiohttp's parser fails a whole read that ends in bytes that are not HTTP: a response
followed in the same read by such leftovers is a protocol error, retried like any other, and
from then on that upstream is sent to through httpcore; nothing of it reaches another request.
"""

from __future__ import annotations

import gc
import threading
import types
from typing import Any

import anyio
import h11
import httpcore
import httpx
import pytest

from asgi_lifetime.gateway._relay import relay
from asgi_lifetime.gateway._transport import GuardedTransport, _leftover, stop_reading

from ..reliability.test_faults import HTTP_PARSERS, assert_idle, eventually, running
from ._raw_upstream import HOLD, RawRequest, Script, chunked, raw_upstream, response

pytestmark = pytest.mark.anyio

SECOND = b'{"second": true}'
TEXT = "h\u00e9llo w\u00f6rld"  # 11 characters, 13 bytes in UTF-8

# name -> (method of the first request, the upstream's raw answer to it, what the first client gets)
MISBEHAVIOURS: dict[str, tuple[str, bytes, int]] = {
    "second response after the first": (
        "POST",
        response(200, b'{"first": 1}') + response(200, b'{"smuggled": 1}'),
        200,
    ),
    "second chunked response after the first": (
        "POST",
        response(200, b'{"first": 1}')
        + response(200, chunked(b'{"smuggled": 1}'), headers=(("transfer-encoding", "chunked"),), length=False),
        200,
    ),
    "body on a HEAD response": ("HEAD", response(200, b'{"smuggled": 1}'), 200),
    "body on a 204": ("POST", response(204, b'{"smuggled": 1}'), 204),
    "body on a 304": ("GET", response(304, b'{"smuggled": 1}'), 304),
    "content-length counted in characters": (
        "POST",
        b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n" + TEXT.encode(),
        200,
    ),
    "body longer than its content-length": (
        "POST",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello, and then some",
        200,
    ),
    "garbage after the response": ("POST", response(200, b'{"first": 1}') + b"garbage\r\n\r\n", 200),
}


def _setting(event: threading.Event) -> Any:
    """A script step that sets ``event`` and sends nothing."""

    def step() -> bytes:
        event.set()
        return b""

    return step


def script(first: bytes) -> Any:
    def answer(request: RawRequest) -> Script:
        if request.target.startswith("/v1/first"):
            return [first]
        return [response(200, SECOND, headers=(("content-type", "application/json"),))]

    return answer


TRANSPORTS = ["httpcore", "aiohttp"]
# aiohttp fails these as protocol errors: the leftovers are not HTTP and came in the response's read.
NOT_HTTP_AFTER = {
    "body on a HEAD response",
    "body on a 204",
    "body on a 304",
    "content-length counted in characters",
    "body longer than its content-length",
    "garbage after the response",
}


@pytest.mark.parametrize("http", HTTP_PARSERS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(MISBEHAVIOURS))
async def test_leftover_bytes_never_reach_the_next_request(case: str, transport: str, http: str) -> None:
    """Also: the client's connection stays usable (a 204 or 304 relayed with the upstream's Content-Length
    made uvicorn's httptools server wait for that body, then fail the response and close the connection)."""
    method, first, status = MISBEHAVIOURS[case]
    serve = {"http": http}
    with (
        raw_upstream(script(first)) as upstream,
        running(upstream_url=upstream.url, upstream_transport=transport, serve=serve) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            one = await client.request(method, "/v1/first", json={} if method == "POST" else None)
            two = await client.post("/v1/second", json={})
        await assert_idle(stack.app, stack.url)
        assert stack.app.state.upstream.transport_name == transport
    assert two.status_code == 200 and two.content == SECOND
    # The connection with leftovers was closed, not reused.
    second = upstream.requests[-1]
    assert second.target == "/v1/second"
    assert all(r.connection != second.connection for r in upstream.requests[:-1])
    assert one.status_code == status
    if transport == "aiohttp" and case in NOT_HTTP_AFTER:
        # The first attempt failed; the retry, and every request after it, went through httpcore.
        assert upstream.targets() == ["/v1/first", "/v1/first", "/v1/second"]
    else:
        assert upstream.targets() == ["/v1/first", "/v1/second"]  # each seen once: no retry


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["second response after the first", "garbage after the response"])
async def test_leftovers_arriving_while_the_connection_is_idle_close_it(case: str, transport: str) -> None:
    """The leftovers come in a read of their own, once the response has ended and its connection
    is back in the pool: aiohttp would parse a second response into the idle connection's queue
    and hand it to the next request on it."""
    method, first, status = MISBEHAVIOURS[case]
    ended = response(200, b'{"first": 1}')
    after = first[len(ended) :]
    answered, written = threading.Event(), threading.Event()

    def leftovers() -> bytes:
        answered.wait(10)  # the client has the whole response: its connection is back in the pool
        return after

    def answer(request: RawRequest) -> Script:
        if request.target.startswith("/v1/first"):
            return [ended, leftovers, _setting(written)]
        return [response(200, SECOND, headers=(("content-type", "application/json"),))]

    with raw_upstream(answer) as upstream, running(upstream_url=upstream.url, upstream_transport=transport) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            one = await client.post("/v1/first", json={})
            assert one.status_code == status and one.content == b'{"first": 1}'
            answered.set()
            await eventually(written.is_set, seconds=5)  # on loopback, in the gateway's socket by now
            if transport == "aiohttp":
                # aiohttp reads them at once: the guard closes the idle connection.
                await eventually(lambda: 0 in upstream.hung_up, seconds=5)
            two = await client.post("/v1/second", json={})
        await assert_idle(stack.app, stack.url)
    assert two.status_code == 200 and two.content == SECOND
    assert upstream.targets() == ["/v1/first", "/v1/second"]
    assert upstream.requests[1].connection != upstream.requests[0].connection


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_clean_response_keeps_its_connection_pooled(transport: str) -> None:
    # The guard must not cost keep-alive: a well-behaved upstream keeps one connection.
    with (
        raw_upstream(script(response(200, b'{"first": 1}'))) as upstream,
        running(upstream_url=upstream.url, upstream_transport=transport) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for _ in range(3):
                assert (await client.post("/v1/first", json={})).status_code == 200
            assert (await client.post("/v1/second", json={})).content == SECOND
        await assert_idle(stack.app, stack.url)
        assert stack.app.state.upstream.transport_name == transport
    assert upstream.connections == 1
    assert {r.connection for r in upstream.requests} == {0}


async def test_guarded_transport_directly() -> None:
    """The transport on its own (no gateway): the same guarantee for any httpx user of it."""
    first = response(200, b"one") + response(200, b"smuggled")
    with raw_upstream(script(first)) as upstream:
        transport = GuardedTransport(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        async with httpx.AsyncClient(transport=transport, base_url=upstream.url) as client:
            assert (await client.post("/v1/first")).content == b"one"
            assert (await client.post("/v1/second")).content == SECOND
    assert upstream.targets() == ["/v1/first", "/v1/second"]


def test_httpcore_internals_the_guard_relies_on() -> None:
    """If httpcore moves these, _transport.py silently stops checking: fail here instead."""
    pool = httpcore.AsyncConnectionPool()
    connection = pool.create_connection(httpcore.Origin(b"http", b"127.0.0.1", 80))
    assert isinstance(connection, httpcore.AsyncHTTPConnection)
    assert hasattr(connection, "_connection")
    source = httpcore.AsyncHTTP11Connection.__init__.__code__.co_names
    assert "_h11_state" in source and "_network_stream" in source
    assert hasattr(h11.Connection, "trailing_data")
    transport = GuardedTransport(limits=httpx.Limits())
    assert hasattr(transport._pool, "_ssl_context")


def _exchanged(after: bytes, *, eof: bool) -> Any:
    """An httpcore-shaped connection whose h11 state finished one exchange, then got ``after`` (and EOF)."""
    state = h11.Connection(h11.CLIENT)
    state.send(h11.Request(method="POST", target="/v1/first", headers=[("host", "x"), ("content-length", "0")]))
    state.send(h11.EndOfMessage())
    state.receive_data(response(200, b"one") + after)
    if eof:
        state.receive_data(b"")
    while not isinstance(state.next_event(), h11.EndOfMessage):
        pass
    return types.SimpleNamespace(_connection=types.SimpleNamespace(_h11_state=state, _network_stream=None))


@pytest.mark.parametrize(
    ("after", "eof", "verdict"),
    [(b"", False, ""), (b"", True, "closed"), (response(200, b"smuggled"), False, "bytes"), (b"junk", True, "bytes")],
    ids=["nothing", "upstream-closed", "second-response", "bytes-then-eof"],
)
def test_what_follows_a_response_decides_reuse_and_warning(after: bytes, eof: bool, verdict: str) -> None:
    """The upstream closing its end after a complete response (its idle timeout, a restart) is no
    misbehaviour: the connection is not reused, without a warning. Bytes after a response are."""
    assert _leftover(_exchanged(after, eof=eof)) == verdict


def _suspended_stream_generators() -> list[str]:
    """httpx's and httpcore's async generators that are alive and not finished."""
    return [
        obj.__qualname__
        for obj in gc.get_objects()
        if isinstance(obj, types.AsyncGeneratorType)
        and obj.ag_frame is not None
        and ("httpcore" in obj.ag_code.co_filename or "httpx" in obj.ag_code.co_filename)
    ]


@pytest.mark.parametrize("stop", ["client-gone", "stop-reading"])
async def test_stopping_between_chunks_ends_every_stream_generator(stop: str) -> None:
    """Stopped between two chunks (the client left while one was being sent), closing only
    ``aiter_raw()`` left httpx's and httpcore's generators under it suspended until collected
    (trio warns about each). Every generator of the chain is ended before the relay returns."""
    events = b"".join(b'data: {"n": %d}\n\n' % n for n in range(40))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    partial = chunked(events, size=32).removesuffix(b"0\r\n\r\n")  # more to come: the stream stays open
    with raw_upstream(lambda request: [head + partial, HOLD]) as upstream:
        transport = GuardedTransport(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        async with httpx.AsyncClient(transport=transport, base_url=upstream.url) as client:
            response = await client.send(client.build_request("POST", "/v1/stream"), stream=True)
            before = _suspended_stream_generators()
            sends = 0

            async def send(message: Any) -> None:
                nonlocal sends
                sends += 1
                if sends >= 3:
                    raise OSError("the client is gone")

            async def receive() -> Any:
                await anyio.sleep_forever()

            gc.disable()  # the check below must see what the code left, not what a collection cleaned up
            try:
                if stop == "client-gone":
                    result = await relay(response, send=send, receive=receive, stall_timeout=10, keepalive_interval=30)
                    assert result.outcome == "client_disconnected"
                else:
                    iterator = response.aiter_raw()
                    assert await iterator.__anext__()
                    await stop_reading(response, iterator, finished=False)
                left = _suspended_stream_generators()
            finally:
                gc.enable()
    assert response.is_closed
    assert len(left) <= len(before), left


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_second_response_in_the_read_that_ends_the_body_is_never_handed_on(transport: str) -> None:
    """The head was read in one read; the end of the body and a second response come in the next.
    aiohttp gives the connection back to its pool as the body's last byte is parsed, before the
    rest of that read: the second response would wait in the pooled connection's queue."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 10\r\n\r\nhello"
    rest = b"world" + response(200, b'{"smuggled": 1}')
    started = threading.Event()

    def answer(request: RawRequest) -> Script:
        if request.target.startswith("/v1/first"):
            return [head, lambda: rest if started.wait(10) else b""]
        return [response(200, SECOND, headers=(("content-type", "application/json"),))]

    with raw_upstream(answer) as upstream, running(upstream_url=upstream.url, upstream_transport=transport) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            async with client.stream("POST", "/v1/first", json={}) as one:
                iterator = one.aiter_raw()
                received = await iterator.__anext__()
                started.set()
                async for piece in iterator:
                    received += piece
            assert received == b"helloworld"
            two = await client.post("/v1/second", json={})
        await assert_idle(stack.app, stack.url)
    assert two.status_code == 200 and two.content == SECOND
    assert upstream.targets() == ["/v1/first", "/v1/second"]
    assert upstream.requests[1].connection != upstream.requests[0].connection
