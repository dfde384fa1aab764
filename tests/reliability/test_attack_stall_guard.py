"""The stall guard run by the request's ``ClientWatch``, attacked by someone who did not write it.

The watch wakes for keep-alives and stall checks, and cancels the relay's read scope once a read has
waited ``STALL_TIMEOUT``. Attacks: a keep-alive the client does not take while the upstream stalls
(the watch busy sending it), drips just under the timeout, a burst then silence, silence after the
headers, a stalled JSON body, keep-alive intervals around the timeout, a deaf watch (``receive()``
failed), many streams stalling at their own times, the Gemini dialect.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import anthropic
import anyio
import httpx
import openai
import pytest
from starlette.types import Message

from asgi_lifetime.gateway._sse import KEEPALIVE, KEEPALIVE_LINE, SSEParser

from ..gateway._raw_upstream import HOLD, RawRequest, Script, raw_upstream, response
from ..gateway.test_relay import (
    DONE,
    HELLO,
    ROLE,
    SSE_HEADERS,
    STOP,
    Client,
    Reissuer,
    Upstream,
    run,
    upstream_response,
)
from ..gateway.test_relay_first_error import chat_error
from ..gateway.test_sdk import CLAUDE_HELLO, SDK_TIMEOUT
from ..gateway.test_sdk import HELLO as CHAT_HELLO
from .test_attack_cpu_cuts import _CLAUDE_FIRST, _OAI_FIRST
from .test_attack_sse_fast_path import SERVERS, gateway
from .test_attack_upstream import FIRST, SSE_HEAD, STREAM_BODY, chunk
from .test_faults import PATH, assert_idle

STALL = 0.3


class _Silent(Upstream):
    """``Upstream`` whose close is an event (the gateway hung up on it)."""

    def __init__(self, *items: bytes | float | Exception) -> None:
        super().__init__(*items)
        self.hung_up = anyio.Event()

    async def aclose(self) -> None:
        await super().aclose()
        self.hung_up.set()


class _NotReading(Client):
    """A client whose window is full once it has its first bytes: a later body send (the watch's
    keep-alive, the relay's error event) blocks until the upstream is hung up on, or 5 s."""

    def __init__(self, upstream: _Silent) -> None:
        super().__init__()
        self.upstream = upstream
        self.blocked_at: float | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and self.body and message["body"] in (KEEPALIVE, KEEPALIVE_LINE):
            self.blocked_at = time.monotonic()
            with anyio.move_on_after(5):
                await self.upstream.hung_up.wait()
        await super().send(message)


@pytest.mark.anyio
@pytest.mark.parametrize("keepalive_interval", [0.05, STALL / 2])
async def test_a_keepalive_the_client_does_not_take_does_not_hold_off_the_stall(keepalive_interval: float) -> None:
    # The watch sends the keep-alives and guards stalls: while it waited on a client that takes nothing,
    # nothing cut the stalled read, and the upstream was held until the client read or left (before
    # the watch guarded stalls, the read's own deadline hung up on it after STALL_TIMEOUT).
    stream = _Silent(ROLE, 30.0)
    client = _NotReading(stream)
    started = time.monotonic()
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS),
        client,
        stall_timeout=STALL,
        keepalive_interval=keepalive_interval,
    )
    assert client.blocked_at is not None, "no keep-alive was sent: the test did not test"
    assert result.outcome == "stalled"
    assert stream.closed
    elapsed = time.monotonic() - started
    assert STALL <= elapsed < 3 * STALL, elapsed
    assert client.error_event()["code"] == "upstream_stalled"


class _SlowToTakeAKeepalive(Client):
    """A client that takes its first keep-alive only once the upstream delivered again, and then only after
    ``STALL`` more: a slow client, not a stalled upstream. Notes a send cut short (servers' sends are not
    all safe to cancel: trio's ``send_all`` may have written part of the bytes)."""

    def __init__(self, delivered: anyio.Event) -> None:
        super().__init__()
        self.delivered = delivered
        self.cut_short = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and message["body"] in (KEEPALIVE, KEEPALIVE_LINE):
            try:
                if not self.delivered.is_set():
                    await self.delivered.wait()
                    await anyio.sleep(STALL)  # the client's slowness, past the read's stall time
            except BaseException:
                self.cut_short += 1
                raise
        await super().send(message)


@pytest.mark.anyio
async def test_a_keepalive_held_up_while_the_upstream_delivers_is_no_stall() -> None:
    # The read ends in time while the watch waits on the client to take a keep-alive: the relay then waits
    # for the client (it sends under the same lock), no stall; and the keep-alive's send is not cut short.
    delivered = anyio.Event()
    stream = Upstream(
        ROLE, STALL / 2, HELLO, STOP + DONE, on_pull=lambda pulled: delivered.set() if pulled == 2 else None
    )
    client = _SlowToTakeAKeepalive(delivered)
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=STALL, keepalive_interval=0.05
    )
    assert result.outcome == "complete" and client.cut_short == 0
    assert client.body.replace(KEEPALIVE, b"") == ROLE + HELLO + STOP + DONE and KEEPALIVE in client.body


class _Timed(Client):
    """A client that notes when its response ended, and may leave when the upstream is hung up on, or
    fail every ``receive()`` (a server whose receive is broken)."""

    def __init__(self, *, leave_on: anyio.Event | None = None, broken: bool = False) -> None:
        super().__init__()
        self.ended_at: float | None = None
        self.leave_on = leave_on
        self.broken = broken

    async def send(self, message: Message) -> None:
        await super().send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended_at = time.monotonic()

    async def receive(self) -> Message:
        if self.broken:
            raise RuntimeError("receive() is broken")
        if self.leave_on is not None:
            await self.leave_on.wait()
            return {"type": "http.disconnect"}
        return await super().receive()


class _Pulls(_Silent):
    """Notes when the last chunk was handed to the relay."""

    def __init__(self, *items: bytes | float | Exception) -> None:
        super().__init__(*items)
        self.last_pull = time.monotonic()
        self.on_pull = self._note

    def _note(self, pulled: int) -> None:
        self.last_pull = time.monotonic()


@pytest.mark.anyio
@pytest.mark.parametrize("first", ["starved", "transient error"])
@pytest.mark.parametrize("then", ["answers slowly", "stalls"])
async def test_a_reissued_response_has_a_stall_guard_of_its_own(first: str, then: str) -> None:
    # The first response waits half the timeout before it starves or fails; the second waits half the
    # timeout before each chunk: the first's read time is not counted into the second's (no early cut),
    # and the second's own silence is still cut on time.
    half = STALL
    stall = 2 * half
    ending = DONE if first == "starved" else chat_error("server_error")  # DONE: nothing to show, withheld
    second_items: list[bytes | float] = [half, ROLE + HELLO, half, STOP + DONE]
    if then == "stalls":
        second_items[-1] = 30.0
    second = _Pulls(*second_items)
    reissue = Reissuer(upstream_response(second, headers=SSE_HEADERS))
    client = _Timed()
    result = await run(
        upstream_response(_Silent(half, ending), headers=SSE_HEADERS),
        client,
        stall_timeout=stall,
        keepalive_interval=5.0,
        reissue=reissue,
    )
    assert reissue.calls == 1 and second.closed
    assert client.body.startswith(ROLE + HELLO)
    if then == "answers slowly":
        assert result.outcome == "complete" and client.body == ROLE + HELLO + STOP + DONE
    else:
        assert result.outcome == "stalled" and client.error_event()["code"] == "upstream_stalled"
        assert client.ended_at is not None
        assert stall <= client.ended_at - second.last_pull < 3 * stall


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [True, False])
@pytest.mark.parametrize("keepalive_interval", [0.05, 5.0])
async def test_a_deaf_watch_still_guards_stalls(keepalive_interval: float, sse_stream: bool) -> None:
    # The server's receive() fails: the watch stops watching the client (and its keep-alives), the stall
    # is still cut on time and reported, the upstream hung up on, the watch's task ended with the relay.
    stream = _Pulls(ROLE, 30.0)
    client = _Timed(broken=True)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    result = await run(
        upstream_response(stream, headers=headers),
        client,
        stall_timeout=STALL,
        keepalive_interval=keepalive_interval,
    )
    ended = time.monotonic()  # a plain body is not ended: the server then closes the connection short
    assert result.outcome == "stalled" and stream.closed
    assert client.body.startswith(ROLE) and KEEPALIVE not in client.body
    if sse_stream:
        assert client.error_event()["code"] == "upstream_stalled"
    assert STALL <= ended - stream.last_pull < 3 * STALL


@pytest.mark.anyio
@pytest.mark.parametrize("sse_stream", [True, False])
async def test_a_client_leaving_as_the_stall_fires(sse_stream: bool) -> None:
    # The client's disconnect comes as the gateway hangs up on the stalled upstream: the relay ends (the
    # run is bounded), the upstream is closed, and nothing is left running.
    stream = _Pulls(ROLE, 30.0)
    client = _Timed(leave_on=stream.hung_up)
    headers = SSE_HEADERS if sse_stream else {"content-type": "application/octet-stream"}
    result = await run(upstream_response(stream, headers=headers), client, stall_timeout=STALL)
    assert stream.closed
    assert result.outcome in ("stalled", "client_disconnected")
    assert client.body.startswith(ROLE)


@pytest.mark.anyio
async def test_many_streams_each_cut_at_its_own_time() -> None:
    # 30 relays, each silent from its own moment on (0 to 0.29 s apart): each cut STALL_TIMEOUT after its
    # own last chunk, none earlier because a neighbour stalled, none held up by the others.
    streams = [_Pulls(ROLE, 0.01 * i, HELLO, 30.0) for i in range(30)]
    clients = [_Timed() for _ in streams]
    outcomes: list[str] = []

    async def one(stream: _Pulls, client: _Timed) -> None:
        result = await run(upstream_response(stream, headers=SSE_HEADERS), client, stall_timeout=STALL)
        outcomes.append(result.outcome)

    async with anyio.create_task_group() as tg:
        for stream, client in zip(streams, clients, strict=True):
            tg.start_soon(one, stream, client)
    assert outcomes == ["stalled"] * 30
    for stream, client in zip(streams, clients, strict=True):
        assert stream.closed and client.body.startswith(ROLE + HELLO)
        assert client.ended_at is not None
        assert STALL <= client.ended_at - stream.last_pull < 3 * STALL, client.ended_at - stream.last_pull


# -- end to end: the gateway under uvicorn and hypercorn (asyncio, trio) before a raw-socket upstream ----

Step = bytes | str | Callable[[], bytes]


class _Marks:
    """Script steps that note when (``time.monotonic()``, one clock for the whole process) the upstream
    wrote its last bytes."""

    def __init__(self) -> None:
        self.last = 0.0

    def at(self, data: bytes) -> Callable[[], bytes]:
        def step() -> bytes:
            self.last = time.monotonic()
            return data

        return step


def _dripped(data: bytes, pause: float, marks: _Marks) -> list[Step]:
    """``data`` an HTTP chunk per byte, ``pause`` apart (the upstream's pace, not a synchronisation)."""

    def step(byte: bytes) -> Callable[[], bytes]:
        def later() -> bytes:
            time.sleep(pause)
            return marks.at(chunk(byte))()

        return later

    return [step(data[i : i + 1]) for i in range(len(data))]


# What the upstream does after its head (then HOLD: silence until the gateway hangs up), and whether the
# client has its status before the stall (then the stall is an in-band error, else a 504).
STALLS: dict[str, tuple[bytes, list[bytes]]] = {
    "headers, then nothing": (SSE_HEAD, []),
    "one event, then silence between events": (SSE_HEAD, [chunk(FIRST)]),
    "a burst, then silence inside an event": (SSE_HEAD, [chunk(FIRST * 40 + FIRST[:25])]),
    "a JSON body's head, then nothing": (
        response(200, b"{}", headers=(("content-type", "application/json"),))[:-2],
        [],
    ),
    "half a JSON body, then silence": (
        response(200, b'{"a": 1}', headers=(("content-type", "application/json"),))[:-8],
        [b'{"a"'],
    ),
}


async def _stream(url: str, *, headers: dict[str, str] | None = None, path: str = PATH) -> tuple[int, bytes, float]:
    """POST a streamed chat request; the status, the raw body, and when its end came."""
    body = bytearray()
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        try:
            async with client.stream("POST", path, json=STREAM_BODY, headers=headers) as answer:
                async for piece in answer.aiter_raw():
                    body += piece
        except httpx.RemoteProtocolError:  # a Content-Length body cut short: the connection closed
            pass
    return answer.status_code, bytes(body), time.monotonic()


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("case", list(STALLS))
async def test_a_stall_is_cut_once_after_stall_timeout(case: str, server: str) -> None:
    # Cut STALL_TIMEOUT after the upstream's last bytes, not earlier (the read began after them) and
    # not much later (not at the watch's next keep-alive, not after two timeouts).
    head, rest = STALLS[case]
    marks = _Marks()
    stall = 0.5
    with (
        raw_upstream(lambda request: [marks.at(head), *map(marks.at, rest), HOLD]) as upstream,
        gateway(upstream.url, server, stall_timeout=stall, keepalive_interval=5.0) as (url, app),
    ):
        status, body, ended = await _stream(url)
        assert upstream.released.wait(5), "the gateway did not hang up on the stalled upstream"
        await assert_idle(app, url)
    assert stall - 0.05 <= ended - marks.last < 3 * stall, ended - marks.last
    assert len(upstream.requests) == 1
    if not rest:  # nothing to send yet: the client gets a status of its own
        assert status == 504 and json.loads(body)["error"]["code"] == "upstream_stalled"
    elif head is SSE_HEAD:
        assert status == 200
        sent = rest[0][rest[0].index(b"\r\n") + 2 : -2]
        whole = sent[: sent.rindex(b"\n\n") + 2]
        assert body.startswith(whole) and body[len(whole) :].startswith(b"event: error\n")  # no half event
        errors = [event for event in SSEParser().feed(body) if event.event == "error"]
        assert [json.loads(event.data)["error"]["code"] for event in errors] == ["upstream_stalled"]
    else:
        assert status == 200 and body == rest[0]  # a body cut short: the connection closed


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize(
    "keepalive_interval", [1.0, 0.5, 0.1], ids=["stall<interval", "stall=interval", "stall>interval"]
)
async def test_keepalives_around_the_stall_timeout(keepalive_interval: float, server: str) -> None:
    # The watch wakes for whichever is due first: the stall is cut on time whatever the keep-alive
    # interval, keep-alives come only between events and only before the cut, none after the error.
    stall, marks = 0.5, _Marks()
    with (
        raw_upstream(lambda request: [marks.at(SSE_HEAD), marks.at(chunk(FIRST)), HOLD]) as upstream,
        gateway(upstream.url, server, stall_timeout=stall, keepalive_interval=keepalive_interval) as (url, app),
    ):
        status, body, ended = await _stream(url)
        assert upstream.released.wait(5)
        await assert_idle(app, url)
    assert stall - 0.05 <= ended - marks.last < 3 * stall, ended - marks.last
    assert status == 200 and body.startswith(FIRST)
    keepalives, _, error = body[len(FIRST) :].partition(b"event: error\n")
    assert keepalives == KEEPALIVE * (len(keepalives) // len(KEEPALIVE))
    assert len(keepalives) // len(KEEPALIVE) <= stall / keepalive_interval + 1
    assert error.endswith(b"\n\n") and error.count(b"\n\n") == 1 and b"upstream_stalled" in error


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
async def test_a_byte_just_under_every_stall_timeout_is_no_stall(server: str) -> None:
    # Each read ends in time: no silence is STALL_TIMEOUT long, so the stream is whole, however long the
    # event takes (documented: STALL_TIMEOUT is silence, not a deadline on progress).
    stall, marks = 0.6, _Marks()
    event = b"data: {}\n\n"
    steps = [marks.at(SSE_HEAD), *_dripped(event, stall / 2, marks), marks.at(b"0\r\n\r\n")]
    with (
        raw_upstream(lambda request: steps) as upstream,
        gateway(upstream.url, server, stall_timeout=stall, keepalive_interval=5.0) as (url, app),
    ):
        status, body, _ = await _stream(url)
        await assert_idle(app, url)
    assert (status, body) == (200, event)
    assert len(upstream.requests) == 1


GEMINI_STREAM = "/v1/models/m:streamGenerateContent?alt=sse"  # under the default paths
GEMINI_EVENT = b'data: {"candidates":[{"content":{"parts":[{"text":"Hi"}],"role":"model"}}]}\n\n'
CLAUDE_EVENT = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message","role":'
    b'"assistant","content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
)
# The client's dialect (its path, or its SDK's header), the upstream's first event, and what the gateway
# may add: its keep-alive comment, and its error event's first line.
DIALECTS: dict[str, tuple[str, dict[str, str], bytes, bytes | None, bytes]] = {
    "openai": (PATH, {}, FIRST, KEEPALIVE, b"event: error\n"),
    "anthropic": ("/v1/messages", {"anthropic-version": "2023-06-01"}, CLAUDE_EVENT, KEEPALIVE, b"event: error\n"),
    "gemini-path": (GEMINI_STREAM, {}, GEMINI_EVENT, None, b'data: {"error":'),
    "gemini-header": (PATH, {"x-goog-api-client": "genai-py/1"}, GEMINI_EVENT, None, b'data: {"error":'),
}


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_a_stall_speaks_the_clients_dialect(dialect: str, server: str) -> None:
    # Keep-alives were due ten times before the stall: a Gemini client gets none and one data-only error
    # event; the others their comments and one ``event: error``.
    path, headers, first, keepalive, error_start = DIALECTS[dialect]
    with (
        raw_upstream(lambda request: [SSE_HEAD, chunk(first), HOLD]) as upstream,
        gateway(upstream.url, server, stall_timeout=0.5, keepalive_interval=0.05) as (url, app),
    ):
        status, body, _ = await _stream(url, headers=headers, path=path)
        assert upstream.released.wait(5)
        await assert_idle(app, url)
    assert status == 200 and body.startswith(first)
    added = body[len(first) :]
    keepalives, _, error = added.partition(error_start)
    if keepalive is None:
        assert keepalives == b"" and b"\n:" not in added and not added.startswith(b":")
    else:
        assert keepalives and keepalives == keepalive * (len(keepalives) // len(keepalive))
    events = SSEParser().feed(error_start + error)
    assert len(events) == 1 and json.loads(events[0].data)["error"]
    assert b"upstream_stalled" in error or b"DEADLINE_EXCEEDED" in error


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_the_sdks_raise_on_a_stall_as_before(sdk: str) -> None:
    # Keep-alives due ten times over, then the stall: the SDKs skip the comments, keep the content and raise
    # on the in-band error (their dialect kept ``: keep-alive`` and ``event: error``).
    first = _OAI_FIRST if sdk == "openai" else _CLAUDE_FIRST
    with (
        raw_upstream(lambda request: [SSE_HEAD, chunk(first), HOLD]) as upstream,
        gateway(upstream.url, "uvicorn", stall_timeout=0.5, keepalive_interval=0.05) as (url, app),
    ):
        text = ""
        if sdk == "openai":
            with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=SDK_TIMEOUT) as oai:
                stream = oai.chat.completions.create(model="m", messages=CHAT_HELLO, stream=True)
                with pytest.raises(openai.APIError, match="sent no data"):
                    for part in stream:
                        text += part.choices[0].delta.content or "" if part.choices else ""
        else:
            with anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0, timeout=SDK_TIMEOUT) as claude:
                with pytest.raises(anthropic.APIStatusError, match="sent no data"):
                    with claude.messages.stream(model="claude", max_tokens=10, messages=CLAUDE_HELLO) as messages:
                        for piece in messages.text_stream:
                            text += piece
        assert text == "Hel"  # the content before the stall
        assert upstream.released.wait(5) and len(upstream.requests) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
async def test_thirty_streams_through_a_server_each_cut_at_its_own_time(server: str) -> None:
    # Each upstream response falls silent at its own moment (10 ms apart): each client gets its error
    # STALL_TIMEOUT after its own upstream's last bytes; no stream is cut for a neighbour's silence.
    stall, count = 0.8, 30
    marks = {n: _Marks() for n in range(count)}

    def answer(request: RawRequest) -> Script:
        n = json.loads(request.body)["n"]
        mark = marks[n]

        def later() -> bytes:
            time.sleep(0.01 * n)  # this upstream's own pace, well within the stall timeout
            return mark.at(chunk(FIRST))()

        return [SSE_HEAD, chunk(FIRST), later, HOLD]

    ended: dict[int, float] = {}
    bodies: dict[int, bytes] = {}

    async def one(client: httpx.AsyncClient, n: int) -> None:
        async with client.stream("POST", PATH, json={**STREAM_BODY, "n": n}) as answer:
            bodies[n] = b"".join([piece async for piece in answer.aiter_raw()])
        ended[n] = time.monotonic()

    with (
        raw_upstream(answer) as upstream,
        gateway(upstream.url, server, stall_timeout=stall, keepalive_interval=5.0) as (url, app),
    ):
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=url, timeout=20, limits=limits) as client:
            async with anyio.create_task_group() as tg:
                for n in range(count):
                    tg.start_soon(one, client, n)
        await assert_idle(app, url)
    assert len(upstream.requests) == count
    for n in range(count):
        assert bodies[n].startswith(FIRST * 2) and b"upstream_stalled" in bodies[n], n
        assert stall - 0.05 <= ended[n] - marks[n].last < 3 * stall, (n, ended[n] - marks[n].last)
