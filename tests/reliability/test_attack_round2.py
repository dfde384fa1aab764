"""Attack, round 2: the graceful drain's two new stops (``StopUploads`` for a body still arriving,
``Forwarder`` for an answer still awaited when ``SHUTDOWN_GRACE`` ends) and the upstream statuses
outside the valid range, as a hostile client, a broken upstream and an SDK user see them, over real
servers on loopback (hypercorn h2c on asyncio and trio, uvicorn h11 and httptools).

Found here:

- over HTTP/2 a refusal that reads the rest of the body before ending its stream (a 413 on the
  declared length: hypercorn fails the connection if a stream ends while its client still sends)
  was refused again by ``StopUploads`` when the grace ended: its 503 raised out of the 413 already
  started, a traceback; the 413's stream never ended, and when its client sent the rest hypercorn
  failed the connection, cutting the other refused upload's stream. ``StopUploads`` refuses only
  while no response has started.
- ``UPSTREAM_TRANSPORT=aiohttp``: an upstream answering ``HTTP/1.1 101`` without an upgrade had its
  101 relayed as the final answer (aiohttp hands it back as the response; 100-599 passed the range
  check): uvicorn h11 dropped the client's connection with nothing sent, httptools raised ("Response
  content shorter than Content-Length") with a 101 on the wire. A final status is 200-599.
- an upstream's headers arriving in the step the grace ends: the relay sent the 503 ``shutting_down``
  itself and the access line said ``code=-`` (a relayed answer's mark); it names the code now.

Held up (kept as tests): beside a streaming neighbour on the same h2c connection, each upload gets its
503 and ends (or is reset by its client, quietly), the neighbour its in-band ``shutting_down``, the
connection stays up; ``Expect: 100-continue``, chunked and silent uploads get the 503 with ``connection:
close``; a body whose last message arrives in the step the grace ends is not refused; an upstream
answering (headers, or its error body being read, by the forwarder or the retry loop) in the step the
grace ends gives one 503, the upstream response closed, one access line, counted as 503, nothing held;
statuses 000, 099, 100, 199, 0999, 600 and reason phrases with NUL or CR are 502 on both transports and
both uvicorn parsers, obs-text relayed, interim 100/102/103 answers skipped for the final one; the
openai and anthropic SDKs (``max_retries=2``) do not multiply the upstream's attempts on those 502s.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import anyio
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import openai
import pytest
from starlette.types import Message, Receive, Scope, Send

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._shutdown import StopSignal, StopUploads, request_shutdown, reset_shutdown

from .._gateways import eventually
from .._servers import served
from ..gateway._raw_upstream import CLOSE, RawRequest, Script, raw_upstream
from .test_attack_drain import read_until_closed, upstream
from .test_attack_metrics import requests_by_status, scrape
from .test_faults import CHAT, PATH, assert_idle, running

SHUTTING_DOWN = b'"code":"shutting_down"'


# -- HTTP/2: several streams on one connection when the grace ends ----------------------------------------


class H2Client:
    """A cleartext HTTP/2 client (prior knowledge) on one connection: streams opened and fed by the test,
    every frame of the server's read in a thread (data acknowledged as it comes)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.changed = threading.Condition()
        self.streams: dict[int, dict[str, Any]] = {}
        self.terminated = False
        with self.changed:
            self.conn.initiate_connection()
            self.sock.sendall(self.conn.data_to_send())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.terminated = True
                    self.changed.notify_all()
                    return
                for event in self.conn.receive_data(data):
                    stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
                    if isinstance(event, h2.events.ResponseReceived) and stream is not None:
                        stream["status"] = int(dict(event.headers)[b":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        if stream is not None:
                            stream["data"] += event.data
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded) and stream is not None:
                        stream["ended"] = True
                    elif isinstance(event, h2.events.StreamReset) and stream is not None:
                        stream["reset"] = event.error_code
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self.terminated = True
                self.sock.sendall(self.conn.data_to_send())
                self.changed.notify_all()

    def open(self, body: bytes, *, length: int | None = None, end: bool = True) -> int:
        head = [(b":method", b"POST"), (b":path", PATH.encode()), (b":scheme", b"http"), (b":authority", b"gw")]
        head.append((b"content-type", b"application/json"))
        if length is not None:
            head.append((b"content-length", b"%d" % length))
        with self.changed:
            sid: int = self.conn.get_next_available_stream_id()
            self.streams[sid] = {"status": None, "data": b"", "ended": False, "reset": None}
            self.conn.send_headers(sid, head, end_stream=not body and end)
            self.sock.sendall(self.conn.data_to_send())
        if body:
            self.send(sid, body, end=end)
        return sid

    def send(self, sid: int, body: bytes, *, end: bool) -> None:
        """``body`` on stream ``sid``, as the flow-control windows allow (they open as the server reads)."""

        def window() -> int:
            return min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)

        with self.changed:
            while True:
                if not self.changed.wait_for(lambda: self.terminated or window() > 0, timeout=10):
                    raise AssertionError(f"stream {sid}: no window to send in")
                assert not self.terminated, self.streams
                size = window()
                chunk, body = body[:size], body[size:]
                self.conn.send_data(sid, chunk, end_stream=end and not body)
                self.sock.sendall(self.conn.data_to_send())
                if not body:
                    return

    def reset(self, sid: int) -> None:
        with self.changed:
            self.conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.CANCEL)
            self.sock.sendall(self.conn.data_to_send())

    def wait(self, condition: Any, what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: condition(self.streams), timeout=10):
                raise AssertionError(
                    f"{what}: {self.terminated} "
                    + repr({k: {**v, "data": v["data"][-60:]} for k, v in self.streams.items()})
                )

    def close(self) -> None:
        self.sock.close()
        self.reader.join(5)


@pytest.mark.parametrize("server", ["hypercorn-asyncio", "hypercorn-trio"])
def test_http2_streams_uploading_when_the_grace_ends_each_get_one_answer(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    # One h2c connection: an endless stream, a 413 still reading the rest of its body (as HTTP/2 needs),
    # an upload with a content-length and one without, both paused. When the grace ends each upload gets
    # its 503, the neighbour its in-band error; the 413 is not answered twice. Once the clients send the
    # rest, every stream ends and the connection still carries a request. Before: the 413 got a 503
    # raised into its started answer (a traceback), and its stream never ended.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    limit = 30_000
    with upstream() as up:
        settings = LifetimeSettings(
            upstream_url=(up.url,), shutdown_grace=0.3, body_idle_timeout=30, max_body_bytes=limit
        )
        app = create_app(settings)
        try:
            with served(app, server) as base:
                client = H2Client(int(base.rsplit(":", 1)[1]))
                try:
                    neighbour = client.open(b'{"model": "stream", "stream": true, "messages": []}')
                    head = b'{"model": "upload", "x": "'
                    big = client.open(head, length=limit + 10_000, end=False)
                    sized = client.open(head + b"a" * 20_000, length=len(head) + 20_002, end=False)
                    chunked = client.open(head + b"a" * 20_000, end=False)
                    abandoned = client.open(head + b"a" * 1_000, end=False)
                    client.wait(lambda s: s[big]["status"] == 413 and s[neighbour]["status"] == 200, "413, stream")
                    eventually(lambda: app.state.lifetime.stats().inflight_bytes >= 40_000, seconds=10, what="read")
                    request_shutdown()
                    # Each refusal's headers and its body come in frames of their own: wait for the body.
                    client.wait(
                        lambda s: all(
                            s[i]["status"] == 503 and SHUTTING_DOWN in s[i]["data"].replace(b" ", b"")
                            for i in (sized, chunked, abandoned)
                        ),
                        "refused",
                    )
                    client.wait(lambda s: s[neighbour]["ended"], "the neighbour ended")
                    assert SHUTTING_DOWN in client.streams[neighbour]["data"].replace(b" ", b"")
                    client.reset(abandoned)  # this client gives up on its upload instead
                    # The clients send the rest of their bodies: each answer ends, on the same connection.
                    client.send(sized, b'"}', end=True)
                    client.send(chunked, b'"}', end=True)
                    client.send(big, b"a" * (limit + 10_000 - len(head)), end=True)
                    client.wait(lambda s: all(s[i]["ended"] for i in (big, sized, chunked)), "every answer ended")
                    assert client.streams[big]["status"] == 413 and not client.terminated
                    assert all(client.streams[i]["reset"] is None for i in (neighbour, big, sized, chunked))
                    late = client.open(b'{"model": "quick", "messages": []}')
                    client.wait(lambda s: s[late]["ended"], "a request after the drain began answered")
                    assert client.streams[late]["status"] == 503 and not client.terminated
                finally:
                    client.close()
                eventually(lambda: app.state.lifetime.stats().idle, seconds=5, what="the gateway idle")
        finally:
            reset_shutdown()
    assert up.seen == ["stream"]  # no upload was forwarded
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name == "asgi_lifetime.access"]
    assert len(lines) == 6, lines  # one a request
    assert sum("status=503 outcome=refused code=shutting_down" in line for line in lines) == 3, lines


# -- HTTP/1.1 uploads of every kind when the grace ends ---------------------------------------------------


UPLOADS = {
    # The client waits for 100 Continue, gets it (the gateway reads), then sends nothing.
    "expect-100": b"content-length: 1000\r\nexpect: 100-continue\r\n\r\n",
    # A chunked body, its first chunk sent.
    "chunked": b"transfer-encoding: chunked\r\n\r\n10\r\n" + b'{"model": "xy", ' + b"\r\n",
    # A length announced, not a byte of the body sent.
    "silent": b"content-length: 1000\r\n\r\n",
}


@pytest.mark.parametrize("server", ["uvicorn-h11", "uvicorn-httptools", "hypercorn-asyncio", "hypercorn-trio"])
@pytest.mark.parametrize("kind", list(UPLOADS))
def test_an_http1_upload_of_any_kind_gets_its_503_when_the_grace_ends(server: str, kind: str) -> None:
    with upstream() as up:
        app = create_app(LifetimeSettings(upstream_url=(up.url,), shutdown_grace=0.3, body_idle_timeout=30))
        try:
            with served(app, server) as base:
                sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=15)
                with sock:
                    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                    sock.sendall(head + UPLOADS[kind])
                    eventually(lambda: app.state.lifetime.stats().inflight_requests, seconds=10, what="admitted")
                    request_shutdown()
                    answer = read_until_closed(sock)
                eventually(lambda: app.state.lifetime.stats().idle, seconds=5, what="the gateway idle")
        finally:
            reset_shutdown()
    if kind == "expect-100" and answer.startswith(b"HTTP/1.1 100 "):
        answer = answer.partition(b"\r\n\r\n")[2]
    head_, _, body = answer.partition(b"\r\n\r\n")
    assert head_.lower().startswith(b"http/1.1 503 ") and b"\r\nconnection: close" in head_.lower(), answer
    assert answer.count(b"HTTP/1.1 5") == 1 and SHUTTING_DOWN in body.replace(b" ", b""), answer
    assert up.seen == []


# -- a body complete in the step the grace ends -------------------------------------------------------------


@pytest.mark.anyio
async def test_a_body_whose_last_message_arrives_as_the_grace_ends_is_not_refused() -> None:
    # The server's receive returns the body's last message in the same step the stop is set (no
    # checkpoint between): the app gets the whole body, never a 503 for a complete upload.
    stop = StopSignal()
    messages: list[Message] = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.request", "body": b"}", "more_body": False},
    ]
    got: list[bytes] = []
    sent: list[Message] = []

    async def receive() -> Message:
        message = messages.pop(0)
        if not message["more_body"]:
            stop.set()  # the grace ends as the last byte arrives
        return message

    async def send(message: Message) -> None:
        sent.append(message)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            got.append(message["body"])
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "path": PATH, "headers": [], "method": "POST"}
    await StopUploads(app, stop=lambda: stop)(scope, receive, send)
    assert got == [b"{", b"}"] and sent[0]["status"] == 200 and stop.is_set()


# -- the upstream answers in the step the grace ends ----------------------------------------------------------


class Closing(httpx.AsyncByteStream):
    """A response body; ``stop_at`` its chunk at which the gateway's stop is set (then it waits)."""

    def __init__(self, chunks: list[bytes], stop_at: int | None, stop: Any) -> None:
        self.chunks, self.stop_at, self.stop = chunks, stop_at, stop
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for n, chunk in enumerate(self.chunks):
            if n == self.stop_at:
                self.stop().set()
                await anyio.sleep_forever()  # the rest never comes: only the stop ends the read
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class AnswersAsTheGraceEnds(httpx.AsyncBaseTransport):
    """The upstream: its headers come in the step the stop is set (``when="headers"``), or it is an error
    whose body is being read when it is set (``when="error-body"``: a 400; ``"retried-error-body"``: a 503)."""

    def __init__(self, when: str) -> None:
        self.when = when
        self.app: Any = None
        self.bodies: list[Closing] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()

        def stop() -> StopSignal:
            signal: StopSignal = self.app.state.drain.stop
            return signal

        if self.when == "headers":
            body = Closing([b'{"id": "c", "choices": []}'], None, stop)
            stop().set()  # in the same step the headers are handed back
            status = 200
        else:  # a 400 is read by the forwarder, a 503 by the retry loop (for Google's RetryInfo)
            body = Closing([b'{"error": {"message": "', b"busy", b'"}}'], 1, stop)
            status = 400 if self.when == "error-body" else 503
        self.bodies.append(body)
        return httpx.Response(status, headers={"content-type": "application/json"}, stream=body)

    def busy(self) -> list[str]:
        """What ``assert_idle`` asks of the pool: the answers not closed."""
        return [f"answer {n} open" for n, body in enumerate(self.bodies) if not body.closed]


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["headers", "error-body", "retried-error-body"])
async def test_an_answer_arriving_as_the_grace_ends_gives_one_503_and_closes_the_upstream(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    transport = AnswersAsTheGraceEnds(when)
    app = create_app(LifetimeSettings(upstream_url=("http://upstream.test",)), transport=transport)
    transport.app = app
    with served(app, "uvicorn-h11") as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            response = await client.post(PATH, json=CHAT)
        assert response.status_code == 503 and SHUTTING_DOWN in response.content.replace(b" ", b"")
        assert [body.closed for body in transport.bodies] == [True]
        eventually(lambda: requests_by_status(scrape(base)) == {503: 1}, seconds=5, what="counted once, as 503")
        await assert_idle(app, base)
    lines = [r.getMessage() for r in caplog.records if r.name == "asgi_lifetime.access"]
    # Before, the relay's own 503 (the headers case) said code=-, the line of a relayed upstream answer.
    assert len(lines) == 1 and "status=503 outcome=shutdown code=shutting_down " in lines[0], lines


# -- upstream statuses outside 200-599, odd reason phrases --------------------------------------------------


STATUS_LINES = {
    b"HTTP/1.1 101 Switching Protocols": 502,  # no upgrade was asked for (aiohttp hands it back as the answer)
    b"HTTP/1.1 100 Continue": 502,  # and then the connection closes: no final answer
    b"HTTP/1.1 199 Odd": 502,
    b"HTTP/1.1 000 Zero": 502,
    b"HTTP/1.1 099 Low": 502,
    b"HTTP/1.1 0999 Four digits": 502,
    b"HTTP/1.1 600 High": 502,
    b"HTTP/1.1 200 a\x00b": 502,  # NUL in the reason phrase
    b"HTTP/1.1 200 a\rb": 502,  # a bare CR in it
    b"HTTP/1.1 200 \x80\xff obs-text": 200,  # allowed (RFC 9112 4)
    # Interim answers before the final one are valid: skipped, the final one relayed.
    b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\nHTTP/1.1 200 OK": 200,
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200 OK": 200,
}


def status_line_upstream(request: RawRequest) -> Script:
    line = json.loads(request.body)["messages"][0]["content"].encode("latin-1")
    return [line + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}", CLOSE]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
@pytest.mark.parametrize("parser", ["h11", "httptools"])
async def test_status_lines_outside_the_final_range_are_502_on_every_transport_and_parser(
    transport: str, parser: str
) -> None:
    # Before: with aiohttp, the 101 was relayed as the answer (uvicorn h11: the connection dropped with
    # nothing sent; httptools: a 101 on the wire and a RuntimeError).
    with (
        raw_upstream(status_line_upstream) as raw,
        running(upstream_url=raw.url, upstream_transport=transport, serve={"http": parser}) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            for line, expected in STATUS_LINES.items():
                body = {**CHAT, "messages": [{"role": "user", "content": line.decode("latin-1")}]}
                response = await client.post(PATH, json=body)
                assert response.status_code == expected, (line, response.status_code, response.text)
                if expected == 502:
                    assert response.headers["x-should-retry"] == "false"
        await assert_idle(stack.app, stack.url)


@pytest.mark.parametrize("line", [b"HTTP/1.1 101 Switching Protocols", b"HTTP/1.1 600 High"])
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_sdks_do_not_multiply_attempts_on_an_invalid_status(line: bytes, sdk: str) -> None:
    # The SDKs retry a 502 twice by default; the gateway's x-should-retry: false stops them: one upstream
    # request per call (a POST is not sent twice by the gateway either).
    def answer(request: RawRequest) -> Script:
        return [line + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}", CLOSE]

    with raw_upstream(answer) as raw, running(upstream_url=raw.url, upstream_transport="aiohttp") as stack:
        status: int
        if sdk == "openai":
            oa = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="k", max_retries=2)
            with pytest.raises(openai.InternalServerError) as from_openai:
                oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            status = from_openai.value.status_code
        else:
            an = anthropic.Anthropic(base_url=stack.url, api_key="k", max_retries=2)
            with pytest.raises(anthropic.InternalServerError) as from_anthropic:
                an.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            status = from_anthropic.value.status_code
        assert status == 502
        assert len(raw.requests) == 1, [r.target for r in raw.requests]
