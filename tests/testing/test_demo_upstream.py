from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette

from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import DemoStats, create_demo_upstream, parse_behaviour

CHAT = {"model": "demo-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
STREAM = {**CHAT, "stream": True}


@pytest.fixture
def app() -> Starlette:
    return create_demo_upstream(tokens_per_second=2000, default_tokens=8)


@pytest.fixture
def url(app: Starlette) -> Iterator[str]:
    with serve_in_thread(app) as base_url:
        yield base_url


@pytest.fixture
async def client(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        yield client


def stats(app: Starlette) -> DemoStats:
    result: DemoStats = app.state.stats
    return result


async def eventually(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll stats that the server thread updates (there is no event to wait for across threads)."""
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.01)


def behaviour(text: str) -> dict[str, str]:
    return {"x-demo-behaviour": text}


def content_of(body: str) -> str:
    """The assistant text of a chat.completion body or of a chat.completion.chunk SSE body."""
    if body.startswith("data: "):
        chunks = [event for event in events(body) if event != "[DONE]" and event["choices"]]
        return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    return str(json.loads(body)["choices"][0]["message"]["content"])


def events(body: str) -> list[Any]:
    """The data payloads of an SSE body: parsed JSON, or the raw string for ``[DONE]``."""
    data = [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("gzip", {"gzip": ""}),
        (" fail=2 , status=429,", {"fail": "2", "status": "429"}),
        ("stall=0,stall=1", {"stall": "1"}),
    ],
)
def test_parse_behaviour(text: str, expected: dict[str, str]) -> None:
    assert parse_behaviour(text) == expected


def test_parse_behaviour_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="'bogus'"):
        parse_behaviour("gzip,bogus=1")


@pytest.mark.parametrize("options", [{"tokens_per_second": 0}, {"default_tokens": -1}, {"default_tokens": 10**6}])
def test_rejects_bad_settings(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        create_demo_upstream(**options)


@pytest.mark.anyio
async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.anyio
async def test_chat_completion(app: Starlette, client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    completion = response.json()
    assert completion["object"] == "chat.completion" and completion["model"] == "demo-model"
    (choice,) = completion["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    assert len(choice["message"]["content"].split()) == 8 == completion["usage"]["completion_tokens"]
    again = await client.post("/v1/chat/completions", json=CHAT)
    assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]  # deterministic
    await eventually(lambda: stats(app).completed == 2)  # the server thread counts after its last send
    assert stats(app).requests == 2 and stats(app).last_body_size == len(again.request.content)


@pytest.mark.anyio
async def test_stream_has_openai_chunk_shape(app: Starlette, client: httpx.AsyncClient) -> None:
    request = {**STREAM, "max_tokens": 12, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    chunks = events(response.text)
    assert chunks[-1] == "[DONE]"
    first, *content, stop, usage, _ = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content and all(chunk["choices"][0]["delta"].keys() == {"content"} for chunk in content)
    assert stop["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in content)
    plain = await client.post("/v1/chat/completions", json={**request, "stream": False})
    assert text == plain.json()["choices"][0]["message"]["content"] and len(text.split()) == 12
    await eventually(lambda: stats(app).completed == 2 and stats(app).active_streams == 0)


@pytest.mark.anyio
async def test_fail_then_succeed(client: httpx.AsyncClient) -> None:
    statuses = []
    for _ in range(3):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("fail=2"))
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert response.headers["retry-after"] == "0" and response.json()["error"]["type"] == "server_error"
    assert statuses == [503, 503, 200]
    other = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("fail=2,id=other"))
    assert other.status_code == 503  # a different behaviour string has its own counter


@pytest.mark.anyio
async def test_fail_with_status(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("fail=1,status=429"))
    assert response.status_code == 429 and response.json()["error"]["code"] == "rate_limit_exceeded"
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("fail=1,status=429"))).is_success
    for _ in range(2):  # status alone fails every time
        response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("status=502"))
        assert response.status_code == 502


@pytest.mark.anyio
async def test_app_wide_behaviour_and_header_override(app: Starlette, client: httpx.AsyncClient) -> None:
    app.state.behaviour = "status=500"
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 500
    response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("status=429"))
    assert response.status_code == 429
    app.state.behaviour = ""
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.anyio
async def test_bad_behaviour_is_a_400(client: httpx.AsyncClient) -> None:
    for text in ("bogus", "stall=soon", "status=200"):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour(text))
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.anyio
async def test_overflow(app: Starlette, client: httpx.AsyncClient) -> None:
    small = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("overflow=4000"))
    assert small.status_code == 200
    large = {**CHAT, "messages": [{"role": "user", "content": "x" * 8000}]}
    response = await client.post("/v1/chat/completions", json=large, headers=behaviour("overflow=4000"))
    size = stats(app).last_body_size
    assert size > 8000
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"This model's maximum context length is 1000 tokens. "
        f"However, your messages resulted in {size // 4} tokens.",
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }


@pytest.mark.anyio
async def test_reject_role(client: httpx.AsyncClient) -> None:
    request = {**CHAT, "messages": [{"role": "developer", "content": "be terse"}, *CHAT["messages"]]}  # type: ignore[misc]
    response = await client.post("/v1/chat/completions", json=request, headers=behaviour("reject_role=developer"))
    assert response.status_code == 400 and "Unexpected role 'developer'" in response.json()["error"]["message"]
    accepted = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("reject_role=developer"))
    assert accepted.status_code == 200


@pytest.mark.anyio
async def test_a_body_that_is_not_a_json_object_is_a_400(client: httpx.AsyncClient) -> None:
    for body in (b"not json", b"", b"\xff\xfe", b"[1, 2]", b"null", b'"text"'):
        response = await client.post("/v1/chat/completions", content=body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "The request body is not a JSON object."


@pytest.mark.anyio
async def test_max_tokens_must_be_a_non_negative_integer(client: httpx.AsyncClient) -> None:
    for fields in ({"max_tokens": -1}, {"max_tokens": True}, {"max_tokens": 1.5}, {"max_tokens": "8"}):
        response = await client.post("/v1/chat/completions", json={**CHAT, **fields})
        assert (
            response.status_code == 400 and response.json()["error"]["message"] == "max_tokens must be an integer >= 0."
        )
    # max_completion_tokens, when present, is the one read.
    refused = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": -1, "max_tokens": 8})
    assert refused.status_code == 400
    answered = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3, "max_tokens": -1})
    assert answered.status_code == 200 and len(content_of(answered.text).split()) == 3


@pytest.mark.anyio
async def test_starve_and_malformed_without_stream(client: httpx.AsyncClient) -> None:
    starved = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("starve"))
    assert starved.status_code == 200 and starved.content == b"" and starved.headers["content-length"] == "0"
    malformed = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("malformed"))
    assert malformed.status_code == 200 and malformed.headers["content-type"] == "application/json"
    assert malformed.content == b'{"choices": [{"message": garbage'


@pytest.mark.anyio
async def test_stall_forever_until_the_client_gives_up(app: Starlette, client: httpx.AsyncClient) -> None:
    lines: list[str] = []
    timeout = httpx.Timeout(5, read=0.3)
    with pytest.raises(httpx.ReadTimeout):
        async with client.stream(
            "POST", "/v1/chat/completions", json=STREAM, headers=behaviour("stall=0"), timeout=timeout
        ) as response:
            async for line in response.aiter_lines():
                lines.append(line)
    (first,) = events("\n\n".join(lines))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    await eventually(lambda: stats(app).disconnects == 1 and stats(app).active_streams == 0)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_finite_stall_then_completes(client: httpx.AsyncClient, stream: bool) -> None:
    started = anyio.current_time()
    response = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=behaviour("stall=0.3")
    )
    assert response.status_code == 200 and anyio.current_time() - started >= 0.3
    assert events(response.text)[-1] == "[DONE]" if stream else response.json()["choices"]


@pytest.mark.anyio
async def test_starve(app: Starlette, client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=STREAM, headers=behaviour("starve"))
    assert response.status_code == 200
    (only,) = events(response.text)
    assert only["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert stats(app).disconnects == 0


@pytest.mark.anyio
async def test_headers_delay(app: Starlette, client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("headers_delay=1"), timeout=0.2)
    await eventually(lambda: stats(app).disconnects == 1)  # noticed while still waiting to send headers
    started = anyio.current_time()
    response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour("headers_delay=0.2"))
    assert response.status_code == 200 and anyio.current_time() - started >= 0.2


@pytest.mark.anyio
@pytest.mark.parametrize("extra", ["", ",gzip"])
@pytest.mark.parametrize("stream", [True, False])
async def test_reset(app: Starlette, client: httpx.AsyncClient, stream: bool, extra: str) -> None:
    request = {**CHAT, "stream": stream, "max_tokens": 30}
    with pytest.raises(httpx.RemoteProtocolError, match="peer closed connection"):
        await client.post("/v1/chat/completions", json=request, headers=behaviour("reset" + extra))
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    await eventually(lambda: stats(app).completed == 1 and stats(app).active_streams == 0)
    assert stats(app).disconnects == 0


@pytest.mark.anyio
async def test_reset_stream_delivers_some_chunks_first(client: httpx.AsyncClient) -> None:
    received: list[str] = []
    request = {**STREAM, "max_tokens": 30}
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", "/v1/chat/completions", json=request, headers=behaviour("reset")) as response:
            async for line in response.aiter_lines():
                received.append(line)
    assert len(events("\n\n".join(received))) == 4  # the role delta and three content chunks


@pytest.mark.anyio
async def test_malformed(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=STREAM, headers=behaviour("malformed=5000"))
    assert response.status_code == 200
    body = response.content
    assert b"this line is not server-sent events\n" in body and b"[DONE]" not in body
    assert body.endswith(b"data: " + b"x" * 5000)


@pytest.mark.anyio
@pytest.mark.parametrize("size", [100, 10_000])
async def test_error_body(client: httpx.AsyncClient, size: int) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT, headers=behaviour(f"error_body={size}"))
    assert response.status_code == 500 and len(response.content) == size
    assert response.headers["content-length"] == str(size) and response.json()["error"]["type"] == "server_error"


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_gzip(client: httpx.AsyncClient, stream: bool) -> None:
    request = {**CHAT, "stream": stream}
    async with client.stream("POST", "/v1/chat/completions", json=request, headers=behaviour("gzip")) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert response.headers["content-encoding"] == "gzip" and raw[:2] == b"\x1f\x8b"
    decoded_by_httpx = (await client.post("/v1/chat/completions", json=request, headers=behaviour("gzip"))).text
    plain = (await client.post("/v1/chat/completions", json=request)).text
    assert content_of(gzip.decompress(raw).decode()) == content_of(decoded_by_httpx) == content_of(plain) != ""


@pytest.mark.anyio
async def test_client_disconnect_mid_stream(app: Starlette, client: httpx.AsyncClient) -> None:
    request = {**STREAM, "max_tokens": 200}
    async with client.stream("POST", "/v1/chat/completions", json=request, headers=behaviour("delay=0.05")) as response:
        received = b""
        # Hang up after a few chunks. Cancelling while a chunk is awaited (rather than breaking out of the
        # loop) finishes httpx's nested async generators, which trio would otherwise report as unclosed.
        with anyio.move_on_after(0.3):
            async for chunk in response.aiter_raw():
                received += chunk
                assert stats(app).active_streams == 1
        assert len(events(received.decode())) >= 2
    await eventually(lambda: stats(app).disconnects == 1 and stats(app).active_streams == 0)
    assert stats(app).completed == 0
