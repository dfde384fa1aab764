"""An event stream whose first event is the upstream's transient error is re-issued, once.

Found by a new-user trial: an upstream answering 200 whose first event is an in-band error saying it
failed on its own side (Anthropic's ``overloaded_error`` / ``api_error``, OpenAI's ``server_error``,
Gemini's ``UNAVAILABLE``) was relayed as it was, although the client had seen nothing and a second
request would very likely succeed (the gateway retries the same failures when they come as statuses).
Now such an event is withheld and the request re-issued through the starvation guard's one re-issue;
if the re-issue fails, the client gets the upstream's error, as before. An error naming the request
(invalid, too long, unauthorized, not found, a rate limit, a quota) is relayed as it is, and nothing is
re-issued once an upstream event reached the client.

The hostile-upstream attacks at the end: nothing makes the client get two answers, half an event, or wait.
"""

from __future__ import annotations

import gzip
import logging
from typing import Any

import anyio
import httpx
import pytest

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._exceptions import UpstreamUnreachable
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._sse import KEEPALIVE, SSEParser, SSETracker
from asgi_lifetime.testing._serve import serve_in_thread

from ..reliability.test_attack_upstream import SSE_HEAD, STREAM_BODY, chunk
from ..reliability.test_faults import FAST, PATH, assert_idle
from ._raw_upstream import RawRequest, Script, raw_upstream
from .test_relay import (
    DONE,
    HELLO,
    PING,
    ROLE,
    SSE_HEADERS,
    STOP,
    Client,
    Reissuer,
    Upstream,
    run,
    sse,
    upstream_response,
)

# -- the shapes -------------------------------------------------------------------------------------


def anthropic_error(kind: str, message: str = "Overloaded") -> bytes:
    return sse({"type": "error", "error": {"type": kind, "message": message}}, event="error")


def chat_error(kind: str | None, code: str | int | None = None, message: str = "The server had an error") -> bytes:
    error: dict[str, Any] = {"message": message, "param": None, "code": code}
    if kind is not None:
        error["type"] = kind
    return sse({"error": error})


def responses_error(code: str | None, message: str = "boom") -> bytes:
    payload = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0}
    return sse(payload, event="error")


def responses_failed(error: dict[str, Any] | None) -> bytes:
    response: dict[str, Any] = {"id": "resp_1", "object": "response", "status": "failed", "error": error, "output": []}
    return sse({"type": "response.failed", "sequence_number": 0, "response": response}, event="response.failed")


def gemini_error(code: int, status: str, message: str = "The model is overloaded.") -> bytes:
    return sse({"error": {"code": code, "message": message, "status": status}})


MESSAGE_START = sse(
    {
        "type": "message_start",
        "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "stop_reason": None},
    },
    event="message_start",
)


def anthropic_answer() -> bytes:
    return b"".join(
        [
            MESSAGE_START,
            sse(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                event="content_block_start",
            ),
            sse(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
                event="content_block_delta",
            ),
            sse({"type": "content_block_stop", "index": 0}, event="content_block_stop"),
            sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, event="message_delta"),
            sse({"type": "message_stop"}, event="message_stop"),
        ]
    )


def responses_answer() -> bytes:
    response = {"id": "resp_2", "object": "response", "status": "in_progress", "output": []}
    return b"".join(
        [
            sse({"type": "response.created", "response": response}, event="response.created"),
            sse({"type": "response.output_text.delta", "delta": "Hi"}, event="response.output_text.delta"),
            sse({"type": "response.completed", "response": {**response, "status": "completed"}}, event="x"),
        ]
    )


CHAT_ANSWER = ROLE + HELLO + STOP + DONE
GEMINI_ANSWER = sse({"candidates": [{"content": {"parts": [{"text": "Hi"}]}, "finishReason": "STOP"}]})

# name -> (the first response's error event, a whole second answer in the same format)
TRANSIENT = {
    "anthropic-overloaded": (anthropic_error("overloaded_error"), anthropic_answer()),
    "anthropic-api-error": (anthropic_error("api_error", "Internal server error"), anthropic_answer()),
    "anthropic-overloaded-crlf": (anthropic_error("overloaded_error").replace(b"\n", b"\r\n"), anthropic_answer()),
    "chat-server-error": (chat_error("server_error"), CHAT_ANSWER),
    "chat-server-error-code": (chat_error("server_error", "server_error"), CHAT_ANSWER),
    "chat-overloaded-named-error": (b"event: error\n" + chat_error("overloaded_error"), CHAT_ANSWER),
    "chat-openrouter-502": (chat_error(None, 502, "Provider returned error"), CHAT_ANSWER),
    "responses-error-event": (responses_error("server_error"), responses_answer()),
    "responses-error-nested": (
        sse(
            {"type": "error", "error": {"type": "server_error", "code": "server_error", "message": "x"}}, event="error"
        ),
        responses_answer(),
    ),
    "responses-failed": (responses_failed({"code": "server_error", "message": "boom"}), responses_answer()),
    "gemini-unavailable": (gemini_error(503, "UNAVAILABLE"), GEMINI_ANSWER),
    "gemini-internal": (gemini_error(500, "INTERNAL", "Internal error"), GEMINI_ANSWER),
}

# Errors naming the request, a wait, or nothing known: relayed as they are.
NOT_TRANSIENT = {
    "anthropic-invalid-request": anthropic_error("invalid_request_error", "prompt is too long"),
    "anthropic-authentication": anthropic_error("authentication_error", "invalid x-api-key"),
    "anthropic-permission": anthropic_error("permission_error"),
    "anthropic-not-found": anthropic_error("not_found_error", "model: claude-nope"),
    "anthropic-too-large": anthropic_error("request_too_large"),
    "anthropic-rate-limit": anthropic_error("rate_limit_error"),
    "anthropic-timeout": anthropic_error("timeout_error"),
    "anthropic-billing": anthropic_error("billing_error"),
    "anthropic-no-type": sse({"type": "error", "error": {"message": "Overloaded"}}, event="error"),
    "chat-context-length": chat_error("invalid_request_error", "context_length_exceeded"),
    "chat-server-error-naming-the-request": chat_error("server_error", "context_length_exceeded"),
    "chat-server-error-unknown-code": chat_error("server_error", "overloaded"),
    "chat-quota": chat_error("insufficient_quota", "insufficient_quota"),
    "chat-rate-limit": chat_error("requests", "rate_limit_exceeded"),
    "chat-error-string": sse({"error": "server_error"}),
    "chat-error-no-names": chat_error(None, None, "overloaded"),
    "chat-error-code-as-text": chat_error(None, "503"),
    "chat-error-code-true": sse({"error": {"code": True, "message": "x"}}),
    "chat-openrouter-429": chat_error(None, 429, "Rate limit exceeded"),
    "chat-openrouter-504": chat_error(None, 504, "Timed out"),
    "responses-rate-limit": responses_error("rate_limit_exceeded"),
    "responses-invalid-prompt": responses_error("invalid_prompt"),
    "responses-no-code": responses_error(None),
    "responses-failed-no-error": responses_failed(None),
    "responses-failed-image": responses_failed({"code": "invalid_image", "message": "bad image"}),
    "gemini-exhausted": gemini_error(429, "RESOURCE_EXHAUSTED"),
    "gemini-invalid": gemini_error(400, "INVALID_ARGUMENT"),
    "gemini-deadline": gemini_error(504, "DEADLINE_EXCEEDED"),
    "event-error-no-json": b"event: error\ndata: overloaded\n\n",
}


class Closing(Upstream):
    """An ``Upstream`` that, once closed, yields nothing more (as a closed connection does)."""

    async def __anext__(self) -> bytes:
        if self.closed:
            raise StopAsyncIteration
        return await super().__anext__()


def sse_response(*items: bytes | float | Exception, status: int = 200) -> tuple[Upstream, httpx.Response]:
    stream = Closing(*items)
    return stream, upstream_response(stream, status=status, headers=SSE_HEADERS)


def test_the_shapes_are_classified_as_these_tests_assume() -> None:
    for name, (error, _) in TRANSIENT.items():
        tracker = SSETracker()
        tracker.feed(error)
        assert tracker.saw_error and tracker.failed_early, name
    for name, error in NOT_TRANSIENT.items():
        tracker = SSETracker()
        tracker.feed(error)
        assert tracker.saw_error and not tracker.failed_early, name


# -- re-issued ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(TRANSIENT))
async def test_a_transient_first_error_is_reissued_and_the_client_gets_only_the_second_answer(name: str) -> None:
    # Before: the client got the error event and the stream ended; the upstream was asked once.
    error, answer = TRANSIENT[name]
    first, response = sse_response(error)
    second, again = sse_response(answer)
    reissue = Reissuer(again)
    counters = Counters()
    client = Client()
    result = await run(response, client, reissue=reissue, counters=counters)
    assert reissue.calls == 1 and result.reissued
    assert client.status == 200 and client.body == answer and client.ended
    assert result.outcome == "complete"
    assert counters.starved == 0  # not a starvation: the upstream said why
    assert first.closed and second.closed


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(NOT_TRANSIENT))
async def test_a_first_error_naming_the_request_is_relayed_not_reissued(name: str) -> None:
    error = NOT_TRANSIENT[name]
    first, response = sse_response(error)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and not result.reissued
    assert client.body == error and client.ended
    assert result.outcome == "upstream_error" and first.closed


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("before", "name"),
    [
        (ROLE, "chat-server-error"),
        (sse({"type": "ping"}, event="ping"), "anthropic-overloaded"),
        (MESSAGE_START, "anthropic-overloaded"),
        (sse({"type": "response.created", "response": {"status": "in_progress"}}), "responses-failed"),
        (sse({"type": "response.in_progress", "response": {}}), "responses-error-event"),
    ],
    ids=["chat-role", "anthropic-ping", "anthropic-message-start", "responses-created", "responses-in-progress"],
)
async def test_a_transient_error_after_a_delivered_event_is_relayed_not_reissued(before: bytes, name: str) -> None:
    # The client has an upstream event: a second answer would be its second.
    error = TRANSIENT[name][0]
    _, response = sse_response(before, error)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and not result.reissued
    assert client.body == before + error and result.outcome == "upstream_error"


@pytest.mark.anyio
async def test_events_before_the_error_in_the_same_read_were_not_delivered_and_go_with_it() -> None:
    # message_start and the error arrive together: the client saw neither, the upstream produced nothing.
    _, response = sse_response(MESSAGE_START + anthropic_error("overloaded_error"))
    reissue = Reissuer(upstream_response(Upstream(anthropic_answer()), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 1 and client.body == anthropic_answer() and result.outcome == "complete"


@pytest.mark.anyio
@pytest.mark.parametrize("together", [True, False], ids=["same-read", "separate-reads"])
async def test_content_before_a_transient_error_is_output_not_reissued(together: bool) -> None:
    # The upstream produced output (and the client may have it): re-issuing would answer twice.
    error = chat_error("server_error")
    _, response = sse_response(*([ROLE + HELLO + error] if together else [ROLE + HELLO, error]))
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and client.body == ROLE + HELLO + error and result.outcome == "upstream_error"


@pytest.mark.anyio
async def test_a_transient_error_then_done_is_reissued() -> None:
    # OpenAI-compatible servers (vLLM, proxies) follow an in-band error with [DONE].
    error = chat_error("server_error")
    _, response = sse_response(error + DONE)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 1 and client.body == CHAT_ANSWER and result.outcome == "complete"


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["anthropic-overloaded", "chat-server-error", "responses-failed"])
async def test_a_transient_error_on_the_reissued_response_too_reaches_the_client_once(name: str) -> None:
    # One re-issue: the second response's error goes to the client as sent, and nothing asks a third time.
    error, _ = TRANSIENT[name]
    second_error = error.replace(b"boom", b"boom again").replace(b"Overloaded", b"Overloaded again")
    second_error = second_error.replace(b"The server had an error", b"The server had an error again")
    assert second_error != error
    first, response = sse_response(error)
    second, again = sse_response(second_error)
    reissue = Reissuer(again)  # a second call would find nothing to pop
    counters = Counters()
    client = Client()
    result = await run(response, client, reissue=reissue, counters=counters)
    assert reissue.calls == 1 and result.reissued
    assert client.body == second_error and client.ended
    assert result.outcome == "upstream_error" and counters.starved == 0
    assert first.closed and second.closed


@pytest.mark.anyio
@pytest.mark.parametrize(
    "outcome",
    ["none", "connect-error", "read-timeout", "lifetime-error", "not-sse-after-start", "error-status-after-start"],
)
async def test_a_failed_reissue_delivers_the_original_error_event(outcome: str) -> None:
    # The client gets exactly what it would have got without the re-issue: the upstream's error, once.
    third = Upstream(b'{"error":{}}')
    item: httpx.Response | None | Exception = {
        "none": None,
        "connect-error": httpx.ConnectError("refused"),
        "read-timeout": httpx.ReadTimeout("slow"),
        "lifetime-error": UpstreamUnreachable("gone"),
        "not-sse-after-start": upstream_response(third, headers={"content-type": "application/json"}),
        "error-status-after-start": upstream_response(third, status=503, headers=SSE_HEADERS),
    }[outcome]
    started = outcome.endswith("after-start")
    error = anthropic_error("overloaded_error")
    # A comment first: the response has started (its 200 and headers went out), and no event has.
    first, response = sse_response(*([PING, error] if started else [error]))
    reissue = Reissuer(item)
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 1 and result.reissued
    assert client.status == 200 and client.headers["content-type"] == SSE_HEADERS["content-type"]
    assert client.body == (PING if started else b"") + error and client.ended
    assert result.outcome == "upstream_error" and first.closed
    if started:
        assert third.closed and third.pulled == 0


@pytest.mark.anyio
async def test_without_a_reissue_the_error_is_relayed_at_once() -> None:
    # No retained body (RETAIN_OUTBOUND=off): nothing could replace it, so it is not held back.
    error = anthropic_error("overloaded_error")
    sent = anyio.Event()
    client = Client()

    async def check() -> None:
        await client.body_seen.wait()
        assert client.body == error  # before the upstream ended
        sent.set()

    first, response = sse_response(error, 0.5, DONE)
    async with anyio.create_task_group() as tg:
        tg.start_soon(check)
        result = await run(response, client)
    assert sent.is_set() and client.body == error + DONE and result.outcome == "upstream_error"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "name", ["anthropic-overloaded", "chat-server-error", "responses-error-event", "responses-failed"]
)
@pytest.mark.parametrize("splits", ["bytes", "halves"])
async def test_an_error_event_split_across_chunks_is_reissued(name: str, splits: str) -> None:
    error, answer = TRANSIENT[name]
    cuts = range(1, len(error)) if splits == "halves" else [None]
    for cut in cuts:
        parts = [error[i : i + 1] for i in range(len(error))] if cut is None else [error[:cut], error[cut:]]
        _, response = sse_response(*parts)
        reissue = Reissuer(upstream_response(Upstream(answer), headers=SSE_HEADERS))
        client = Client()
        result = await run(response, client, reissue=reissue)
        assert reissue.calls == 1, cut
        assert client.body == answer and result.outcome == "complete", cut


@pytest.mark.anyio
async def test_the_reissue_is_logged_and_the_starvation_counter_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    secret = "sk-quoted-from-the-request"
    _, response = sse_response(anthropic_error("overloaded_error", f"Overloaded {secret}"))
    counters = Counters()
    with caplog.at_level(logging.WARNING, logger="asgi_lifetime.gateway._relay"):
        await run(
            response,
            Client(),
            reissue=Reissuer(upstream_response(Upstream(anthropic_answer()), headers=SSE_HEADERS)),
            counters=counters,
        )
    messages = [record.getMessage() for record in caplog.records]
    assert any("failed before any output" in message and "re-issuing" in message for message in messages), messages
    assert not any(secret in message for message in messages)  # the upstream's message is not logged
    assert counters.starved == 0 and counters.stalled == 0


# -- a hostile upstream ---------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("after", ["silence", "comments", "content"], ids=str)
async def test_an_upstream_that_keeps_the_stream_open_after_its_error_is_not_waited_for(after: str) -> None:
    # The error ends the attempt: what follows is not read (a stall, endless comments, even content: the
    # client gets the re-issued answer at once, not after the stall timeout, and only that one).
    tails: dict[str, list[bytes | float]] = {
        "silence": [60.0],
        "comments": [PING, 0.5] * 100,
        "content": [0.2, ROLE + HELLO + STOP + DONE],
    }
    tail = tails[after]
    first, response = sse_response(chat_error("server_error"), *tail)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    with anyio.fail_after(1.5):  # the stall timeout is 2 s
        result = await run(response, client, reissue=reissue, stall_timeout=2.0)
    assert reissue.calls == 1 and client.body == CHAT_ANSWER and result.outcome == "complete"
    assert first.closed and first.pulled == 1


@pytest.mark.anyio
async def test_an_error_followed_by_content_in_the_same_read_is_output() -> None:
    # Content after the error: the upstream produced output. Relayed as sent, once; no second answer.
    body = chat_error("server_error") + ROLE + HELLO + STOP + DONE
    _, response = sse_response(body)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and client.body == body and result.outcome == "upstream_error"  # it said so


@pytest.mark.anyio
async def test_an_error_followed_by_a_huge_event_in_the_same_read_is_relayed_whole_once() -> None:
    # The error is withheld, then the rest of the read outgrows the hold and streams through: the client
    # now has the error. The attempt must go on (its big event is half sent), and nothing is re-issued.
    error = chat_error("server_error")
    big = b'data: {"choices":[{"delta":{"content":"' + b"x" * (2 * 1024 * 1024)
    rest = b'"}}]}\n\n' + STOP + DONE
    _, response = sse_response(error + big, rest)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and not result.reissued
    assert client.body == error + big + rest and client.ended
    events = SSEParser(limit=4 * 1024 * 1024).feed(client.body)
    assert len(events) == 4  # the error, the big event (whole), the stop, [DONE]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "before",
    [sse({"kind": "custom", "n": 1}), sse("not json"), sse({"error": None, "x": 1})],
    ids=["unknown-format", "not-json", "null-error-member"],
)
async def test_an_event_no_rule_can_judge_before_the_error_makes_it_output(before: bytes) -> None:
    # In the same read as the error, an event of no known format: it may be output, so nothing is re-issued.
    error = chat_error("server_error")
    _, response = sse_response(before + error)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and client.body == before + error


@pytest.mark.anyio
async def test_an_error_too_large_to_hold_is_relayed_not_reissued() -> None:
    # An error event over the withholding bound cannot be taken back: it goes out, and the client has it.
    error = anthropic_error("overloaded_error", "O" * (80 * 1024))
    _, response = sse_response(error)
    reissue = Reissuer(upstream_response(Upstream(anthropic_answer()), headers=SSE_HEADERS))
    client = Client()
    result = await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and client.body == error and result.outcome == "upstream_error"


@pytest.mark.anyio
async def test_half_an_event_after_the_error_is_never_sent() -> None:
    # The read holds the error and the start of another event; the re-issue fails: the client gets the error
    # (whole) and the end of the stream, never the fragment.
    error = chat_error("server_error")
    _, response = sse_response(error + b'data: {"choices":[{"delta":{"content":"Hel')
    client = Client()
    result = await run(response, client, reissue=Reissuer(None))
    assert client.body == error and client.ended and result.outcome == "upstream_error"
    assert len(client.events) == 1


@pytest.mark.anyio
async def test_keepalives_continue_while_reissuing_after_an_error() -> None:
    async def slow_reissue() -> httpx.Response | None:
        await anyio.sleep(0.3)
        return upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS)

    _, response = sse_response(chat_error("server_error"))
    client = Client()
    result = await run(response, client, reissue=slow_reissue, keepalive_interval=0.05)
    assert result.outcome == "complete" and result.reissued
    assert client.bodies.count(KEEPALIVE) >= 3
    assert client.body.replace(KEEPALIVE, b"") == CHAT_ANSWER


@pytest.mark.anyio
async def test_a_client_leaving_during_the_reissue_ends_the_relay() -> None:
    leave = anyio.Event()

    async def hanging_reissue() -> httpx.Response | None:
        leave.set()
        await anyio.sleep(60)
        raise AssertionError("not cancelled")

    first, response = sse_response(chat_error("server_error"))
    client = Client()
    async with anyio.create_task_group() as tg:

        async def disconnect() -> None:
            await leave.wait()
            client.disconnect()

        tg.start_soon(disconnect)
        result = await run(response, client, reissue=hanging_reissue)
        tg.cancel_scope.cancel()  # no re-issue, no disconnect: the assertions below say so
    assert leave.is_set()
    assert result.outcome == "client_disconnected" and first.closed
    assert b"server_error" not in client.body


@pytest.mark.anyio
async def test_an_error_status_or_an_encoded_stream_is_not_judged() -> None:
    # Not in-band: a non-2xx event stream, or one with a content-encoding, is relayed as sent.
    error = chat_error("server_error")
    _, response = sse_response(error, status=500)
    reissue = Reissuer(upstream_response(Upstream(CHAT_ANSWER), headers=SSE_HEADERS))
    client = Client()
    await run(response, client, reissue=reissue)
    assert reissue.calls == 0 and client.status == 500 and client.body == error

    encoded = gzip.compress(error)
    stream = Upstream(encoded)
    gzipped = upstream_response(stream, headers={**SSE_HEADERS, "content-encoding": "gzip"})
    client = Client()
    await run(gzipped, client, reissue=reissue)
    assert reissue.calls == 0 and client.body == encoded


# -- end to end: the gateway under uvicorn, a raw-socket upstream -----------------------------------------

CHAT_ERROR_EVENT = b'data: {"error":{"message":"The server had an error","type":"server_error","param":null}}\n\n'
CHAT_STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)


@pytest.mark.anyio
@pytest.mark.parametrize("second", ["answer", "error"])
async def test_end_to_end_a_first_error_is_reissued_once(second: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    answers = {"error": CHAT_ERROR_EVENT, "answer": CHAT_STREAM}

    def answer(request: RawRequest) -> Script:
        body = CHAT_ERROR_EVENT if len(upstream.requests) == 1 else answers[second]
        return [SSE_HEAD, chunk(body), b"0\r\n\r\n"]

    with raw_upstream(answer) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **FAST))
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                response = await client.post(PATH, json=STREAM_BODY)
            stats = await assert_idle(app, url)
    assert response.status_code == 200 and response.content == answers[second]
    assert len(upstream.requests) == 2
    assert upstream.requests[0].body == upstream.requests[1].body  # the same request, re-issued
    [line] = [record.__dict__["asgi_lifetime"] for record in caplog.records if record.name == "asgi_lifetime.access"]
    assert line["attempts"] == 2
    assert line["outcome"] == ("complete" if second == "answer" else "upstream_error")
    assert stats["starved"] == 0 and stats["retried"] == 1
