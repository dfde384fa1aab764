"""The per-request CPU cuts attacked by someone who did not write them.

- the SSE guard's skip of events that "cannot be terminal or an error" after content
  (``StreamFormat.inert``): hostile spellings, SSE framings and chunkings, compared with a tracker
  that parses every event, and end to end with the ``openai`` and ``anthropic`` SDKs;
- the relay's one stall scope per response: a chunk that arrives as the deadline passes, drips,
  bursts then silence, a slow client, keep-alives around a dripped event;
- the upstream URL cache, the cookie-less client, the cached metrics children.

Real sockets where it matters: the gateway under uvicorn (``running``) in front of a raw-socket
upstream (``tests/gateway/_raw_upstream.py``); every such test ends with ``assert_idle``.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import anyio
import anyio.lowlevel
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._prepare import Prepared
from asgi_lifetime.gateway._sse import KEEPALIVE, SSETracker
from asgi_lifetime.gateway._upstream import UpstreamClient
from asgi_lifetime.testing._serve import serve_in_thread

from ..gateway._raw_upstream import HOLD, RawRequest, Script, raw_upstream
from ..gateway.test_relay import (
    DONE,
    HELLO,
    ROLE,
    SSE_HEADERS,
    STOP,
    Client,
    Upstream,
    delta,
    run,
    sse,
    upstream_response,
)
from ..gateway.test_sdk import CLAUDE_HELLO, SDK_TIMEOUT, settle
from ..gateway.test_sdk import HELLO as CHAT_HELLO
from ..gateway.test_sdk import SETTINGS as SDK_SETTINGS
from .test_attack_upstream import FIRST, SSE_HEAD, STREAM_BODY, answering, chunk
from .test_faults import PATH, assert_idle, raw_client, request_bytes, running, sse_error

SESSION = "attack-cpu-cuts"
TRANSPORTS = ["httpcore", "aiohttp"]

# -- the relay's stall scope -------------------------------------------------------------------


class _ArrivesAtTheDeadline(Upstream):
    """Its last chunk is read before the stall deadline, but the reading task resumes only after it.

    That is what a real read does when the deadline falls in the same event-loop turn as the data:
    trio's socket read ends in a shielded checkpoint after ``recv`` succeeded, and asyncio may run
    the deadline's timer before the reading task's wake-up (a loop lagging under load). The relay
    must relay the chunk, as it did with a scope per read: the data came in time.
    """

    def __init__(self, *chunks: bytes, lag: float) -> None:
        super().__init__()
        self.chunks = list(chunks)
        self.lag = lag

    async def __anext__(self) -> bytes:
        if not self.chunks:
            raise StopAsyncIteration
        item = self.chunks.pop(0)
        if not self.chunks:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.lag)  # the data is in hand; the deadline passes meanwhile
        return item


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [True, False])
async def test_a_chunk_read_as_the_stall_deadline_passes_is_relayed(sse_stream: bool) -> None:
    # One stall scope per response: its deadline was lifted after the read, but a cancel that already
    # ran cannot be undone, so the scope cancelled the sending of a chunk that had arrived: the
    # client got upstream_stalled instead of the stream's end (outcome "stalled"); a plain body was cut.
    stream = _ArrivesAtTheDeadline(ROLE + HELLO, STOP + DONE, lag=0.3)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    client = Client()
    result = await run(upstream_response(stream, headers=headers), client, stall_timeout=0.2)
    assert result.outcome == "complete" and client.ended
    assert client.body == ROLE + HELLO + STOP + DONE
    assert stream.closed


@pytest.mark.anyio
async def test_after_a_chunk_at_the_deadline_the_stall_guard_still_works() -> None:
    # The chunk that came as the deadline passed is relayed outside the spent scope; the next silence
    # is still a stall.
    class ThenSilence(_ArrivesAtTheDeadline):
        async def __anext__(self) -> bytes:
            if len(self.chunks) == 1:
                item = self.chunks.pop(0)
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(self.lag)
                return item
            await anyio.sleep(30)
            raise StopAsyncIteration

    stream = ThenSilence(ROLE + HELLO, lag=0.3)
    client = Client()
    result = await run(upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=0.2)
    assert result.outcome == "stalled"
    assert client.body.startswith(ROLE + HELLO)
    assert client.error_event()["code"] == "upstream_stalled"


# -- the SSE guard's skip after content, against a tracker that parses every event --------------

CONTENT = {
    "openai-chat": (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
    ),
    "openai-responses": (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
    ),
    "anthropic-messages": (
        b'event: message_start\ndata: {"type":"message_start","message":{"stop_reason":null}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta'
        b'","delta":{"type":"text_delta","text":"Hi"}}\n\n'
    ),
    "gemini": b'data: {"candidates":[{"content":{"parts":[{"text":"Hi"}]}}]}\n\n',
}


def _verdict(tracker: SSETracker) -> tuple[object, ...]:
    return (
        tracker.starved,
        tracker.judged,
        tracker.saw_content,
        tracker.saw_terminal,
        tracker.saw_natural_stop,
        tracker.saw_error,
        tracker.error_message,
        tracker.events,
        tracker.parser.at_boundary,
        tracker.parser.mid_event,
    )


def _judge(raw: bytes, cuts: list[int], *, keep_text: bool) -> SSETracker:
    tracker = SSETracker(keep_text=keep_text)
    start = 0
    for cut in [*sorted(set(cuts)), len(raw)]:
        tracker.feed(raw[start:cut])
        start = cut
    return tracker


# Events an upstream may send after content that look like ordinary content to a byte scan, in every
# spelling the brief of the attack named: error objects inside content events, event names and types
# that disagree, escapes, duplicate keys, ``data:`` without its space, multi-line data, CR/CRLF/LF,
# comments, id and retry fields.
HOSTILE = {
    "chat-error-beside-choices": b'data: {"choices":[{"delta":{"content":"x"}}],"error":{"message":"boom"}}\n\n',
    "chat-error-escaped-key": b'data: {"choices":[],"\\u0065rror":{"message":"boom"}}\n\n',
    "chat-error-escaped-word": b'data: {"choices":[],"err\\u006fr":{"message":"boom"}}\n\n',
    "chat-type-error-escaped": b'data: {"type":"\\u0065rror","message":"boom"}\n\n',
    "chat-finish-no-space-data": b'data:{"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n',
    "chat-finish-multiline": b'data: {"choices":[{"delta":{},\ndata: "finish_reason":"stop"}]}\n\n',
    "chat-finish-split-key-value": b'data: {"choices":[{"finish_reason":\ndata: "stop"}]}\n\n',
    "chat-finish-null-then-value-lines": (
        b'data: {"choices":[{"finish_reason":null}\ndata: ,{"finish_reason":"stop"}]}\n\n'
    ),
    "chat-finish-cr": b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\r\r',
    "chat-finish-crlf": b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\r\n\r\n',
    "chat-finish-comment-id-retry": b': hi\nid: 7\nretry: 10\ndata: {"choices":[{"finish_reason":"stop"}]}\n\n',
    "chat-finish-tab": b'data: {"choices":[{"finish_reason":\t"stop"}]}\n\n',
    "chat-null-dup-later-value": b'data: {"choices":[{"finish_reason":null,"delta":{},"finish_reason":"length"}]}\n\n',
    "chat-done-no-space": b"data:[DONE]\n\n",
    "chat-done-cr": b"data: [DONE]\r\n\r\n",
    "chat-done-cr-only": b"data: [DONE]\r\r",
    "chat-done-trailing-cr-in-value": b"data: [DONE]\r\n\n",
    "anthropic-name-delta-type-error": (
        b'event: content_block_delta\ndata: {"type":"error","error'
        b'":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    ),
    "anthropic-name-error-type-delta": (
        b'event: error\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}\n\n'
    ),
    "anthropic-name-stop-type-delta": (
        b'event: message_stop\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}\n\n'
    ),
    "anthropic-name-delta-type-stop": b'event: content_block_delta\ndata: {"type":"message_stop"}\n\n',
    "anthropic-escaped-stop-type": b'event: content_block_delta\ndata: {"type":"message_\\u0073top"}\n\n',
    "anthropic-escaped-stop-reason": (
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_\\u0072eason":"end_turn"}}\n\n'
    ),
    "anthropic-event-name-cr": b'event: message_stop\rdata: {"type":"message_stop"}\r\r',
    "gemini-error-beside-candidates": (
        b'data: {"candidates":[{"content":{"parts":[{"text":"x"}]}}],"error":{"code":500,"message":"boom"}}\n\n'
    ),
    "gemini-finish-late-key": (
        b'data: {"candidates":[{"content":{"parts":[{"text":"x"}]},"index":0,"finishReason":"STOP"}]}\n\n'
    ),
    "gemini-finish-escaped": b'data: {"candidates":[{"finish\\u0052eason":"STOP"}]}\n\n',
    "gemini-block-escaped": b'data: {"promptFeedback":{"block\\u0052eason":"SAFETY"}}\n\n',
    "responses-failed-key-order": (
        b'data: {"response":{"status":"failed","error":{"message":"boom"}},"type":"response.failed"}\n\n'
    ),
    "responses-failed-escaped": b'data: {"type":"response.f\\u0061iled","response":{}}\n\n',
    "responses-incomplete-spaced": b'data: { "type" : "response.incomplete" , "response" : { } }\n\n',
    "responses-completed-escaped": b'data: {"type":"response.\\u0063ompleted"}\n\n',
    "responses-object-escaped": b'data: {"\\u006fbject":"response","status":"completed"}\n\n',
    "responses-error-type": b'event: error\ndata: {"type":"error","code":"server_error","message":"boom"}\n\n',
    "leading-space-object": b'data:   {"choices":[{"finish_reason":"stop"}],"type":"message_stop"}\n\n',
    "bom-mid-stream": b'data: \xef\xbb\xbf{"choices":[{"finish_reason":"stop"}]}\n\n',
}


def _all_cuts(raw: bytes) -> list[list[int]]:
    return [[]] + [[i] for i in range(1, len(raw))]


@pytest.mark.parametrize("fmt", list(CONTENT))
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_event_after_content_is_judged_as_when_parsed(fmt: str, name: str) -> None:
    """Every hostile spelling, after content in every format, cut at every byte: the tracker that skips
    inert events decides exactly as the one that parses everything (and the parse finds the terminal)."""
    raw = CONTENT[fmt] + HOSTILE[name]
    for cuts in _all_cuts(raw):
        fast, reference = _judge(raw, cuts, keep_text=False), _judge(raw, cuts, keep_text=True)
        assert fast.saw_content
        assert _verdict(fast) == _verdict(reference), (name, cuts)


_KEYS = (
    "choices",
    "delta",
    "content",
    "text",
    "finish_reason",
    "error",
    "type",
    "message",
    "stop_reason",
    "candidates",
    "parts",
    "finishReason",
    "promptFeedback",
    "blockReason",
    "object",
    "status",
    "response",
    "index",
)
_WORDS = (
    "stop",
    "error",
    "end_turn",
    "message_stop",
    "content_block_delta",
    "response.completed",
    "response.failed",
    "response.incomplete",
    "response.output_text.delta",
    "STOP",
    "failed",
    "completed",
    "x",
    "",
)


def _escape(text: str, rng: random.Random) -> str:
    """``text`` as a JSON string body, some characters written as ``\\uXXXX``."""
    return "".join(f"\\u{ord(c):04x}" if rng.random() < 0.2 else c for c in text)


def _write(value: Any, rng: random.Random) -> str:
    """JSON with hostile spellings: random whitespace (newlines included), escapes, duplicate keys."""

    def space() -> str:
        spaces: list[str] = ["", "", " ", "\t", "\n", "  "]
        return rng.choice(spaces)

    if isinstance(value, list) and value and value[0] == "__object__":
        items = [f'{space()}"{_escape(k, rng)}"{space()}:{space()}{_write(v, rng)}' for k, v in value[1:]]
        return "{" + ",".join(items) + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + _write(v, rng) for v in value) + "]"
    if isinstance(value, str):
        return f'"{_escape(value, rng)}"'
    return json.dumps(value)


_leaf = st.one_of(st.none(), st.sampled_from(_WORDS), st.integers(0, 3), st.booleans())
_json_value = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(st.tuples(st.sampled_from(_KEYS), inner), min_size=1, max_size=4).map(
            lambda pairs: ["__object__", *pairs]
        ),
    ),
    max_leaves=12,
)
_objects = st.lists(st.tuples(st.sampled_from(_KEYS), _json_value), min_size=1, max_size=4).map(
    lambda pairs: ["__object__", *pairs]
)
_names = st.sampled_from(
    [None, "error", "message_stop", "content_block_delta", "message_delta", "response.completed", "ping", "message"]
)


@st.composite
def _events(draw: st.DrawFn) -> bytes:
    rng = draw(st.randoms(use_true_random=False))
    data = _write(draw(_objects), rng)
    end = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    lines = []
    if draw(st.booleans()):
        lines.append(": comment")
    name = draw(_names)
    if name is not None:
        lines.append(f"event: {name}")
    if draw(st.booleans()):
        lines.append("id: 1")
    # The data over several ``data:`` lines (joined with newlines: JSON whitespace), with or without the space.
    for piece in data.split("\n"):
        lines.append(("data:" if draw(st.booleans()) else "data: ") + piece)
    return (end.join(lines) + end + end).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(list(CONTENT)),
    events=st.lists(_events(), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 4000), max_size=6),
)
def test_any_event_after_content_is_judged_as_when_parsed(fmt: str, events: list[bytes], cuts: list[int]) -> None:
    raw = CONTENT[fmt] + b"".join(events)
    cuts = [c for c in cuts if c < len(raw)]
    fast, reference = _judge(raw, cuts, keep_text=False), _judge(raw, cuts, keep_text=True)
    assert _verdict(fast) == _verdict(reference)


# -- end to end: what an SDK sees when the skipped part of a stream carries the error ------------

_OAI_ROLE = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
_OAI_FIRST = _OAI_ROLE + b'"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n'
_OAI_MORE = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"lo"},"finish_reason":null}]}\n\n'
)
_CLAUDE_FIRST = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
    b'"assistant","model":"claude","content":[],"stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":1,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hel"}}\n\n'
)
_CLAUDE_MORE = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"lo"}}\n\n'
)

# (the events after the first content, as the upstream sends them; the message the SDK must raise)
OPENAI_ERRORS = {
    "error-beside-choices": (
        _OAI_MORE + b'data: {"choices":[{"index":0,"delta":{}}],"error":{"message":"boom beside"}}\n\n',
        "boom beside",
    ),
    "escaped-error-key": (_OAI_MORE + b'data: {"\\u0065rror":{"message":"boom escaped"}}\n\n', "boom escaped"),
    "error-no-space-crlf": (_OAI_MORE + b'data:{"error":{"message":"boom crlf"}}\r\n\r\n', "boom crlf"),
    "error-multiline": (_OAI_MORE + b'data: {"error":\ndata: {"message":"boom lines"}}\n\n', "boom lines"),
    "named-error": (_OAI_MORE + b'event: error\r\ndata: {"error":{"message":"boom named"}}\r\n\r\n', "boom named"),
}
ANTHROPIC_ERRORS = {
    "error-event": (
        _CLAUDE_MORE + b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Over"}}\n\n',
        "Over",
    ),
    "error-event-cr": (
        _CLAUDE_MORE + b'event: error\rdata: {"type":"error","error":{"type":"api_error","message":"Cr"}}\r\r',
        "Cr",
    ),
}


def _raw_stream_upstream(events: bytes) -> Any:
    """A raw upstream answering every request with a chunked event stream: ``events`` one byte per
    HTTP chunk (every split of every event), then the end of the body."""
    body = b"".join(chunk(events[i : i + 1]) for i in range(len(events)))
    return raw_upstream(answering(SSE_HEAD + body + b"0\r\n\r\n"))


@contextlib.contextmanager
def _gateway(upstream_url: str) -> Iterator[tuple[str, Starlette]]:
    gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), **SDK_SETTINGS))
    with serve_in_thread(gateway) as url:
        yield url, gateway


def _outcome(gateway: Starlette) -> str:
    settle(lambda: gateway.state.book.get(SESSION) is not None, what=lambda: "the outcome recorded")
    entry = gateway.state.book.get(SESSION)
    assert entry is not None
    return str(entry.last_outcome)


@pytest.mark.parametrize("name", list(OPENAI_ERRORS))
def test_the_openai_sdk_sees_an_error_sent_after_content(name: str) -> None:
    events, message = OPENAI_ERRORS[name]
    with _raw_stream_upstream(_OAI_FIRST + events) as upstream, _gateway(upstream.url) as (url, gateway):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=SDK_TIMEOUT) as client:
            stream = client.chat.completions.create(
                model="m", messages=CHAT_HELLO, stream=True, extra_headers={"x-session-id": SESSION}
            )
            text = ""
            with pytest.raises(openai.APIError, match=message):
                for part in stream:
                    text += part.choices[0].delta.content or "" if part.choices else ""
            assert text == "Hello"
        assert _outcome(gateway) == "upstream_error"
        assert len(upstream.requests) == 1


@pytest.mark.parametrize("name", list(ANTHROPIC_ERRORS))
def test_the_anthropic_sdk_sees_an_error_sent_after_content(name: str) -> None:
    events, message = ANTHROPIC_ERRORS[name]
    with _raw_stream_upstream(_CLAUDE_FIRST + events) as upstream, _gateway(upstream.url) as (url, gateway):
        with anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0, timeout=SDK_TIMEOUT) as client:
            text = ""
            with pytest.raises(anthropic.APIStatusError, match=message):
                with client.messages.stream(
                    model="claude", max_tokens=10, messages=CLAUDE_HELLO, extra_headers={"x-session-id": SESSION}
                ) as stream:
                    for piece in stream.text_stream:
                        text += piece
            assert text == "Hello"
        assert _outcome(gateway) == "upstream_error"
        assert len(upstream.requests) == 1


# A terminal a byte scan cannot see, then the end of the body: the answer is whole (no starvation error
# appended); and an event that only looks terminal: the stream starved (the SDK gets the error).
OPENAI_ENDINGS = {
    "spaced-finish": (b'data: {"choices":[{"index":0,"delta":{},"finish_reason" : "stop"}]}\n\n', None),
    "escaped-finish": (b'data: {"choices":[{"index":0,"delta":{},"finish_\\u0072eason":"stop"}]}\n\n', None),
    "finish-over-lines": (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":\ndata: "stop"}]}\n\n', None),
    "finish-in-text-only": (
        b'data: {"choices":[{"index":0,"delta":{"content":"finish_reason stop"},"finish_reason":null}]}\n\n',
        "ended without a terminal event",
    ),
}


@pytest.mark.parametrize("name", list(OPENAI_ENDINGS))
def test_the_openai_sdk_gets_a_whole_answer_or_the_starvation_error(name: str) -> None:
    events, message = OPENAI_ENDINGS[name]
    with _raw_stream_upstream(_OAI_FIRST + _OAI_MORE + events) as upstream, _gateway(upstream.url) as (url, gateway):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=SDK_TIMEOUT) as client:
            stream = client.chat.completions.create(
                model="m", messages=CHAT_HELLO, stream=True, extra_headers={"x-session-id": SESSION}
            )
            with contextlib.ExitStack() as expect:
                if message is not None:
                    expect.enter_context(pytest.raises(openai.APIError, match=message))
                text = "".join(part.choices[0].delta.content or "" for part in stream if part.choices)
                assert text.startswith("Hello")
        assert _outcome(gateway) == ("complete" if message is None else "starved")
        assert len(upstream.requests) == 1


# -- cookies: one client's upstream Set-Cookie never reaches another client's upstream request ------


class _CookieThenRedirect:
    """A raw upstream's answers: the first sets a session cookie, every later one redirects."""

    def __init__(self) -> None:
        self.url = ""

    def __call__(self, request: RawRequest) -> Script:
        if request.target == "/elsewhere" or not request.headers.get("x-second"):
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nset-cookie: session=a-secret; Path=/\r\n"
            return [head + b"content-length: 2\r\n\r\n{}"]
        location = f"location: {self.url}/elsewhere\r\n".encode()
        return [b"HTTP/1.1 307 Temporary Redirect\r\n" + location + b"content-length: 0\r\n\r\n"]


@pytest.mark.parametrize("client", ["gateway's own", "caller's, following redirects"])
def test_an_upstream_cookie_never_reaches_another_clients_upstream_request(client: str) -> None:
    # The gateway's own client keeps no cookie (2c8aa0f). A client passed in keeps its jar, which fills
    # with every client's upstream Set-Cookie; httpx sends that jar on a redirect it follows: client B's
    # request went to Location with client A's session cookie (and its body re-sent there). Now no
    # redirect is followed, whatever the client (the aiohttp transport never did): B gets the 307.
    own = None
    if client != "gateway's own":
        own = httpx.AsyncClient(
            follow_redirects=True,
            cookies={"caller": "own-cookie"},
            transport=httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0)),
        )
    answer = _CookieThenRedirect()
    with raw_upstream(answer) as upstream:
        answer.url = upstream.url
        gateway = create_app(LifetimeSettings(upstream_url=(upstream.url,), **SDK_SETTINGS), client=own)
        body = {"model": "m", "messages": []}
        with serve_in_thread(gateway) as url:
            with httpx.Client(base_url=url, timeout=SDK_TIMEOUT) as client_a:
                first = client_a.post("/v1/chat/completions", json=body)
            assert first.status_code == 200 and first.headers["set-cookie"].startswith("session=")  # A's, relayed
            with httpx.Client(base_url=url, timeout=SDK_TIMEOUT, headers={"x-second": "1"}) as client_b:
                second = client_b.post("/v1/chat/completions", json=body)
        assert all("cookie" not in r.headers for r in upstream.requests), [r.headers for r in upstream.requests]
        assert [r.target for r in upstream.requests] == ["/v1/chat/completions"] * 2
        assert second.status_code == 307
        jar = gateway.state.upstream._client.cookies
        if own is None:
            # No cookie kept at all (httpx's private _cookies replaced: this fails if httpx moves its jar).
            assert len(jar) == 0 and type(jar).__name__ == "_NoCookies"
    if own is not None:
        assert own.cookies.get("caller") == "own-cookie"  # the caller's jar is the caller's: left as it was set


# -- a response read to its end is not closed again: its connection is still never handed on dirty --

_STREAM_END = (
    chunk(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n') + b"0\r\n\r\n"
)
_SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n" + b'{"smuggled": 1}'
# What the first answer looks like: a whole stream followed by a second response in the same write, or
# split so that the end of the stream and the extra response come in the read after its head.
FIRST_ANSWERS: dict[str, list[bytes]] = {
    "stream then a response, one write": [SSE_HEAD + chunk(FIRST) + _STREAM_END + _SMUGGLED],
    "stream, then its end and a response": [SSE_HEAD + chunk(FIRST), _STREAM_END + _SMUGGLED],
    "stream, a chunk declaring less than it carries": [
        SSE_HEAD + chunk(FIRST) + b"5\r\n" + b'data: {"x":1}\n\n' + b"\r\n" + _STREAM_END + _SMUGGLED
    ],
}


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(FIRST_ANSWERS))
async def test_a_stream_read_to_its_end_never_hands_its_leftovers_on(case: str, transport: str) -> None:
    fresh = b'{"fresh": true}'

    def answer(request: RawRequest) -> Script:
        if request.target.startswith("/v1/chat"):
            return list(FIRST_ANSWERS[case])
        return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n" + fresh]

    with raw_upstream(answer) as upstream, running(upstream_url=upstream.url, upstream_transport=transport) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            async with client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as one:
                first = b"".join([piece async for piece in one.aiter_raw()])
            two = await client.post("/v1/second", json={})
        await assert_idle(stack.app, stack.url)
    assert one.status_code == 200 and first.startswith(FIRST)
    assert two.status_code == 200 and two.content == fresh
    second = [r for r in upstream.requests if r.target == "/v1/second"]
    assert len(second) == 1 and all(
        r.connection != second[0].connection for r in upstream.requests if r is not second[0]
    )


# -- the relay over real sockets: drips, bursts then silence, a slow client, hang-ups -------------

_END = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def _dripped(data: bytes, pause: float) -> list[bytes | str | Callable[[], bytes]]:
    """One byte per HTTP chunk, each ``pause`` seconds after the last (the upstream's thread sleeps)."""

    def step(byte: bytes) -> Callable[[], bytes]:
        def later() -> bytes:
            time.sleep(pause)
            return chunk(byte)

        return later

    return [step(data[i : i + 1]) for i in range(len(data))]


def _scripted(*steps: bytes | str | Callable[[], bytes]) -> Callable[[RawRequest], Script]:
    return lambda request: list(steps)


def _without_keepalives(body: bytes) -> tuple[bytes, list[int]]:
    """The body without the gateway's keep-alives, and where each one was (offsets in what is left)."""
    rest, offsets = bytearray(), []
    for piece in body.split(KEEPALIVE):
        rest += piece
        offsets.append(len(rest))
    return bytes(rest), offsets[:-1]


@pytest.mark.anyio
async def test_a_dripped_stream_gets_keepalives_only_between_events() -> None:
    # One byte every 20 ms, the stall timeout 0.5 s, a keep-alive after 50 ms of client silence: the
    # stream is relayed whole (not a stall: no silence is that long), and every keep-alive sits
    # between two of the upstream's events, never inside one.
    events = FIRST + _END
    with (
        raw_upstream(_scripted(SSE_HEAD, *_dripped(events, 0.02), b"0\r\n\r\n")) as upstream,
        running(upstream_url=upstream.url, keepalive_interval=0.05, stall_timeout=0.5) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async with client.stream("POST", PATH, json=STREAM_BODY) as response:
                body = b"".join([piece async for piece in response.aiter_raw()])
        await assert_idle(stack.app, stack.url)
    rest, offsets = _without_keepalives(body)
    assert rest == events
    assert offsets, "no keep-alive was sent: the test did not test"
    boundaries = {0, len(FIRST), len(FIRST) + _END.index(b"\n\n") + 2, len(events)}
    assert set(offsets) <= boundaries, (offsets, boundaries)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cut", ["between events", "inside an event"])
async def test_a_burst_then_silence_is_a_stall_and_everything_is_released(cut: str, transport: str) -> None:
    burst = FIRST * 50 + (b"" if cut == "between events" else b'data: {"choices":[{"index":0,"del')
    with (
        raw_upstream(answering(SSE_HEAD, chunk(burst), HOLD)) as upstream,
        running(upstream_url=upstream.url, stall_timeout=0.3, upstream_transport=transport) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async with client.stream("POST", PATH, json=STREAM_BODY) as response:
                body = b"".join([piece async for piece in response.aiter_raw()])
        assert upstream.released.wait(5), "the gateway did not hang up on the stalled upstream"
        await assert_idle(stack.app, stack.url)
        assert stack.stats()["stalled"] == 1
    rest, _ = _without_keepalives(body)
    assert rest.startswith(FIRST * 50)
    assert sse_error(rest[len(FIRST * 50) :]) is not None
    assert rest[len(FIRST * 50) :].startswith(b"event: error")  # no half event before it
    assert b'"upstream_stalled"' in rest


@pytest.mark.anyio
async def test_a_client_that_does_not_read_while_the_upstream_stalls() -> None:
    # The client's window is small and it reads nothing: the relay waits on the client (no stall: the
    # upstream is not the slow one); then the upstream goes silent; the client reads it all: the
    # events, then upstream_stalled.
    burst = FIRST * 4000  # ~300 KiB: more than the client's socket and uvicorn take
    with (
        raw_upstream(answering(SSE_HEAD, chunk(burst), HOLD)) as upstream,
        running(upstream_url=upstream.url, stall_timeout=0.3) as stack,
    ):
        async with raw_client(stack.url, rcvbuf=4096) as client:
            await client.send(request_bytes(json.dumps(STREAM_BODY).encode()))
            status, _ = await client.head()
            assert status == 200
            await anyio.sleep(1.0)  # longer than the stall timeout, the client reading nothing
            body = bytearray()
            with anyio.fail_after(20):
                while piece := await client.data(seconds=10):
                    body += piece
        assert upstream.released.wait(5)
        await assert_idle(stack.app, stack.url)
    rest, _ = _without_keepalives(bytes(body))
    assert rest.startswith(burst)
    assert b'"upstream_stalled"' in rest[len(burst) :]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("phase", ["before the first byte", "inside a dripped event", "between events", "in silence"])
async def test_a_client_leaving_at_any_phase_releases_everything(phase: str, transport: str) -> None:
    steps: dict[str, list[bytes | str | Callable[[], bytes]]] = {
        "before the first byte": [HOLD],
        "inside a dripped event": [SSE_HEAD, chunk(FIRST), *_dripped(FIRST[:30], 0.01), HOLD],
        "between events": [SSE_HEAD, chunk(FIRST), HOLD],
        "in silence": [SSE_HEAD, chunk(FIRST), chunk(b": upstream comment\n\n"), HOLD],
    }
    with (
        raw_upstream(_scripted(*steps[phase])) as upstream,
        running(
            upstream_url=upstream.url, stall_timeout=10.0, keepalive_interval=0.05, upstream_transport=transport
        ) as stack,
    ):
        async with raw_client(stack.url) as client:
            await client.send(request_bytes(json.dumps(STREAM_BODY).encode()))
            assert upstream.held.wait(5)
            if phase != "before the first byte":
                assert (await client.head())[0] == 200
                assert (await client.data()).startswith(FIRST)
        assert upstream.released.wait(5), "the upstream was not hung up on"
        await assert_idle(stack.app, stack.url)


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [True, False])
async def test_a_stream_of_ready_chunks_does_not_hold_the_event_loop(sse_stream: bool) -> None:
    # The send lock takes no loop turn any more (fast_acquire), and httpcore hands over the HTTP chunks
    # h11 parsed from one socket read without awaiting: 2-byte chunks relayed one after the other
    # without a single loop turn (measured on main under uvicorn: 4,000 events in 2-byte HTTP chunks,
    # a /healthz probe every 2 ms got 67 answers in 4.5 s, against 1,173 in 9.8 s before 7c1103d).
    # Here the upstream's chunks are all ready: other tasks must still get turns while they are relayed.
    events = sse(delta(content="x")) * 200
    chunks = [events[i : i + 2] for i in range(0, len(events), 2)]
    turns = 0
    done = anyio.Event()

    async def other_request() -> None:
        nonlocal turns
        while not done.is_set():
            await anyio.lowlevel.checkpoint()
            turns += 1

    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    client = Client()
    async with anyio.create_task_group() as tg:
        tg.start_soon(other_request)
        await anyio.lowlevel.checkpoint()
        before = turns
        result = await run(upstream_response(Upstream(*chunks, STOP + DONE), headers=headers), client)
        during = turns - before
        done.set()
    assert client.body == events + STOP + DONE and result.outcome == "complete"
    assert during >= len(chunks) // 64, f"{during} turns for {len(chunks)} chunks"


# -- upstream URLs parsed once: no collision, no growth, no leak -------------------------------------


@pytest.mark.anyio
async def test_the_url_cache_never_mixes_requests_up_and_stays_bounded() -> None:
    # Paths that differ only in case, percent-encoding, a trailing slash, dot segments, a fragment-like
    # %23, plus 300 per-request ids (more than the cache holds) and queries (never kept: they may carry
    # a key): each request goes to exactly its own URL, and the cache stays within its bound.
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.raw_path, "ascii"))
        return httpx.Response(200, json={})

    tricky = ["/v1/a", "/V1/a", "/v1/%61", "/v1/a/", "/v1/./a", "/v1/a%23b", "/v1/a?key=one", "/v1/a?key=two"]
    paths = [*tricky, *(f"/v1/files/file-{n}" for n in range(300)), *tricky]
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with UpstreamClient(settings=LifetimeSettings(), base_url="http://upstream.test", client=client) as upstream:
        for path in paths:
            prepared = Prepared(method="POST", path=path, headers=[], body=b"{}")
            await (await upstream.forward(prepared, on_retries_settled=lambda: None)).aclose()
        cached = dict(upstream._urls)
    await client.aclose()
    expected = [str(httpx.URL("http://upstream.test" + path).raw_path, "ascii") for path in paths]
    assert seen == expected
    assert len(cached) <= 256 and not any("?" in text for text in cached)
    assert all(url == httpx.URL(text) for text, url in cached.items())  # each under its own text
