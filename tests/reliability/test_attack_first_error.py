"""Attacks on the re-issue of an event stream whose first event is the upstream's transient error.

A hostile upstream on a raw socket (``_raw_upstream``) behind the gateway under uvicorn on loopback, and
the relay with scripted responses: the re-issue must stay inside the retry policy (``MAX_ATTEMPTS``,
``RETRY_DEADLINE``, the upstreams that failed this request), never give the client two answers, half an
event or a hang, never lose the error, and leave nothing held once the response ends.
"""

from __future__ import annotations

import gzip
import logging
import threading
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._settings import RetainOutbound
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._shutdown import StopSignal
from asgi_lifetime.testing._serve import serve_in_thread

from ..gateway._raw_upstream import CLOSE, HOLD, RawRequest, Script, raw_upstream
from ..gateway.test_relay import Client, Reissuer, run
from ..gateway.test_relay_first_error import (
    CHAT_ERROR_EVENT,
    CHAT_STREAM,
    MESSAGE_START,
    anthropic_error,
    responses_error,
    sse_response,
)
from .test_attack_upstream import SSE_HEAD, STREAM_BODY, chunk
from .test_faults import FAST, PATH, assert_idle, eventually

END = b"0\r\n\r\n"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def first_error_then(second: bytes) -> Any:
    """An upstream whose first answer is a 200 stream of the transient error, every later one ``second``."""

    def answer(request: RawRequest) -> Script:
        return [SSE_HEAD, chunk(CHAT_ERROR_EVENT if request is first[0] else second), END]

    first: list[RawRequest] = []

    def recorded(request: RawRequest) -> Script:
        if not first:
            first.append(request)
        return answer(request)

    return recorded


def access_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    [line] = [r.__dict__["asgi_lifetime"] for r in caplog.records if r.name == "asgi_lifetime.access"]
    return dict(line)


async def post(url: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        return await client.post(PATH, json=STREAM_BODY)


# -- the retry policy ---------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("retain", ["off", "memory", "disk"])
async def test_the_reissue_needs_a_retained_body(retain: RetainOutbound, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    with raw_upstream(first_error_then(CHAT_STREAM)) as upstream:
        # disk with a 0-byte spill threshold: the re-issue reads the body back from the file.
        app = create_app(
            LifetimeSettings(upstream_url=(upstream.url,), retain_outbound=retain, retain_spill_bytes=0, **FAST)
        )
        with serve_in_thread(app) as url:
            response = await post(url)
            stats = await assert_idle(app, url)  # nothing retained or in flight once the response ended
    reissued = retain != "off"
    assert response.content == (CHAT_STREAM if reissued else CHAT_ERROR_EVENT)
    assert len(upstream.requests) == (2 if reissued else 1)
    assert len({r.body for r in upstream.requests}) == 1  # the same bytes, from memory or the file
    line = access_line(caplog)
    assert (line["attempts"], line["outcome"]) == ((2, "complete") if reissued else (1, "upstream_error"))
    assert stats["retried"] == (1 if reissued else 0) and stats["starved"] == 0


@pytest.mark.anyio
async def test_max_attempts_one_sends_the_request_once(caplog: pytest.LogCaptureFixture) -> None:
    # MAX_ATTEMPTS is "upstream attempts per request, all kinds": 1 leaves no re-issue. Before: a second request.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    with raw_upstream(first_error_then(CHAT_STREAM)) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **{**FAST, "max_attempts": 1}))
        with serve_in_thread(app) as url:
            response = await post(url)
            await assert_idle(app, url)
    assert len(upstream.requests) == 1
    assert response.content == CHAT_ERROR_EVENT  # the upstream's error, once
    assert access_line(caplog)["attempts"] == 1


@pytest.mark.anyio
async def test_the_reissue_does_not_go_over_the_attempts_the_retries_spent() -> None:
    # A 503 retried, then the error in band: MAX_ATTEMPTS=2 is spent. Before: a third request.
    def answer(request: RawRequest) -> Script:
        if len(upstream.requests) == 1:
            return [BUSY]
        return [SSE_HEAD, chunk(CHAT_ERROR_EVENT if len(upstream.requests) == 2 else CHAT_STREAM), END]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **{**FAST, "max_attempts": 2}))
        with serve_in_thread(app) as url:
            response = await post(url)
            await assert_idle(app, url)
    assert len(upstream.requests) == 2
    assert response.content == CHAT_ERROR_EVENT


@pytest.mark.anyio
async def test_the_reissue_is_not_made_after_the_retry_deadline() -> None:
    # RETRY_DEADLINE is "seconds all attempts of one request may take". The error comes after it passed.
    # Before: re-issued anyway. (The wait only makes the error late; nothing waits on it to synchronise.)
    def late_error() -> bytes:
        threading.Event().wait(0.6)
        return chunk(CHAT_ERROR_EVENT)

    def answer(request: RawRequest) -> Script:
        return [SSE_HEAD, late_error, END] if len(upstream.requests) == 1 else [SSE_HEAD, chunk(CHAT_STREAM), END]

    settings = {**FAST, "retry_deadline": 0.3, "stall_timeout": 5.0}
    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **settings))
        with serve_in_thread(app) as url:
            response = await post(url)
            await assert_idle(app, url)
    assert len(upstream.requests) == 1
    assert response.content == CHAT_ERROR_EVENT


@pytest.mark.anyio
async def test_the_reissue_goes_to_another_upstream_than_the_one_that_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A session pins its upstream (rendezvous hash), but a retried 503 goes elsewhere: so must a re-issue
    # after the same failure in band. Before: the re-issue went back to the overloaded upstream.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    order: list[str] = []  # which upstream each request went to

    def answering(name: str) -> Any:
        def answer(request: RawRequest) -> Script:
            order.append(name)
            return [SSE_HEAD, chunk(CHAT_ERROR_EVENT if len(order) == 1 else CHAT_STREAM), END]

        return answer

    with raw_upstream(answering("one")) as one, raw_upstream(answering("two")) as two:
        app = create_app(LifetimeSettings(upstream_url=(one.url, two.url), **FAST))
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                response = await client.post(PATH, json=STREAM_BODY, headers={"x-session-id": "s-1"})
            await assert_idle(app, url)
    assert response.content == CHAT_STREAM
    assert (len(one.requests), len(two.requests)) == (1, 1)
    line = access_line(caplog)
    assert line["attempts"] == 2 and line["outcome"] == "complete"
    assert sorted(order) == ["one", "two"]
    assert line["upstream"] == {"one": one.url, "two": two.url}[order[1]]  # the upstream that answered


# -- what the client gets ------------------------------------------------------------------------------

ERROR_WITH_FIELDS = b": keep\n\nid: 7\nretry: 1000\n" + CHAT_ERROR_EVENT
# Over the 64 KiB the relay withholds: relayed as it came, not re-issued.
HUGE_ERROR = b'data: {"error":{"type":"server_error","message":"' + b"x" * 100_000 + b'"}}\n\n'


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("first", "requests", "expected"),
    [
        # re-issued: the client never had an upstream event
        ([CHAT_ERROR_EVENT + b"data: [DONE]\n\n"], 2, b"answer"),
        ([ERROR_WITH_FIELDS], 2, b"answer"),  # the comment came in the error's read: withheld with it
        ([MESSAGE_START + anthropic_error("overloaded_error")], 2, b"answer"),  # one read: neither was sent
        # an unterminated error then the end: no event at all, a starved stream (re-issued as such)
        ([CHAT_ERROR_EVENT[:-1]], 2, b"answer"),
        # not re-issued: too large to withhold, or not transient
        ([HUGE_ERROR], 1, b"first"),
        ([b'data: {"error":{"type":"server_error","code":"context_length_exceeded"}}\n\n'], 1, b"first"),
    ],
    ids=["done-after", "id-retry-comment", "message-start-same-read", "unterminated", "huge", "code"],
)
async def test_end_to_end_shapes(first: list[bytes], requests: int, expected: bytes) -> None:
    def answer(request: RawRequest) -> Script:
        if len(upstream.requests) == 1:
            return [SSE_HEAD, *(chunk(part) for part in first), END]
        return [SSE_HEAD, chunk(CHAT_STREAM), END]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            response = await post(url)
            await assert_idle(app, url)
    assert len(upstream.requests) == requests
    body = response.content
    if expected == b"first":
        assert body == b"".join(first)
    else:
        assert body == expected.replace(b"answer", CHAT_STREAM)


@pytest.mark.anyio
async def test_a_gzip_stream_is_not_judged_so_its_error_is_relayed() -> None:
    encoded = gzip.compress(CHAT_ERROR_EVENT)
    head = SSE_HEAD.replace(b"\r\n\r\n", b"\r\ncontent-encoding: gzip\r\n\r\n")

    def answer(request: RawRequest) -> Script:
        return [head, chunk(encoded), END]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            response = await post(url)
            await assert_idle(app, url)
    assert len(upstream.requests) == 1
    assert response.headers["content-encoding"] == "gzip" and response.content == CHAT_ERROR_EVENT


@pytest.mark.anyio
async def test_an_error_after_a_message_start_the_client_received_is_relayed_not_reissued() -> None:
    # The upstream sends its error only once the client has the message_start: a second answer would be two.
    received = threading.Event()

    def error_once_received() -> bytes:
        received.wait(10)
        return chunk(anthropic_error("overloaded_error"))

    def answer(request: RawRequest) -> Script:
        if len(upstream.requests) == 1:
            return [SSE_HEAD, chunk(MESSAGE_START), error_once_received, END]
        return [SSE_HEAD, chunk(CHAT_STREAM), END]

    body = b""
    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            async with (
                httpx.AsyncClient(base_url=url, timeout=20) as client,
                client.stream("POST", PATH, json=STREAM_BODY) as response,
            ):
                async for part in response.aiter_raw():
                    body += part
                    if body == MESSAGE_START:
                        received.set()
            await assert_idle(app, url)
    assert received.is_set() and len(upstream.requests) == 1
    assert body == MESSAGE_START + anthropic_error("overloaded_error")


@pytest.mark.anyio
async def test_a_client_leaving_during_the_reissue_closes_the_reissued_request() -> None:
    def answer(request: RawRequest) -> Script:
        return [SSE_HEAD, chunk(CHAT_ERROR_EVENT), END] if len(upstream.requests) == 1 else [HOLD]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            async with anyio.create_task_group() as tg:
                tg.start_soon(post, url)
                await eventually(upstream.held.is_set)
                tg.cancel_scope.cancel()  # the client hangs up while the re-issue waits for headers
            await eventually(upstream.released.is_set)
            await assert_idle(app, url)
    assert len(upstream.requests) == 2


@pytest.mark.anyio
async def test_stop_during_the_reissue_ends_with_the_shutdown_error_only() -> None:
    first, response = sse_response(CHAT_ERROR_EVENT, 30.0)
    stop = StopSignal()
    entered = anyio.Event()

    async def reissue() -> httpx.Response:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def stop_when_reissuing() -> None:
        await entered.wait()
        stop.set()

    client = Client()
    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_reissuing)
        result = await run(response, client, reissue=reissue, stop=stop)
    assert first.closed
    assert result.status == 503 and result.outcome == "shutdown"  # nothing was sent: the gateway's 503
    assert b"shutting_down" in client.body and b"The server had an error" not in client.body  # one answer


@pytest.mark.anyio
async def test_a_reissue_that_raises_delivers_the_error_once() -> None:
    client = Client()
    reissue = Reissuer(httpx.ConnectError("down"))
    result = await run(sse_response(CHAT_ERROR_EVENT)[1], client, reissue=reissue)
    assert reissue.calls == 1
    assert client.body == CHAT_ERROR_EVENT and result.outcome == "upstream_error"


# -- the official SDKs -----------------------------------------------------------------------------------

SDK_ERRORS = {
    "/v1/chat/completions": CHAT_ERROR_EVENT,
    "/v1/messages": anthropic_error("overloaded_error"),
    "/v1/responses": responses_error("server_error"),
}


def sdk_error(name: str, base: str) -> tuple[str, str]:
    """What the official SDK raises when the stream it opened is the upstream's transient error."""
    try:
        if name == "anthropic":
            client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=20)
            with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
                s.get_final_text()
        elif name == "responses":
            with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=20) as oa:
                with oa.responses.stream(model="m", input="hi") as stream:
                    list(stream)
        else:
            with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=20) as oa:
                list(oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("the SDK raised nothing")


@pytest.mark.parametrize("name", ["chat", "responses", "anthropic"])
def test_an_sdk_raises_the_same_error_through_the_gateway_as_from_the_upstream_after_one_reissue(name: str) -> None:
    def answer(request: RawRequest) -> Script:
        return [SSE_HEAD, chunk(SDK_ERRORS[request.target]), END]

    with raw_upstream(answer) as upstream:
        direct = sdk_error(name, upstream.url)
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            through = sdk_error(name, url)
    # The same exception and message (the Responses SDK stream refuses an error before response.created,
    # with or without the gateway); the gateway asked twice, the SDK once.
    assert through == direct
    assert len(upstream.requests) == 3


# -- bookkeeping -----------------------------------------------------------------------------------------


SECONDS: dict[str, Script] = {
    "answer": [SSE_HEAD, chunk(CHAT_STREAM), END],
    "busy": [BUSY.replace(b"content-length: 2", b"x-should-retry: false\r\ncontent-length: 2")],
    "hung-up": [CLOSE],
}


@pytest.mark.anyio
@pytest.mark.parametrize("second", list(SECONDS))
async def test_every_reissue_made_is_counted_as_an_attempt(second: str, caplog: pytest.LogCaptureFixture) -> None:
    # The access log's attempts, the retried counter and attempts_total agree on a re-issue whatever became
    # of it. Before: one that met a 503 or a hang-up was in the access log only.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")

    def answer(request: RawRequest) -> Script:
        return [SSE_HEAD, chunk(CHAT_ERROR_EVENT), END] if len(upstream.requests) == 1 else SECONDS[second]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            response = await post(url)
            stats = await assert_idle(app, url)
            async with httpx.AsyncClient(base_url=url) as client:
                metrics = (await client.get("/metrics")).text
    assert len(upstream.requests) == 2
    assert response.content == (CHAT_STREAM if second == "answer" else CHAT_ERROR_EVENT)
    assert access_line(caplog)["attempts"] == 2
    assert stats["retried"] == 1
    assert 'asgi_lifetime_attempts_total{kind="retry",reason="no_output"} 1.0' in metrics
