"""Event streams of every kind, cut everywhere: the client only ever gets whole events.

Issue 9: the starvation guard judged event streams it did not know (streamed transcription,
image generation, speech) and re-issued them; an event over 1 MiB made a stream "malformed"
and re-issued it; and a stream cut in the middle of an event left a half event on the client
that the gateway's resync newline then completed. Each test here parses what the client got
as an SSE client would: every dispatched event is complete JSON, the last one is the
gateway's error where one is due, and the upstream was asked once unless a re-issue is allowed.

Relay-level tests drive ``relay`` with scripted chunks; the socket tests put the gateway
(``create_app`` under uvicorn) in front of a raw upstream that writes exact bytes and then
resets the connection, ends the chunked body short, ends it cleanly, or stalls.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import socket
import struct
import termios
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from asgi_lifetime._settings import MiB
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway._relay import EVENT_HOLD_LIMIT, relay
from asgi_lifetime.gateway._sse import MAX_BUFFER, SSEEvent, SSEParser

from .._servers import threaded_server
from ..reliability.test_faults import Stack, assert_idle, running
from .test_relay import SSE_HEADERS, Client, Reissuer, Upstream, upstream_response

Event = tuple[str | None, Any]  # (the event: field or None, the data: a JSON payload or "[DONE]")


def _chat(**delta: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def _typed(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"

# Each format's complete stream, and whether the guard judges it (recognises the format).
STREAMS: dict[str, tuple[list[Event], bool]] = {
    "chat": (
        [
            (None, _chat(role="assistant", content="")),
            (None, _chat(content="Hello there")),
            (None, _chat(content=", how are you?")),
            (None, {**_chat(), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            (None, "[DONE]"),
        ],
        True,
    ),
    "responses": (
        [
            ("response.created", _typed("response.created", response={"id": "r1", "status": "in_progress"})),
            ("response.output_text.delta", _typed("response.output_text.delta", delta="Hello there")),
            ("response.output_text.delta", _typed("response.output_text.delta", delta=", how are you?")),
            ("response.completed", _typed("response.completed", response={"id": "r1", "status": "completed"})),
        ],
        True,
    ),
    "anthropic": (
        [
            ("message_start", _typed("message_start", message={"id": "m1", "content": [], "stop_reason": None})),
            ("content_block_delta", _typed("content_block_delta", delta={"type": "text_delta", "text": "Hello"})),
            ("content_block_delta", _typed("content_block_delta", delta={"type": "text_delta", "text": " there"})),
            ("message_delta", _typed("message_delta", delta={"stop_reason": "end_turn"})),
            ("message_stop", _typed("message_stop")),
        ],
        True,
    ),
    "gemini": (
        [
            (None, {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hello"}]}}]}),
            (None, {"candidates": [{"content": {"role": "model", "parts": [{"text": " there"}]}}]}),
            (None, {"candidates": [{"content": {"parts": [{"text": "!"}]}, "finishReason": "STOP"}]}),
        ],
        True,
    ),
    "transcription": (
        [
            (None, _typed("transcript.text.delta", delta="Hello")),
            (None, _typed("transcript.text.delta", delta=" there")),
            (None, _typed("transcript.text.done", text="Hello there", usage={"type": "tokens", "total_tokens": 9})),
        ],
        False,
    ),
    "image": (
        [
            (
                "image_generation.partial_image",
                _typed("image_generation.partial_image", b64_json=_B64, partial_image_index=0),
            ),
            (
                "image_generation.partial_image",
                _typed("image_generation.partial_image", b64_json=_B64 * 2, partial_image_index=1),
            ),
            ("image_generation.completed", _typed("image_generation.completed", b64_json=_B64 * 3, size="1x1")),
        ],
        False,
    ),
    "speech": (
        [
            (None, _typed("speech.audio.delta", audio=_B64)),
            (None, _typed("speech.audio.delta", audio=_B64[::-1])),
            (None, _typed("speech.audio.done", usage={"input_tokens": 3, "output_tokens": 9})),
        ],
        False,
    ),
    "custom": (
        [("tick", {"n": 1, "note": "first"}), ("tick", {"n": 2, "note": "second"}), ("tock", {"n": 3})],
        False,
    ),
}
ENDINGS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def _lines(event: Event) -> list[bytes]:
    name, payload = event
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return ([f"event: {name}".encode()] if name else []) + [f"data: {data}".encode()]


def render(events: list[Event], ending: bytes = b"\n") -> bytes:
    return b"".join(ending.join(_lines(event)) + ending + ending for event in events)


def cut_offset(events: list[Event], index: int, where: str, ending: bytes) -> int:
    """Where to cut the stream inside (or just before) event ``index``."""
    start = len(render(events[:index], ending))
    lines = _lines(events[index])
    data_start = start + sum(len(line) + len(ending) for line in lines[:-1])
    return {
        "boundary": start,
        "between-lines": start + len(lines[0]) + len(ending),
        "mid-line": data_start + len(lines[-1]) // 2,
        "after-cr": data_start + len(lines[-1]) + 1,
    }[where]


def expected_data(events: list[Event]) -> list[Any]:
    return [payload for _, payload in events]


def client_events(body: bytes) -> list[SSEEvent]:
    """Parse the body as an SSE client would (no size limit that matters here)."""
    return SSEParser(limit=64 * MiB).feed(body)


def upstream_data(events: list[SSEEvent]) -> list[Any]:
    """The data of every event that is not the gateway's error; each must be complete JSON (or [DONE])."""
    return [event.data if event.data == "[DONE]" else json.loads(event.data) for event in events]


def check_stream(body: bytes, sent: list[Event], error: str | None) -> None:
    """The client got exactly ``sent`` as whole events, then the gateway's ``error`` event (if any)."""
    events = client_events(body)
    if error is not None:
        assert events and events[-1].event == "error", events[-3:]
        assert json.loads(events[-1].data)["error"]["code"] == error
        events = events[:-1]
    assert all(event.event != "error" for event in events)
    assert upstream_data(events) == expected_data(sent)


# Cut positions inside event 2 (two whole events already reached the client, so nothing may be
# re-issued); "after-cr" only exists with CRLF line endings.
CUTS = [
    pytest.param(where, ending, id=f"{where}-{ending}")
    for ending in ENDINGS
    for where in ("mid-line", "between-lines", "after-cr", "boundary")
    if where != "after-cr" or ending == "crlf"
]
KINDS = ["reset", "end", "stall"]


def _end_error(judged: bool, where: str, kind: str) -> str | None:
    """The gateway's error event after events 0-1 and a cut in or before event 2, or None."""
    if kind == "reset":
        return "bad_gateway"
    if kind == "stall":
        return "upstream_stalled"
    if judged:
        return "upstream_starved"  # a recognised format ended without its terminal event
    return None if where == "boundary" else "bad_gateway"  # a whole stream of unknown format is output


# -- relay level -----------------------------------------------------------------------------------


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] if size else [data]


async def _relay(items: Sequence[bytes | float | Exception], **options: Any) -> tuple[Client, Any, Reissuer, Counters]:
    stream = Upstream(*items)
    reissue = Reissuer(upstream_response(Upstream(b"data: {}\n\n"), headers=SSE_HEADERS))
    counters = Counters()
    client = Client()
    options.setdefault("stall_timeout", 0.1)
    with anyio.fail_after(5):
        result = await relay(
            upstream_response(stream, headers=SSE_HEADERS),
            send=client.send,
            receive=client.receive,
            keepalive_interval=30,
            reissue=reissue,
            counters=counters,
            **options,
        )
    assert stream.closed
    return client, result, reissue, counters


def _tail(kind: str) -> list[bytes | float | Exception]:
    tails: dict[str, list[bytes | float | Exception]] = {
        "reset": [httpx.ReadError("reset")],
        "end": [],
        "stall": [30.0],
    }
    return tails[kind]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("where", "ending"), CUTS)
@pytest.mark.parametrize("name", list(STREAMS))
@pytest.mark.parametrize("size", [0, 7], ids=["one-chunk", "7-byte-chunks"])
async def test_cut_inside_an_event_leaves_no_half_event(
    name: str, where: str, ending: str, kind: str, size: int
) -> None:
    events, judged = STREAMS[name]
    raw = render(events, ENDINGS[ending])
    cut = cut_offset(events, 2, where, ENDINGS[ending])
    items: list[bytes | float | Exception] = [*_chunks(raw[:cut], size), *_tail(kind)]
    if kind == "stall" and size:
        items = [*_chunks(raw[:cut], 64), 30.0]  # fewer pieces: each would be a stall-free read
    client, result, reissue, counters = await _relay(items)
    error = _end_error(judged, where, kind)
    check_stream(client.body, events[:2], error)
    assert client.ended and client.status == 200
    assert reissue.calls == 0  # two events reached the client: a second answer cannot follow
    assert counters.starved == (1 if error == "upstream_starved" else 0)
    assert (
        result.outcome
        == {
            None: "complete",
            "bad_gateway": "upstream_error",
            "upstream_stalled": "stalled",
            "upstream_starved": "starved",
        }[error]
    )


@pytest.mark.anyio
@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("name", list(STREAMS))
async def test_whole_streams_of_every_format_pass_unjudged_or_complete(name: str, ending: str) -> None:
    events, _ = STREAMS[name]
    raw = render(events, ENDINGS[ending])
    client, result, reissue, counters = await _relay(_chunks(raw, 5))
    assert client.body == raw
    assert result.outcome == "complete" and reissue.calls == 0 and counters.starved == 0


@pytest.mark.anyio
@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("name", list(STREAMS))
async def test_clean_end_inside_an_event_after_a_whole_stream(name: str, ending: str) -> None:
    # A recognised format has had its terminal event: the answer is whole and the unfinished
    # tail (which no client would dispatch) is dropped. Any other format cannot tell: error event.
    events, judged = STREAMS[name]
    eol = ENDINGS[ending]
    raw = render(events, eol)
    tail = b'data: {"note": "after the' if ending != "lf" else b"data: [DONE]" + eol
    client, result, reissue, _ = await _relay([raw, tail])
    check_stream(client.body, events, None if judged else "bad_gateway")
    assert client.body == raw if judged else client.body[len(raw) :].startswith(b"event: error\n")
    assert result.outcome == ("complete" if judged else "upstream_error") and reissue.calls == 0


@pytest.mark.anyio
@pytest.mark.parametrize("name", [name for name, (_, judged) in STREAMS.items() if not judged])
async def test_unknown_formats_are_never_reissued_even_without_their_done_event(name: str) -> None:
    # Before: a transcription/image/speech stream was judged starved (no "terminal"), re-issued
    # (the client got the answer twice) and then ended with upstream_starved.
    events, _ = STREAMS[name]
    client, result, reissue, counters = await _relay([render(events[:1]), render(events[1:2])])
    assert result.outcome == "complete" and reissue.calls == 0 and counters.starved == 0
    check_stream(client.body, events[:2], None)


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["mid-line", "between-lines"])
@pytest.mark.parametrize("name", list(STREAMS))
async def test_stream_ending_inside_its_first_event_is_reissued_without_the_fragment(name: str, where: str) -> None:
    events, _ = STREAMS[name]
    raw = render(events)
    first = Upstream(raw[: cut_offset(events, 0, where, b"\n")])
    second = Upstream(*_chunks(raw, 11))
    reissue = Reissuer(upstream_response(second, headers=SSE_HEADERS))
    client = Client()
    with anyio.fail_after(5):
        result = await relay(
            upstream_response(first, headers=SSE_HEADERS),
            send=client.send,
            receive=client.receive,
            stall_timeout=1,
            keepalive_interval=30,
            reissue=reissue,
        )
    assert reissue.calls == 1 and result.reissued and result.outcome == "complete"
    assert client.body == raw  # the second answer alone


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["reset", "stall"])
async def test_failure_inside_the_first_event_is_a_plain_error_response(kind: str) -> None:
    events, _ = STREAMS["transcription"]
    raw = render(events)
    client, result, reissue, _ = await _relay([raw[: cut_offset(events, 0, "mid-line", b"\n")], *_tail(kind)])
    assert client.status == (502 if kind == "reset" else 504)
    assert json.loads(client.body)["error"]["code"] == ("bad_gateway" if kind == "reset" else "upstream_stalled")
    assert reissue.calls == 0


def _big_item(size: int) -> Event:
    image = "A" * size
    item = {"type": "image_generation_call", "id": "ig_1", "status": "completed", "result": image}
    return "response.output_item.done", _typed("response.output_item.done", output_index=0, item=item)


def image_tool_stream(size: int) -> list[Event]:
    """A Responses stream with the image-generation tool: two events carry the whole base64 image."""
    name, done = _big_item(size)
    completed = {"id": "r1", "status": "completed", "output": [done["item"]]}
    return [
        ("response.created", _typed("response.created", response={"id": "r1", "status": "in_progress"})),
        (
            "response.output_item.added",
            _typed(
                "response.output_item.added",
                output_index=0,
                item={"type": "image_generation_call", "id": "ig_1", "status": "in_progress"},
            ),
        ),
        (name, done),
        ("response.completed", _typed("response.completed", response=completed)),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("size", [64 * 1024, 1536 * 1024], ids=["64KiB", "1.5MiB"])
async def test_large_events_are_relayed_intact_and_not_reissued(size: int) -> None:
    # Before: an event over 1 MiB made the stream "malformed": re-issued, the image generated
    # twice, and the SDK raised "Duplicate response output index 0".
    raw = render(image_tool_stream(size))
    client, result, reissue, counters = await _relay(_chunks(raw, 65536))
    assert client.body == raw
    assert result.outcome == "complete" and reissue.calls == 0 and counters.starved == 0


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_cut_inside_an_event_larger_than_the_hold_ends_the_response_abruptly(kind: str) -> None:
    events = image_tool_stream(EVENT_HOLD_LIMIT + 4096)
    raw = render(events)
    cut = cut_offset(events, 3, "boundary", b"\n") - 100  # inside event 2, past the hold
    client, result, reissue, _ = await _relay([*_chunks(raw[:cut], 65536), *_tail(kind)])
    assert client.body == raw[:cut]  # the large event streamed through as it came...
    assert not client.ended  # ...and nothing completes it: the connection is left to close
    assert reissue.calls == 0
    assert result.outcome in ("upstream_error", "stalled")


@pytest.mark.anyio
async def test_hold_is_bounded_while_an_event_streams_through() -> None:
    # Memory: what was read from the upstream and not yet sent is at most the hold plus one chunk.
    raw = render(image_tool_stream(4 * MAX_BUFFER))
    chunks = _chunks(raw, 65536)
    client = Client()
    held: list[int] = []
    # Called as chunk n is pulled: chunks 1..n-1 were read by then.
    stream = Upstream(*chunks, on_pull=lambda n: held.append(sum(map(len, chunks[: n - 1])) - len(client.body)))
    with anyio.fail_after(5):
        result = await relay(
            upstream_response(stream, headers=SSE_HEADERS),
            send=client.send,
            receive=client.receive,
            stall_timeout=1,
            keepalive_interval=30,
        )
    assert client.body == raw and result.outcome == "complete"
    assert max(held) <= EVENT_HOLD_LIMIT + 65536
    assert max(held) > 0  # events were held whole (the small ones, and the large one until the hold ran out)


# -- over real sockets -----------------------------------------------------------------------------


def _unacked(conn: socket.socket) -> int:
    """Bytes written to ``conn`` that the peer has not acknowledged yet (Linux ``SIOCOUTQ``)."""
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]  # type: ignore[no-any-return]


@dataclass
class Script:
    """What the raw upstream does for one request: write ``body`` (chunked), then ``then``."""

    body: bytes
    then: str  # "reset" (RST), "incomplete" (FIN without the last chunk), "end" (clean), "stall"
    pieces: int = 3


@dataclass
class RawUpstream:
    """A threaded TCP upstream that answers each request with the scripts of its ``x-script`` id, in turn."""

    url: str = ""
    scripts: dict[str, list[Script]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)

    def add(self, *scripts: Script) -> str:
        key = uuid.uuid4().hex
        self.scripts[key] = list(scripts)
        self.hits[key] = 0
        return key

    def serve(self, conn: socket.socket) -> None:
        with contextlib.closing(conn):
            conn.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            head, _, body = head.partition(b"\r\n\r\n")
            headers = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            )
            length = int(headers.get(b"content-length", b"0"))
            while len(body) < length:
                body += conn.recv(65536)
            key = headers[b"x-script"].decode()
            self.hits[key] += 1
            script = self.scripts[key][min(self.hits[key], len(self.scripts[key])) - 1]
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            )
            step = max(1, len(script.body) // script.pieces)
            for i in range(0, len(script.body), step):
                piece = script.body[i : i + step]
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            if script.then == "end":
                conn.sendall(b"0\r\n\r\n")
            elif script.then == "reset":
                # A reset drops what is still in the send buffer: wait until the gateway's kernel has it all.
                deadline = time.monotonic() + 10
                while _unacked(conn) and time.monotonic() < deadline:
                    time.sleep(0.001)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            elif script.then == "stall":
                self.release.wait(10)


@contextlib.contextmanager
def raw_upstream() -> Iterator[RawUpstream]:
    upstream = RawUpstream()
    with threaded_server(lambda conn, _: upstream.serve(conn), name="raw-upstream") as url:
        upstream.url = url
        try:
            yield upstream
        finally:
            upstream.release.set()


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[Stack, RawUpstream]]:
    with raw_upstream() as upstream, running(upstream_url=upstream.url) as stack:
        yield stack, upstream


async def fetch(stack: Stack, key: str, *, path: str = "/v1/chat/completions") -> tuple[int, bytes, bool]:
    """POST through the gateway; the status, the body, and whether it ended properly (not cut off)."""
    body = b""
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        request = client.build_request("POST", path, json={"model": "m", "stream": True}, headers={"x-script": key})
        response = await client.send(request, stream=True)
        try:
            async for chunk in response.aiter_raw():
                body += chunk
        except httpx.RemoteProtocolError:
            return response.status_code, body, False
        finally:
            await response.aclose()
    return response.status_code, body, True


SOCKET_KINDS = ["reset", "incomplete", "end", "stall"]


def _socket_error(judged: bool, where: str, kind: str) -> str | None:
    return _end_error(judged, where, {"incomplete": "reset"}.get(kind, kind))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", SOCKET_KINDS)
@pytest.mark.parametrize("name", list(STREAMS))
async def test_socket_cut_mid_event_of_every_format(gateway: tuple[Stack, RawUpstream], name: str, kind: str) -> None:
    stack, upstream = gateway
    events, judged = STREAMS[name]
    raw = render(events)
    key = upstream.add(Script(raw[: cut_offset(events, 2, "mid-line", b"\n")], kind))
    status, body, complete = await fetch(stack, key)
    assert status == 200 and complete
    check_stream(body, events[:2], _socket_error(judged, "mid-line", kind))
    assert upstream.hits[key] == 1
    await assert_idle(stack.app, stack.url)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["incomplete", "end"])
@pytest.mark.parametrize(("where", "ending"), CUTS)
@pytest.mark.parametrize("name", ["chat", "transcription"])
async def test_socket_cut_positions_and_line_endings(
    gateway: tuple[Stack, RawUpstream], name: str, where: str, ending: str, kind: str
) -> None:
    stack, upstream = gateway
    events, judged = STREAMS[name]
    raw = render(events, ENDINGS[ending])
    key = upstream.add(Script(raw[: cut_offset(events, 2, where, ENDINGS[ending])], kind, pieces=5))
    status, body, complete = await fetch(stack, key)
    assert status == 200 and complete
    check_stream(body, events[:2], _socket_error(judged, where, kind))
    assert upstream.hits[key] == 1


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(STREAMS))
async def test_socket_whole_stream_of_every_format_is_relayed_once(
    gateway: tuple[Stack, RawUpstream], name: str
) -> None:
    stack, upstream = gateway
    events, _ = STREAMS[name]
    raw = render(events)
    key = upstream.add(Script(raw, "end", pieces=4))
    status, body, complete = await fetch(stack, key)
    assert status == 200 and complete and body == raw
    assert upstream.hits[key] == 1


@pytest.mark.anyio
async def test_socket_first_event_cut_then_clean_end_is_reissued_without_the_fragment(
    gateway: tuple[Stack, RawUpstream],
) -> None:
    stack, upstream = gateway
    events, _ = STREAMS["chat"]
    raw = render(events)
    key = upstream.add(Script(raw[: cut_offset(events, 0, "mid-line", b"\n")], "end"), Script(raw, "end"))
    status, body, complete = await fetch(stack, key)
    assert status == 200 and complete and body == raw
    assert upstream.hits[key] == 2


@pytest.mark.anyio
async def test_socket_image_tool_event_over_1mib_is_relayed_intact_once(gateway: tuple[Stack, RawUpstream]) -> None:
    stack, upstream = gateway
    raw = render(image_tool_stream(1536 * 1024))
    key = upstream.add(Script(raw, "end", pieces=40))
    status, body, complete = await fetch(stack, key, path="/v1/responses")
    assert status == 200 and complete
    assert body == raw
    events = client_events(body)
    assert [event.event for event in events][2:] == ["response.output_item.done", "response.completed"]
    assert len(json.loads(events[2].data)["item"]["result"]) == 1536 * 1024
    assert upstream.hits[key] == 1


@pytest.mark.anyio
@pytest.mark.parametrize("kind", SOCKET_KINDS)
async def test_socket_cut_inside_an_event_over_the_hold_is_a_broken_connection(
    gateway: tuple[Stack, RawUpstream], kind: str
) -> None:
    stack, upstream = gateway
    events = image_tool_stream(1536 * 1024)
    raw = render(events)
    cut = cut_offset(events, 3, "boundary", b"\n") - 100  # inside event 2, past the hold
    key = upstream.add(Script(raw[:cut], kind, pieces=20))
    status, body, complete = await fetch(stack, key, path="/v1/responses")
    assert status == 200 and not complete  # the client's HTTP library reports the connection cut off
    assert body == raw[:cut]  # the two small events, then the large one as far as it came: never completed
    assert [json.loads(event.data)["type"] for event in client_events(body)] == [
        "response.created",
        "response.output_item.added",
    ]
    assert upstream.hits[key] == 1
    await assert_idle(stack.app, stack.url)
