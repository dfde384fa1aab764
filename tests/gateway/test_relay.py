from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Message

from asgi_lifetime._asgi import normalize_headers
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway._relay import HOP_BY_HOP, ClientWatch, RelayResult, filter_headers, relay
from asgi_lifetime.gateway._shutdown import StopSignal
from asgi_lifetime.gateway._sse import KEEPALIVE, SSEEvent, SSEParser

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8"}


class Upstream(httpx.AsyncByteStream):
    """Yields byte chunks; a number sleeps that long, an exception is raised. Records pulls and closes.

    An iterator object rather than an async generator: an abandoned generator is reported by
    trio's finalizer, and the only generator these tests should see is the one relay owns.
    """

    def __init__(self, *items: bytes | float | Exception, on_pull: Callable[[int], None] | None = None) -> None:
        self.items = list(items)
        self.on_pull = on_pull
        self.pulled = 0
        self.closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        while self.items:
            item = self.items.pop(0)
            if isinstance(item, (int, float)):
                await anyio.sleep(item)
            elif isinstance(item, Exception):
                raise item
            else:
                self.pulled += 1
                if self.on_pull is not None:
                    self.on_pull(self.pulled)
                return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


def upstream_response(
    stream: Upstream, *, status: int = 200, headers: dict[str, str] | list[tuple[str, str]] | None = None
) -> httpx.Response:
    request = httpx.Request("POST", "http://upstream.test/v1/chat/completions")
    return httpx.Response(status, headers=headers, stream=stream, request=request)


class Client:
    """A recording ASGI ``send`` and a ``receive`` that blocks until ``disconnect()``."""

    def __init__(self, *, send_delay: float = 0.0, leftovers: int = 0) -> None:
        self.messages: list[Message] = []
        self.send_delay = send_delay
        self.sending = False
        self.leftovers = leftovers
        self.body_seen = anyio.Event()
        self._disconnected = anyio.Event()

    async def send(self, message: Message) -> None:
        assert not self.sending, "send() called concurrently"
        self.sending = True
        try:
            if self.send_delay and message["type"] == "http.response.body":
                await anyio.sleep(self.send_delay)
            self.messages.append(message)
            if message["type"] == "http.response.body" and message["body"]:
                self.body_seen.set()
        finally:
            self.sending = False

    async def receive(self) -> Message:
        if self.leftovers:
            self.leftovers -= 1
            return {"type": "http.request", "body": b"", "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    def disconnect(self) -> None:
        self._disconnected.set()

    @property
    def start(self) -> Message:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        assert len(starts) == 1
        assert self.messages[0] is starts[0]
        return starts[0]

    @property
    def status(self) -> int:
        return int(self.start["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.start["headers"]}

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]

    @property
    def body(self) -> bytes:
        return b"".join(self.bodies)

    @property
    def ended(self) -> bool:
        last = self.messages[-1]
        return last["type"] == "http.response.body" and not last.get("more_body", False)

    @property
    def events(self) -> list[SSEEvent]:
        return SSEParser().feed(self.body)

    def error_event(self) -> dict[str, Any]:
        last = self.events[-1]
        assert last.event == "error"
        return dict(json.loads(last.data)["error"])


async def run(response: httpx.Response, client: Client, **options: Any) -> RelayResult:
    options.setdefault("stall_timeout", 2.0)
    options.setdefault("keepalive_interval", 1.0)
    with anyio.fail_after(5):
        return await relay(response, send=client.send, receive=client.receive, **options)


def sse(*payloads: dict[str, Any] | str, event: str | None = None) -> bytes:
    out = b""
    for payload in payloads:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        out += (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()
    return out


def delta(**fields: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def finish(reason: str = "stop") -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


ROLE = sse(delta(role="assistant"))
HELLO = sse(delta(content="Hel"), delta(content="lo"))
STOP = sse(finish("stop"))
DONE = sse("[DONE]")


# -- headers -------------------------------------------------------------------------------------


def test_hop_by_hop_set() -> None:
    assert {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"} <= HOP_BY_HOP
    assert {"proxy-authenticate", "proxy-authorization"} <= HOP_BY_HOP


def test_filter_headers_asgi_direction() -> None:
    headers = [
        (b"Host", b"gateway"),
        (b"Connection", b"keep-alive, X-Secret-Hop"),
        (b"x-secret-hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"TE", b"trailers"),
        (b"Proxy-Authorization", b"Basic xyz"),
        (b"Authorization", b"Bearer k"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Upgrade", b"h2c"),
        (b"X-Kept", b"a"),
        (b"X-Kept", b"b"),
    ]
    # As the gateway reads a scope: names lower-cased once where it first reads them, not in here again.
    scope = {"headers": headers}
    normalize_headers(scope)
    assert filter_headers(scope["headers"]) == [
        (b"host", b"gateway"),
        (b"authorization", b"Bearer k"),
        (b"x-kept", b"a"),
        (b"x-kept", b"b"),
    ]


def test_filter_headers_httpx_direction() -> None:
    headers = httpx.Headers(
        [("Content-Type", "application/json"), ("Connection", "close"), ("Trailer", "x"), ("Set-Cookie", "a=1")]
    )
    assert filter_headers(headers) == [(b"content-type", b"application/json"), (b"set-cookie", b"a=1")]


@pytest.mark.anyio
async def test_passes_status_and_headers_minus_hop_by_hop() -> None:
    body = b'{"id":"x","choices":[]}'
    stream = Upstream(body[:10], body[10:])
    response = upstream_response(
        stream,
        status=201,
        headers=[
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("x-request-id", "abc"),
        ],
    )
    client = Client()
    result = await run(response, client)
    assert client.status == 201
    assert client.headers == {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "x-request-id": "abc",
    }
    assert client.body == body and client.ended
    assert result == RelayResult(201, len(body), result.first_byte_at, "complete", False)
    assert result.first_byte_at is not None
    assert stream.closed


@pytest.mark.anyio
async def test_sse_drops_content_length() -> None:
    body = ROLE + HELLO + STOP + DONE
    response = upstream_response(Upstream(body), headers={**SSE_HEADERS, "content-length": str(len(body))})
    client = Client()
    result = await run(response, client)
    assert "content-length" not in client.headers
    assert client.headers["content-type"] == SSE_HEADERS["content-type"]
    assert client.body == body and result.outcome == "complete"


@pytest.mark.anyio
async def test_gzip_is_passed_through_raw() -> None:
    compressed = gzip.compress(json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode() * 50)
    third = len(compressed) // 3
    stream = Upstream(compressed[:third], compressed[third : 2 * third], compressed[2 * third :])
    headers = {
        "content-type": "application/json",
        "content-encoding": "gzip",
        "content-length": str(len(compressed)),
    }
    client = Client()
    result = await run(upstream_response(stream, headers=headers), client)
    assert client.body == compressed
    assert client.headers["content-encoding"] == "gzip"
    assert client.headers["content-length"] == str(len(compressed))
    assert result.outcome == "complete" and result.bytes_out == len(compressed)


@pytest.mark.anyio
async def test_gzip_sse_is_a_plain_stream() -> None:
    # Compressed SSE can be neither parsed nor have bytes injected: no keep-alives in the silence,
    # no starvation verdict on a stream with no terminal event.
    compressed = gzip.compress(ROLE + HELLO)
    stream = Upstream(compressed[:5], 0.3, compressed[5:])
    counters = Counters()
    client = Client()
    response = upstream_response(stream, headers={**SSE_HEADERS, "content-encoding": "gzip", "content-length": "9"})
    result = await run(response, client, keepalive_interval=0.05, counters=counters)
    assert client.body == compressed
    assert "content-length" not in client.headers
    assert result.outcome == "complete" and counters.starved == 0


# -- backpressure, first byte ----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [False, True])
async def test_backpressure_one_chunk_in_flight(sse_stream: bool) -> None:
    client = Client(send_delay=0.02)
    lead: list[int] = []

    def on_pull(pulled: int) -> None:
        delivered = sum(1 for b in client.bodies if b)
        lead.append(pulled - delivered)

    chunks = [sse(delta(content=str(i))) for i in range(10)] + [STOP + DONE]
    stream = Upstream(*chunks, on_pull=on_pull)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    result = await run(upstream_response(stream, headers=headers), client)
    assert result.outcome == "complete"
    assert len(lead) == len(chunks)
    assert max(lead) == 1  # the chunk being sent; the upstream is never read further ahead
    assert client.body == b"".join(chunks)


@pytest.mark.anyio
async def test_on_start_called_once_with_the_status_and_start_is_lazy() -> None:
    calls: list[tuple[int, int]] = []
    client = Client()

    def on_start(status: int) -> None:
        calls.append((status, len(client.messages)))

    stream = Upstream(0.05, ROLE, HELLO, STOP + DONE)
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, on_start=on_start)
    assert calls == [(200, 0)]  # once, before anything, even the response start, was sent
    assert client.messages[0]["type"] == "http.response.start"
    assert result.first_byte_at is not None
    assert result.bytes_out == len(client.body)


# -- client disconnect, cancellation ---------------------------------------------------------


@pytest.mark.anyio
async def test_client_disconnect_closes_upstream_at_once() -> None:
    stream = Upstream(ROLE, 30.0, HELLO)
    client = Client(leftovers=2)
    response = upstream_response(stream, headers=SSE_HEADERS)
    results: list[RelayResult] = []
    done = anyio.Event()

    async def go() -> None:
        results.append(await run(response, client, stall_timeout=60.0, keepalive_interval=30.0))
        done.set()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(go)
            await client.body_seen.wait()
            before = anyio.current_time()
            client.disconnect()
            await done.wait()
            assert anyio.current_time() - before < 0.5
    (result,) = results
    assert result.outcome == "client_disconnected"
    assert stream.closed and response.is_closed
    await anyio.sleep(0.05)
    assert stream.pulled == 1


@pytest.mark.anyio
async def test_disconnect_before_anything_was_sent() -> None:
    stream = Upstream(30.0, ROLE)
    client = Client()
    client.disconnect()
    with anyio.fail_after(2):
        result = await run(upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=60.0)
    assert result.outcome == "client_disconnected" and result.status == 499
    assert client.messages == [] and stream.closed


@pytest.mark.anyio
async def test_send_oserror_is_a_disconnect() -> None:
    stream = Upstream(ROLE, HELLO)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset")
        sent.append(message)

    with anyio.fail_after(2):
        result = await relay(
            upstream_response(stream, headers=SSE_HEADERS),
            send=send,
            receive=Client().receive,
            stall_timeout=1,
            keepalive_interval=1,
        )
    assert result.outcome == "client_disconnected" and stream.closed


@pytest.mark.anyio
async def test_cancellation_from_outside_closes_upstream() -> None:
    stream = Upstream(ROLE, 30.0, HELLO)
    client = Client()
    response = upstream_response(stream, headers=SSE_HEADERS)
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: relay(
                    response, send=client.send, receive=client.receive, stall_timeout=60, keepalive_interval=60
                )
            )
            await client.body_seen.wait()
            tg.cancel_scope.cancel()
    assert stream.closed and response.is_closed
    assert stream.pulled == 1


@pytest.mark.anyio
async def test_exception_from_send_propagates_unwrapped_and_closes_upstream() -> None:
    stream = Upstream(ROLE, HELLO)

    async def send(message: Message) -> None:
        raise RuntimeError("app bug")

    with pytest.raises(RuntimeError, match="app bug"):
        await relay(
            upstream_response(stream, headers=SSE_HEADERS),
            send=send,
            receive=Client().receive,
            stall_timeout=1,
            keepalive_interval=1,
        )
    assert stream.closed


# -- stall guard, keep-alives ----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("headers", [{"content-type": "application/json"}, SSE_HEADERS])
async def test_stall_before_first_byte_is_a_504(headers: dict[str, str]) -> None:
    stream = Upstream(30.0, b"late")
    counters = Counters()
    client = Client()
    result = await run(
        upstream_response(stream, headers=headers), client, stall_timeout=0.1, keepalive_interval=1, counters=counters
    )
    assert client.status == 504
    assert client.headers["content-type"] == "application/json"
    assert json.loads(client.body)["error"]["code"] == "upstream_stalled"
    assert client.headers["content-length"] == str(len(client.body))
    assert client.ended
    assert result.outcome == "stalled" and result.status == 504 and result.first_byte_at is None
    assert counters.stalled == 1 and stream.closed


@pytest.mark.anyio
async def test_stall_after_first_byte_sse_sends_error_event() -> None:
    stream = Upstream(ROLE + sse(delta(content="Hi")), 30.0, DONE)
    counters = Counters()
    client = Client()
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS),
        client,
        stall_timeout=0.2,
        keepalive_interval=1,
        counters=counters,
    )
    assert client.status == 200 and client.ended
    error = client.error_event()
    assert error["code"] == "upstream_stalled" and error["type"] == "upstream_error"
    assert "0.2 seconds" in error["message"]
    assert result.outcome == "stalled"
    assert counters.stalled == 1 and counters.starved == 0
    assert stream.closed


@pytest.mark.anyio
async def test_stall_after_first_byte_plain_stream_is_left_unfinished() -> None:
    stream = Upstream(b"part one", 30.0, b"part two")
    counters = Counters()
    client = Client()
    result = await run(
        upstream_response(stream, headers={"content-type": "text/plain"}), client, stall_timeout=0.1, counters=counters
    )
    # A stalled body is cut short: ending it would make it look complete.
    assert client.status == 200 and client.body == b"part one" and not client.ended
    assert result.outcome == "stalled" and counters.stalled == 1 and stream.closed


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [False, True])
async def test_a_failed_receive_leaves_the_stall_guard_on(sse_stream: bool) -> None:
    """The client's watch also runs the stall guard: when its receive() fails, it stops watching the
    client and sending keep-alives, but a stalled upstream is still caught."""

    class DeafClient(Client):
        async def receive(self) -> Message:
            raise RuntimeError("this server's receive() is broken")

    stream = Upstream(ROLE, 30.0, DONE)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    client = DeafClient()
    result = await run(upstream_response(stream, headers=headers), client, stall_timeout=0.3, keepalive_interval=0.05)
    assert result.outcome == "stalled" and stream.closed
    assert KEEPALIVE not in client.bodies  # no keep-alive once receive() failed
    assert client.body.startswith(ROLE)


@pytest.mark.anyio
async def test_keepalives_do_not_reset_the_stall_timer() -> None:
    stream = Upstream(ROLE, 30.0, DONE)
    client = Client()
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=0.35, keepalive_interval=0.05
    )
    assert result.outcome == "stalled"
    assert client.bodies.count(KEEPALIVE) >= 3
    assert client.error_event()["code"] == "upstream_stalled"


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [False, True])
async def test_a_slow_client_is_not_a_stalled_upstream(sse_stream: bool) -> None:
    """The stall deadline runs only while the relay waits for the upstream, not while a slow
    client takes each chunk (longer than the stall timeout here)."""
    chunks = [ROLE, sse(delta(content="Hi")), STOP + DONE]
    client = Client(send_delay=0.3)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    result = await run(upstream_response(Upstream(*chunks), headers=headers), client, stall_timeout=0.2)
    assert result.outcome == "complete" and client.ended
    assert client.body == b"".join(chunks)


def count_timed_scopes(monkeypatch: pytest.MonkeyPatch, *, shielded_only: bool = False) -> list[float]:
    """The delay of every ``anyio.move_on_after`` scope (or shielded one) opened from now on (the scopes still work)."""
    scopes: list[float] = []
    real = anyio.move_on_after

    def counting(delay: float, shield: bool = False) -> anyio.CancelScope:
        if shield or not shielded_only:
            scopes.append(delay)
        return real(delay, shield=shield)

    monkeypatch.setattr(anyio, "move_on_after", counting)
    return scopes


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [False, True])
async def test_no_timer_scope_per_chunk(sse_stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relaying a long stream sets up its stall guard once, not once per chunk (a cancel scope
    and a timer each cost more than relaying a small chunk), and still catches a stall after it."""
    scopes = count_timed_scopes(monkeypatch)
    chunks = [sse(delta(content=str(i))) for i in range(40)]
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    client = Client()
    result = await run(upstream_response(Upstream(*chunks, 30.0, DONE), headers=headers), client, stall_timeout=0.2)
    assert result.outcome == "stalled" and client.body.startswith(b"".join(chunks))
    assert len(scopes) <= 3, scopes


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [False, True])
async def test_a_response_read_to_its_end_is_not_closed_again(
    sse_stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx closes a response as its last chunk is read: the relay's closes (stop reading, close
    each response) then skip the shielded, time-bounded close they need for an unfinished one."""
    scopes = count_timed_scopes(monkeypatch, shielded_only=True)  # the keep-alive wait has one of its own
    stream = Upstream(ROLE, HELLO, STOP + DONE)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    response = upstream_response(stream, headers=headers)
    result = await run(response, Client())
    assert result.outcome == "complete" and response.is_closed and stream.closed
    assert scopes == []


@pytest.mark.anyio
async def test_keepalives_during_short_silences() -> None:
    upstream_bytes = [ROLE, sse(delta(content="Hi")), STOP + DONE]
    stream = Upstream(0.2, upstream_bytes[0], 0.2, upstream_bytes[1], 0.2, upstream_bytes[2])
    client = Client()
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=1.0, keepalive_interval=0.05
    )
    assert result.outcome == "complete"
    # The first keep-alive is due before the first upstream byte: it sends the response start.
    assert client.messages[0]["type"] == "http.response.start" and client.bodies[0] == KEEPALIVE
    assert client.bodies.count(KEEPALIVE) >= 3
    assert [b for b in client.bodies if b not in (KEEPALIVE, b"")] == upstream_bytes
    assert client.events == SSEParser().feed(b"".join(upstream_bytes))


KEEPALIVE_SPLITS = {
    "inside-a-line": (
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}',
        b',"finish_reason":"stop"}]}\n\n' + DONE,
    ),
    "inside-an-event": (
        b"event: message\ndata: " + json.dumps(delta(content="a")).encode() + b"\n",
        b"\n" + STOP + DONE,
    ),
    "after-the-cr-of-a-crlf": (b"data: " + json.dumps(delta(content="a")).encode() + b"\r", b"\n\r\n" + STOP + DONE),
}


@pytest.mark.anyio
@pytest.mark.parametrize(("first", "rest"), list(KEEPALIVE_SPLITS.values()), ids=list(KEEPALIVE_SPLITS))
async def test_keepalives_only_between_whole_events(first: bytes, rest: bytes) -> None:
    # The unfinished event is held: keep-alives go out meanwhile, and the event goes whole.
    stream = Upstream(first, 0.3, rest)
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, keepalive_interval=0.05)
    assert result.outcome == "complete"
    assert client.bodies.count(KEEPALIVE) >= 3
    assert b"".join(b for b in client.bodies if b != KEEPALIVE) == first + rest
    assert client.events == SSEParser().feed(first + rest)
    received = SSEParser()
    for body in client.bodies:
        received.feed(body)
        assert received.at_boundary  # every message leaves the client between events


# -- starvation guard -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_stream_ending_without_terminal_is_starvation() -> None:
    stream = Upstream(ROLE)
    counters = Counters()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, counters=counters)
    assert client.status == 200 and client.ended
    assert client.body.startswith(ROLE)
    error = client.error_event()
    assert error["code"] == "upstream_starved" and "no output" in error["message"]
    assert result.outcome == "starved" and counters.starved == 1 and stream.closed


@pytest.mark.anyio
async def test_content_without_terminal_is_starvation_but_not_reissued() -> None:
    calls: list[int] = []

    async def reissue() -> httpx.Response | None:
        calls.append(1)
        return None

    counters = Counters()
    client = Client()
    stream = Upstream(ROLE, HELLO)
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, reissue=reissue, counters=counters)
    assert calls == []  # the client has seen content: a second answer cannot be appended
    assert client.body.startswith(ROLE + HELLO)
    error = client.error_event()
    assert error["code"] == "upstream_starved" and "terminal" in error["message"]
    assert result.outcome == "starved" and not result.reissued and counters.starved == 1


@pytest.mark.anyio
async def test_unterminated_last_event_is_closed_before_the_error_event() -> None:
    stream = Upstream(ROLE + b'data: {"choices":[{"delta":{"cont')
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client)
    assert result.outcome == "starved"
    assert client.error_event()["code"] == "upstream_starved"


@pytest.mark.anyio
async def test_done_without_content_is_starvation_and_done_is_withheld() -> None:
    stream = Upstream(ROLE, DONE)
    counters = Counters()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, counters=counters)
    assert result.outcome == "starved" and counters.starved == 1
    assert [e.data for e in client.events][:-1] == [json.dumps(delta(role="assistant"))]
    assert client.error_event()["code"] == "upstream_starved"
    assert b"[DONE]" not in client.body


@pytest.mark.anyio
async def test_abnormal_finish_without_content_is_starvation() -> None:
    stream = Upstream(ROLE, sse(finish("abort")) + DONE)
    counters = Counters()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, counters=counters)
    assert result.outcome == "starved" and counters.starved == 1
    assert b"abort" not in client.body and b"[DONE]" not in client.body


@pytest.mark.anyio
async def test_starvation_with_nothing_sent_is_a_502() -> None:
    stream = Upstream()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client)
    assert client.status == 502
    assert json.loads(client.body)["error"]["code"] == "upstream_starved"
    assert result.outcome == "starved" and result.status == 502


@pytest.mark.anyio
async def test_stream_ending_inside_an_event_larger_than_the_hold_is_cut_not_completed() -> None:
    # Before: the gateway judged the stream malformed, then ended the half line with "\n\n" and an
    # error event, so the client parsed the truncated data as an event.
    huge = b"data: " + b"x" * (1024 * 1024 + 10)
    stream = Upstream(ROLE, huge[: 512 * 1024], huge[512 * 1024 :])
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client)
    assert result.outcome == "upstream_error"
    assert client.body == ROLE + huge  # streamed through as it came, and nothing after it
    assert not client.ended  # left unfinished: the server closes the connection
    assert stream.closed


NATURAL_STOPS = {
    "openai-finish-stop": ROLE + STOP + DONE,
    "openai-content-filter": ROLE + sse(finish("content_filter")),
    "anthropic-end-turn": (
        sse(
            {"type": "message_start", "message": {"type": "message", "content": [], "stop_reason": None}},
            event="message_start",
        )
        + sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, event="message_delta")
        + sse({"type": "message_stop"}, event="message_stop")
    ),
    "responses-completed": sse(
        {"type": "response.completed", "response": {"status": "completed"}}, event="response.completed"
    ),
    "gemini-stop": sse({"candidates": [{"content": {"parts": []}, "finishReason": "STOP"}]}),
}


@pytest.mark.anyio
@pytest.mark.parametrize("body", list(NATURAL_STOPS.values()), ids=list(NATURAL_STOPS))
async def test_natural_stop_without_content_is_not_starvation(body: bytes) -> None:
    calls: list[int] = []

    async def reissue() -> httpx.Response | None:
        calls.append(1)
        return None

    stream = Upstream(*(body[i : i + 20] for i in range(0, len(body), 20)))
    counters = Counters()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, reissue=reissue, counters=counters)
    assert result.outcome == "complete" and counters.starved == 0 and calls == []
    assert client.body == body and client.ended


@pytest.mark.anyio
async def test_natural_stop_with_content_is_complete() -> None:
    body = ROLE + HELLO + STOP + DONE
    counters = Counters()
    client = Client()
    result = await run(upstream_response(Upstream(body), headers=SSE_HEADERS), client, counters=counters)
    assert result.outcome == "complete" and counters.starved == 0 and client.body == body


@pytest.mark.anyio
async def test_upstream_error_event_is_relayed_not_starvation() -> None:
    error = sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, event="error")
    stream = Upstream(ROLE, error)
    counters = Counters()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, counters=counters)
    assert result.outcome == "upstream_error" and counters.starved == 0
    assert client.body == ROLE + error


@pytest.mark.anyio
async def test_error_status_sse_is_not_judged() -> None:
    body = sse({"error": {"message": "rate limited"}})[:-1]  # not even a complete event
    counters = Counters()
    client = Client()
    result = await run(upstream_response(Upstream(body), status=429, headers=SSE_HEADERS), client, counters=counters)
    assert client.status == 429 and client.body == body
    assert result.outcome == "complete" and counters.starved == 0


# -- re-issue -------------------------------------------------------------------------------------


class Reissuer:
    def __init__(self, *responses: httpx.Response | None | Exception) -> None:
        self.responses = list(responses)
        self.calls = 0

    async def __call__(self) -> httpx.Response | None:
        self.calls += 1
        item = self.responses.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


PING = b": ping\n\n"


@pytest.mark.anyio
async def test_reissue_when_no_upstream_event_was_sent() -> None:
    # Comments and an unfinished first event: the client has no event, so a second answer is its only one.
    first = Upstream(PING, ROLE[:20])
    second = Upstream(ROLE, HELLO, STOP + DONE)
    reissue = Reissuer(upstream_response(second, headers=SSE_HEADERS))
    counters = Counters()
    client = Client()
    result = await run(upstream_response(first, headers=SSE_HEADERS), client, reissue=reissue, counters=counters)
    assert reissue.calls == 1
    assert result.outcome == "complete" and result.reissued
    assert client.body == PING + ROLE + HELLO + STOP + DONE  # no fragment of the first attempt
    assert counters.starved == 1
    assert first.closed and second.closed


@pytest.mark.anyio
async def test_no_reissue_once_an_upstream_event_was_sent() -> None:
    # Before: a starved stream was re-issued whenever it had no content, so the client got
    # the first stream's events and then a whole second answer.
    first = Upstream(ROLE)
    reissue = Reissuer(upstream_response(Upstream(ROLE, HELLO, STOP + DONE), headers=SSE_HEADERS))
    counters = Counters()
    client = Client()
    result = await run(upstream_response(first, headers=SSE_HEADERS), client, reissue=reissue, counters=counters)
    assert reissue.calls == 0 and not result.reissued
    assert result.outcome == "starved" and counters.starved == 1
    assert client.body.startswith(ROLE) and client.error_event()["code"] == "upstream_starved"


@pytest.mark.anyio
@pytest.mark.parametrize("chunks", [(ROLE + DONE,), (DONE,)], ids=["role-and-done-together", "done-alone"])
async def test_reissue_replaces_a_withheld_done(chunks: tuple[bytes, ...]) -> None:
    first = Upstream(*chunks)
    second = Upstream(HELLO + STOP + DONE)
    reissue = Reissuer(upstream_response(second, headers=SSE_HEADERS))
    client = Client()
    result = await run(upstream_response(first, headers=SSE_HEADERS), client, reissue=reissue)
    assert result.outcome == "complete" and result.reissued
    assert client.body == HELLO + STOP + DONE


@pytest.mark.anyio
async def test_reissue_after_a_cut_first_event_sends_no_fragment() -> None:
    first = Upstream(b'data: {"choices":[{"delta":{"role":"assis')
    second = Upstream(HELLO + STOP + DONE)
    client = Client()
    result = await run(
        upstream_response(first, headers=SSE_HEADERS),
        client,
        reissue=Reissuer(upstream_response(second, headers=SSE_HEADERS)),
    )
    assert result.outcome == "complete"
    assert client.body == HELLO + STOP + DONE


@pytest.mark.anyio
async def test_reissue_uses_new_status_and_headers_when_nothing_was_sent() -> None:
    first = Upstream()
    second = Upstream(b'{"error":{"message":"slow down"}}')
    reissue = Reissuer(
        upstream_response(second, status=429, headers={"content-type": "application/json", "retry-after": "3"})
    )
    client = Client()
    response = upstream_response(first, headers={**SSE_HEADERS, "x-attempt": "1"})
    result = await run(response, client, reissue=reissue)
    assert client.status == 429 and client.headers["retry-after"] == "3" and "x-attempt" not in client.headers
    assert client.body == b'{"error":{"message":"slow down"}}'
    assert result.reissued and result.status == 429 and result.outcome == "complete"


@pytest.mark.anyio
async def test_reissue_only_once_even_if_the_second_starves() -> None:
    first, second = Upstream(), Upstream(ROLE, DONE)
    reissue = Reissuer(
        upstream_response(second, headers=SSE_HEADERS), upstream_response(Upstream(HELLO), headers=SSE_HEADERS)
    )
    counters = Counters()
    client = Client()
    result = await run(upstream_response(first, headers=SSE_HEADERS), client, reissue=reissue, counters=counters)
    assert reissue.calls == 1
    assert result.outcome == "starved" and result.reissued
    assert client.error_event()["code"] == "upstream_starved"
    assert counters.starved == 2  # each starved upstream response counts
    assert first.closed and second.closed


@pytest.mark.anyio
@pytest.mark.parametrize("outcome", ["none", "connect-error", "not-sse"])
async def test_reissue_that_yields_nothing_usable_ends_with_error_event(outcome: str) -> None:
    third = Upstream(b'{"error":{}}')
    item: httpx.Response | None | Exception = {
        "none": None,
        "connect-error": httpx.ConnectError("refused"),
        "not-sse": upstream_response(third, status=500, headers={"content-type": "application/json"}),
    }[outcome]
    reissue = Reissuer(item)
    client = Client()
    first = Upstream(PING)  # sends the response start, and no event
    result = await run(upstream_response(first, headers=SSE_HEADERS), client, reissue=reissue)
    assert reissue.calls == 1 and result.outcome == "starved" and result.reissued
    assert client.status == 200 and client.error_event()["code"] == "upstream_starved"
    assert first.closed
    if outcome == "not-sse":
        assert third.closed and third.pulled == 0


@pytest.mark.anyio
async def test_keepalives_continue_while_reissuing() -> None:
    async def slow_reissue() -> httpx.Response | None:
        await anyio.sleep(0.3)
        return upstream_response(Upstream(HELLO + STOP + DONE), headers=SSE_HEADERS)

    client = Client()
    result = await run(
        upstream_response(Upstream(PING), headers=SSE_HEADERS), client, reissue=slow_reissue, keepalive_interval=0.05
    )
    assert result.outcome == "complete"
    assert client.bodies.count(KEEPALIVE) >= 3


# -- upstream read errors -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("error", [httpx.ReadError("reset"), httpx.RemoteProtocolError("peer closed")])
async def test_read_error_before_first_byte_is_a_502(error: Exception) -> None:
    stream = Upstream(error)
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client)
    assert client.status == 502
    assert json.loads(client.body)["error"]["type"] == "upstream_error"
    assert result.outcome == "upstream_error" and stream.closed


@pytest.mark.anyio
async def test_read_error_after_first_byte_sse_sends_error_event() -> None:
    stream = Upstream(ROLE, HELLO, httpx.ReadError("reset"))
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client)
    assert client.status == 200 and client.body.startswith(ROLE + HELLO)
    assert client.error_event()["type"] == "upstream_error"
    assert result.outcome == "upstream_error" and stream.closed


@pytest.mark.anyio
async def test_read_error_after_first_byte_plain_stream_is_left_unfinished() -> None:
    # Ending it would make a cut-off body look complete (a chunked one gets its last chunk).
    stream = Upstream(b"abc", httpx.RemoteProtocolError("peer closed"))
    client = Client()
    result = await run(upstream_response(stream, headers={"content-type": "text/plain"}), client)
    assert client.body == b"abc" and not client.ended
    assert result.outcome == "upstream_error" and stream.closed


@pytest.mark.anyio
async def test_through_a_real_async_client() -> None:
    stream = Upstream(ROLE, 0.05, HELLO, STOP + DONE)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=SSE_HEADERS, stream=stream)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        response = await http.send(http.build_request("POST", "http://upstream.test/v1/chat/completions"), stream=True)
        client = Client()
        result = await run(response, client)
    assert result.outcome == "complete" and client.body == ROLE + HELLO + STOP + DONE
    assert stream.closed


@pytest.mark.anyio
async def test_invalid_timeouts() -> None:
    client = Client()
    with pytest.raises(ValueError, match="stall_timeout"):
        await relay(
            upstream_response(Upstream()),
            send=client.send,
            receive=client.receive,
            stall_timeout=0,
            keepalive_interval=1,
        )
    with pytest.raises(ValueError, match="keepalive_interval"):
        await relay(
            upstream_response(Upstream()),
            send=client.send,
            receive=client.receive,
            stall_timeout=1,
            keepalive_interval=0,
        )


# -- graceful shutdown: the stop event -------------------------------------------------------


async def run_stopped_after_first_byte(response: httpx.Response, client: Client) -> RelayResult:
    """``run`` with a stop event that is set once the client has seen the first body bytes."""
    stop = StopSignal()

    async def stop_after_first_byte() -> None:
        await client.body_seen.wait()
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_after_first_byte)
        result = await run(response, client, stall_timeout=10, stop=stop)
    return result


@pytest.mark.anyio
async def test_stop_mid_stream_ends_with_an_inband_shutdown_error() -> None:
    stream = Upstream(ROLE + sse(delta(content="Hi")), 30.0, DONE)
    client = Client()
    result = await run_stopped_after_first_byte(upstream_response(stream, headers=SSE_HEADERS), client)
    assert result.outcome == "shutdown"
    assert client.status == 200 and client.ended
    error = client.error_event()
    assert error["code"] == "shutting_down"
    assert stream.closed


@pytest.mark.anyio
@pytest.mark.parametrize(
    "headers",
    [{"content-type": "application/json"}, {**SSE_HEADERS, "content-encoding": "gzip"}],
    ids=["json", "encoded-event-stream"],
)
async def test_stop_mid_stream_ends_a_stream_without_keepalives(headers: dict[str, str]) -> None:
    """No keep-alive task (not an in-band stream): the stop is watched by a task of its own."""
    stream = Upstream(b'{"choices": [', 30.0, b"]}")
    client = Client()
    result = await run_stopped_after_first_byte(upstream_response(stream, headers=headers), client)
    assert result.outcome == "shutdown"
    assert client.status == 200 and not client.ended  # cut short: it cannot be made to look complete
    assert stream.closed


@pytest.mark.anyio
async def test_stop_before_first_byte_is_a_503_with_retry_after() -> None:
    stream = Upstream(30.0, DONE)
    stop = StopSignal()
    stop.set()
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=10, stop=stop)
    assert result.outcome == "shutdown"
    assert client.status == 503 and client.headers["retry-after"] == "1"
    assert json.loads(client.body)["error"]["code"] == "shutting_down"
    assert stream.closed


@pytest.mark.anyio
async def test_unset_stop_changes_nothing() -> None:
    stream = Upstream(ROLE, sse(delta(content="Hi")), sse(finish()), DONE)
    result = await run(upstream_response(stream, headers=SSE_HEADERS), Client(), stop=StopSignal())
    assert result.outcome == "complete"


# -- one helper task per relay ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("with_stop", [False, True], ids=["no-stop", "stop"])
@pytest.mark.parametrize("headers", [SSE_HEADERS, {"content-type": "application/json"}], ids=["event-stream", "json"])
async def test_a_relay_runs_one_helper_task(headers: dict[str, str], with_stop: bool) -> None:
    """Disconnect watching and keep-alives share one task, and ``stop`` needs none: it cancels the
    scope the relay registered, and the registration ends with the relay."""
    stream = Upstream(ROLE, 30.0, DONE)
    stop = StopSignal() if with_stop else None
    client = Client()
    counted: list[int] = []

    async def relay_it() -> None:
        await run(upstream_response(stream, headers=headers), client, stall_timeout=10, stop=stop)

    async with anyio.create_task_group() as tg:
        before = len(anyio.get_running_tasks())
        tg.start_soon(relay_it)
        with anyio.fail_after(5):
            await client.body_seen.wait()
        counted.append(len(anyio.get_running_tasks()) - before)
        client.disconnect()
    assert counted == [2]  # the relaying task and its one helper
    assert stream.closed
    if stop is not None:
        assert not stop._scopes  # nothing registered outlives the relay


@pytest.mark.anyio
async def test_a_disconnect_after_keepalives_still_ends_the_relay() -> None:
    """The helper's wait for a disconnect is cancelled whenever a keep-alive is due; it is
    taken up again after each, so a client leaving later is still noticed at once."""
    stream = Upstream(ROLE, 30.0, DONE)
    client = Client()
    result: list[RelayResult] = []
    third_keepalive = anyio.Event()

    async def send(message: Message) -> None:
        await client.send(message)
        if client.bodies.count(KEEPALIVE) >= 3:
            third_keepalive.set()

    async def relay_it() -> None:
        result.append(
            await relay(
                upstream_response(stream, headers=SSE_HEADERS),
                send=send,
                receive=client.receive,
                stall_timeout=20,
                keepalive_interval=0.02,
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(relay_it)
        with anyio.fail_after(5):
            await third_keepalive.wait()
        client.disconnect()
    assert result[0].outcome == "client_disconnected"
    assert stream.closed


@pytest.mark.anyio
@pytest.mark.parametrize("headers", [SSE_HEADERS, {"content-type": "application/json"}], ids=["event-stream", "json"])
async def test_a_stop_set_before_the_relay_cancels_it_at_once(headers: dict[str, str]) -> None:
    stop = StopSignal()
    stop.set()
    stream = Upstream(30.0, DONE)
    result = await run(upstream_response(stream, headers=headers), Client(), stop=stop)
    assert result.outcome == "shutdown" and result.status == 503
    assert stream.closed and not stop._scopes


@pytest.mark.anyio
@pytest.mark.parametrize("headers", [SSE_HEADERS, {"content-type": "application/json"}], ids=["event-stream", "json"])
async def test_a_client_gone_before_the_relay_starts_is_not_relayed_to(headers: dict[str, str]) -> None:
    """The request's watch saw the disconnect between forwarding and relaying (nothing to cancel then):
    the relay it is handed ends at once, and closes the upstream."""
    client = Client()
    client.disconnect()
    watch = ClientWatch(client.receive)
    await watch.run()  # returns at the disconnect
    assert watch.gone
    stream = Upstream(30.0, DONE)
    with anyio.fail_after(5):
        result = await relay(
            upstream_response(stream, headers=headers),
            send=client.send,
            receive=client.receive,
            stall_timeout=10,
            keepalive_interval=1,
            watch=watch,
        )
    assert result.outcome == "client_disconnected" and result.status == 499
    assert stream.closed and client.messages == []
