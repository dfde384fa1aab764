"""The release proof: while a large request's answer streams, none of its input is reachable any more
except (optionally, with RETAIN_OUTBOUND) the accepted outbound body.

The gateway is driven as a raw ASGI app: the test is the server (its ``receive`` hands over a
32 MiB conversation in 1 MiB chunks, its ``send`` records the response) and the upstream is an
httpx transport that streams one SSE event and then waits for the test. At that moment, with the
gateway suspended mid-stream, the test checks:

- the parsed graph: the preparer swaps the conversation for weak-referenceable containers that
  serialize identically, and every weak reference is dead after ``gc.collect()``;
- the parsed graph is already gone during the attempt: a changed body's conversation is dropped
  item by item as it is serialized, and the refold and role-remap closures re-parse the outbound
  body when they need it instead of holding the parse;
- those closures (found on the ``Prepared`` holder during the attempt, before retries settle)
  hold no parse, and are dead;
- the raw bytes: ``tracemalloc`` sees about the outbound body (RETAIN_OUTBOUND=memory) or nearly
  nothing (off, or disk once the body is in its temporary file), where any suspended frame
  holding the raw body would add another 32 MiB;
- ``retained_input_bytes`` is exactly the outbound body's size (memory), or 0; ``retained_disk_bytes``
  is the outbound body's size with disk.

After the response ends, everything is back to idle.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import tracemalloc
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from blake3 import blake3
from starlette.applications import Starlette
from starlette.types import Scope

from asgi_lifetime import LifetimeSettings, LifetimeStats, MiB
from asgi_lifetime._settings import RetainOutbound
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._prepare import Draft, Prepared
from asgi_lifetime.gateway._refold import Conversation
from asgi_lifetime.gateway._transport import UpstreamTransport

from .._asgi import Connection, json_scope
from ..reliability.test_faults import eventually
from ._raw_upstream import chunked

pytestmark = pytest.mark.anyio

BODY_SIZE = 32 * MiB
TURNS = 2048
FIRST_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n'
LAST_EVENTS = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


class TrackedDict(dict[str, Any]):
    """A dict that can be weakly referenced (a plain dict cannot); serializes like a dict."""


class TrackedList(list[Any]):
    """A list that can be weakly referenced; serializes like a list."""


def make_body() -> bytes:
    """A text conversation of about BODY_SIZE bytes: a system prompt and TURNS user/assistant turns."""
    per_message = BODY_SIZE // (2 * TURNS) - 40
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful assistant."}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"question {turn}: " + "q" * per_message})
        messages.append({"role": "assistant", "content": f"answer {turn}: " + "a" * per_message})
    messages.append({"role": "user", "content": "and now?"})
    return json.dumps({"model": "big-model", "stream": True, "messages": messages}).encode()


@dataclass
class Probe:
    """Weak references to every piece of request input the gateway may hold."""

    graph: list[weakref.ref[Any]] = field(default_factory=list)
    closures: list[weakref.ref[Any]] = field(default_factory=list)
    tracked: weakref.ref[Any] | None = None
    graph_at_attempt: int = -1

    def track(self, change: bool) -> Callable[[Draft], None]:
        """A preparer that puts the parsed conversation in weak-referenceable containers.

        Without ``change`` it mutates in place and does not mark the body changed: the
        containers serialize to the same JSON, so the outbound body is the raw body itself.
        """

        def preparer(draft: Draft) -> None:
            body = draft.body
            tracked = TrackedList(TrackedDict(message) for message in body["messages"])
            self.tracked = weakref.ref(tracked)
            self.graph.append(weakref.ref(tracked))
            self.graph.extend(weakref.ref(message) for message in tracked)
            if change:
                document = TrackedDict({**body, "model": "routed-model", "messages": tracked})
                self.graph.append(weakref.ref(document))
                draft.body = document
            else:
                body["messages"] = tracked

        return preparer

    def find_closures(self) -> None:
        """During the attempt: weak references to the refold and role-remap closures of the request's
        ``Prepared`` holder, and how much of the parsed graph is still alive at that moment."""
        assert self.tracked is not None
        gc.collect()
        self.graph_at_attempt = sum(ref() is not None for ref in self.graph)
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which loads the modules behind
            # lazy proxies (the openai SDK's, once imported): megabytes traced in the middle of this test.
            if type(obj) is Prepared and not obj.settled:
                for closure in (obj.refold, obj.remap_role):
                    assert isinstance(closure, types.FunctionType) and closure.__closure__
                    for cell in closure.__closure__:  # none of them holds (a piece of) a parse
                        assert not isinstance(cell.cell_contents, Conversation | dict | list)
                    self.closures.append(weakref.ref(closure))

    def alive(self) -> tuple[int, int]:
        return sum(ref() is not None for ref in self.graph), sum(ref() is not None for ref in self.closures)


class Stream(httpx.AsyncByteStream):
    """The upstream's answer: one SSE event, then a wait for the test, then the end."""

    def __init__(self, gate: anyio.Event) -> None:
        self.gate = gate
        self.step = 0
        self.closed = False

    def __aiter__(self) -> Stream:  # a plain iterator: nothing to finalize if the relay stops early
        return self

    async def __anext__(self) -> bytes:
        self.step += 1
        if self.step == 1:
            return FIRST_EVENT
        if self.step == 2:
            await self.gate.wait()
            return LAST_EVENTS
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


class Upstream(httpx.AsyncBaseTransport):
    """Reads the request body the way a network transport does (iterating it, keeping nothing)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.gate = anyio.Event()
        self.requests = 0
        self.received = 0
        self.hasher = blake3()
        self.streams: list[Stream] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        self.probe.find_closures()  # during the attempt: the closures exist until retries settle
        assert isinstance(request.stream, httpx.AsyncByteStream)
        async for chunk in request.stream:
            self.received += len(chunk)
            self.hasher.update(chunk)
        del chunk
        stream = Stream(self.gate)
        self.streams.append(stream)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


def scope_for(body: bytes) -> Scope:
    return json_scope(
        body, "/v1/chat/completions", (b"host", b"gateway.test"), (b"x-session-id", b"big-session"), state={}
    )


@dataclass
class Seen:
    """What a run saw mid-stream (upstream waiting, the gateway suspended in the relay), and after it."""

    memory: int
    """Bytes ``tracemalloc`` traced mid-stream."""
    stats: LifetimeStats
    alive: tuple[int, int]
    """``probe.alive()`` mid-stream."""
    final_memory: int = -1
    """Bytes traced after the response."""


async def stream_and_probe(
    app: Starlette, body: bytes, probe: Probe, retain: RetainOutbound, release: Callable[[], object], seconds: float
) -> tuple[Connection, Seen]:
    """Send ``body`` through ``app`` and look at the process while the answer streams (``retain=disk``:
    once the body is on disk), then ``release`` the upstream's rest and let the response end."""
    lifetime = app.state.lifetime
    client = Connection(body, marker=FIRST_EVENT)
    gc.collect()
    tracemalloc.start()
    try:
        with anyio.fail_after(seconds):
            async with anyio.create_task_group() as tg:
                tg.start_soon(app, scope_for(body), client.receive, client.send)
                await client.marked.wait()
                if retain == "disk":  # the body moves to disk while the answer streams: wait for it
                    await eventually(lambda: lifetime.stats().spilled == 1, seconds=20)

                # --- mid-stream: the upstream is waiting, the gateway is suspended in the relay.
                gc.collect()
                seen = Seen(tracemalloc.get_traced_memory()[0], lifetime.stats(), probe.alive())
                assert not client.ended.is_set()
                release()
            client.hang_up.set()

        # --- after the response.
        gc.collect()
        seen.final_memory = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        await app.state.upstream.aclose()
    return client, seen


def assert_released(app: Starlette, body: bytes, retain: RetainOutbound, client: Connection, seen: Seen) -> None:
    """The raw body: mid-stream only the retained outbound body is still reachable (with
    RETAIN_OUTBOUND=disk it is in a temporary file, not in the process); after the response, idle."""
    ratio = seen.memory / len(body)
    if retain == "memory":
        assert 0.8 < ratio < 1.6, f"traced {seen.memory} bytes mid-stream ({ratio:.2f}x the body)"
    else:
        assert ratio < 0.3, f"traced {seen.memory} bytes mid-stream ({ratio:.2f}x the body)"
    assert client.ended.is_set() and bytes(client.received) == FIRST_EVENT + LAST_EVENTS
    assert app.state.lifetime.stats().idle, app.state.lifetime.stats()
    assert seen.final_memory / len(body) < 0.3, f"traced {seen.final_memory} bytes after the response"


@pytest.fixture(scope="module")
def body() -> bytes:
    return make_body()


@pytest.mark.parametrize(
    ("retain", "change"),
    [
        pytest.param("off", False, id="retain-off"),
        pytest.param("memory", False, id="retain-memory"),
        pytest.param("memory", True, id="retain-memory-changed-body"),
        pytest.param("off", True, id="retain-off-changed-body"),
        pytest.param("disk", False, id="retain-disk"),
        pytest.param("disk", True, id="retain-disk-changed-body"),
    ],
)
async def test_input_is_released_before_the_answer_streams(body: bytes, retain: RetainOutbound, change: bool) -> None:
    assert 30 * MiB < len(body) < 34 * MiB
    probe = Probe()
    upstream = Upstream(probe)
    settings = LifetimeSettings(
        upstream_url=("http://upstream.test",),
        retain_outbound=retain,
        stall_timeout=30.0,
        keepalive_interval=30.0,
    )
    app = create_app(settings, preparers=[probe.track(change)], transport=upstream)

    def release() -> None:
        assert upstream.streams[0].step == 2  # the upstream is waiting for the test
        upstream.gate.set()

    client, seen = await stream_and_probe(app, body, probe, retain, release, seconds=30)

    outbound = upstream.received
    assert upstream.requests == 1
    if change:
        assert outbound != len(body)
    else:
        assert outbound == len(body) and upstream.hasher.hexdigest() == blake3(body).hexdigest()

    # (a) the parsed graph was gone already while the request was sent (no closure holds it), and the
    # refold / role-remap closures are gone now (and they did exist).
    assert len(probe.graph) > 2 * TURNS and len(probe.closures) == 2
    assert probe.graph_at_attempt == 0
    assert seen.alive == (0, 0)
    # (b) the raw body: only the retained outbound body is still reachable, and accounted for;
    # (c) after the response: idle, and nothing of the request left.
    assert_released(app, body, retain, client, seen)
    stats = seen.stats
    assert stats.retained_input_bytes == (outbound if retain == "memory" else 0)
    assert stats.retained_disk_bytes == (outbound if retain == "disk" else 0)
    assert stats.inflight_requests == 1 and stats.pinned_sessions == 1
    assert client.status == 200
    assert upstream.streams[0].closed
    assert probe.alive() == (0, 0)


class SocketUpstream:
    """The same answer from a loopback socket, so that the gateway's own network transport
    (aiohttp or httpcore) sends the body: hashed as it arrives, nothing of it kept."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.gate = threading.Event()
        self.requests = 0
        self.received = 0
        self.hasher = blake3()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(30)
        sock, _ = self.listener.accept()
        with sock:
            sock.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            head, _, rest = head.partition(b"\r\n\r\n")
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
            length = int({k.strip().lower(): v for k, v in fields.items()}[b"content-length"])
            self.requests += 1
            self.received, piece = len(rest), rest
            self.hasher.update(piece)
            while self.received < length:
                piece = sock.recv(min(65536, length - self.received))
                self.received += len(piece)
                self.hasher.update(piece)
            del piece
            sock.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + chunked(FIRST_EVENT, size=len(FIRST_EVENT)).removesuffix(b"0\r\n\r\n")
            )
            self.gate.wait(30)
            sock.sendall(chunked(LAST_EVENTS, size=len(LAST_EVENTS)))
            sock.recv(1)  # until the gateway closes its pooled connection (aclose)

    def close(self) -> None:
        self.gate.set()
        self.thread.join(30)
        self.listener.close()


class Probing(httpx.AsyncBaseTransport):
    """The gateway's network transport, with the probe looking for the closures during the attempt."""

    def __init__(self, probe: Probe, inner: UpstreamTransport) -> None:
        self.probe = probe
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.probe.find_closures()
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("transport", ["auto", "httpcore"])
@pytest.mark.parametrize("retain", ["off", "memory", "disk"])
async def test_input_is_released_over_each_network_transport(
    body: bytes, retain: RetainOutbound, transport: str, anyio_backend: str
) -> None:
    """The release proof again, the body sent over a socket by UPSTREAM_TRANSPORT's transport
    (auto: aiohttp on asyncio, httpcore on trio): neither keeps the body once it is sent."""
    probe = Probe()
    upstream = SocketUpstream()
    settings = LifetimeSettings(
        upstream_url=(upstream.url,), retain_outbound=retain, stall_timeout=30.0, keepalive_interval=30.0
    )
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    network = UpstreamTransport(choice=transport, limits=limits)
    app = create_app(settings, preparers=[probe.track(False)], transport=Probing(probe, network))
    try:
        client, seen = await stream_and_probe(app, body, probe, retain, upstream.gate.set, seconds=60)
    finally:
        upstream.close()
    expected = "httpcore" if transport == "httpcore" or anyio_backend == "trio" else "aiohttp"
    assert network.name == expected
    assert upstream.requests == 1 and upstream.received == len(body)
    assert upstream.hasher.hexdigest() == blake3(body).hexdigest()
    assert len(probe.closures) == 2 and probe.alive() == (0, 0)
    assert_released(app, body, retain, client, seen)
    assert seen.stats.retained_input_bytes == (len(body) if retain == "memory" else 0)
