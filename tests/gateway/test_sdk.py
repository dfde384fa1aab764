"""The gateway as the official ``openai`` and ``anthropic`` SDKs see it, over real sockets.

The gateway (``create_app``) runs under uvicorn on loopback in front of ``tests.sdk_upstream``
(a scripted upstream speaking each API's exact wire format, also under uvicorn). The SDK clients
point their ``base_url`` at the gateway. Every streamed case checks that the SDK's final object is
what the upstream sent, that the upstream was asked exactly once, and that the gateway is idle after.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import anyio
import openai
import pytest
from anthropic import AsyncAnthropic
from anthropic.types import MessageParam
from anthropic.types.beta import BetaMessageParam
from openai import AsyncOpenAI
from openai._streaming import SSEDecoder
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import held, wait_idle
from asgi_lifetime.testing._serve import serve_in_thread

from .._servers import hypercorn_in_thread
from . import sdk_upstream as up
from .sdk_upstream import Fault, ScriptedUpstream

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
IMAGES = "/v1/images/generations"
SPEECH = "/v1/audio/speech"
MESSAGES = "/v1/messages"
MAX_ATTEMPTS = 2
SETTINGS: dict[str, Any] = {
    "max_attempts": MAX_ATTEMPTS,
    "backoff_base": 0.01,
    "backoff_max": 0.02,
    "retry_after_cap": 0.05,
    "connect_timeout": 5.0,
    "headers_timeout": 10.0,
    "stall_timeout": 10.0,
    "keepalive_interval": 5.0,
}
SDK_TIMEOUT = 20.0
STALL_SECONDS = 10.0  # how long a held upstream waits for the gateway to hang up
# The same message in each SDK's own parameter type (each SDK types ``messages`` with its TypedDicts).
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
CLAUDE_HELLO: list[MessageParam] = [{"role": "user", "content": "hello"}]
BETA_HELLO: list[BetaMessageParam] = [{"role": "user", "content": "hello"}]
AUDIO = ("speech.wav", b"RIFF" + bytes(4000), "audio/wav")
# On trio, the SDKs' AsyncStream leaves its own async generators (httpx2's aiter_bytes, httpcore2's
# PoolByteStream, the SSE decoder, _iter_events...) unexhausted when it stops at ``[DONE]`` or is
# closed early; trio's finalizer then warns. Ignored only in the async tests, whose event loop runs
# nothing but the SDK client: the gateway and the upstream run in uvicorn's threads, on asyncio.
SDK_ASYNCGENS_ON_TRIO = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object:pytest.PytestUnraisableExceptionWarning"
)


@dataclass
class Served:
    upstream: ScriptedUpstream
    gateway: Starlette
    url: str
    clients: list[Any] = field(default_factory=list)  # sync clients, closed when the stack stops

    def openai(self, **options: Any) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="sk-test", **{"timeout": SDK_TIMEOUT, **options})
        self.clients.append(client)
        return client

    # AsyncOpenAI and AsyncAnthropic imported by name: in this class body ``openai`` and ``anthropic``
    # are the methods, which shadow the modules in the annotations that follow them.
    def async_openai(self, **options: Any) -> AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="sk-test", **{"timeout": SDK_TIMEOUT, **options})

    def anthropic(self, **options: Any) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key="sk-ant-test", **{"timeout": SDK_TIMEOUT, **options})
        self.clients.append(client)
        return client

    def async_anthropic(self, **options: Any) -> AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="sk-ant-test", **{"timeout": SDK_TIMEOUT, **options})

    def wait_idle(self) -> None:
        """``asgi_lifetime.testing.wait_idle``, for the synchronous tests (the gateway runs in uvicorn's thread)."""
        settle(lambda: not held(self.gateway), what=lambda: f"gateway idle (busy: {held(self.gateway)})")

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.gateway.state.lifetime.stats().as_dict()
        return result


def settle(predicate: Callable[[], bool], *, what: Callable[[], object], within: float = 5.0) -> None:
    """Wait for a condition another thread (uvicorn's) makes true; the callers here are synchronous."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within}s: {what()}")
        time.sleep(0.01)


async def eventually(predicate: Callable[[], bool], *, what: Callable[[], object], within: float = 5.0) -> None:
    with anyio.move_on_after(within):
        while not predicate():  # noqa: ASYNC110  (the state lives in another thread: nothing to await)
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"not reached within {within}s: {what()}")


@contextlib.contextmanager
def serving(*, delay: float = 0.0, **settings: Any) -> Iterator[Served]:
    upstream = ScriptedUpstream(delay=delay)
    with serve_in_thread(upstream.app) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**SETTINGS, **settings}))
        with serve_in_thread(gateway) as url, _closing(Served(upstream, gateway, url)) as served:
            yield served


@contextlib.contextmanager
def _closing(served: Served) -> Iterator[Served]:
    try:
        yield served
    finally:
        for client in served.clients:
            client.close()


@pytest.fixture
def served() -> Iterator[Served]:
    with serving() as running:
        yield running


def once(served: Served, path: str) -> None:
    """The upstream got exactly one request, and nothing else."""
    seen = served.upstream.seen(path)
    assert seen.requests == 1, f"{path} asked {seen.requests} times"
    assert served.upstream.total_requests() == 1


# --- OpenAI chat ----------------------------------------------------------------------------------


def test_chat_completion(served: Served) -> None:
    client = served.openai()
    raw = client.chat.completions.with_raw_response.create(model="gpt-test", messages=HELLO)
    completion = raw.parse()
    assert completion.choices[0].message.content == up.TEXT
    assert completion.model_dump(exclude_unset=True) == up.chat_completion("gpt-test")
    assert raw.headers["x-request-id"] == "req_chat" and completion._request_id == "req_chat"
    once(served, CHAT)
    served.wait_idle()


def test_chat_stream(served: Served) -> None:
    client = served.openai()
    stream = client.chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
    chunks = list(stream)
    assert [chunk.model_dump(exclude_unset=True) for chunk in chunks] == [d for _, d in up.chat_chunks("gpt-test")[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == up.TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    once(served, CHAT)
    served.wait_idle()


def test_chat_stream_helper(served: Served) -> None:
    client = served.openai()
    with client.chat.completions.stream(model="gpt-test", messages=HELLO) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == up.TEXT and final.choices[0].finish_reason == "stop"
    once(served, CHAT)
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_chat_stream_async(anyio_backend: str) -> None:
    with serving() as served:
        async with served.async_openai() as client:
            stream = await client.chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        assert text == up.TEXT
        once(served, CHAT)
        await wait_idle(served.gateway)


# --- OpenAI Responses -----------------------------------------------------------------------------


def _sent_response(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = events[-1][1]["response"]
    return response


def test_responses_create(served: Served) -> None:
    response = served.openai().responses.create(model="gpt-test", input="hello")
    assert response.output_text == up.TEXT and response.id == "resp_scripted"
    once(served, RESPONSES)
    served.wait_idle()


def test_responses_stream_text(served: Served) -> None:
    client = served.openai()
    with client.responses.stream(model="gpt-test", input="hello") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == up.TEXT
    assert final.output_text == up.TEXT
    sent = _sent_response(up.response_text_events("gpt-test"))
    assert final.id == sent["id"] and final.status == "completed"
    item = final.output[0]
    assert item.type == "message" and item.id == sent["output"][0]["id"] and item.status == "completed"
    assert [(part.type, getattr(part, "text", None)) for part in item.content] == [("output_text", up.TEXT)]
    once(served, RESPONSES)
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_responses_stream_text_async(anyio_backend: str) -> None:
    with serving() as served:
        async with served.async_openai() as client:
            async with client.responses.stream(model="gpt-test", input="hello") as stream:
                deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
                final = await stream.get_final_response()
        assert "".join(deltas) == up.TEXT and final.output_text == up.TEXT
        once(served, RESPONSES)
        await wait_idle(served.gateway)


IMAGE_TOOL: Any = [{"type": "image_generation", "size": "1024x1024", "quality": "high", "output_format": "png"}]


def test_responses_stream_with_a_large_image_event(served: Served) -> None:
    """``response.output_item.done`` and ``response.completed`` are each > 1 MiB on one ``data:`` line."""
    client = served.openai()
    with client.responses.stream(model="gpt-test", input="draw", tools=IMAGE_TOOL) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == [name for name, _ in up.response_image_events("gpt-test")]
    assert len(up.BIG_IMAGE_B64) > 1024 * 1024
    item = final.output[0]
    assert item.type == "image_generation_call" and item.result == up.BIG_IMAGE_B64
    once(served, RESPONSES)
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_responses_stream_with_a_large_image_event_async(anyio_backend: str) -> None:
    with serving() as served:
        async with served.async_openai() as client:
            stream = await client.responses.create(model="gpt-test", input="draw", tools=IMAGE_TOOL, stream=True)
            done = [event async for event in stream if event.type == "response.output_item.done"]
        assert len(done) == 1 and getattr(done[0].item, "result", None) == up.BIG_IMAGE_B64
        once(served, RESPONSES)
        await wait_idle(served.gateway)


# --- audio and images -----------------------------------------------------------------------------


def test_transcription_stream(served: Served) -> None:
    client = served.openai()
    stream = client.audio.transcriptions.create(model="gpt-4o-transcribe", file=AUDIO, stream=True)
    events = list(stream)
    assert [event.type for event in events][-1] == "transcript.text.done"
    deltas = "".join(event.delta for event in events if event.type == "transcript.text.delta")
    assert deltas == up.TRANSCRIPT and events[-1].text == up.TRANSCRIPT  # type: ignore[union-attr]
    assert [e.model_dump(exclude_unset=True) for e in events] == [d for _, d in up.transcription_events()]
    once(served, TRANSCRIPTIONS)
    served.wait_idle()


def test_image_generation_stream(served: Served) -> None:
    client = served.openai()
    stream = client.images.generate(model="gpt-image-1", prompt="a fox", stream=True, partial_images=2)
    events = list(stream)
    assert [e.model_dump(exclude_unset=True) for e in events] == [d for _, d in up.image_events(2)]
    assert events[-1].type == "image_generation.completed" and events[-1].b64_json == up.SMALL_IMAGE_B64
    once(served, IMAGES)
    served.wait_idle()


def _speech_events(chunks: Iterator[bytes]) -> list[dict[str, Any]]:
    return [sse.json() for sse in SSEDecoder().iter_bytes(chunks)]


def test_speech_sse(served: Served) -> None:
    client = served.openai()
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input="hello", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _speech_events(response.iter_bytes())
    assert events == [d for _, d in up.speech_events()]
    once(served, SPEECH)
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_audio_and_image_streams_async(anyio_backend: str) -> None:
    with serving() as served:
        async with served.async_openai() as client:
            stream = await client.audio.transcriptions.create(model="gpt-4o-transcribe", file=AUDIO, stream=True)
            transcript = [event async for event in stream]
            images = await client.images.generate(model="gpt-image-1", prompt="a fox", stream=True, partial_images=1)
            image = [event async for event in images]
        assert transcript[-1].type == "transcript.text.done" and transcript[-1].text == up.TRANSCRIPT
        assert image[-1].type == "image_generation.completed" and image[-1].b64_json == up.SMALL_IMAGE_B64
        assert served.upstream.seen(TRANSCRIPTIONS).requests == 1 and served.upstream.seen(IMAGES).requests == 1
        await wait_idle(served.gateway)


# --- Anthropic ------------------------------------------------------------------------------------


def _sent_fields(model: Any, sent: dict[str, Any]) -> bool:
    """The SDK object carries every field the upstream sent, unchanged (it may add its own defaults)."""
    projected: object = _project(model.model_dump(), sent)
    return projected == sent


def _project(value: Any, like: Any) -> Any:
    """``value`` cut down to the keys ``like`` has, recursively."""
    if isinstance(like, dict) and isinstance(value, dict):
        return {key: _project(value.get(key), like[key]) for key in like}
    if isinstance(like, list) and isinstance(value, list) and len(like) == len(value):
        return [_project(v, w) for v, w in zip(value, like, strict=True)]
    return value


def test_anthropic_message(served: Served) -> None:
    client = served.anthropic()
    message = client.messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO)
    assert _sent_fields(message, up.anthropic_message("claude-test"))
    once(served, MESSAGES)
    seen = served.upstream.seen(MESSAGES)
    assert seen.headers[0]["anthropic-version"] == client.default_headers["anthropic-version"]
    served.wait_idle()


def test_anthropic_stream(served: Served) -> None:
    client = served.anthropic()
    with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == up.TEXT
    assert _sent_fields(final, up.anthropic_message("claude-test"))
    once(served, MESSAGES)
    served.wait_idle()


def test_anthropic_raw_event_sequence(served: Served) -> None:
    client = served.anthropic()
    stream = client.messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO, stream=True)
    kinds = [event.type for event in stream]
    # The SDK drops ``ping``; everything else arrives in order.
    assert kinds == [name for name, _ in up.anthropic_events("claude-test") if name != "ping"]
    once(served, MESSAGES)
    served.wait_idle()


def test_anthropic_beta_query_and_headers_reach_the_upstream(served: Served) -> None:
    client = served.anthropic()
    # This SDK (anthropic 2.x) no longer adds ``?beta=true`` itself; older ones did, so send it.
    message = client.beta.messages.create(
        model="claude-test",
        max_tokens=64,
        messages=BETA_HELLO,
        betas=["interleaved-thinking-2025-05-14"],
        extra_query={"beta": "true"},
    )
    assert message.content[0].type == "text" and message.content[0].text == up.TEXT
    seen = served.upstream.seen(MESSAGES)
    assert seen.queries == ["beta=true"]
    assert seen.headers[0]["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert seen.headers[0]["anthropic-version"] == client.default_headers["anthropic-version"]


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_anthropic_stream_async(anyio_backend: str) -> None:
    with serving() as served:
        async with served.async_anthropic() as client:
            async with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
                text = "".join([chunk async for chunk in stream.text_stream])
                final = await stream.get_final_message()
        assert text == up.TEXT and final.stop_reason == "end_turn"
        assert _sent_fields(final, up.anthropic_message("claude-test"))
        once(served, MESSAGES)
        await wait_idle(served.gateway)


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "exception"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (422, openai.UnprocessableEntityError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_openai_4xx_surfaces_as_the_sdk_exception(
    served: Served, status: int, exception: type[openai.APIStatusError], stream: bool
) -> None:
    served.upstream.fail(CHAT, Fault(status=status, message="you did it wrong", code="bad_thing"))
    with pytest.raises(exception) as caught:
        served.openai().chat.completions.create(model="gpt-test", messages=HELLO, stream=stream)
    assert caught.value.status_code == status
    assert caught.value.code == "bad_thing"
    assert "you did it wrong" in caught.value.message
    assert isinstance(caught.value.body, dict) and caught.value.body["message"] == "you did it wrong"
    once(served, CHAT)
    served.wait_idle()


@pytest.mark.parametrize(
    ("status", "exception"),
    [
        (400, anthropic.BadRequestError),
        (401, anthropic.AuthenticationError),
        (403, anthropic.PermissionDeniedError),
        (404, anthropic.NotFoundError),
        (413, anthropic.RequestTooLargeError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_4xx_surfaces_as_the_sdk_exception(
    served: Served, status: int, exception: type[anthropic.APIStatusError], stream: bool
) -> None:
    served.upstream.fail(MESSAGES, Fault(status=status, message="prompt is too long"))
    client = served.anthropic()
    with pytest.raises(exception) as caught:
        if stream:
            with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as events:
                events.get_final_message()
        else:
            client.messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO)
    assert caught.value.status_code == status
    assert "prompt is too long" in caught.value.message
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["message"] == "prompt is too long"
    assert caught.value.request_id == "req_scripted"
    once(served, MESSAGES)
    served.wait_idle()


# Statuses the SDKs retry by default (max_retries=2): 408, 409, 429 and every 5xx. The gateway
# retries 429/502/503/504/529 itself: once its MAX_ATTEMPTS are spent it says x-should-retry:
# false, so one SDK call costs at most MAX_ATTEMPTS upstream requests. A 500 it does not retry:
# the SDK's own retries stay (each of its attempts is one upstream request, never multiplied).
SDK_ATTEMPTS = 3  # the SDKs' default max_retries=2, plus the first


def _hits_allowed(status: int) -> int:
    return SDK_ATTEMPTS if status == 500 else MAX_ATTEMPTS


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_retryable_status_exhausted_does_not_multiply_attempts(
    served: Served, status: int, stream: bool
) -> None:
    served.upstream.fail(CHAT, Fault(status=status, message="try later"), times=None)
    with pytest.raises(openai.APIStatusError) as caught:
        served.openai().chat.completions.create(model="gpt-test", messages=HELLO, stream=stream)
    assert caught.value.status_code == status and "try later" in caught.value.message
    requests = served.upstream.seen(CHAT).requests
    assert requests == _hits_allowed(status), f"the upstream was asked {requests} times for one SDK call"
    served.wait_idle()


@pytest.mark.parametrize("status", [429, 500, 503, 529])
def test_anthropic_retryable_status_exhausted_does_not_multiply_attempts(served: Served, status: int) -> None:
    served.upstream.fail(MESSAGES, Fault(status=status, message="Overloaded"), times=None)
    with pytest.raises(anthropic.APIStatusError) as caught:
        served.anthropic().messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO)
    assert caught.value.status_code == status and "Overloaded" in caught.value.message
    requests = served.upstream.seen(MESSAGES).requests
    assert requests == _hits_allowed(status), f"the upstream was asked {requests} times for one SDK call"
    served.wait_idle()


def test_retry_after_ms_reaches_the_sdk(served: Served) -> None:
    """A relayed 429 keeps the upstream's ``retry-after-ms``: the SDK honours it when it does retry."""
    served.upstream.fail(CHAT, Fault(status=429, headers={"retry-after-ms": "10"}), times=None)
    raw = served.openai(max_retries=0).chat.completions.with_raw_response
    with pytest.raises(openai.RateLimitError) as caught:
        raw.create(model="gpt-test", messages=HELLO)
    assert caught.value.response.headers.get("retry-after-ms") == "10"
    served.wait_idle()


# --- cancellation, resets, stalls -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One streamed endpoint: how the SDK opens it and how many events it takes to get content."""

    path: str
    open: Callable[[Served], Any]
    content_at: int  # upstream events up to and including the first content


def _open_chat(served: Served) -> Any:
    return served.openai().chat.completions.create(model="gpt-test", messages=HELLO, stream=True)


def _open_responses(served: Served) -> Any:
    return served.openai().responses.create(model="gpt-test", input="hello", stream=True)


def _open_transcription(served: Served) -> Any:
    return served.openai().audio.transcriptions.create(model="gpt-4o-transcribe", file=AUDIO, stream=True)


def _open_images(served: Served) -> Any:
    return served.openai().images.generate(model="gpt-image-1", prompt="a fox", stream=True, partial_images=3)


def _open_anthropic(served: Served) -> Any:
    return served.anthropic().messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO, stream=True)


CASES = {
    "chat": Case(CHAT, _open_chat, 2),
    "responses": Case(RESPONSES, _open_responses, 5),
    "transcription": Case(TRANSCRIPTIONS, _open_transcription, 1),
    "images": Case(IMAGES, _open_images, 1),
    "anthropic": Case(MESSAGES, _open_anthropic, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_closing_a_stream_midway_cancels_the_upstream_request(served: Served, name: str) -> None:
    case = CASES[name]
    served.upstream.fail(case.path, Fault(stall_after=case.content_at + 1))
    stream = case.open(served)
    for _ in stream:
        break  # one event in hand, the upstream still streaming (stalled), and the client gives up
    stream.close()
    settle(lambda: served.upstream.seen(case.path).disconnects == 1, what=lambda: str(served.upstream.seen(case.path)))
    assert served.upstream.seen(case.path).completed == 0
    once(served, case.path)
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_breaking_out_of_an_async_stream_cancels_the_upstream_request(anyio_backend: str) -> None:
    with serving() as served:
        served.upstream.fail(RESPONSES, Fault(stall_after=6))
        async with served.async_openai() as client:
            async with client.responses.stream(model="gpt-test", input="hello") as stream:
                async for event in stream:
                    if event.type == "response.output_text.delta":
                        break
        await eventually(lambda: served.upstream.seen(RESPONSES).disconnects == 1, what=lambda: held(served.gateway))
        once(served, RESPONSES)
        await wait_idle(served.gateway)


def test_sdk_timeout_on_a_stalled_stream_cancels_the_upstream_request(served: Served) -> None:
    served.upstream.fail(CHAT, Fault(stall_after=3))
    stream = served.openai(timeout=0.5, max_retries=0).chat.completions.create(
        model="gpt-test", messages=HELLO, stream=True
    )
    with pytest.raises(openai.APITimeoutError):
        for _ in stream:
            pass
    stream.close()
    settle(lambda: served.upstream.seen(CHAT).disconnects == 1, what=lambda: str(served.upstream.seen(CHAT)))
    once(served, CHAT)
    served.wait_idle()


@pytest.mark.parametrize("half", [True, False], ids=["mid-event", "between-events"])
@pytest.mark.parametrize("name", list(CASES))
def test_upstream_reset_midstream_raises_an_sdk_error_not_a_decode_error(served: Served, name: str, half: bool) -> None:
    case = CASES[name]
    served.upstream.fail(case.path, Fault(cut_after=case.content_at + 1, half=half))
    received: list[Any] = []
    with pytest.raises(Exception) as caught:  # noqa: B017  (the type is the assertion below)
        for event in case.open(served):
            received.append(event)
    assert isinstance(caught.value, (openai.APIError, anthropic.APIError)), repr(caught.value)
    assert not isinstance(caught.value, json.JSONDecodeError)
    assert len(received) >= 1  # the content before the cut reached the client
    assert served.upstream.seen(case.path).cuts == 1
    once(served, case.path)  # content had reached the client: no re-issue
    served.wait_idle()


def test_anthropic_stream_reset_mid_event_raises_an_api_error(served: Served) -> None:
    served.upstream.fail(MESSAGES, Fault(cut_after=5, half=True))
    client = served.anthropic()
    with pytest.raises(anthropic.APIError) as caught:
        with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
            stream.get_final_message()
    assert not isinstance(caught.value, json.JSONDecodeError)
    once(served, MESSAGES)
    served.wait_idle()


# --- headers the SDKs send ------------------------------------------------------------------------


def test_sdk_headers_reach_the_upstream(served: Served) -> None:
    client = served.openai(default_headers={"OpenAI-Beta": "assistants=v2"})
    client.chat.completions.create(model="gpt-test", messages=HELLO)
    headers = served.upstream.seen(CHAT).headers[0]
    assert headers["openai-beta"] == "assistants=v2"
    assert headers["x-stainless-lang"] == "python"
    assert headers["x-stainless-retry-count"] == "0"
    assert headers["user-agent"].startswith("OpenAI/Python")


# --- other servers --------------------------------------------------------------------------------


@contextlib.contextmanager
def serving_hypercorn(backend: str, **settings: Any) -> Iterator[Served]:
    upstream = ScriptedUpstream()
    with serve_in_thread(upstream.app) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**SETTINGS, **settings}))
        with (
            hypercorn_in_thread(gateway, backend) as port,
            _closing(Served(upstream, gateway, f"http://127.0.0.1:{port}")) as served,
        ):
            yield served


def _happy_chat(served: Served) -> str:
    stream = served.openai().chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == up.TEXT
    return CHAT


def _happy_responses(served: Served) -> str:
    with served.openai().responses.stream(model="gpt-test", input="hello") as stream:
        assert stream.get_final_response().output_text == up.TEXT
    return RESPONSES


def _happy_responses_image(served: Served) -> str:
    with served.openai().responses.stream(model="gpt-test", input="draw", tools=IMAGE_TOOL) as stream:
        assert getattr(stream.get_final_response().output[0], "result", None) == up.BIG_IMAGE_B64
    return RESPONSES


def _happy_transcription(served: Served) -> str:
    events = list(served.openai().audio.transcriptions.create(model="gpt-4o-transcribe", file=AUDIO, stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == up.TRANSCRIPT
    return TRANSCRIPTIONS


def _happy_images(served: Served) -> str:
    events = list(served.openai().images.generate(model="gpt-image-1", prompt="a fox", stream=True, partial_images=2))
    assert [e.type for e in events] == [name for name, _ in up.image_events(2)]
    return IMAGES


def _happy_speech(served: Served) -> str:
    with served.openai().audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input="hello", stream_format="sse"
    ) as response:
        assert _speech_events(response.iter_bytes()) == [d for _, d in up.speech_events()]
    return SPEECH


def _happy_anthropic(served: Served) -> str:
    with served.anthropic().messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
        assert _sent_fields(stream.get_final_message(), up.anthropic_message("claude-test"))
    return MESSAGES


HAPPY = {
    "chat": _happy_chat,
    "responses": _happy_responses,
    "responses-image": _happy_responses_image,
    "transcription": _happy_transcription,
    "images": _happy_images,
    "speech": _happy_speech,
    "anthropic": _happy_anthropic,
}


@pytest.mark.parametrize("name", list(HAPPY))
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_happy_paths_under_hypercorn(backend: str, name: str) -> None:
    with serving_hypercorn(backend) as served:
        path = HAPPY[name](served)
        once(served, path)
        served.wait_idle()


# --- more of what an SDK user meets ---------------------------------------------------------------


def test_responses_create_with_a_large_image(served: Served) -> None:
    """A non-streamed answer > 1 MiB is relayed as it is."""
    response = served.openai().responses.create(model="gpt-test", input="draw", tools=IMAGE_TOOL)
    assert getattr(response.output[0], "result", None) == up.BIG_IMAGE_B64
    once(served, RESPONSES)
    served.wait_idle()


def test_sdk_timeout_before_headers_cancels_the_upstream_request(served: Served) -> None:
    served.upstream.fail(CHAT, Fault(hold=STALL_SECONDS))
    client = served.openai(timeout=0.5, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="gpt-test", messages=HELLO)
    settle(lambda: served.upstream.seen(CHAT).disconnects == 1, what=lambda: str(served.upstream.seen(CHAT)))
    once(served, CHAT)
    served.wait_idle()


def test_gateway_timeout_exhausted_is_not_retried_again_by_the_sdk() -> None:
    """The gateway's own 504 (no headers within HEADERS_TIMEOUT, MAX_ATTEMPTS times): the SDK must not multiply it."""
    with serving(headers_timeout=0.3) as served:
        served.upstream.fail(CHAT, Fault(hold=STALL_SECONDS), times=None)
        with pytest.raises(openai.APIStatusError) as caught:
            served.openai().chat.completions.create(model="gpt-test", messages=HELLO)
        assert caught.value.status_code == 504 and caught.value.code == "upstream_timeout"
        requests = served.upstream.seen(CHAT).requests
        assert requests <= MAX_ATTEMPTS, f"the upstream was asked {requests} times for one SDK call"
        assert served.stats()["admitted"] == 1
        served.wait_idle()


def test_gateway_unreachable_upstream_is_not_retried_again_by_the_sdk() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        gateway = create_app(LifetimeSettings(upstream_url=(dead,), **SETTINGS))
        with serve_in_thread(gateway) as url, _closing(Served(ScriptedUpstream(), gateway, url)) as served:
            with pytest.raises(openai.APIStatusError) as caught:
                served.openai().chat.completions.create(model="gpt-test", messages=HELLO)
            assert caught.value.status_code == 502 and caught.value.code == "upstream_unreachable"
            assert served.stats()["admitted"] == 1, "the SDK re-sent a request the gateway had already retried"
            served.wait_idle()


def _transient_code(path: str) -> str:
    """What the API calls a failure on its own side, in its in-band error: a second request would not meet it."""
    return "overloaded_error" if path == MESSAGES else "server_error"


def _inband_error(stream: Any) -> str:
    """Read ``stream`` until the upstream's in-band error; its message ("" if none came)."""
    try:
        for event in stream:
            if getattr(event, "type", None) == "error":  # the Responses API's error is an event, not raised
                return str(event.message)
    except (openai.APIError, anthropic.APIError) as exc:  # the other SDK streams raise it
        return str(exc)
    return ""


@pytest.mark.parametrize(("where", "transient"), [("first", False), ("after-content", False), ("after-content", True)])
@pytest.mark.parametrize("name", list(CASES))
def test_upstream_inband_error_reaches_the_sdk_and_is_not_resent(
    served: Served, name: str, where: str, transient: bool
) -> None:
    # Not transient: "overloaded" is no API's name for a failure on its side. Transient after content: the
    # client has part of an answer, a second one cannot follow.
    case = CASES[name]
    after = 0 if where == "first" else case.content_at + 1
    code = _transient_code(case.path) if transient else "overloaded"
    served.upstream.fail(case.path, Fault(error_after=after, message="the model is overloaded", code=code))
    assert "the model is overloaded" in _inband_error(case.open(served))
    once(served, case.path)
    served.wait_idle()


@pytest.mark.parametrize("name", list(CASES))
def test_a_transient_first_inband_error_is_reissued_and_the_sdk_gets_the_whole_answer(
    served: Served, name: str
) -> None:
    # Before: the SDK raised the upstream's overloaded_error / server_error (the upstream asked once), though
    # the client had nothing and a second request answers. Now the gateway re-issues the request once.
    case = CASES[name]
    expected = [(type(event).__name__, getattr(event, "type", None)) for event in case.open(served)]  # a clean run
    fault = Fault(error_after=0, message="the model is overloaded", code=_transient_code(case.path))
    served.upstream.fail(case.path, fault)
    assert [(type(event).__name__, getattr(event, "type", None)) for event in case.open(served)] == expected
    assert served.upstream.seen(case.path).requests == 3  # the clean run, the failed attempt and its re-issue
    assert served.stats()["starved"] == 0
    served.wait_idle()


@pytest.mark.parametrize("name", list(CASES))
def test_a_transient_inband_error_every_time_reaches_the_sdk_after_one_reissue(served: Served, name: str) -> None:
    case = CASES[name]
    fault = Fault(error_after=0, message="the model is overloaded", code=_transient_code(case.path))
    served.upstream.fail(case.path, fault, times=None)
    assert "the model is overloaded" in _inband_error(case.open(served))
    assert served.upstream.seen(case.path).requests == 2  # one re-issue, never a third request
    assert served.upstream.total_requests() == 2
    served.wait_idle()


def test_gateway_error_on_the_anthropic_path_has_the_anthropic_shape() -> None:
    """A 413 the gateway itself answers on /v1/messages: the Anthropic SDK expects ``{"type": "error", ...}``."""
    with serving(max_body_bytes=2048, max_inflight_bytes=4096) as served:
        with pytest.raises(anthropic.RequestTooLargeError) as caught:
            served.anthropic().messages.create(
                model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "x" * 4096}]
            )
        body = caught.value.body
        assert isinstance(body, dict) and isinstance(body.get("error"), dict)
        assert body["error"].get("message") and body["error"].get("type")
        assert body.get("type") == "error", f"OpenAI-shaped error on an Anthropic path: {body}"
        assert served.upstream.total_requests() == 0


@pytest.mark.parametrize("fault", ["client-closes", "stall", "cut", "cut-mid-event"])
def test_stream_ending_early_under_hypercorn_trio_leaves_nothing_behind(fault: str) -> None:
    """The gateway on trio: a stream that ends early (client hangs up, upstream stalls or drops) closes
    the upstream and leaves no async generator to the GC (trio warns about those: warnings are errors)."""
    faults = {
        "client-closes": Fault(stall_after=4),
        "stall": Fault(stall_after=4),
        "cut": Fault(cut_after=4),
        "cut-mid-event": Fault(cut_after=4, half=True),
    }
    with serving_hypercorn("trio", stall_timeout=0.5 if fault == "stall" else 10.0) as served:
        served.upstream.fail(CHAT, faults[fault])
        stream = served.openai().chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
        with contextlib.suppress(openai.APIError, json.JSONDecodeError):  # the errors are asserted elsewhere
            for _ in stream:
                if fault == "client-closes":
                    break
        stream.close()
        if fault in ("client-closes", "stall"):
            settle(lambda: served.upstream.seen(CHAT).disconnects == 1, what=lambda: str(served.upstream.seen(CHAT)))
        once(served, CHAT)
        served.wait_idle()


@pytest.mark.parametrize("where", ["first", "after-content"])
@pytest.mark.parametrize("name", list(CASES))
def test_stalled_upstream_ends_the_sdk_stream_with_an_error(name: str, where: str) -> None:
    """Silent before the first byte: the gateway answers 504 (which the SDK must not re-send); after
    content: the stream ends with the gateway's in-band error, which the SDK raises."""
    with serving(stall_timeout=0.5) as served:
        case = CASES[name]
        served.upstream.fail(case.path, Fault(stall_after=0 if where == "first" else case.content_at + 1))
        with pytest.raises(Exception) as caught:  # noqa: B017  (the type is the assertion below)
            for _ in case.open(served):
                pass
        assert isinstance(caught.value, (openai.APIError, anthropic.APIError)), repr(caught.value)
        if where == "first":
            assert isinstance(caught.value, (openai.APIStatusError, anthropic.APIStatusError))
            assert caught.value.status_code == 504
        assert "no data for 0.5 seconds" in str(caught.value)
        settle(
            lambda: served.upstream.seen(case.path).disconnects >= 1, what=lambda: str(served.upstream.seen(case.path))
        )
        once(served, case.path)
        served.wait_idle()


def test_get_and_bodiless_requests(served: Served) -> None:
    client = served.openai()
    assert [model.id for model in client.models.list()] == ["gpt-test"]
    assert client.models.retrieve("gpt-test").id == "gpt-test"
    claude = served.anthropic()
    assert [model.id for model in claude.models.list()] == ["claude-test"]
    counted = claude.messages.count_tokens(model="claude-test", messages=CLAUDE_HELLO)
    assert counted.input_tokens == 11
    assert served.upstream.seen("/v1/models").requests == 2
    served.wait_idle()


def test_unknown_path_is_the_upstreams_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        served.openai().batches.list()
    served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_cancelling_an_async_stream_with_a_cancel_scope_cancels_the_upstream_request(anyio_backend: str) -> None:
    """A caller's timeout (``move_on_after``) around a stalled stream: once the client is closed, the
    gateway sees the hang-up and cancels the upstream request."""
    with serving() as served:
        served.upstream.fail(MESSAGES, Fault(stall_after=5))
        async with served.async_anthropic() as client:
            with anyio.move_on_after(1.0) as scope:
                async with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
                    async for _ in stream.text_stream:
                        pass
            assert scope.cancelled_caught
        await eventually(lambda: served.upstream.seen(MESSAGES).disconnects == 1, what=lambda: held(served.gateway))
        once(served, MESSAGES)
        await wait_idle(served.gateway)


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_concurrent_async_streams(anyio_backend: str) -> None:
    texts: list[str] = []
    with serving(delay=0.005) as served:
        async with served.async_openai() as openai_client, served.async_anthropic() as anthropic_client:

            async def chat() -> None:
                stream = await openai_client.chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
                texts.append("".join([chunk.choices[0].delta.content or "" async for chunk in stream]))

            async def message() -> None:
                async with anthropic_client.messages.stream(
                    model="claude-test", max_tokens=64, messages=CLAUDE_HELLO
                ) as stream:
                    texts.append("".join([text async for text in stream.text_stream]))

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(chat)
                    tg.start_soon(message)
        assert texts == [up.TEXT] * 16
        assert served.upstream.seen(CHAT).requests == 8 and served.upstream.seen(MESSAGES).requests == 8
        assert served.upstream.seen(CHAT).completed == 8 and served.upstream.seen(MESSAGES).completed == 8
        await wait_idle(served.gateway)
