"""The gateway as a user of Google's official ``google-genai`` SDK meets it, over real sockets.

The SDK (sync, and ``client.aio`` on asyncio over aiohttp and on trio over httpx) points its
``base_url`` at the gateway (under uvicorn, or hypercorn), in front of ``tests.gateway.sdk_upstream``
speaking Gemini's wire format on ``/v1beta/models/<model>:<method>``. What the SDK raises through the
gateway is what it raises talking to Google: ``ClientError`` / ``ServerError`` with Google's ``code``,
``status`` and ``message``; a stream's chunks are the upstream's, each once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from asgi_lifetime.testing import wait_idle

from ..gateway import sdk_upstream as up
from ..gateway.sdk_upstream import Fault
from ..gateway.test_sdk import (
    MAX_ATTEMPTS,
    SDK_ASYNCGENS_ON_TRIO,
    SDK_TIMEOUT,
    STALL_SECONDS,
    Served,
    eventually,
    once,
    serving,
    serving_hypercorn,
    settle,
)

PATHS = ("/v1beta/",)
MODEL = "gemini-test"
GENERATE = f"{up.GEMINI}/models/{MODEL}:generateContent"
STREAM = f"{up.GEMINI}/models/{MODEL}:streamGenerateContent"
OVERFLOW = "The input token count (2000000) exceeds the maximum number of tokens allowed (1048576)."
SECRET = "client-secret-7f3a"  # a client's own key in ``?key=``: never forwarded, logged or echoed
KEYED: dict[str, Any] = {
    "upstream_api_key": "sk-upstream",
    "upstream_auth": "x-goog-api-key",
    "gateway_keys": ("gateway-key",),
}


@contextlib.contextmanager
def gemini_serving(**settings: Any) -> Iterator[Served]:
    with serving(paths=PATHS, **settings) as served:
        yield served


def gemini(served: Served, key: str = "gateway-key", **options: Any) -> genai.Client:
    """The SDK pointed at the gateway, as a user configures it (``HttpOptions.base_url``)."""
    http = types.HttpOptions(base_url=served.url, api_version="v1beta", timeout=int(SDK_TIMEOUT * 1000), **options)
    client = genai.Client(api_key=key, http_options=http)
    served.clients.append(client)
    return client


def streamed(client: genai.Client, contents: Any = "hello") -> list[types.GenerateContentResponse]:
    return list(client.models.generate_content_stream(model=MODEL, contents=contents))


def _sent_chunks() -> list[dict[str, Any]]:
    return [data for _, data in up.gemini_chunks(MODEL)]


def assert_whole_stream(chunks: list[types.GenerateContentResponse]) -> None:
    """Every event the upstream sent, whole, in order, once."""
    assert [chunk.text for chunk in chunks] == up.WORDS
    assert [chunk.usage_metadata.total_token_count for chunk in chunks if chunk.usage_metadata] == [
        c["usageMetadata"]["totalTokenCount"] for c in _sent_chunks()
    ]
    assert chunks[-1].candidates and chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP


def raised(call: Callable[[], object]) -> errors.APIError:
    with pytest.raises(errors.APIError) as info:
        call()
    return info.value


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """What the gateway and its servers logged (not the test's own httpx client, which logs its URLs)."""
    return "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))


def gateway_error(error: errors.APIError, cls: type[errors.APIError], code: int, status: str, reason: str) -> None:
    """The gateway's own error as the SDK parsed it: Google's code and status, the gateway's code as reason."""
    assert type(error) is cls, repr(error)
    assert (error.code, error.status) == (code, status), repr(error)
    assert error.message and error.details["error"]["details"][0]["reason"] == reason, repr(error)


# --- the happy paths -----------------------------------------------------------------------------


def _generate(served: Served) -> str:
    response = gemini(served).models.generate_content(model=MODEL, contents="hello")
    assert response.text == up.TEXT and response.response_id == "resp_scripted"
    assert response.usage_metadata and response.usage_metadata.total_token_count == 9 + len(up.WORDS)
    return GENERATE


def _stream(served: Served) -> str:
    assert_whole_stream(streamed(gemini(served)))
    return STREAM


def _count_tokens(served: Served) -> str:
    assert gemini(served).models.count_tokens(model=MODEL, contents="hello").total_tokens == 11
    return f"{up.GEMINI}/models/{MODEL}:countTokens"


def _embed(served: Served) -> str:
    response = gemini(served).models.embed_content(model=MODEL, contents="hello")
    assert response.embeddings and response.embeddings[0].values == up.EMBEDDING
    return f"{up.GEMINI}/models/{MODEL}:batchEmbedContents"


def _list(served: Served) -> str:
    assert [model.name for model in gemini(served).models.list()] == [f"models/{MODEL}"]
    return f"{up.GEMINI}/models"


def _get(served: Served) -> str:
    model = gemini(served).models.get(model=MODEL)
    assert model.name == f"models/{MODEL}" and model.input_token_limit == 1_048_576
    return f"{up.GEMINI}/models/{MODEL}"


HAPPY: dict[str, Callable[[Served], str]] = {
    "generate_content": _generate,
    "generate_content_stream": _stream,
    "count_tokens": _count_tokens,
    "embed_content": _embed,
    "models.list": _list,
    "models.get": _get,
}


@pytest.mark.parametrize("keyed", [False, True], ids=["pass-through", "keyed"])
@pytest.mark.parametrize("name", list(HAPPY))
def test_sdk_calls_get_the_upstreams_answer_once(name: str, keyed: bool) -> None:
    with gemini_serving(**(KEYED if keyed else {})) as served:
        path = HAPPY[name](served)
        once(served, path)
        seen = served.upstream.seen(path)
        # Exactly one credential reaches the upstream: ours when keyed, else the client's own.
        assert seen.headers[0]["x-goog-api-key"] == ("sk-upstream" if keyed else "gateway-key")
        assert "key=" not in seen.queries[0]
        assert seen.headers[0]["x-goog-api-client"].startswith("google-genai-sdk/")
        served.wait_idle()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_under_hypercorn(backend: str) -> None:
    with serving_hypercorn(backend, paths=PATHS) as served:
        assert_whole_stream(streamed(gemini(served)))
        once(served, STREAM)
        served.wait_idle()


@contextlib.asynccontextmanager
async def async_gemini(served: Served, backend: str) -> AsyncIterator[Any]:
    """``client.aio``: over aiohttp on asyncio (the SDK's choice when aiohttp is installed), over httpx
    on trio (aiohttp needs asyncio)."""
    options: dict[str, Any] = {}
    if backend == "trio":
        options["httpx_async_client"] = httpx.AsyncClient(timeout=SDK_TIMEOUT)
    client = gemini(served, **options).aio
    try:
        yield client
    finally:
        await client.aclose()
        if "httpx_async_client" in options:
            await options["httpx_async_client"].aclose()


# google-genai subclasses aiohttp's ClientSession, which aiohttp warns about when the class is made.
AIOHTTP_SUBCLASS = pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")


@pytest.mark.anyio
@AIOHTTP_SUBCLASS
async def test_the_async_client(anyio_backend: str) -> None:
    with gemini_serving() as served:
        async with async_gemini(served, anyio_backend) as client:
            stream = await client.models.generate_content_stream(model=MODEL, contents="hello")
            assert_whole_stream([chunk async for chunk in stream])
            answer = await client.models.generate_content(model=MODEL, contents="hello")
            assert answer.text == up.TEXT
        assert served.upstream.seen(STREAM).requests == served.upstream.seen(GENERATE).requests == 1
        await wait_idle(served.gateway)


@pytest.mark.anyio
@AIOHTTP_SUBCLASS
@SDK_ASYNCGENS_ON_TRIO  # the SDK's inner async generators, left unexhausted when the stream is closed
async def test_leaving_an_async_stream_midway_cancels_the_upstream_request(anyio_backend: str) -> None:
    with serving(paths=PATHS, delay=0.05) as served:
        async with async_gemini(served, anyio_backend) as client:
            stream = await client.models.generate_content_stream(model=MODEL, contents="hello")
            assert (await stream.__anext__()).text == up.WORDS[0]
            await stream.aclose()
        await eventually(
            lambda: served.upstream.seen(STREAM).disconnects == 1, what=lambda: served.upstream.seen(STREAM)
        )
        once(served, STREAM)
        await wait_idle(served.gateway)


# --- upstream errors: what the SDK raises is what it raises talking to Google ----------------------


@pytest.mark.parametrize(
    ("status", "headers", "attempts"),
    [
        (429, {"retry-after": "0"}, MAX_ATTEMPTS),
        (500, {}, 1),
        (503, {}, MAX_ATTEMPTS),
    ],
    ids=["429", "500", "503"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_error_status_is_the_sdks_error(
    status: int, headers: dict[str, str], attempts: int, stream: bool
) -> None:
    with gemini_serving() as served:
        path = STREAM if stream else GENERATE
        served.upstream.fail(path, Fault(status=status, message="scripted failure", headers=headers), times=None)
        client = gemini(served)
        error = raised(
            lambda: streamed(client) if stream else client.models.generate_content(model=MODEL, contents="x")
        )
        assert type(error) is (errors.ClientError if status < 500 else errors.ServerError)
        expected = {
            "code": status,
            "message": "scripted failure",
            "status": up.gemini_error_object(status, Fault())["status"],
        }
        assert (error.code, error.status, error.message) == (status, expected["status"], expected["message"])
        assert served.upstream.seen(path).requests == attempts
        served.wait_idle()


def _retry_info(delay: str) -> Fault:
    """Google's 429: no ``Retry-After`` header, the wait in the body (``google.rpc.RetryInfo``)."""
    return Fault(status=429, message="quota exceeded", headers={"x-retry-delay": delay})


@pytest.mark.parametrize(("delay", "attempts"), [("30s", 1), ("0.300s", MAX_ATTEMPTS)], ids=["over-the-cap", "within"])
@pytest.mark.parametrize("stream", [False, True])
def test_geminis_retry_info_is_the_wait_the_upstream_asked_for(delay: str, attempts: int, stream: bool) -> None:
    """A wait over ``RETRY_AFTER_CAP`` (1 s here) is the client's: the 429 goes to it at once, with its
    ``RetryInfo``, as one with ``Retry-After: 30`` does; a shorter one is waited (the backoff alone is
    at most 0.02 s), then retried."""
    with gemini_serving(retry_after_cap=1.0) as served:
        path = STREAM if stream else GENERATE
        served.upstream.fail(path, _retry_info(delay), times=None)
        client = gemini(served)
        started = time.monotonic()
        error = raised(
            lambda: streamed(client) if stream else client.models.generate_content(model=MODEL, contents="x")
        )
        waited = time.monotonic() - started
        assert (type(error), error.code, error.status) == (errors.ClientError, 429, "RESOURCE_EXHAUSTED")
        assert error.details["error"]["details"][0]["retryDelay"] == delay
        assert served.upstream.seen(path).requests == attempts
        assert waited >= (0.3 if attempts > 1 else 0.0)
        served.wait_idle()


def test_a_first_unavailable_event_is_reissued_and_the_sdk_sees_only_the_second_answer() -> None:
    with gemini_serving() as served:
        served.upstream.fail(STREAM, Fault(error_after=0, code="UNAVAILABLE"))
        assert_whole_stream(streamed(gemini(served)))
        assert served.upstream.seen(STREAM).requests == 2
        served.wait_idle()


def test_an_error_after_content_is_the_upstreams_error_and_is_not_resent() -> None:
    with gemini_serving() as served:
        served.upstream.fail(STREAM, Fault(error_after=3, code="UNAVAILABLE", message="overloaded"))
        chunks: list[types.GenerateContentResponse] = []
        stream = gemini(served).models.generate_content_stream(model=MODEL, contents="hello")
        error = raised(lambda: chunks.extend(stream))
        assert [chunk.text for chunk in chunks] == up.WORDS[:3]
        assert (type(error), error.code, error.status, error.message) == (
            errors.ServerError,
            503,
            "UNAVAILABLE",
            "overloaded",
        )
        once(served, STREAM)
        served.wait_idle()


STALLING: dict[str, Any] = {"stall_timeout": 0.5, "keepalive_interval": 0.05}  # keep-alives were due ten times


# The gateway's own in-band errors: before, it wrote ``event: error`` and ``: keep-alive`` lines, which
# google-genai takes for JSON and fails the stream on (``UnknownApiResponseError``), whatever happened.
@pytest.mark.parametrize(
    ("fault", "settings", "code", "status", "reason"),
    [
        (Fault(cut_after=3, half=True), {}, 502, "INTERNAL", "bad_gateway"),
        (Fault(cut_after=3), {}, 502, "INTERNAL", "bad_gateway"),
        (Fault(cut_after=0), {}, 502, "INTERNAL", "bad_gateway"),
        (Fault(stall_after=3), STALLING, 504, "DEADLINE_EXCEEDED", "upstream_stalled"),
        (Fault(stall_after=0), STALLING, 504, "DEADLINE_EXCEEDED", "upstream_stalled"),
    ],
    ids=["cut-mid-event", "cut-between-events", "cut-before-any-event", "stalled", "stalled-before-any-event"],
)
def test_a_stream_the_upstream_breaks_ends_with_a_server_error_after_the_chunks_it_sent(
    fault: Fault, settings: dict[str, Any], code: int, status: str, reason: str
) -> None:
    sent = fault.cut_after if fault.cut_after is not None else fault.stall_after
    with gemini_serving(**settings) as served:
        served.upstream.fail(STREAM, fault)
        chunks: list[types.GenerateContentResponse] = []
        stream = gemini(served).models.generate_content_stream(model=MODEL, contents="hello")
        gateway_error(raised(lambda: chunks.extend(stream)), errors.ServerError, code, status, reason)
        assert [chunk.text for chunk in chunks] == up.WORDS[:sent]
        once(served, STREAM)  # the upstream may have generated it: not sent again
        served.wait_idle()


def test_a_transient_first_event_every_time_is_reissued_once_then_the_upstreams_error() -> None:
    with gemini_serving() as served:
        served.upstream.fail(STREAM, Fault(error_after=0, code="INTERNAL", message="internal"), times=None)
        error = raised(lambda: streamed(gemini(served)))
        assert (type(error), error.code, error.status, error.message) == (
            errors.ServerError,
            500,
            "INTERNAL",
            "internal",
        )
        assert served.upstream.seen(STREAM).requests == 2
        served.wait_idle()


def test_a_silent_upstream_does_not_break_the_stream() -> None:
    """A thinking model is silent for a while before its first token: no keep-alive reaches the client
    (``KEEPALIVE_INTERVAL`` passes ten times in the pause), and the stream is whole."""
    with gemini_serving(keepalive_interval=0.05) as served:
        served.upstream.fail(STREAM, Fault(pause_after=1, pause=0.5))
        with httpx.Client(timeout=SDK_TIMEOUT) as raw:
            body = raw.post(f"{served.url}{STREAM}?alt=sse", json={"contents": []}).content
        assert body == b"".join(up.sse_frame(None, chunk) for chunk in _sent_chunks())
        served.upstream.fail(STREAM, Fault(pause_after=0, pause=0.5))
        assert_whole_stream(streamed(gemini(served)))
        served.wait_idle()


# --- the gateway's own errors, as the SDK parses them ---------------------------------------------


def _raw_exchange(url: str, request: bytes) -> httpx.Response:
    """Send ``request`` as is on a new connection; the answer (the gateway closes after an error)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=SDK_TIMEOUT) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return httpx.Response(status, content=body, headers={"content-type": "application/json"})


def _sdk_parse(response: httpx.Response) -> errors.APIError:
    return raised(lambda: errors.APIError.raise_for_response(response))


def _wrong_key_header(served: Served) -> errors.APIError:
    return raised(lambda: gemini(served, key="wrong").models.generate_content(model=MODEL, contents="x"))


def _wrong_key_query(served: Served) -> errors.APIError:
    return _sdk_parse(httpx.post(f"{served.url}{GENERATE}?key={SECRET}", json={"contents": []}))


def _too_large(served: Served) -> errors.APIError:
    return raised(lambda: streamed(gemini(served), "x" * 4096))


def _invalid_json(served: Served) -> errors.APIError:
    return _sdk_parse(httpx.post(f"{served.url}{GENERATE}", content=b"{", headers={"x-goog-api-key": "gateway-key"}))


def _invalid_path(served: Served) -> errors.APIError:
    head = f"POST {up.GEMINI}/models/../{MODEL}:generateContent HTTP/1.1\r\nhost: g\r\nx-goog-api-key: gateway-key"
    return _sdk_parse(_raw_exchange(served.url, f"{head}\r\ncontent-length: 2\r\n\r\n{{}}".encode()))


def _slow_body(served: Served) -> errors.APIError:
    head = f"POST {GENERATE} HTTP/1.1\r\nhost: g\r\nx-goog-api-key: gateway-key\r\ncontent-length: 100\r\n\r\n"
    return _sdk_parse(_raw_exchange(served.url, head.encode() + b'{"contents"'))


def _outside_paths(served: Served) -> errors.APIError:
    """An API version the gateway does not serve (``PATHS`` has ``/v1beta/`` only)."""
    http = types.HttpOptions(base_url=served.url, api_version="v1alpha")
    client = genai.Client(api_key="gateway-key", http_options=http)
    served.clients.append(client)
    return raised(lambda: client.models.generate_content(model=MODEL, contents="x"))


def _shed(served: Served) -> errors.APIError:
    served.upstream.fail(GENERATE, Fault(hold=1.0))  # the holder keeps the only slot for a second
    holder = threading.Thread(target=lambda: gemini(served).models.generate_content(model=MODEL, contents="x"))
    holder.start()
    try:
        settle(lambda: served.upstream.seen(GENERATE).requests == 1, what=lambda: "the holder reached the upstream")
        return raised(lambda: gemini(served).models.generate_content(model=MODEL, contents="x"))
    finally:
        holder.join(STALL_SECONDS)


GATEWAY_ERRORS: dict[str, tuple[Callable[[Served], errors.APIError], type[errors.APIError], int, str, str]] = {
    "401 x-goog-api-key": (_wrong_key_header, errors.ClientError, 401, "UNAUTHENTICATED", "invalid_api_key"),
    "401 key=": (_wrong_key_query, errors.ClientError, 401, "UNAUTHENTICATED", "invalid_api_key"),
    "413": (_too_large, errors.ClientError, 413, "INVALID_ARGUMENT", "request_too_large"),
    "400 invalid_json": (_invalid_json, errors.ClientError, 400, "INVALID_ARGUMENT", "invalid_json"),
    "400 invalid_path": (_invalid_path, errors.ClientError, 400, "INVALID_ARGUMENT", "invalid_path"),
    "408": (_slow_body, errors.ClientError, 408, "DEADLINE_EXCEEDED", "request_timeout"),
    "404 outside PATHS": (_outside_paths, errors.ClientError, 404, "NOT_FOUND", "not_found"),
    "503 overloaded": (_shed, errors.ServerError, 503, "UNAVAILABLE", "overloaded"),
}


@pytest.mark.parametrize("name", list(GATEWAY_ERRORS))
def test_the_gateways_own_errors_are_the_sdks_errors(name: str, caplog: pytest.LogCaptureFixture) -> None:
    call, cls, code, status, reason = GATEWAY_ERRORS[name]
    settings = {"max_body_bytes": 2048, "body_idle_timeout": 0.3, "max_inflight": 1, "admission_timeout": 0.3}
    caplog.set_level(logging.INFO)
    with gemini_serving(**KEYED, **settings) as served:
        gateway_error(call(served), cls, code, status, reason)
        served.wait_idle()
        metrics = httpx.get(f"{served.url}/metrics").text
    assert SECRET not in logged(caplog) and SECRET not in metrics


# --- keys -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "pass-through"])
def test_a_clients_key_in_the_query_is_never_logged(keyed: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Keyed, the client's ``?key=`` is dropped (the upstream gets our key only); passed through, it is
    the client's own credential and goes upstream as sent. Neither logs nor ``/metrics`` show it."""
    caplog.set_level(logging.DEBUG)
    with gemini_serving(**(KEYED if keyed else {})) as served:
        response = httpx.post(
            f"{served.url}{STREAM}?alt=sse&key={SECRET}",
            json={"contents": []},
            headers={"x-goog-api-key": "gateway-key", "x-goog-api-client": "google-genai-sdk/3"},
        )
        assert response.status_code == 200 and SECRET not in response.text
        seen = served.upstream.seen(STREAM)
        assert seen.queries == (["alt=sse"] if keyed else [f"alt=sse&key={SECRET}"])
        assert seen.headers[0]["x-goog-api-key"] == ("sk-upstream" if keyed else "gateway-key")
        served.wait_idle()
        metrics = httpx.get(f"{served.url}/metrics").text
    assert "asgi_lifetime.access" in {record.name for record in caplog.records}  # the check saw the access log
    assert SECRET not in logged(caplog) and SECRET not in metrics


# --- context overflow, retries, uploads ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_context_overflow_in_geminis_wording_is_refolded(stream: bool) -> None:
    turns = [
        types.Content(role="user" if i % 2 == 0 else "model", parts=[types.Part(text=f"turn {i} " + "w" * 200)])
        for i in range(9)
    ]
    with gemini_serving() as served:
        path = STREAM if stream else GENERATE
        served.upstream.fail(path, Fault(status=400, message=OVERFLOW))
        client = gemini(served)
        if stream:
            assert_whole_stream(streamed(client, turns))
        else:
            assert client.models.generate_content(model=MODEL, contents=turns).text == up.TEXT
        sizes = served.upstream.seen(path).body_sizes
        assert len(sizes) == 2 and sizes[1] < sizes[0]
        assert served.stats()["refolded"] == 1
        served.wait_idle()


def test_the_sdks_retry_options_multiply_the_gateways_attempts() -> None:
    """google-genai does not honour ``x-should-retry: false``: with ``HttpRetryOptions`` it retries the
    gateway's exhausted 503 (and 502/504) itself. The SDK's default is no retry (docs/operators.md)."""
    with gemini_serving() as served:
        served.upstream.fail(GENERATE, Fault(status=503), times=None)
        retrying = types.HttpRetryOptions(attempts=2, initial_delay=0.0, max_delay=0.0, jitter=0.0)
        error = raised(
            lambda: gemini(served, retry_options=retrying).models.generate_content(model=MODEL, contents="x")
        )
        assert (error.code, served.upstream.seen(GENERATE).requests) == (503, 2 * MAX_ATTEMPTS)
    with gemini_serving(headers_timeout=0.3) as served:
        served.upstream.fail(GENERATE, Fault(hold=STALL_SECONDS))
        error = raised(lambda: gemini(served).models.generate_content(model=MODEL, contents="x"))
        gateway_error(error, errors.ServerError, 504, "DEADLINE_EXCEEDED", "upstream_timeout")
        once(served, GENERATE)  # sent whole: neither the gateway nor the (default) SDK sends it again
        served.wait_idle()


def test_a_file_upload_goes_to_the_url_the_upstream_names() -> None:
    """``files.upload`` starts a resumable upload under ``/upload/v1beta/files`` (forwarded when ``PATHS``
    has ``/upload/``, the gateway's 404 otherwise); the upstream's ``x-goog-upload-url`` names where the
    bytes go, its own host, and the SDK sends them there (without a key: the URL is the credential), not
    through the gateway: a known limit (docs/operators.md)."""
    upload = f"/upload{up.GEMINI}/files"
    with gemini_serving(**KEYED) as served:
        error = raised(
            lambda: gemini(served).files.upload(file=io.BytesIO(b"hello"), config={"mime_type": "text/plain"})
        )
        assert error.code == 404 and served.upstream.total_requests() == 0
    with serving(paths=(*PATHS, "/upload/"), **KEYED) as served:
        file = gemini(served).files.upload(file=io.BytesIO(b"hello"), config={"mime_type": "text/plain"})
        assert file.name == "files/scripted" and file.size_bytes == 5
        start, data = served.upstream.seen(upload).headers
        assert (start["x-goog-upload-protocol"], start["x-goog-upload-command"]) == ("resumable", "start")
        assert start["x-goog-api-key"] == "sk-upstream"  # the start went through the gateway
        assert "x-goog-api-key" not in data  # the bytes did not (the gateway would have injected its key)
        served.wait_idle()


# --- a client leaving ------------------------------------------------------------------------------


def test_closing_a_stream_midway_cancels_the_upstream_request() -> None:
    with serving(paths=PATHS, delay=0.05) as served:
        stream = gemini(served).models.generate_content_stream(model=MODEL, contents="hello")
        assert isinstance(stream, Generator)  # what the SDK returns: closing it closes the response
        assert next(stream).text == up.WORDS[0]
        stream.close()
        settle(lambda: served.upstream.seen(STREAM).disconnects == 1, what=lambda: str(served.upstream.seen(STREAM)))
        once(served, STREAM)
        served.wait_idle()
