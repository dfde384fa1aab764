"""The gateway's own errors take the shape the client's SDK parses: Anthropic's on the Messages
API, Gemini's on model methods, OpenAI's elsewhere, in plain responses and in-band SSE errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import respx

from asgi_lifetime import AdmissionRejected, BodyTooLarge, LifetimeError, UpstreamStalled
from asgi_lifetime._exceptions import error_shape

from .test_gateway import BASE, gateway, make_settings
from .test_relay_events import _relay, client_events

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/responses", "openai"),
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),
        ("/anthropic/v1/messages", "anthropic"),
        ("/v1/complete", "anthropic"),
        ("/v1beta/models/gemini-2.0-flash:generateContent", "gemini"),
        ("/v1beta/models/gemini-2.0-flash:streamGenerateContent", "gemini"),
        ("/v1/models", "openai"),
        ("/v1/models/gpt-4o", "openai"),
    ],
)
def test_shape_by_path(path: str, shape: str) -> None:
    assert error_shape(path) == shape


def test_anthropic_shape() -> None:
    body = BodyTooLarge(10).to_dict("anthropic")
    assert body["type"] == "error"
    assert body["error"]["type"] == "request_too_large"
    assert body["error"]["message"] == "request body exceeds the limit of 10 bytes"
    assert AdmissionRejected("full").to_dict("anthropic")["error"]["type"] == "overloaded_error"
    assert UpstreamStalled("stalled").to_dict("anthropic")["error"]["type"] == "api_error"
    assert LifetimeError("boom").to_dict("anthropic")["error"]["type"] == "api_error"


def test_gemini_shape() -> None:
    body = UpstreamStalled("stalled").to_dict("gemini")["error"]
    assert body["code"] == 504 and body["status"] == "DEADLINE_EXCEEDED" and body["message"] == "stalled"
    assert body["details"][0]["reason"] == "upstream_stalled"
    assert BodyTooLarge(10).to_dict("gemini")["error"]["status"] == "INVALID_ARGUMENT"


def test_openai_shape_is_the_default() -> None:
    assert BodyTooLarge(10).to_dict() == {
        "error": {"type": "invalid_request_error", "code": "request_too_large", "message": BodyTooLarge(10).message}
    }


@pytest.mark.parametrize(
    ("path", "check"),
    [
        ("/v1/messages", lambda body: body["type"] == "error" and body["error"]["type"] == "request_too_large"),
        (
            "/v1beta/models/g:generateContent",
            lambda body: body["error"]["code"] == 413 and body["error"]["status"] == "INVALID_ARGUMENT",
        ),
        ("/v1/chat/completions", lambda body: body["error"]["code"] == "request_too_large"),
    ],
)
async def test_gateway_refusal_in_the_client_shape(path: str, check: Callable[[Any], bool]) -> None:
    with respx.mock(assert_all_called=False) as mock:
        route = mock.post(url__startswith=BASE).respond(200, json={})
        async with gateway(make_settings(max_body_bytes=64, paths=("/v1/", "/v1beta/"))) as (_, client):
            response = await client.post(path, content=json.dumps({"messages": ["x" * 100]}))
    assert response.status_code == 413
    assert check(response.json())
    assert not route.called


async def test_not_found_on_the_anthropic_path_in_its_shape() -> None:
    async with gateway(make_settings()) as (_, client):
        response = await client.get("/anthropic/v1/messages")  # outside PATHS: the gateway's own 404
        other = await client.get("/nowhere")
    assert response.status_code == 404 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error"
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("shape", "check"),
    [
        ("anthropic", lambda data: data["type"] == "error" and data["error"]["type"] == "api_error"),
        ("openai", lambda data: data["error"]["code"] == "upstream_stalled"),
    ],
)
async def test_in_band_error_in_the_client_shape(shape: str, check: Callable[[Any], bool]) -> None:
    start = b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}\n\n'
    delta = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
    )
    client, result, _, _ = await _relay([start, delta, 30.0], error_shape=shape)
    events = client_events(client.body)
    assert events[-1].event == "error"
    assert check(json.loads(events[-1].data))
    assert result.outcome == "stalled"
