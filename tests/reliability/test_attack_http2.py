"""Attacks over HTTP/2: the gateway (``create_app``) under a real hypercorn serving cleartext HTTP/2 with
prior knowledge (h2c), in front of a raw-socket upstream on loopback.

The clients are httpx with ``http2=True`` (what the SDKs use when handed such a client) and, to send what
httpx never would (a reset stream, a connection dropped with streams open, trailers), the ``h2`` state
machine over an anyio socket. hypercorn's worker runs in a thread on asyncio or trio; the client side runs
on the test's own backend (asyncio and trio).

What each test holds: many streams on one connection each get exactly their own bytes; large bodies flow
through HTTP/2's flow control, bounded by ``MAX_BODY_BYTES`` before and after gzip; a stream reset by the
client (mid-upload, mid-answer) or a connection closed with streams open closes that request's upstream
connection, leaves its neighbours alone and leaves the gateway idle.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx
import pytest

from asgi_lifetime import LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import held, serve_in_thread, wait_idle

from .._servers import hypercorn_in_thread
from ..gateway._raw_upstream import HOLD, RawRequest, RawUpstream, Script, raw_upstream, response
from .test_faults import busy_connections

CHAT = "/v1/chat/completions"
# hypercorn's worker and the upstream transport (aiohttp runs on asyncio only).
SERVED = [("asyncio", "httpcore"), ("asyncio", "aiohttp"), ("trio", "httpcore")]
WAIT = 20.0  # bound on anything a test waits for (loaded CI machine; it passes in well under a second)
SETTINGS: dict[str, Any] = {
    "max_attempts": 1,
    "stall_timeout": 10.0,
    "keepalive_interval": 10.0,
    "headers_timeout": 10.0,
    "body_idle_timeout": 10.0,
}
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
END_OF_BODY = b"0\r\n\r\n"


def after(wait: Callable[[], object]) -> bytes:
    """A script step that blocks the upstream's connection thread on ``wait`` and writes nothing."""
    wait()
    return b""


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def chat_body(marker: str, *, stream: bool = True, padding: int = 0) -> bytes:
    content = marker + "." * padding
    return json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": content}]}).encode()


def marker_of(request: RawRequest) -> str:
    content: str = json.loads(request.body)["messages"][0]["content"]
    return content.rstrip(".")


def sse_events(marker: str, count: int) -> list[bytes]:
    """The chat chunk events the upstream sends for ``marker``: each names the marker and its index."""
    events = []
    for index in range(count):
        delta = {"content": f"{marker}:{index:04d} " + marker[-1] * 40}
        data = {"id": marker, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        events.append(b"data: " + json.dumps(data).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


@contextlib.contextmanager
def gateway(
    answer: Callable[[RawRequest], Script], worker: str, transport: str = "httpcore", **settings: Any
) -> Iterator[tuple[RawUpstream, Any, int]]:
    """A raw upstream answering with ``answer`` and the gateway in front of it under hypercorn (``worker``),
    which serves HTTP/1.1 and h2c on one loopback port: yields the upstream, the app and the port."""
    with raw_upstream(answer) as upstream:
        merged = {**SETTINGS, **settings}
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), upstream_transport=transport, **merged))
        with hypercorn_in_thread(app, worker) as port:
            yield upstream, app, port


async def idle(app: Any) -> None:
    """Nothing held: the gauges, the upstreams' in-flight counts, and no pooled upstream connection in a request."""
    await wait_idle(app, within=WAIT, extra=lambda: busy_connections(app))


# -- a low-level HTTP/2 client -----------------------------------------------------------------------------


@dataclass
class Stream:
    """One stream's answer as the client saw it."""

    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    reset: int | None = None  # the error code of a RST_STREAM from the server
    ended: anyio.Event = field(default_factory=anyio.Event)
    progressed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def status(self) -> int:
        return int(dict(self.headers)[b":status"])

    def json(self) -> Any:
        return json.loads(bytes(self.data))


class H2Client:
    """The ``h2`` state machine over an anyio socket: a task reads frames (acknowledging data, so the server
    can always send), ``send`` writes a body within the flow-control windows, ``reset`` and ``aclose`` end a
    stream or the connection as a client can, at any point."""

    def __init__(self, sock: anyio.abc.SocketStream) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.sock = sock
        self.streams: dict[int, Stream] = {}
        self.window = anyio.Event()  # set (and replaced) when the server opens a window
        self.closed = False
        self.lock = anyio.Lock()

    async def flush(self) -> None:
        async with self.lock:
            data = self.conn.data_to_send()
            if data and not self.closed:
                await self.sock.send(data)

    async def read(self) -> None:
        # h2.exceptions.ProtocolError: a frame after our own GOAWAY (h2's connection is closed then).
        gone = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, h2.exceptions.ProtocolError)
        with contextlib.suppress(*gone):
            while True:
                data = await self.sock.receive(65536)
                for event in self.conn.receive_data(data):
                    self.on(event)
                await self.flush()
        self.closed = True
        for stream in self.streams.values():
            stream.ended.set()
        self.window.set()

    def on(self, event: h2.events.Event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and stream is not None:
            stream.headers = list(event.headers)
        elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
            stream.trailers = list(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if stream is not None:
                stream.data += event.data
                stream.progressed.set()
                stream.progressed = anyio.Event()
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.ended.set()
        elif isinstance(event, h2.events.StreamReset) and stream is not None:
            stream.reset = event.error_code
            stream.ended.set()
        if isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged, h2.events.StreamReset)):
            self.window.set()
            self.window = anyio.Event()

    async def open(self, path: str | bytes, headers: Sequence[tuple[bytes, bytes]] = (), *, end: bool = False) -> int:
        stream_id: int = self.conn.get_next_available_stream_id()
        self.streams[stream_id] = Stream()
        target = path.encode() if isinstance(path, str) else path
        head = [(b":method", b"POST"), (b":path", target), (b":scheme", b"http"), (b":authority", b"gw.test")]
        self.conn.send_headers(stream_id, head + list(headers), end_stream=end)
        await self.flush()
        return stream_id

    async def send(
        self, stream_id: int, body: bytes, *, end: bool = True, stop: Callable[[], bool] = lambda: False
    ) -> None:
        """Send ``body`` on the stream as the windows allow; with ``stop``, return early once it is true."""
        view = memoryview(body)
        while view and not stop():
            window = self.conn.local_flow_control_window(stream_id)
            if window == 0:
                if self.closed or self.streams[stream_id].ended.is_set():
                    return
                await self.window.wait()
                continue
            size = min(window, self.conn.max_outbound_frame_size, len(view))
            self.conn.send_data(stream_id, bytes(view[:size]))
            view = view[size:]
            await self.flush()
        if end and not stop():
            self.conn.end_stream(stream_id)
            await self.flush()

    async def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        await self.flush()

    async def post(self, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> Stream:
        stream_id = await self.open(path, [(b"content-type", b"application/json"), *headers])
        await self.send(stream_id, body)
        stream = self.streams[stream_id]
        await stream.ended.wait()
        return stream


@contextlib.asynccontextmanager
async def h2_client(port: int) -> AsyncIterator[H2Client]:
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        client = H2Client(sock)
        # Windows as large as h2 allows, so our side never slows the server's answer.
        client.conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        client.conn.initiate_connection()
        client.conn.increment_flow_control_window(2**31 - 1 - 65535)
        await client.flush()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(client.read)
            try:
                yield client
            finally:
                client.closed = True
                tasks.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def httpx_h2(port: int) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=1)  # every request on the one connection
    async with httpx.AsyncClient(
        http1=False, http2=True, base_url=f"http://127.0.0.1:{port}", timeout=WAIT, limits=limits
    ) as client:
        yield client


# -- many streams on one connection ------------------------------------------------------------------------

STREAMS = 20
EVENTS = 150


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_each_multiplexed_stream_gets_exactly_its_own_answer(worker: str, transport: str) -> None:
    # Every upstream answer waits until all twenty requests have arrived, so the twenty answers stream at
    # the same time through one client connection, each on its own upstream connection.
    everyone = threading.Barrier(STREAMS, timeout=WAIT)

    def answer(request: RawRequest) -> Script:
        marker = marker_of(request)
        return [lambda: after(everyone.wait), SSE_HEAD, *map(chunk, sse_events(marker, EVENTS)), END_OF_BODY]

    with gateway(answer, worker, transport) as (upstream, app, port):
        async with httpx_h2(port) as client:
            answers: dict[str, bytes] = {}

            async def one(marker: str) -> None:
                async with client.stream("POST", CHAT, content=chat_body(marker)) as reply:
                    assert reply.http_version == "HTTP/2" and reply.status_code == 200
                    answers[marker] = b"".join([piece async for piece in reply.aiter_raw()])

            markers = [f"stream-{n:02d}-{chr(65 + n)}" for n in range(STREAMS)]
            async with anyio.create_task_group() as tasks:
                for marker in markers:
                    tasks.start_soon(one, marker)
            await idle(app)
    assert {marker: answers[marker] for marker in markers} == {m: b"".join(sse_events(m, EVENTS)) for m in markers}
    assert sorted(marker_of(r) for r in upstream.requests) == markers
    assert upstream.connections == STREAMS  # one upstream connection per concurrent request


# -- large bodies through HTTP/2 flow control ---------------------------------------------------------------


def echo_size(request: RawRequest) -> Script:
    """The upstream answers with the size and a digest of the body it received."""
    import hashlib

    digest = hashlib.sha256(request.body).hexdigest()
    return [response(200, json.dumps({"size": len(request.body), "sha256": digest}).encode())]


# -- a client resetting a stream, or closing the connection, with others in flight ----------------------------


def held_or_streamed(go: threading.Event) -> Callable[[RawRequest], Script]:
    """The upstream of the reset tests: a request marked ``hold`` gets two events, then the upstream waits
    for the gateway to hang up; any other gets its whole stream once ``go`` is set (after the reset)."""

    def answer(request: RawRequest) -> Script:
        marker = marker_of(request)
        events = [chunk(event) for event in sse_events(marker, 20)]
        if marker.startswith("hold"):
            return [SSE_HEAD, *events[:2], HOLD]
        return [SSE_HEAD, events[0], lambda: after(lambda: go.wait(WAIT)), *events[1:], END_OF_BODY]

    return answer


async def until(condition: Callable[[], object], what: str) -> None:
    """Poll state another thread changes (hypercorn's, the upstream's): there is no event to wait on."""
    with anyio.move_on_after(WAIT):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"not within {WAIT}s: {what}")


async def neighbour_then(
    client: H2Client, go: threading.Event, action: Callable[[], Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> Stream:
    """Open a streaming neighbour, wait for its first event, run ``action`` (the attack), let the neighbour's
    upstream go on, and return the neighbour's answer once complete."""
    stream_id = await client.open(CHAT, [(b"content-type", b"application/json"), *headers])
    await client.send(stream_id, chat_body("neighbour"))
    neighbour = client.streams[stream_id]
    await until(lambda: neighbour.data, "the neighbour's first event")
    await action()
    go.set()
    with anyio.fail_after(WAIT):
        await neighbour.ended.wait()
    return neighbour


def complete(stream: Stream, marker: str) -> bool:
    return stream.status == 200 and stream.reset is None and bytes(stream.data) == b"".join(sse_events(marker, 20))


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_stream_reset_mid_answer_closes_its_upstream_and_spares_its_neighbour(
    worker: str, transport: str
) -> None:
    go = threading.Event()
    with gateway(held_or_streamed(go), worker, transport) as (upstream, app, port):
        async with h2_client(port) as client:

            async def reset_mid_answer() -> None:
                stream_id = await client.open(CHAT, [(b"content-type", b"application/json")])
                await client.send(stream_id, chat_body("hold"))
                await until(lambda: client.streams[stream_id].data, "the held stream's first event")
                await client.reset(stream_id)
                await until(lambda: upstream.releases == 1, "the held request's upstream connection closed")

            neighbour = await neighbour_then(client, go, reset_mid_answer)
            assert complete(neighbour, "neighbour")
            await idle(app)
            again = await client.post(CHAT, chat_body("after", stream=False))  # the connection serves on
    assert again.status == 200
    assert sorted(marker_of(r) for r in upstream.requests) == ["after", "hold", "neighbour"]


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_stream_reset_mid_upload_forwards_nothing_and_spares_its_neighbour(worker: str, transport: str) -> None:
    go = threading.Event()
    with gateway(held_or_streamed(go), worker, transport) as (upstream, app, port):
        async with h2_client(port) as client:

            async def reset_mid_upload() -> None:
                stream_id = await client.open(CHAT, [(b"content-type", b"application/json")])
                await client.send(stream_id, chat_body("upload", padding=8 * MiB)[: 4 * MiB], end=False)
                await until(lambda: app.state.lifetime.stats().inflight_bytes >= 2 * MiB, "half the body read")
                await client.reset(stream_id)
                await until(lambda: app.state.lifetime.stats().aborted == 1, "the upload seen aborted")

            neighbour = await neighbour_then(client, go, reset_mid_upload)
            assert complete(neighbour, "neighbour")
            await idle(app)
    assert [marker_of(r) for r in upstream.requests] == ["neighbour"]


@pytest.mark.anyio
@pytest.mark.parametrize("goaway", [True, False], ids=["goaway", "close"])
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_connection_closed_with_streams_in_flight_closes_every_upstream(
    worker: str, transport: str, goaway: bool
) -> None:
    go = threading.Event()
    with gateway(held_or_streamed(go), worker, transport) as (upstream, app, port):
        async with h2_client(port) as client:
            for n in range(3):
                stream_id = await client.open(CHAT, [(b"content-type", b"application/json")])
                await client.send(stream_id, chat_body(f"hold-{n}"))
            upload = await client.open(CHAT, [(b"content-type", b"application/json")])
            await client.send(upload, chat_body("upload", padding=8 * MiB)[: 2 * MiB], end=False)
            await until(lambda: upstream.holding == 3, "three answers streaming")
            if goaway:
                client.conn.close_connection()
                await client.flush()
        # The socket is closed here.
        await until(lambda: upstream.releases == 3, "every upstream connection closed")
        await idle(app)
    assert sorted(marker_of(r) for r in upstream.requests) == ["hold-0", "hold-1", "hold-2"]


# -- large bodies through HTTP/2 flow control --------------------------------------------------------------


def echo_digest(request: RawRequest) -> Script:
    """The upstream answers with the size and digest of the body it received."""
    digest = hashlib.sha256(request.body).hexdigest()
    return [response(200, json.dumps({"size": len(request.body), "sha256": digest}).encode())]


async def pieces(body: bytes, size: int = 256 * 1024) -> AsyncIterator[bytes]:
    """A body as an async iterator: httpx sends it without a content-length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def gzipped(body: bytes) -> bytes:
    return gzip.compress(body, compresslevel=1)


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_large_bodies_at_once_on_one_connection_arrive_whole(worker: str, transport: str) -> None:
    # Sent with the h2 client: httpx's own HTTP/2 uploads, several at once on one connection, stall in its
    # flow-control wait (pydantic/httpx2#1133; httpcore has the same code), which is the client's bug.
    bodies = {f"big-{n}": chat_body(f"big-{n}", padding=(10 + n) * MiB) for n in range(3)}
    with gateway(echo_digest, worker, transport, max_body_bytes=16 * MiB) as (upstream, app, port):
        async with h2_client(port) as client:
            answers: dict[str, Stream] = {}

            async def send(name: str, encoded: bool) -> None:
                body = bodies[name]
                headers = [(b"content-encoding", b"gzip")] if encoded else []
                answers[f"{name}-{encoded}"] = await client.post(CHAT, gzipped(body) if encoded else body, headers)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tasks:
                    for name in bodies:
                        for encoded in (False, True):
                            tasks.start_soon(send, name, encoded)
            await idle(app)
    for key, answer in answers.items():
        body = bodies[key.rsplit("-", 1)[0]]
        assert answer.status == 200, (key, bytes(answer.data[:200]))
        assert answer.json() == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}, key
    assert len(upstream.requests) == 6
    assert all(request.headers["content-length"] == str(len(request.body)) for request in upstream.requests)


# -- a refusal before the body is read ---------------------------------------------------------------------

LIMIT = 4 * MiB
BOMB = gzip.compress(bytes(64 * MiB), compresslevel=9)  # ~64 KiB on the wire
REFUSED = {
    # name: (path, headers, body, status, code)
    "too-large": (CHAT, [], chat_body("x", padding=LIMIT + 1), 413, "request_too_large"),
    "too-large-anthropic": ("/v1/messages", [], chat_body("x", padding=LIMIT + 1), 413, "request_too_large"),
    "gzip-bomb": (CHAT, [(b"content-encoding", b"gzip")], BOMB, 413, "request_too_large"),
    "declared-length": (
        CHAT,
        [(b"content-length", str(LIMIT + 1).encode())],
        bytes(LIMIT + 1),
        413,
        "request_too_large",
    ),
    "unsupported-encoding": (CHAT, [(b"content-encoding", b"br")], bytes(2 * MiB), 415, "unsupported_encoding"),
    "no-gateway-key": (CHAT, [], chat_body("x", padding=2 * MiB), 401, "invalid_api_key"),
    "overloaded": (CHAT, [], chat_body("x", padding=2 * MiB), 503, "overloaded"),
    # RequestHead's refusals (h2 passes a vertical tab in a value; HTTP/1.1 servers refuse it themselves).
    "invalid-header": (CHAT, [(b"x-note", b"a\x0bb")], chat_body("x", padding=2 * MiB), 400, "invalid_header"),
    "invalid-path": ("/v1/./chat/completions", [], chat_body("x", padding=2 * MiB), 400, "invalid_path"),
}
CASE_SETTINGS: dict[str, dict[str, Any]] = {
    "no-gateway-key": {"gateway_keys": ("gw-key",), "upstream_api_key": "sk-up"},
    # The neighbour holds the one slot: the refused request waits ADMISSION_TIMEOUT, reading at most
    # 64 KiB of its body meanwhile, and is answered 503 with the rest unread.
    "overloaded": {"max_inflight": 1, "admission_timeout": 0.2, "admission_target_delay": 0},
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_refusal_before_the_body_is_read_spares_the_other_streams(
    worker: str, transport: str, case: str
) -> None:
    # The gateway answers 413/415/401 (408, 503 alike) before the client finished sending. hypercorn closes
    # the stream when the answer ends; the client's next DATA frame for it then failed the whole connection
    # (KeyError in hypercorn's h2 protocol, pgjones/hypercorn#329): every other stream on it was cut.
    path, headers, body, status, code = REFUSED[case]
    changes = CASE_SETTINGS.get(case, {})
    go = threading.Event()
    with gateway(held_or_streamed(go), worker, transport, max_body_bytes=LIMIT, **changes) as (upstream, app, port):
        async with h2_client(port) as client:
            refused: list[Stream] = []

            async def refuse() -> None:
                with anyio.fail_after(WAIT):
                    refused.append(await client.post(path, body, headers))

            neighbour_headers = [(b"authorization", b"Bearer gw-key")] if "gateway_keys" in changes else []
            neighbour = await neighbour_then(client, go, refuse, neighbour_headers)
            assert complete(neighbour, "neighbour")
            [answer] = refused
            assert (answer.status, answer.reset) == (status, None)
            error = answer.json()["error"]
            assert error["code"] == code
            if path == "/v1/messages":
                assert answer.json()["type"] == "error"
            await idle(app)
            again = await client.post(CHAT, chat_body("after", stream=False), neighbour_headers)
    assert again.status == 200  # the connection serves on
    assert sorted(marker_of(r) for r in upstream.requests) == ["after", "neighbour"]


# -- the official SDKs over h2c ----------------------------------------------------------------------------


def sdk_calls(openai_client: Any, anthropic_client: Any) -> dict[str, Any]:
    """What each SDK returns for a chat completion and a message, streamed and not."""
    hello = [{"role": "user", "content": "hello"}]
    chat = openai_client.chat.completions.create(model="gpt-test", messages=hello)
    chunks = openai_client.chat.completions.create(model="gpt-test", messages=hello, stream=True)
    message = anthropic_client.messages.create(model="claude-test", max_tokens=64, messages=hello)
    with anthropic_client.messages.stream(model="claude-test", max_tokens=64, messages=hello) as stream:
        events = [event.model_dump() for event in stream]
        final = stream.get_final_message()
    return {
        "chat": chat.model_dump(),
        "chunks": [chunk.model_dump() for chunk in chunks],
        "message": message.model_dump(),
        "events": events,
        "final": final.model_dump(),
    }


@pytest.mark.parametrize(("worker", "transport"), SERVED)
def test_the_sdks_over_h2c_get_what_the_upstream_gives_them(worker: str, transport: str) -> None:
    import anthropic
    import httpx2
    import openai

    from ..gateway.sdk_upstream import ScriptedUpstream
    from ..gateway.test_sdk import settle

    def calls(base: str, versions: list[str], **options: Any) -> dict[str, Any]:
        # The openai SDK takes an httpx client (or an httpx2 one); the anthropic SDK only an httpx2 one.
        hooks = {"response": [lambda answer: versions.append(answer.http_version)]}
        with (
            httpx.Client(timeout=WAIT, event_hooks=hooks, **options) as for_openai,
            httpx2.Client(timeout=WAIT, event_hooks=hooks, **options) as for_anthropic,
        ):
            return sdk_calls(
                # Typed as httpx2's client; an httpx one is accepted at runtime (what its users pass).
                openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", http_client=for_openai, max_retries=0),  # type: ignore[arg-type]
                anthropic.Anthropic(base_url=base, api_key="sk-ant-test", http_client=for_anthropic, max_retries=0),
            )

    upstream = ScriptedUpstream()
    direct_versions: list[str] = []
    gateway_versions: list[str] = []
    with serve_in_thread(upstream.app) as upstream_url:
        direct = calls(upstream_url, direct_versions)
        app = create_app(LifetimeSettings(upstream_url=(upstream_url,), upstream_transport=transport, **SETTINGS))
        with hypercorn_in_thread(app, worker) as port:
            through = calls(f"http://127.0.0.1:{port}", gateway_versions, http1=False, http2=True)
            settle(lambda: not held(app), what=lambda: held(app), within=WAIT)
    assert through == direct
    assert set(direct_versions) == {"HTTP/1.1"} and gateway_versions == ["HTTP/2"] * 4


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_httpx_over_h2c_gets_its_413_and_keeps_its_connection(worker: str, transport: str) -> None:
    # httpx sends the whole body before it reads the answer: the refusal's end waits for it.
    with gateway(echo_digest, worker, transport, max_body_bytes=LIMIT) as (upstream, app, port):
        async with httpx_h2(port) as client:
            big = await client.post(CHAT, content=pieces(chat_body("x", padding=2 * LIMIT)))
            bomb = await client.post(CHAT, content=pieces(BOMB), headers={"content-encoding": "gzip"})
            small = chat_body("small")
            fine = await client.post(CHAT, content=pieces(small), headers={"content-type": "application/json"})
            await idle(app)
    for refused in (big, bomb):
        assert refused.http_version == "HTTP/2" and refused.status_code == 413
        assert refused.json()["error"]["code"] == "request_too_large"
    assert fine.status_code == 200 and fine.json()["size"] == len(small)
    assert len(upstream.requests) == 1


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_client_that_resumes_its_body_after_its_408_spares_the_other_streams(
    worker: str, transport: str
) -> None:
    # Half a body, silence past BODY_IDLE_TIMEOUT (408), then the rest once the answer is in: the data
    # arrives for a stream the gateway has answered. Its end waits (BODY_IDLE_TIMEOUT at most) for it.
    go = threading.Event()
    with gateway(held_or_streamed(go), worker, transport, body_idle_timeout=0.5) as (upstream, app, port):
        async with h2_client(port) as client:
            late: list[Stream] = []

            async def pause_then_resume() -> None:
                body = chat_body("late", padding=MiB)
                stream_id = await client.open(CHAT, [(b"content-type", b"application/json")])
                await client.send(stream_id, body[: len(body) // 2], end=False)
                stream = client.streams[stream_id]
                await until(lambda: stream.data, "the 408's body")
                await client.send(stream_id, body[len(body) // 2 :])
                with anyio.fail_after(WAIT):
                    await stream.ended.wait()
                late.append(stream)

            neighbour = await neighbour_then(client, go, pause_then_resume)
            assert complete(neighbour, "neighbour")
            [answer] = late
            assert (answer.status, answer.reset, answer.json()["error"]["code"]) == (408, None, "request_timeout")
            await idle(app)
    assert [marker_of(r) for r in upstream.requests] == ["neighbour"]


# -- what HTTP/2 lets a client put in a request ------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_request_trailers_te_and_authority_are_not_forwarded(worker: str, transport: str) -> None:
    # HTTP/2 carries request trailers (a HEADERS frame after the body), allows ``te: trailers``, and names
    # the host in ``:authority`` (h2 refuses a ``host`` that differs from it, on both sides). The upstream
    # gets its own Host, no TE, and none of the trailer fields (hypercorn drops them).
    with gateway(echo_digest, worker, transport) as (upstream, app, port):
        async with h2_client(port) as client:
            head = [(b"content-type", b"application/json"), (b"te", b"trailers")]
            stream_id = await client.open(CHAT, head)
            body = chat_body("trailers")
            await client.send(stream_id, body, end=False)
            trailers = [(b"x-session-id", b"from-trailer"), (b"authorization", b"Bearer trailer-key")]
            client.conn.send_headers(stream_id, trailers, end_stream=True)
            await client.flush()
            stream = client.streams[stream_id]
            with anyio.fail_after(WAIT):
                await stream.ended.wait()
            await idle(app)
    assert stream.status == 200 and stream.json()["size"] == len(body)
    [request] = upstream.requests
    assert request.headers["host"] == upstream.url.removeprefix("http://")
    lines = request.raw_head.lower().split(b"\r\n")
    assert not [line for line in lines if line.startswith((b"te:", b"x-session-id:", b"authorization:"))]
    assert b"gw.test" not in request.raw_head


PSEUDO_PATHS = {
    # :path as sent (h2 checks only that it is there): the answer, and whether anything is forwarded.
    b"/v1/%2e%2e/admin": 400,  # dot segments, encoded: invalid_path
    b"/v1/chat/completions/../../admin": 400,
    b"http://evil.test/v1/chat/completions": 404,  # absolute form: not under PATHS
    b"//evil.test/v1/chat/completions": 404,
    b"*": 404,
}


@pytest.mark.anyio
@pytest.mark.parametrize("path", PSEUDO_PATHS, ids=repr)
async def test_a_path_pseudo_header_outside_the_prefixes_is_never_forwarded(path: bytes) -> None:
    # (A :path with a byte over 0x7F fails hypercorn itself, before the app: its scope decodes it as ASCII.)
    with gateway(echo_digest, "asyncio") as (upstream, app, port):
        async with h2_client(port) as client:
            client.conn.config.validate_outbound_headers = False
            client.conn.config.normalize_outbound_headers = False
            stream_id = await client.open(path, [(b"content-type", b"application/json")])
            await client.send(stream_id, chat_body("path", stream=False))
            stream = client.streams[stream_id]
            with anyio.fail_after(WAIT):
                await stream.ended.wait()
            await idle(app)
    assert stream.status == PSEUDO_PATHS[path]
    assert stream.json()["error"]["code"] == ("invalid_path" if stream.status == 400 else "not_found")
    assert upstream.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize(("worker", "transport"), SERVED)
async def test_a_stream_reset_while_queued_for_admission_leaves_the_queue(worker: str, transport: str) -> None:
    go = threading.Event()
    changes = {"max_inflight": 1, "admission_timeout": WAIT, "admission_target_delay": 0}
    with gateway(held_or_streamed(go), worker, transport, **changes) as (upstream, app, port):
        async with h2_client(port) as client:

            async def reset_while_queued() -> None:
                stream_id = await client.open(CHAT, [(b"content-type", b"application/json")])
                await client.send(stream_id, chat_body("queued"))
                await until(lambda: app.state.lifetime.stats().queued_requests == 1, "the request queued")
                await client.reset(stream_id)
                await until(lambda: app.state.lifetime.stats().aborted == 1, "the queued request seen aborted")

            neighbour = await neighbour_then(client, go, reset_while_queued)  # holds the one slot meanwhile
            assert complete(neighbour, "neighbour")
            await idle(app)
    stats = app.state.lifetime.stats()
    assert (stats.queued_requests, stats.rejected) == (0, 0)
    assert [marker_of(r) for r in upstream.requests] == ["neighbour"]
