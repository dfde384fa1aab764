"""Retries do not multiply: the real openai and anthropic SDKs (default ``max_retries=2``) in front
of the gateway under uvicorn, in front of a failing upstream on loopback.

The gateway retries up to ``MAX_ATTEMPTS``; when it gives up it says ``x-should-retry: false``,
which both SDKs obey (``_should_retry`` in their ``_base_client.py``), so the upstream sees
``MAX_ATTEMPTS`` requests per SDK call, not ``MAX_ATTEMPTS * (max_retries + 1)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import anthropic
import pytest

from asgi_lifetime._exceptions import (
    AdmissionRejected,
    AuthenticationError,
    BodyIdleTimeout,
    BodyTooLarge,
    LifetimeError,
    MalformedBody,
    UpstreamError,
    UpstreamStalled,
    UpstreamStarved,
    UpstreamTimeout,
    UpstreamUnreachable,
)

from ..reliability.test_faults import running
from ._raw_upstream import CLOSE, HOLD, RawRequest, RawUpstream, Script, raw_upstream, response

if TYPE_CHECKING:
    import openai


def _openai() -> Any:
    # Imported when a test runs, not at collection: importing openai in the suite's process made
    # test_release's traced-memory check (which runs earlier) see a body's worth more memory.
    import openai

    return openai


ATTEMPTS = 4
# Fast gateway retries; the SDKs keep their defaults (max_retries=2).
GATEWAY: dict[str, Any] = {"max_attempts": ATTEMPTS, "backoff_base": 0.01, "backoff_max": 0.02, "headers_timeout": 0.5}
ERROR = b'{"error": {"type": "overloaded", "message": "busy"}}'


def failing(status: int) -> Any:
    def answer(request: RawRequest) -> Script:
        if status == 0:
            return [CLOSE]  # hang up before any response headers
        if status == -1:
            return [HOLD]  # never answer: the gateway's headers timeout (504)
        return [response(status, ERROR, headers=(("content-type", "application/json"),))]

    return answer


@contextmanager
def stack(status: int) -> Iterator[tuple[RawUpstream, str]]:
    with raw_upstream(failing(status)) as upstream, running(upstream_url=upstream.url, **GATEWAY) as gateway:
        yield upstream, gateway.url


# upstream behaviour -> the status the SDK ends with (the gateway's own 502/504, or the relayed one)
CASES = {
    "429 relayed": (429, 429),
    "502 relayed": (502, 502),
    "503 relayed": (503, 503),
    "504 relayed": (504, 504),
    "connection closed: gateway 502": (0, 502),
    "no headers in time: gateway 504": (-1, 504),
}


def chat(client: openai.OpenAI) -> None:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], timeout=20)


def message(client: anthropic.Anthropic) -> None:
    client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}], timeout=20)


def _upstream_requests(status: int) -> int:
    # No headers in time after the whole request was sent: the upstream may be generating the
    # answer, so the gateway does not send it again (one request); the others, MAX_ATTEMPTS.
    return 1 if status == -1 else ATTEMPTS


@pytest.mark.parametrize("case", list(CASES))
def test_openai_sdk_does_not_multiply_the_gateways_retries(case: str) -> None:
    status, expected = CASES[case]
    with stack(status) as (upstream, url):
        with pytest.raises(_openai().APIStatusError) as info:
            with _openai().OpenAI(base_url=f"{url}/v1", api_key="k") as client:
                chat(client)
        assert info.value.status_code == expected
        assert info.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == _upstream_requests(status)


@pytest.mark.parametrize("case", list(CASES))
def test_anthropic_sdk_does_not_multiply_the_gateways_retries(case: str) -> None:
    status, expected = CASES[case]
    with stack(status) as (upstream, url):
        with pytest.raises(anthropic.APIStatusError) as info:
            with anthropic.Anthropic(base_url=url, api_key="k") as client:
                message(client)
        assert info.value.status_code == expected
    assert len(upstream.requests) == _upstream_requests(status)


@pytest.mark.anyio
async def test_async_sdks_do_not_multiply_the_gateways_retries() -> None:
    with stack(503) as (upstream, url):
        async with _openai().AsyncOpenAI(base_url=f"{url}/v1", api_key="k") as oai:
            with pytest.raises(_openai().APIStatusError):
                await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], timeout=20)
        assert len(upstream.requests) == ATTEMPTS
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k") as ant:
            with pytest.raises(anthropic.APIStatusError):
                await ant.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}], timeout=20
                )
    assert len(upstream.requests) == 2 * ATTEMPTS


def test_a_non_retryable_upstream_error_is_left_to_the_sdk() -> None:
    # The gateway does not retry a 500, so it does not forbid the SDK to: one layer of retries only.
    with stack(500) as (upstream, url):
        with pytest.raises(_openai().APIStatusError) as info:
            with _openai().OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=1) as client:
                chat(client)
        assert "x-should-retry" not in info.value.response.headers
    assert len(upstream.requests) == 2


def test_without_gateway_retries_the_sdk_may_retry() -> None:
    # MAX_ATTEMPTS=1: the gateway does not retry, so it leaves retrying to the client.
    with raw_upstream(failing(503)) as upstream, running(upstream_url=upstream.url, max_attempts=1) as gateway:
        with _openai().OpenAI(base_url=f"{gateway.url}/v1", api_key="k", max_retries=1) as client:
            with pytest.raises(_openai().APIStatusError) as info:
                chat(client)
        assert "x-should-retry" not in info.value.response.headers
    assert len(upstream.requests) == 2


@pytest.mark.parametrize(
    "error",
    [
        UpstreamError("x"),
        UpstreamUnreachable("x"),
        UpstreamTimeout("x"),
        UpstreamStalled("x"),
        UpstreamStarved("x"),
    ],
)
def test_gateway_errors_tell_sdks_not_to_retry(error: LifetimeError) -> None:
    start, _ = error.asgi_response()
    assert (b"x-should-retry", b"false") in start["headers"]


@pytest.mark.parametrize(
    "error",
    [MalformedBody("x"), AuthenticationError("x"), BodyTooLarge(1), BodyIdleTimeout(1.0), AdmissionRejected("x")],
)
def test_client_errors_leave_retrying_to_the_sdk(error: LifetimeError) -> None:
    # 4xx: the SDKs do not retry these anyway (408 aside, which they may retry: a slow client body).
    # A 503 not admitted: nothing went upstream, and Retry-After asks the client to come back.
    start, _ = error.asgi_response()
    assert all(name != b"x-should-retry" for name, _ in start["headers"])
