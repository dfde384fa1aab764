"""The SSE guard's parser fast path (``SSEParser.feed``) attacked by a hostile upstream, end to end.

The gateway (``create_app``) runs under uvicorn, and under hypercorn on asyncio and on trio, in front of
a raw-socket upstream (``tests/gateway/_raw_upstream.py``) that sends chosen bytes in chosen HTTP chunks:
chunks that take the fast path (whole ``\\n`` lines after a line end) alternate with ones that take the
general path (a line carried over, a ``\\r``, the first line) in the middle of events. The client parses
what it got as a browser does (``SSEParser`` from a fresh start): the events are the upstream's, none
half, none twice, keep-alives only between events. Every socket test ends with ``assert_idle``.

Found here: a BOM at the start of the upstream's stream was relayed after the keep-alives sent while the
upstream was silent (or after a starved first attempt's comments), where it is no BOM but part of a field
name: the client dropped the first event, that the guard had counted as delivered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import anyio
import httpx
import httpx2
import openai
import pytest
from starlette.applications import Starlette

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._sse import KEEPALIVE, SSEEvent, SSEParser
from asgi_lifetime.testing._serve import serve_in_thread

from .._servers import hypercorn_in_thread
from ..gateway._raw_upstream import RawRequest, Script, raw_upstream
from ..gateway.test_relay_events import STREAMS, render
from ..gateway.test_sdk import CLAUDE_HELLO, SDK_TIMEOUT
from .test_attack_cpu_cuts import _CLAUDE_FIRST, _CLAUDE_MORE
from .test_attack_upstream import SSE_HEAD, STREAM_BODY, chunk
from .test_faults import FAST, PATH, assert_idle

SERVERS = ["uvicorn", "hypercorn-asyncio", "hypercorn-trio"]
BOM = b"\xef\xbb\xbf"
END_OF_BODY = b"0\r\n\r\n"

# An OpenAI chat stream (judged by the guard) and a custom one (not judged: output once it has an event).
CHAT_FIRST = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n'
)
CHAT_MORE = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"lo"},"finish_reason":null}]}\n\n'
)
CHAT_END = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
CHAT = CHAT_FIRST + CHAT_MORE + CHAT_END


@contextlib.contextmanager
def gateway(upstream_url: str, server: str, **changes: Any) -> Iterator[tuple[str, Starlette]]:
    """``create_app`` in front of ``upstream_url``, served by ``server`` (one of ``SERVERS``)."""
    app = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, **changes}))
    if server == "uvicorn":
        with serve_in_thread(app) as url:
            yield url, app
    else:
        with hypercorn_in_thread(app, server.partition("-")[2]) as port:
            yield f"http://127.0.0.1:{port}", app


def openai_chat(url: str, **http_options: Any) -> tuple[str, list[Any]]:
    """A streamed chat completion through the gateway at ``url`` with the openai SDK (``http_options``
    go to its httpx client): the answer's text and the chunks it came in."""
    with (
        openai.DefaultHttpxClient(timeout=SDK_TIMEOUT, **http_options) as http,
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, http_client=http) as client,
    ):
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        parts = list(stream)
    return "".join(part.choices[0].delta.content or "" for part in parts if part.choices), parts


def events(body: bytes) -> list[SSEEvent]:
    """The events a spec-following client without a size limit parses from ``body`` (a BOM is one only
    at the very start). Of the upstream's bytes, sent in one piece: the events it sent."""
    return SSEParser(limit=64 * 1024 * 1024).feed(body)


async def _fetch(url: str, *, on_piece: Callable[[bytes], None] = lambda body: None) -> tuple[int, bytes]:
    """POST a streamed chat request; the status and the raw body (``on_piece`` sees the body so far)."""
    body = bytearray()
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        async with client.stream("POST", PATH, json=STREAM_BODY) as response:
            async for piece in response.aiter_raw():
                body += piece
                on_piece(bytes(body))
    return response.status_code, bytes(body)


def _scripted(*steps: bytes | str | Callable[[], bytes]) -> Callable[[RawRequest], Script]:
    return lambda request: list(steps)


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(chunk(piece) for piece in pieces if piece)


# -- the defect: a BOM relayed after bytes the gateway sent first -----------------------------------

# The stream with its BOM, in HTTP chunks: whole; alone; split over three chunks (general path); the BOM's
# line then fast-path chunks.
BOM_CHUNKS = {
    "whole": [BOM + CHAT],
    "bom-alone": [BOM, CHAT],
    "bom-split": [BOM[:1], BOM[1:2], BOM[2:] + CHAT_FIRST[:9], CHAT_FIRST[9:], CHAT_MORE, CHAT_END],
    "bom-then-fast-path": [BOM + CHAT_FIRST, CHAT_MORE, CHAT_END],
}


def _after(go: threading.Event, body: bytes) -> Callable[[], bytes]:
    """A script step: ``body``, written once ``go`` is set (bounded)."""

    def step() -> bytes:
        assert go.wait(10), "the client never got a keep-alive"
        return body

    return step


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("split", list(BOM_CHUNKS))
async def test_a_bom_after_keepalives_does_not_cost_the_first_event(server: str, split: str) -> None:
    # The upstream sends its head, then is silent until the client has a keep-alive (no timing luck: the
    # client releases it), then its stream with a BOM. Before: the BOM followed the keep-alive, the client
    # read the first event's field name as "\ufeffdata" and dropped it (the role and "Hel" lost); the
    # guard had counted it as delivered, and the outcome was "complete".
    go = threading.Event()
    body = _chunked(BOM_CHUNKS[split]) + END_OF_BODY

    def on_piece(got: bytes) -> None:
        if KEEPALIVE in got:
            go.set()

    with (
        raw_upstream(_scripted(SSE_HEAD, _after(go, body))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        status, got = await _fetch(url, on_piece=on_piece)
        await assert_idle(app, url)
    assert status == 200 and got.startswith(KEEPALIVE)
    assert events(got) == events(BOM + CHAT)
    assert len(upstream.requests) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
async def test_a_reissued_stream_with_a_bom_after_a_starved_attempts_comments(server: str) -> None:
    # The first attempt sends a comment (relayed: it is between events) and ends without an event:
    # starved, re-issued. The second starts with a BOM, after the comment the client already has.
    answers = [
        [SSE_HEAD, chunk(b": warming up\n\n"), END_OF_BODY],
        [SSE_HEAD, chunk(BOM + CHAT_FIRST), chunk(CHAT_MORE + CHAT_END), END_OF_BODY],
    ]

    def answer(request: RawRequest) -> Script:
        return list(answers[min(len(upstream.requests), 2) - 1])

    with raw_upstream(answer) as upstream, gateway(upstream.url, server) as (url, app):
        status, got = await _fetch(url)
        await assert_idle(app, url)
    assert status == 200 and got.startswith(b": warming up\n\n")
    assert events(got) == events(CHAT)
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("split", ["bom-alone", "bom-split"])
def test_the_openai_sdk_reads_the_whole_answer_after_keepalives_and_a_bom(server: str, split: str) -> None:
    # Before: the SDK got "lo" only (the role and "Hel" were in the event the BOM broke).
    go = threading.Event()
    body = _chunked(BOM_CHUNKS[split]) + END_OF_BODY
    with (
        raw_upstream(_scripted(SSE_HEAD, _after(go, body))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        # The gateway sends its head with the first keep-alive: the upstream is released then.
        text, parts = openai_chat(url, event_hooks={"response": [lambda response: go.set()]})
        anyio.run(assert_idle, app, url)
    assert text == "Hello"
    assert parts[0].choices[0].delta.role == "assistant"
    assert len(upstream.requests) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", list(STREAMS))
async def test_every_format_keeps_its_first_event_after_keepalives_and_a_bom(fmt: str) -> None:
    go = threading.Event()
    sent = render(STREAMS[fmt][0])
    body = _chunked([BOM, sent[:7], sent[7:]]) + END_OF_BODY

    def on_piece(got: bytes) -> None:
        if KEEPALIVE in got:
            go.set()

    with (
        raw_upstream(_scripted(SSE_HEAD, _after(go, body))) as upstream,
        gateway(upstream.url, "uvicorn", keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        status, got = await _fetch(url, on_piece=on_piece)
        await assert_idle(app, url)
    assert status == 200 and got.startswith(KEEPALIVE)
    assert events(got) == events(sent)
    assert len(upstream.requests) == 1


CLAUDE = (
    _CLAUDE_FIRST
    + _CLAUDE_MORE
    + b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    + b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
    + b'"stop_sequence":null},"usage":{"output_tokens":2}}\n\n'
    + b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@pytest.mark.parametrize("server", SERVERS)
def test_the_anthropic_sdk_reads_the_whole_answer_after_keepalives_and_a_bom(server: str) -> None:
    # Before: the message_start event was lost: the SDK had no message (AssertionError in get_final_message).
    go = threading.Event()
    body = _chunked([BOM, CLAUDE]) + END_OF_BODY
    with (
        raw_upstream(_scripted(SSE_HEAD, _after(go, body))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        hooks = {"response": [lambda response: go.set()]}
        with (
            anthropic.DefaultHttpxClient(timeout=SDK_TIMEOUT, event_hooks=hooks) as http,
            anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0, http_client=http) as client,
        ):
            with client.messages.stream(model="claude", max_tokens=10, messages=CLAUDE_HELLO) as stream:
                text = "".join(stream.text_stream)
                final = stream.get_final_message()
        anyio.run(assert_idle, app, url)
    assert text == "Hello" and final.stop_reason == "end_turn"
    assert len(upstream.requests) == 1


# -- keep-alives in a stream that carries ids ----------------------------------------------------------

# The openai and anthropic SDKs keep the last event id across events (as the spec says) and dispatch an
# event at every blank line once they hold one: a keep-alive ending in a blank line was an empty event,
# and the SDK failed to parse its empty data (a bare JSONDecodeError in the middle of the answer).


class _Watching(httpx2.BaseTransport):
    """The SDK's transport (the openai SDK sends with httpx2), calling ``seen`` with the response
    body so far as it arrives."""

    def __init__(self, seen: Callable[[bytes], None]) -> None:
        self._inner = httpx2.HTTPTransport()
        self._seen = seen

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_WatchedStream(response.stream, self._seen),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._inner.close()


class _WatchedStream(httpx2.SyncByteStream):
    def __init__(self, inner: Any, seen: Callable[[bytes], None]) -> None:
        self._inner = inner
        self._seen = seen

    def __iter__(self) -> Iterator[bytes]:
        body = b""
        for piece in self._inner:
            body += piece
            self._seen(body)
            yield piece

    def close(self) -> None:
        self._inner.close()


@pytest.mark.parametrize("server", SERVERS)
def test_the_openai_sdk_reads_a_stream_with_ids_through_keepalives(server: str) -> None:
    go = threading.Event()
    got: list[bytes] = []

    def seen(body: bytes) -> None:
        got[:] = [body]
        if b": keep-alive" in body.partition(b"id: 1\n")[2]:
            go.set()  # a keep-alive came after the event with the id: the upstream goes on

    rest = _chunked([CHAT_MORE, CHAT_END]) + END_OF_BODY
    with (
        raw_upstream(_scripted(SSE_HEAD, chunk(b"id: 1\n" + CHAT_FIRST), _after(go, rest))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        text, _ = openai_chat(url, transport=_Watching(seen))
        anyio.run(assert_idle, app, url)
    assert text == "Hello"
    # The keep-alives were comment lines only, and the client's events are the upstream's.
    assert b": keep-alive\n\n" not in got[0] and b": keep-alive\n" in got[0]
    assert [event.data for event in events(got[0])] == [event.data for event in events(b"id: 1\n" + CHAT)]
    assert len(upstream.requests) == 1


# -- fast and general path chunks alternating inside events: what the client gets ---------------------

# A custom event stream (not judged: every event is output) in hostile HTTP chunkings. Each is relayed
# byte for byte, the client parses the upstream's events.
CUSTOM_CHUNKS: dict[str, list[bytes]] = {
    "line-then-its-end": [b"data: x", b"\n\n", b"data: y\n\n"],
    "line-end-then-blank": [b"data: x\n", b"\n", b"data: y\n", b"\ndata: z\n\n"],
    "lone-cr-then-lf": [b"data: x\r", b"\n", b"\r", b"\n", b"data: y\n\n"],
    "cr-blank-then-fast": [b"data: x\n\r", b"data: y\n\n"],
    "crlf-split-then-fast": [b"data: x\r\n\r", b"\ndata: y\n", b"\n"],
    "comment-only-chunks": [b": one\n", b": two\n\n", b"data: x\n\n", b": three\n", b"data: y\n\n"],
    "comment-inside-event": [b"data: x\n", b": inside\n", b"data: more\n\n"],
    "multi-line-data-over-chunks": [b"data: a\n", b"data: b\n", b"data: c\n", b"\n"],
    "fields-over-chunks": [b"event: custom\n", b"id: 7\n", b"retry: 10\n", b"data: x\n", b"\n"],
    "nul-and-invalid-utf8": [b"id: a\0b\n", b"data: \xff\xfe\0\n\n", b"data: \xc3\n", b"\xa9\n\n"],
    "no-space-and-empty-data": [b"data:x\n", b"data\n\n", b"data:\n\n"],
    "unknown-fields": [b"foo: bar\n", b"data: x\n", b"\n", b"dat\n\n"],
    "blank-lines-only-between": [b"\n\n\n", b"data: x\n\n", b"\n\n"],
    "dripped-bytes": [bytes([b]) for b in b"data: x\n\ndata: y\n\n"],
}


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("name", list(CUSTOM_CHUNKS))
async def test_a_custom_stream_in_alternating_chunks_is_relayed_as_sent(server: str, name: str) -> None:
    pieces = [b"data: first\n\n", *CUSTOM_CHUNKS[name]]  # the first line is read; the rest may take the fast path
    sent = b"".join(pieces)
    with (
        raw_upstream(_scripted(SSE_HEAD, _chunked(pieces) + END_OF_BODY)) as upstream,
        gateway(upstream.url, server) as (url, app),
    ):
        status, got = await _fetch(url)
        await assert_idle(app, url)
    assert status == 200
    assert got == sent
    assert events(got) == events(sent)
    assert len(upstream.requests) == 1


# A stream that ends after fast-path chunks, in the middle of a line or an event: the unfinished part is
# never relayed, and the client learns the stream broke (an error event after the whole events).
UNFINISHED: dict[str, list[bytes]] = {
    "mid-line": [b"data: x\n\n", b"data: y\n\n", b"data: hal"],
    "after-a-field-line": [b"data: x\n\n", b"data: y\n", b"event: z\n"],
    "after-a-cr": [b"data: x\n\n", b"data: y\r"],
    "comment-inside": [b"data: x\n\n", b"data: y\n: c\n"],
}


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("name", list(UNFINISHED))
async def test_a_custom_stream_ending_inside_an_event_gets_an_error_after_whole_events(server: str, name: str) -> None:
    pieces = UNFINISHED[name]
    sent = b"".join(pieces)
    whole = sent[: sent.rindex(b"\n\n") + 2]  # the upstream's whole events
    with (
        raw_upstream(_scripted(SSE_HEAD, _chunked(pieces) + END_OF_BODY)) as upstream,
        gateway(upstream.url, server) as (url, app),
    ):
        status, got = await _fetch(url)
        await assert_idle(app, url)
    assert status == 200
    assert got.startswith(whole) and got[len(whole) :].startswith(b"event: error\n")
    parsed = events(got)
    assert parsed[:-1] == events(sent) == events(whole)
    assert parsed[-1].event == "error" and "middle of an event" in parsed[-1].data
    assert len(upstream.requests) == 1


# A judged (OpenAI chat) stream in hostile chunkings: after content and its terminal the answer is whole;
# without the terminal (ended mid-line after fast-path chunks) it starved: the whole events, then the error.
CHAT_CHUNKS: dict[str, tuple[list[bytes], bool]] = {
    "fast-path-events": ([CHAT_FIRST, CHAT_MORE, CHAT_END], True),
    "events-cut-at-data": ([CHAT_FIRST + CHAT_MORE[:6], CHAT_MORE[6:], CHAT_END], True),
    "blank-line-alone": ([CHAT_FIRST[:-1], b"\n", CHAT_MORE[:-1], b"\n" + CHAT_END], True),
    "done-spelled-no-space": ([CHAT_FIRST, CHAT_MORE, CHAT_END.replace(b"data: [DONE]", b"data:[DONE]")], True),
    "junk-after-done": ([CHAT_FIRST, CHAT_MORE, CHAT_END, b'data: {"junk\n'], True),
    "ends-mid-line": ([CHAT_FIRST, CHAT_MORE, CHAT_END[:40]], False),
    "ends-before-blank-line": ([CHAT_FIRST, CHAT_MORE, CHAT_END[: CHAT_END.index(b"\n") + 1]], False),
    "done-without-finish-mid-line": ([CHAT_FIRST, CHAT_MORE, b"data: [DO"], False),
}


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("name", list(CHAT_CHUNKS))
async def test_a_chat_stream_in_hostile_chunks_is_whole_or_ends_starved(server: str, name: str) -> None:
    pieces, whole = CHAT_CHUNKS[name]
    sent = b"".join(pieces)
    with (
        raw_upstream(_scripted(SSE_HEAD, _chunked(pieces) + END_OF_BODY)) as upstream,
        gateway(upstream.url, server) as (url, app),
    ):
        status, got = await _fetch(url)
        await assert_idle(app, url)
    assert status == 200 and len(upstream.requests) == 1  # content was delivered: never re-issued
    parsed = events(got)
    expected = events(sent)
    if whole:
        assert parsed == expected
        assert sent.startswith(got) and got.endswith(b"\n\n")  # an unfinished tail is dropped, not completed
    else:
        assert parsed[:-1] == expected
        assert parsed[-1].event == "error" and "upstream_starved" in parsed[-1].data


@pytest.mark.anyio
async def test_an_event_growing_past_the_hold_in_fast_path_chunks_streams_through_whole() -> None:
    # 64 KiB data lines, each its own chunk (the fast path: whole lines after a line end), 20 of them:
    # the event outgrows the parser's limit and the relay's hold while every chunk stays under both.
    line = b"data: " + b"a" * (64 * 1024) + b"\n"
    pieces = [b"data: first\n\n", *([line] * 20), b"\n", b"data: after\n\n"]
    sent = b"".join(pieces)
    with (
        raw_upstream(_scripted(SSE_HEAD, _chunked(pieces) + END_OF_BODY)) as upstream,
        gateway(upstream.url, "uvicorn") as (url, app),
    ):
        status, got = await _fetch(url)
        await assert_idle(app, url)
    assert status == 200 and got == sent
    parsed = events(got)
    assert [len(event.data) for event in parsed] == [5, 20 * (64 * 1024 + 1) - 1, 5]
    assert len(upstream.requests) == 1
