"""An upstream that answers before it has read the whole request body, on both upstream transports.

nginx answers 413 past ``client_max_body_size`` as soon as it has read the head; an auth proxy
answers 401, an overloaded API 429/503, all without reading a 16 MiB body, which is far larger
than the socket buffers: the gateway's write blocks, or fails on the upstream's reset, while the
answer waits unread. The gateway (``create_app``, driven in-process on asyncio and trio) sends to a
raw loopback upstream (a thread per connection, scripted per attempt) over aiohttp (asyncio) and
httpcore (asyncio and trio). What must hold after each attack:

- the client gets the upstream's own status and error body, not a 502/504 of the gateway's;
- a retryable early answer is retried ``max_attempts`` times at most, each retry sending the
  whole body again, byte for byte;
- a reset mid-body ends, after bounded retries, in the gateway's OpenAI-style upstream error;
- the access log's ``attempts`` is what the upstream saw (its connections that carried the body);
- a small request sent next gets its own answer (no desynchronised connection was pooled);
- the body is released once the request settled (``tracemalloc``, as ``tests/gateway/test_release.py``);
- nothing hangs (every exchange under ``anyio.fail_after``) and the pool ends idle.

httpcore wrote the whole body before reading anything: an upstream that answered and stopped
reading got a 504 after ``max_attempts`` full re-sends, and on asyncio one that answered and hung
up lost its answer (anyio reads the socket only while a task receives, and the failed write
closed it): a 502 after as many re-sends. ``gateway/_watched.py`` reads while httpcore writes.

An upstream that closes at once with the body unread sends a TCP reset, which may destroy its own
answer before it is read (RFC 9112 9.6: a server must close gracefully, as nginx's lingering close
does): on asyncio either transport may then lose it. That case is pinned by its bounded outcome.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import json
import logging
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from httpcore._async.http11 import AsyncHTTP11Connection
from httpcore._backends.auto import AutoBackend

from asgi_lifetime import LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._access_log import ACCESS_LOGGER

from .._nginx import nginx_server
from .._servers import free_port, require_binary, threaded_server
from ..gateway.test_upstream_transport import runs_here
from .test_faults import busy_connections, eventually

pytestmark = pytest.mark.anyio

TRANSPORTS = ["httpcore", "aiohttp"]
PATH = "/v1/chat/completions"
BODY_SIZE = 16 * MiB
READ_FIRST = 256 * 1024  # what the upstream reads of a large body before it answers
LARGE = MiB  # a request body at least this large is "the large request"
ERROR = json.dumps({"error": {"message": "Request too large", "type": "invalid_request_error", "code": "too_big"}})
HOLD = 30.0  # the longest an upstream connection waits for the test (only matters on failure)
SETTINGS: dict[str, Any] = {
    "max_attempts": 3,
    "backoff_base": 0.01,
    "backoff_max": 0.02,
    "retry_after_cap": 0.02,
    "retry_deadline": 60.0,
    "headers_timeout": 3.0,  # an upstream that stopped reading blocked httpcore's write this long per attempt
    "connect_timeout": 5.0,
    "stall_timeout": 10.0,
}


def answer(status: int, body: bytes, *, close: bool) -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    head += "connection: close\r\n" if close else "connection: keep-alive\r\n"
    return head.encode() + b"\r\n" + body


@dataclass
class Seen:
    """One large request as the upstream saw it."""

    connection: int
    length: int  # its Content-Length
    prefix: str = ""  # sha256 of the bytes read before answering
    whole: str = ""  # sha256 of the whole body, when it was read


# What the upstream does with a large request once it has read its head and (at least) READ_FIRST
# bytes of its body, given those bytes; True: serve the next request on the same connection.
Act = Callable[[socket.socket, Seen, bytearray, "EarlyUpstream"], bool]


@dataclass
class EarlyUpstream:
    acts: list[Act]  # per large request, in order; the last one repeats
    url: str = ""
    large: list[Seen] = field(default_factory=list)
    small: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, sock: socket.socket, number: int) -> None:
        with sock:
            sock.settimeout(HOLD)
            buffer = b""
            try:
                while not self.stop.is_set():
                    while b"\r\n\r\n" not in buffer:
                        data = sock.recv(65536)
                        if not data:
                            return
                        buffer += data
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
                    length = int({k.strip().lower(): v for k, v in fields.items()}[b"content-length"])
                    if length < LARGE:
                        while len(buffer) < length:
                            buffer += sock.recv(65536)
                        body, buffer = buffer[:length], buffer[length:]
                        with self.lock:
                            self.small += 1
                        # Its own answer: what it asked for, echoed.
                        sock.sendall(answer(200, json.dumps({"echo": json.loads(body)}).encode(), close=False))
                        continue
                    seen = Seen(number, length)
                    read = bytearray(buffer)
                    while len(read) < READ_FIRST:
                        data = sock.recv(65536)
                        if not data:
                            return
                        read += data
                    seen.prefix = hashlib.sha256(read[:READ_FIRST]).hexdigest()
                    with self.lock:
                        self.large.append(seen)
                        act = self.acts[min(len(self.large), len(self.acts)) - 1]
                    if not act(sock, seen, read, self):
                        return
                    buffer = b""
            except OSError:
                return

    def read_rest(self, sock: socket.socket, seen: Seen, read: bytearray) -> None:
        """Read the large body to its end (hashing it whole)."""
        hasher = hashlib.sha256(read)
        got = len(read)
        while got < seen.length:
            data = sock.recv(min(65536, seen.length - got))
            if not data:
                raise OSError("the gateway hung up mid-body")
            hasher.update(data)
            got += len(data)
        seen.whole = hasher.hexdigest()

    def hold(self) -> None:
        """Read nothing more; wait for the test to end (the gateway's close is not watched for)."""
        self.stop.wait(HOLD)


# --- the upstream's acts ---------------------------------------------------------------------------


def early_then_shut(status: int) -> Act:
    """(a, c) Answer, close its side (FIN, the graceful close of RFC 9112 9.6), read nothing more."""

    def act(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
        sock.sendall(answer(status, ERROR.encode(), close=True))
        sock.shutdown(socket.SHUT_WR)
        upstream.hold()
        return False

    return act


def early_and_stop_reading(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
    """(b) Answer 413 as if the connection could go on, then neither read nor close."""
    sock.sendall(answer(413, ERROR.encode(), close=False))
    upstream.hold()
    return False


def early_then_drain(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
    """(e) Answer 413 with keep-alive, then read and discard the rest, and serve the next request."""
    sock.sendall(answer(413, ERROR.encode(), close=False))
    upstream.read_rest(sock, seen, read)
    return True


def reset(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
    """(d) Reset the connection: no answer, an RST (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False


def early_then_close(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
    """Answer 401 and close at once with the body unread: Linux sends a reset, not a FIN."""
    sock.sendall(answer(401, ERROR.encode(), close=True))
    return False


def read_all_then_ok(sock: socket.socket, seen: Seen, read: bytearray, upstream: EarlyUpstream) -> bool:
    upstream.read_rest(sock, seen, read)
    sock.sendall(answer(200, json.dumps({"whole": seen.whole}).encode(), close=False))
    return True


# --- the harness -------------------------------------------------------------------------------------


@contextlib.contextmanager
def early_upstream(*acts: Act) -> Iterator[EarlyUpstream]:
    upstream = EarlyUpstream(list(acts))
    with threaded_server(upstream.serve, name="early-upstream", join=HOLD + 5) as url:
        upstream.url = url
        try:
            yield upstream
        finally:
            upstream.stop.set()


@pytest.fixture(scope="module")
def big() -> bytes:
    """A chat request of about BODY_SIZE bytes."""
    content = "x" * (BODY_SIZE - 100)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


@dataclass
class Outcome:
    response: httpx.Response
    attempts: list[int]  # the access log's attempts, per request (the large one first)
    traced: int  # bytes tracemalloc still traced after the large request settled
    described: int  # requests the gateway's upstream pool counted


async def attack(
    upstream: EarlyUpstream, transport: str, body: bytes, caplog: pytest.LogCaptureFixture, **changes: Any
) -> Outcome:
    """Send ``body`` through a gateway on ``upstream``, then a small request; check what must hold of both."""
    settings = LifetimeSettings(upstream_url=(upstream.url,), upstream_transport=transport, **{**SETTINGS, **changes})
    app = create_app(settings)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with app.router.lifespan_context(app):
        asgi = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=asgi, base_url="http://gateway.test", timeout=120) as client:
            gc.collect()
            tracemalloc.start()
            try:
                with anyio.fail_after(60):
                    response = await client.post(PATH, content=body, headers={"content-type": "application/json"})
                del body
                gc.collect()
                traced = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            # A small request next: its own answer, whatever connection it gets.
            small = {"model": "m", "messages": [{"role": "user", "content": "small"}], "n": 7}
            with anyio.fail_after(30):
                echo = await client.post(PATH, json=small)
            assert echo.status_code == 200, echo.text
            assert echo.json() == {"echo": small}
        await eventually(lambda: busy_connections(app) == [], seconds=10)
        assert app.state.lifetime.stats().idle, app.state.lifetime.stats()
        described = app.state.upstream.describe()[0]["requests"]
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    attempts = [getattr(r, "asgi_lifetime")["attempts"] for r in records]  # noqa: B009 (set by the logger's extra=)
    return Outcome(response, attempts, traced, described)


def assert_released(outcome: Outcome) -> None:
    assert outcome.traced < 0.3 * BODY_SIZE, f"{outcome.traced} bytes traced after the request settled"


def assert_counted(outcome: Outcome, upstream: EarlyUpstream, attempts: int) -> None:
    """The gateway's count of attempts is the upstream's count of large requests."""
    assert len(upstream.large) == attempts
    assert len({seen.connection for seen in upstream.large}) == attempts  # one connection each
    assert outcome.attempts == [attempts, 1]
    assert outcome.described == attempts + 1  # the small request's attempt too
    assert upstream.small == 1


def assert_same_body(upstream: EarlyUpstream, body: bytes) -> None:
    """Every attempt sent this body: its length, and the same first bytes."""
    prefix = hashlib.sha256(body[:READ_FIRST]).hexdigest()
    assert {(seen.length, seen.prefix) for seen in upstream.large} == {(len(body), prefix)}


# --- the attacks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("status", [413, 400, 401])
async def test_an_early_answer_then_close_is_relayed(
    big: bytes, transport: str, status: int, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(a) An early 413/400/401, then the upstream closes its side without reading on: the client
    gets that answer, after one attempt (httpcore on asyncio: a 502 after three re-sends)."""
    if not runs_here(transport, anyio_backend):
        return
    with early_upstream(early_then_shut(status)) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        assert (outcome.response.status_code, outcome.response.text) == (status, ERROR)
        assert_counted(outcome, upstream, 1)
        assert_same_body(upstream, big)
    assert_released(outcome)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_early_answer_on_a_connection_that_stops_reading_is_relayed(
    big: bytes, transport: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(b) An early 413, and the upstream neither reads nor closes: the answer is relayed at once
    (httpcore wrote on until the headers timeout: a 504 after three full re-sends)."""
    if not runs_here(transport, anyio_backend):
        return
    with early_upstream(early_and_stop_reading) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        assert (outcome.response.status_code, outcome.response.text) == (413, ERROR)
        assert_counted(outcome, upstream, 1)
    assert_released(outcome)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("recovers", [True, False], ids=["then-ok", "exhausted"])
async def test_a_retryable_early_answer_is_retried_with_the_whole_body(
    big: bytes, transport: str, recovers: bool, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(c) An early 503 (then the upstream closes its side): retried at most ``max_attempts`` times,
    each attempt sending the whole body again; the last 503 reaches the client as the upstream sent
    it (marked not to be retried again), or the attempt that reads it all gets the identical body."""
    if not runs_here(transport, anyio_backend):
        return
    last = read_all_then_ok if recovers else early_then_shut(503)
    with early_upstream(early_then_shut(503), early_then_shut(503), last) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        response = outcome.response
        if recovers:
            assert response.status_code == 200
            assert response.json() == {"whole": hashlib.sha256(big).hexdigest()}
        else:
            assert (response.status_code, response.text) == (503, ERROR)
            assert response.headers["x-should-retry"] == "false"
        assert_counted(outcome, upstream, 3)
        assert_same_body(upstream, big)
    assert_released(outcome)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_reset_mid_body_is_a_gateway_error_after_bounded_retries(
    big: bytes, transport: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(d) The upstream resets the connection after reading part of the body, every time."""
    if not runs_here(transport, anyio_backend):
        return
    with early_upstream(reset) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        assert outcome.response.status_code == 502
        error = outcome.response.json()["error"]
        assert (error["type"], error["code"]) == ("upstream_error", "upstream_unreachable")
        assert error["message"].endswith("after 3 attempts")
        assert_counted(outcome, upstream, 3)
        assert_same_body(upstream, big)
    assert_released(outcome)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_early_answer_on_a_connection_kept_alive_is_relayed(
    big: bytes, transport: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(e) An early 413 with keep-alive, then the upstream reads and discards the rest (legal). Both
    transports stop sending once the answer is in and close the connection (never reused)."""
    if not runs_here(transport, anyio_backend):
        return
    with early_upstream(early_then_drain) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        assert (outcome.response.status_code, outcome.response.text) == (413, ERROR)
        assert_counted(outcome, upstream, 1)
    assert_released(outcome)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_early_answer_then_reset_is_bounded(
    big: bytes, transport: str, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An early 401, then an immediate close with the body unread (a reset). The reset may destroy
    the answer before it is read (TCP's rule, not the gateway's): the client gets the 401, or after
    bounded attempts the gateway's 502; never a hang, and the attempts are counted right."""
    if not runs_here(transport, anyio_backend):
        return
    with early_upstream(early_then_close) as upstream:
        outcome = await attack(upstream, transport, big, caplog)
        response = outcome.response
        attempts = len(upstream.large)
        if response.status_code == 401:
            assert response.text == ERROR
            assert 1 <= attempts <= 3
        else:
            assert response.status_code == 502 and attempts == 3
            assert response.json()["error"]["code"] == "upstream_unreachable"
        assert_counted(outcome, upstream, attempts)
    assert_released(outcome)


NGINX_SITE = """
server {{
    listen 127.0.0.1:{port};
    client_max_body_size 1m;
    location / {{
        proxy_pass http://127.0.0.1:{upstream};
    }}
}}
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_nginx_client_max_body_size_413_is_relayed(
    big: bytes, transport: str, anyio_backend: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """(f) A real nginx with ``client_max_body_size 1m`` in front of the upstream: its 413 (sent once
    it has read the head, then a lingering close) reaches the client, after one attempt."""
    if not runs_here(transport, anyio_backend):
        return
    require_binary("nginx", "nginx-light")
    with early_upstream(read_all_then_ok) as upstream:
        port = free_port()
        site = NGINX_SITE.format(port=port, upstream=upstream.url.rsplit(":", 1)[1])
        with nginx_server(tmp_path / "nginx", site, port=port) as nginx:
            proxied = EarlyUpstream([], url=nginx.base)
            outcome = await attack(proxied, transport, big, caplog)
        response = outcome.response
        assert response.status_code == 413
        assert b"413 Request Entity Too Large" in response.content
        assert upstream.large == [] and upstream.small == 1  # the small request went through nginx
        assert outcome.attempts == [1, 1]
    assert_released(outcome)


def test_httpcore_reads_the_answer_after_a_write_error() -> None:
    """``gateway/_watched.py`` ends a write with a WriteError when the upstream answered during it, for
    httpcore to go on and read that answer: if httpcore stops doing so, fail here."""
    source = inspect.getsource(AsyncHTTP11Connection.handle_async_request)
    assert "except WriteError:" in source
    assert hasattr(AutoBackend, "connect_tcp")
