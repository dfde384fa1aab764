"""The gateway as a new user meets it with the official ``openai`` and ``anthropic`` SDKs: what broke.

Each test is a defect found by driving the gateway (under uvicorn, over loopback) with the SDKs, in
front of ``tests.sdk_upstream`` or a purpose-built upstream on another loopback port.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from starlette.types import Message, Receive, Scope, Send

from asgi_lifetime._exceptions import error_shape
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._relay import relay
from asgi_lifetime.testing._serve import serve_in_thread

from ..gateway import sdk_upstream as up
from ..gateway.test_sdk import (
    CLAUDE_HELLO,
    HELLO,
    SDK_TIMEOUT,
    SETTINGS,
    STALL_SECONDS,
    Served,
    _closing,
    serving,
    settle,
)

SESSION = "attack-sdk-session"


class _Lingering:
    """An upstream that streams ``events`` whole, then keeps the response open (no end of body) until
    the peer hangs up: as a real upstream may after its terminal event (``[DONE]``), for a moment or
    longer. Counts requests and whether each ended by the peer leaving."""

    def __init__(self, events: list[tuple[str | None, Any]]) -> None:
        self.frames = [up.sse_frame(name, data) for name, data in events]
        self._lock = threading.Lock()
        self.requests = 0
        self.peer_left = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        with self._lock:
            self.requests += 1
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        with anyio.move_on_after(STALL_SECONDS):
            while (await receive())["type"] != "http.disconnect":
                pass
            with self._lock:
                self.peer_left += 1
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@contextlib.contextmanager
def _gateway_before(upstream_app: Any, **settings: Any) -> Iterator[Served]:
    with serve_in_thread(upstream_app) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**SETTINGS, **settings}))
        with serve_in_thread(gateway) as url, _closing(Served(up.ScriptedUpstream(), gateway, url)) as served:
            yield served


@contextlib.contextmanager
def serving_keyed(**settings: Any) -> Iterator[Served]:
    """The scripted upstream behind a gateway that injects its own key and wants a gateway key."""
    with serving(upstream_api_key="sk-upstream", gateway_keys=("gateway-key",), **settings) as served:
        yield served


@contextlib.contextmanager
def serving_dead_upstream() -> Iterator[Served]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        gateway = create_app(LifetimeSettings(upstream_url=(dead,), **SETTINGS))
        with serve_in_thread(gateway) as url, _closing(Served(up.ScriptedUpstream(), gateway, url)) as served:
            yield served


def _with_key(served: Served, sdk: Any, key: str) -> Any:
    base_url = f"{served.url}/v1" if sdk is openai.OpenAI else served.url
    client = sdk(base_url=base_url, api_key=key, max_retries=0, timeout=SDK_TIMEOUT)
    served.clients.append(client)
    return client


def _recorded(served: Served) -> tuple[int, str]:
    entry = served.gateway.state.book.get(SESSION)
    assert entry is not None, "nothing recorded for the session"
    return entry.last_status, entry.last_outcome


# --- a stream read to its end is a complete answer -------------------------------------------------


def test_chat_stream_read_to_done_is_recorded_complete() -> None:
    """The openai SDK stops reading at ``data: [DONE]`` and closes the connection. When the upstream's
    end of body comes after that (a moment later, over a real network), the client had the whole
    answer: bookkeeping, metrics and the access log must say ``complete``, not ``client_disconnected``."""
    upstream = _Lingering(up.chat_chunks("gpt-test"))
    with _gateway_before(upstream) as served:
        client = served.openai(default_headers={"x-session-id": SESSION})
        stream = client.chat.completions.create(model="gpt-test", messages=HELLO, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == up.TEXT
        settle(lambda: served.gateway.state.book.get(SESSION) is not None, what=lambda: "the outcome recorded")
        served.wait_idle()
        assert upstream.requests == 1
        assert _recorded(served) == (200, "complete")


# --- the gateway's own errors in the shape of the SDK that called -----------------------------------


def _anthropic_shaped(body: object) -> bool:
    return (
        isinstance(body, dict)
        and body.get("type") == "error"
        and isinstance(body.get("error"), dict)
        and bool(body["error"].get("type"))
        and bool(body["error"].get("message"))
    )


ANTHROPIC_ELSEWHERE = {
    "models.list": lambda client: client.models.list(),
    "models.retrieve": lambda client: client.models.retrieve("claude-test"),
    "batches.list": lambda client: client.messages.batches.list(),  # under /v1/messages: by path already
    "files.upload": lambda client: client.beta.files.upload(file=("a.txt", b"abc", "text/plain")),
}


@pytest.mark.parametrize("call", list(ANTHROPIC_ELSEWHERE))
def test_anthropic_sdk_gets_anthropic_errors_off_the_messages_path(call: str) -> None:
    """The anthropic SDK calls /v1/models and /v1/files too; a refusal there (a wrong gateway key)
    must be in its shape, as on /v1/messages: ``{"type": "error", "error": {"type", "message"}}``."""
    with serving_keyed() as served:
        client = _with_key(served, anthropic.Anthropic, "not-a-gateway-key")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            ANTHROPIC_ELSEWHERE[call](client)
        assert _anthropic_shaped(caught.value.body), caught.value.body
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        assert served.upstream.total_requests() == 0


def test_anthropic_sdk_gets_anthropic_errors_from_a_dead_upstream_off_the_messages_path() -> None:
    """The gateway's own 502 after its retries, on /v1/models for the anthropic SDK."""
    with serving_dead_upstream() as served:
        with pytest.raises(anthropic.APIStatusError) as caught:
            served.anthropic(max_retries=0).models.list()
        assert caught.value.status_code == 502
        assert _anthropic_shaped(caught.value.body), caught.value.body
        served.wait_idle()


def test_openai_sdk_still_gets_openai_errors() -> None:
    with serving_keyed() as served:
        with pytest.raises(openai.AuthenticationError) as caught:
            _with_key(served, openai.OpenAI, "not-a-gateway-key").models.list()
        body = caught.value.body
        assert isinstance(body, dict) and body.get("code") == "invalid_api_key" and "type" in body
        assert served.upstream.total_requests() == 0


@pytest.mark.parametrize(
    ("path", "headers", "shape"),
    [
        ("/v1/models", [(b"anthropic-version", b"2023-06-01")], "anthropic"),
        ("/v1/files", [(b"Anthropic-Version", b"2023-06-01")], "anthropic"),
        ("/v1/models", [(b"x-stainless-lang", b"python")], "openai"),
        ("/upload/v1beta/files", [(b"x-goog-api-client", b"google-genai-sdk/1.0")], "gemini"),
        # A credential header says nothing: the gateway injects x-goog-api-key for every client
        # when UPSTREAM_AUTH=x-goog-api-key (an OpenAI SDK on Gemini's OpenAI-compatible API).
        ("/v1/chat/completions", [(b"x-goog-api-key", b"k")], "openai"),
        ("/v1/chat/completions", [(b"x-api-key", b"k")], "openai"),
        # The path decides first.
        ("/v1/messages", [(b"x-goog-api-client", b"x")], "anthropic"),
        ("/v1beta/models/g:generateContent", [(b"anthropic-version", b"x")], "gemini"),
    ],
)
def test_error_shape_follows_the_sdk_that_called(path: str, headers: list[tuple[bytes, bytes]], shape: str) -> None:
    assert error_shape(path, headers) == shape


def test_the_gateways_404_for_the_anthropic_sdk_is_anthropic_shaped() -> None:
    """A path outside ``PATHS`` (a base_url with a typo): Starlette's 404, rendered by the gateway."""
    with serving() as served:
        client = anthropic.Anthropic(base_url=f"{served.url}/typo", api_key="k", max_retries=0, timeout=SDK_TIMEOUT)
        served.clients.append(client)
        with pytest.raises(anthropic.NotFoundError) as caught:
            client.models.list()
        assert _anthropic_shaped(caught.value.body), caught.value.body
        assert served.upstream.total_requests() == 0


# --- the gateway's 503 before any upstream attempt is the SDK's to retry ----------------------------


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_sdk_retries_a_request_the_gateway_could_not_admit(sdk: str) -> None:
    """Not admitted within ADMISSION_TIMEOUT: 503 with ``Retry-After``. Nothing reached the upstream, so
    an SDK retry cannot multiply upstream attempts; ``x-should-retry: false`` would contradict the
    ``Retry-After`` beside it and make every SDK call fail during a burst (or a drain's DRAIN_DELAY)."""
    path = up.ANTHROPIC_PATH if sdk == "anthropic" else "/v1/chat/completions"
    with serving(max_inflight=1, admission_timeout=0.3) as served:
        served.upstream.fail(path, up.Fault(hold=1.0))  # the holder keeps the only slot for a second
        holder = served.openai() if sdk == "openai" else served.anthropic()
        waiter = served.openai() if sdk == "openai" else served.anthropic()  # default max_retries=2

        def call(client: Any) -> str:
            if sdk == "openai":
                completion = client.chat.completions.create(model="gpt-test", messages=HELLO)
                return str(completion.choices[0].message.content)
            message = client.messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO)
            return str(message.content[0].text)

        answers: list[str] = []
        thread = threading.Thread(target=lambda: answers.append(call(holder)))
        thread.start()
        try:
            settle(lambda: served.upstream.seen(path).requests == 1, what=lambda: "the holder reached the upstream")
            assert call(waiter) == up.TEXT  # rejected once (the slot is held), retried by the SDK, answered
        finally:
            thread.join(STALL_SECONDS)
        assert answers == [up.TEXT]
        assert served.stats()["rejected"] >= 1
        assert served.upstream.seen(path).requests == 2  # the holder's and the waiter's: each once
        served.wait_idle()


# --- the upstream's Retry-After is honoured, or the gateway does not retry -------------------------


@pytest.mark.parametrize("header", [{"retry-after": "5"}, {"retry-after-ms": "5000"}], ids=["seconds", "ms"])
def test_upstream_asking_for_a_longer_wait_than_the_cap_is_not_asked_again_early(header: dict[str, str]) -> None:
    """A 429 asking for 5 s with RETRY_AFTER_CAP=0.05: re-sending after 0.05 s ignores what the
    upstream asked (a rate limiter counts it against the key). The gateway should give the 429,
    with its wait, to the client at once, which the SDKs honour (they wait up to 60 s)."""
    with serving(retry_after_cap=0.05, max_attempts=3) as served:
        served.upstream.fail("/v1/chat/completions", up.Fault(status=429, headers=header), times=None)
        with pytest.raises(openai.RateLimitError) as caught:
            served.openai(max_retries=0).chat.completions.create(model="gpt-test", messages=HELLO)
        assert all(caught.value.response.headers.get(name) == value for name, value in header.items())
        assert served.upstream.seen("/v1/chat/completions").requests == 1
        served.wait_idle()


# --- a request the upstream may be working on is not sent again -----------------------------------


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_slow_non_streamed_answer_is_not_generated_twice(sdk: str) -> None:
    """A non-streamed completion sends its headers only when the answer is ready: past HEADERS_TIMEOUT
    (which operators.md suggests lowering below a balancer's idle timeout) the upstream is still
    generating. Re-sending starts another billed generation (nginx never re-sends a POST that reached
    an upstream). The client should get the 504 after one attempt."""
    path = up.ANTHROPIC_PATH if sdk == "anthropic" else "/v1/chat/completions"
    with serving(headers_timeout=0.3, max_attempts=3) as served:
        served.upstream.fail(path, up.Fault(hold=STALL_SECONDS), times=None)
        with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
            if sdk == "openai":
                served.openai(max_retries=0).chat.completions.create(model="gpt-test", messages=HELLO)
            else:
                served.anthropic(max_retries=0).messages.create(
                    model="claude-test", max_tokens=64, messages=CLAUDE_HELLO
                )
        error = caught.value
        assert isinstance(error, (openai.APIStatusError, anthropic.APIStatusError))  # narrows the tuple's common base
        assert error.status_code == 504
        assert served.upstream.seen(path).requests == 1, "the same generation was requested again"
        served.wait_idle()


# --- Azure's credential header ---------------------------------------------------------------------


class _Recording:
    """An upstream that answers every request with an empty chat completion and records its headers."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        body = b'{"id":"c","object":"chat.completion","created":1,"model":"d","choices":[]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


AZURE: dict[str, Any] = {"upstream_api_key": "sk-upstream", "gateway_keys": ("gateway-key",), "paths": ("/openai/",)}


@pytest.mark.parametrize("how", ["api-key is the gateway key", "api-key beside a bearer gateway key"])
def test_azure_openai_sdk_api_key_header(how: str) -> None:
    upstream = _Recording()
    with _gateway_before(upstream, **AZURE) as served:
        if how == "api-key is the gateway key":
            client = openai.AzureOpenAI(azure_endpoint=served.url, api_key="gateway-key", api_version="2024-10-21")
        else:
            client = openai.AzureOpenAI(
                azure_endpoint=served.url,
                azure_ad_token="gateway-key",
                api_version="2024-10-21",
                default_headers={"api-key": "the-clients-own-secret"},
            )
        served.clients.append(client.with_options(max_retries=0))
        served.clients[-1].chat.completions.create(model="d", messages=HELLO)
        assert len(upstream.headers) == 1
        forwarded = upstream.headers[0]
        assert forwarded.get("authorization") == "Bearer sk-upstream"
        assert "api-key" not in forwarded, "a client credential reached the upstream beside the gateway's key"


@pytest.mark.parametrize("status", [429, 503, 529])
def test_upstream_saying_do_not_retry_is_not_retried(status: int) -> None:
    with serving(max_attempts=3) as served:
        fault = up.Fault(status=status, message="do not retry this", headers={"x-should-retry": "false"})
        served.upstream.fail(up.ANTHROPIC_PATH, fault, times=None)
        with pytest.raises(anthropic.APIStatusError) as caught:
            served.anthropic().messages.create(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO)
        assert caught.value.status_code == status
        assert served.upstream.seen(up.ANTHROPIC_PATH).requests == 1
        served.wait_idle()


# --- token-id inputs are ordinary API calls ----------------------------------------------------------


class _EchoSize:
    """An upstream that answers an embeddings / completions call and records each body."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(b"".join(chunks))
        if scope["path"].endswith("/embeddings"):
            data = b'{"object":"embedding","index":0,"embedding":[0.5]}'
            body = b'{"object":"list","data":[' + data + b'],"model":"e","usage":{"prompt_tokens":1,"total_tokens":1}}'
        else:
            body = b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def _tokens() -> list[list[int]]:
    """Pre-tokenized input, as tiktoken gives it: 500,000 ids of 3 digits (the body is about 2 MiB).
    Built when the test runs: held from collection on, it would weigh on test_release's traced memory."""
    return [[100 + (i * 7919 + j * 104729) % 900 for j in range(8000)] for i in range(62)]


@pytest.mark.parametrize("endpoint", ["embeddings", "completions"])
def test_token_id_inputs_are_served(endpoint: str) -> None:
    upstream = _EchoSize()
    with _gateway_before(upstream) as served:
        client = served.openai(max_retries=0)
        tokens = _tokens()
        sent: list[Any]
        if endpoint == "embeddings":
            result = client.embeddings.create(model="text-embedding-3-small", input=tokens, encoding_format="float")
            assert result.data[0].embedding == [0.5]
            key, sent = "input", tokens
        else:
            client.completions.create(model="davinci-002", prompt=tokens[0] * 62, max_tokens=1)
            key, sent = "prompt", tokens[0] * 62
        (body,) = upstream.bodies
        assert len(body) > 1024 * 1024 and json.loads(body)[key] == sent  # forwarded as sent
        served.wait_idle()


# --- a client leaving mid-stream leaves no half-run generator behind ---------------------------------


class _Watched(httpx.AsyncByteStream):
    """An upstream body (many events, then silence) whose iterator notes when it is finalized."""

    def __init__(self) -> None:
        self.finalized = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            for frame in [up.sse_frame(None, data) for _, data in up.chat_chunks("gpt-test")[:-1]]:
                yield frame
            await anyio.sleep(STALL_SECONDS)
        finally:
            self.finalized = True

    async def aclose(self) -> None:
        pass


@pytest.mark.anyio
async def test_a_client_leaving_while_the_relay_sends_finalizes_the_upstream_iterators(anyio_backend: str) -> None:
    """The client leaves while the relay is blocked sending to it (a client that stopped reading): the
    relay ends, and every generator of the upstream body's chain has been finalized by then."""
    body = _Watched()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    blocked, gone = anyio.Event(), anyio.Event()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            blocked.set()
            await anyio.sleep_forever()  # the client's window is full

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        response = await client.send(client.build_request("POST", "http://upstream/v1/chat/completions"), stream=True)
        results: list[Any] = []

        async def run() -> None:
            results.append(
                await relay(response, send=send, receive=receive, stall_timeout=STALL_SECONDS, keepalive_interval=60)
            )

        with anyio.fail_after(STALL_SECONDS):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await blocked.wait()
                gone.set()
        assert results[0].outcome == "client_disconnected"
        assert body.finalized, "the upstream body's generator was left suspended"
