"""The gateway in process: ``create_app`` behind ``httpx.ASGITransport``, the upstream mocked with respx."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import respx
from blake3 import blake3
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._bookkeeping import Outcome
from asgi_lifetime.gateway._prepare import Draft
from asgi_lifetime.testing import assert_idle

pytestmark = pytest.mark.anyio

BASE = "http://upstream.test/base"
PATH = "/v1/chat/completions"
OK = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
JSON_HEADERS = {"content-type": "application/json"}
TIMEOUT = 10


def make_settings(**changes: Any) -> LifetimeSettings:
    defaults: dict[str, Any] = {
        "upstream_url": (BASE,),
        "backoff_base": 0.001,
        "backoff_max": 0.005,
        "max_attempts": 3,
        "retry_deadline": 5.0,
        "upstream_cooloff": 0.0,
    }
    return LifetimeSettings(**{**defaults, **changes})


@contextlib.asynccontextmanager
async def gateway(
    settings: LifetimeSettings | None = None, **options: Any
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The gateway app and an httpx client talking to it in process; the upstream client is closed on exit."""
    app = create_app(settings or make_settings(), **options)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
            with anyio.fail_after(TIMEOUT):
                yield app, client
    finally:
        await app.state.upstream.aclose()


def assert_json_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"type", "code", "message"}
    assert error["code"] == code
    return error


def conversation(turns: int, size: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} " + "q" * size})
        messages.append({"role": "assistant", "content": f"answer {i} " + "a" * size})
    messages.append({"role": "user", "content": "last question"})
    return {"model": "m", "messages": messages}


# --- forwarding: path, query, headers, body ---------------------------------------------------


async def test_path_and_query_are_appended_to_the_upstream_base_url() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway() as (app, client):
            response = await client.post(PATH + "?api-version=2024-10-01&x=a%20b", json=CHAT)
    assert response.status_code == 200 and response.json() == OK
    url = route.calls[0].request.url
    assert str(url) == BASE + PATH + "?api-version=2024-10-01&x=a%20b"
    await assert_idle(app)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/embeddings", "/v1/responses/resp_1/input_items"])
async def test_any_path_under_the_prefix_is_forwarded(path: str) -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.get(path).respond(200, json={"data": []})
        async with gateway() as (app, client):
            response = await client.get(path)
    assert response.status_code == 200 and response.json() == {"data": []}
    assert route.calls[0].request.url.path == "/base" + path
    await assert_idle(app)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/org%2Fmodel-7b",  # an encoded slash stays one segment
        "/v1/files/a%3Fb",  # an encoded ? is not the start of the query
        "/v1/files/a%20b%25c",
        "/v1/files/caf%C3%A9",
    ],
)
@pytest.mark.parametrize("mount", ["", "/llm"])
async def test_path_is_forwarded_with_the_clients_encoding(path: str, mount: str) -> None:
    gateway_app = create_app(make_settings())
    app = Starlette(routes=[Mount(mount, gateway_app)]) if mount else gateway_app
    try:
        with respx.mock(assert_all_called=True) as router:
            route = router.get(url__startswith=BASE).respond(200, json={})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
                with anyio.fail_after(TIMEOUT):
                    response = await c.get(mount + path + "?x=1")
    finally:
        await gateway_app.state.upstream.aclose()
    assert response.status_code == 200
    assert route.calls[0].request.url.raw_path == f"/base{path}?x=1".encode()
    await assert_idle(gateway_app)


async def test_client_headers_pass_through_except_hop_by_hop_and_host() -> None:
    headers = {
        "content-type": "application/json",
        "authorization": "Bearer sk-client",
        "x-session-id": "sess-1",
        "openai-organization": "org-1",
        "x-custom": "kept",
        "connection": "keep-alive, x-per-hop",
        "x-per-hop": "dropped",
        "keep-alive": "timeout=5",
        "te": "trailers",
        "proxy-authorization": "Basic cHJveHk=",
        "upgrade": "h2c",
        "host": "gateway.example",
    }
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway() as (app, client):
            response = await client.post(PATH, content=json.dumps(CHAT).encode(), headers=headers)
    assert response.status_code == 200
    sent = route.calls[0].request.headers
    assert sent["authorization"] == "Bearer sk-client"
    assert sent["x-session-id"] == "sess-1"
    assert sent["openai-organization"] == "org-1"
    assert sent["x-custom"] == "kept"
    assert sent["content-type"] == "application/json"
    assert sent["host"] == "upstream.test"
    for name in ("x-per-hop", "keep-alive", "te", "proxy-authorization", "upgrade"):
        assert name not in sent, name
    assert sent.get("connection", "keep-alive") == "keep-alive"  # httpx's own, not the client's list
    await assert_idle(app)


async def test_unchanged_body_is_forwarded_byte_for_byte() -> None:
    # Odd spacing, key order and an escape: a re-serialization would change every one of them.
    body = b'{ "messages" : [ {"content":"h\\u00e9llo", "role":"user"} ],\n  "model":"m", "temperature": 1.0 }'
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway() as (app, client):
            response = await client.post(PATH, content=body, headers=JSON_HEADERS)
    assert response.status_code == 200
    assert route.calls[0].request.content == body
    assert route.calls[0].request.headers["content-length"] == str(len(body))
    await assert_idle(app)


async def test_preparer_changes_model_and_adds_headers() -> None:
    body = b'{"model": "gpt-4o",   "messages": [{"role": "user", "content": "hello"}]}'

    def route_model(draft: Draft) -> None:
        draft.body["model"] = "gpt-4.1-mini"
        draft.mark_changed()
        draft.headers["x-routed"] = "1"

    async def tag(draft: Draft) -> None:
        await anyio.lowlevel.checkpoint()
        draft.headers["x-custom"] = "from-preparer"  # replaces the client's header of that name

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway(preparers=[route_model, tag]) as (app, client):
            response = await client.post(PATH, content=body, headers={**JSON_HEADERS, "x-custom": "from-client"})
    assert response.status_code == 200
    request = route.calls[0].request
    assert request.content != body
    assert json.loads(request.content) == {**json.loads(body), "model": "gpt-4.1-mini"}
    assert request.headers["content-length"] == str(len(request.content))
    assert request.headers["x-routed"] == "1"
    assert request.headers.get_list("x-custom") == ["from-preparer"]
    await assert_idle(app)


async def test_preparer_that_replaces_the_body() -> None:
    def replace(draft: Draft) -> None:
        draft.body = {**draft.body, "model": "replaced", "stream": False}

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway(preparers=[replace]) as (app, client):
            response = await client.post(PATH, json=CHAT)
    assert response.status_code == 200
    assert json.loads(route.calls[0].request.content) == {**CHAT, "model": "replaced", "stream": False}
    await assert_idle(app)


async def test_non_json_content_type_is_forwarded_unchanged() -> None:
    boundary = "xYzZY"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + b"{not json \xff\xfe}\r\n"
        + f"--{boundary}--\r\n".encode()
    )
    content_type = f"multipart/form-data; boundary={boundary}"
    seen: list[Draft] = []

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post("/v1/files").respond(200, json={"id": "file-1"})
        async with gateway(preparers=[seen.append]) as (app, client):
            response = await client.post("/v1/files", content=body, headers={"content-type": content_type})
    assert response.status_code == 200 and response.json() == {"id": "file-1"}
    request = route.calls[0].request
    assert request.content == body
    assert request.headers["content-type"] == content_type
    assert seen == []  # preparers only see parsed JSON bodies
    await assert_idle(app)


async def test_compressed_request_body_is_forwarded_decoded() -> None:
    body = json.dumps(conversation(turns=3, size=2000)).encode()
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway(bookkeeper=recorder) as (app, client):
            headers = {**JSON_HEADERS, "content-encoding": "gzip"}
            response = await client.post(PATH, content=gzip.compress(body), headers=headers)
    assert response.status_code == 200
    request = route.calls[0].request
    assert request.content == body
    assert "content-encoding" not in request.headers
    assert request.headers["content-length"] == str(len(body))
    assert recorder.outcomes[0].fingerprint.wire_hash == blake3(body).hexdigest()
    await assert_idle(app)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"model": "m", "messages": [', id="truncated"),
        pytest.param(b"{'model': 'm'}", id="single-quotes"),
        pytest.param(b"not json at all", id="text"),
        pytest.param(b'{"model": "m"} trailing', id="trailing-garbage"),
        pytest.param(b'{"model": "\xff\xfe"}', id="invalid-utf8"),
        pytest.param(b'\xef\xbb\xbf{"model": "m"}', id="utf8-bom"),
        pytest.param('{"model": "m"}'.encode("utf-16"), id="utf16"),
    ],
)
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", None])
async def test_malformed_json_is_a_400_and_nothing_is_forwarded(body: bytes, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway() as (app, client):
            response = await client.post(PATH, content=body, headers=headers)
    assert_json_error(response, 400, "invalid_json")
    assert not route.called
    await assert_idle(app)


async def test_an_upstream_client_error_is_relayed_as_is() -> None:
    # A 400 on a chat body is read (is it an overflow, a rejected role?) and then replayed.
    error = b'{"error": {"message": "temperature must be <= 2", "type": "invalid_request_error"}}'
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(400, content=error, headers={"content-type": "application/json"})
        async with gateway() as (app, client):
            response = await client.post(PATH, json={**CHAT, "temperature": 7})
    assert route.call_count == 1
    assert response.status_code == 400
    assert response.content == error
    assert response.headers["content-length"] == str(len(error))
    await assert_idle(app)


async def test_an_in_memory_transport_works() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"echo": json.loads(request.content)})

    async with gateway(transport=httpx.MockTransport(handler)) as (app, client):
        response = await client.post(PATH, json=CHAT)
    assert response.status_code == 200 and response.json() == {"echo": CHAT}
    await assert_idle(app)


# --- upstream failures and retries ------------------------------------------------------------


async def test_upstream_unreachable_is_a_502() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=httpx.ConnectError("connection refused"))
        async with gateway() as (app, client):
            response = await client.post(PATH, json=CHAT)
    error = assert_json_error(response, 502, "upstream_unreachable")
    assert "3 attempts" in error["message"]
    assert route.call_count == 3
    assert app.state.lifetime.stats().retried == 2
    await assert_idle(app)


async def test_upstream_timeout_is_a_504() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=httpx.ReadTimeout("timed out"))
        async with gateway() as (app, client):
            response = await client.post(PATH, json=CHAT)
    assert_json_error(response, 504, "upstream_timeout")
    assert route.call_count == 1  # sent whole: the upstream may be generating, so it is not sent again
    await assert_idle(app)


async def test_upstream_headers_timeout_is_a_504() -> None:
    started: list[float] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        started.append(anyio.current_time())
        await anyio.sleep(5)
        return httpx.Response(200, json=OK)

    # respx records a call only when its side effect returns, and these never do.
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        router.post(PATH).mock(side_effect=slow)
        async with gateway(make_settings(headers_timeout=0.05, max_attempts=2)) as (app, client):
            response = await client.post(PATH, json=CHAT)
    assert_json_error(response, 504, "upstream_timeout")
    assert len(started) == 1  # sent whole: the upstream may be generating, so it is not sent again
    await assert_idle(app)


async def test_503_then_200_is_retried() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH)
        route.side_effect = [httpx.Response(503, json={"error": {"message": "busy"}}), httpx.Response(200, json=OK)]
        async with gateway() as (app, client):
            response = await client.post(PATH, json=CHAT)
            stats = (await client.get("/lifetime/stats")).json()
    assert response.status_code == 200 and response.json() == OK
    assert route.call_count == 2
    assert stats["retried"] == 1
    sent = route.calls[0].request.content
    assert route.calls[1].request.content == sent and json.loads(sent) == CHAT
    await assert_idle(app)


async def test_exhausted_retryable_status_is_relayed() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(503, json={"error": {"message": "busy"}})
        async with gateway() as (app, client):
            response = await client.post(PATH, json=CHAT)
    assert response.status_code == 503 and response.json() == {"error": {"message": "busy"}}
    assert route.call_count == 3
    await assert_idle(app)


async def test_context_overflow_is_refolded_end_to_end() -> None:
    limit = 2000  # bytes the "model" accepts
    window = limit // 4

    def upstream(request: httpx.Request) -> httpx.Response:
        if len(request.content) > limit:
            message = f"This model's maximum context length is {window} tokens. However, you requested more."
            error = {"error": {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}}
            return httpx.Response(400, json=error)
        return httpx.Response(200, json=OK)

    body = conversation(turns=10, size=400)
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=upstream)
        async with gateway(make_settings(max_attempts=4)) as (app, client):
            response = await client.post(PATH, json=body)
            stats = (await client.get("/lifetime/stats")).json()
    assert response.status_code == 200 and response.json() == OK
    assert route.call_count == 2
    assert stats["refolded"] == 1
    refolded = json.loads(route.calls[1].request.content)
    assert len(route.calls[1].request.content) <= limit
    assert refolded["messages"][0] == body["messages"][0]  # the system message is pinned
    assert refolded["messages"][-1] == body["messages"][-1]  # and the last user turn kept
    await assert_idle(app)


# --- the gateway's own routes -----------------------------------------------------------------


async def test_healthz() -> None:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.route()
        async with gateway() as (app, client):
            response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert not route.called
    assert app.state.lifetime.stats().admitted == 0  # not counted as a forwarded request


@pytest.mark.parametrize("keys", [(), ("client-key",)])
@pytest.mark.parametrize(
    "path", ["/v1/realtime?model=m", "/ws/google.ai.generativelanguage.v1beta.BidiGenerateContent"]
)
async def test_a_websocket_is_closed_before_it_is_accepted(path: str, keys: tuple[str, ...]) -> None:
    # The gateway proxies HTTP only (docs/operators.md, "WebSocket clients"): Starlette has no websocket
    # route, so the handshake is closed before it is accepted, which an ASGI server answers with HTTP 403
    # (uvicorn: tests/reliability/test_attack_newuser.py::test_serve_does_not_log_the_key_in_a_websocket_query).
    path, _, query = path.partition("?")
    scope = {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "scheme": "ws",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"sec-websocket-version", b"13")],
        "client": ("127.0.0.1", 5555),
        "server": ("testserver", 80),
        "subprotocols": [],
        "state": {},
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    settings = make_settings(gateway_keys=keys, upstream_api_key="sk-up" if keys else None)
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.route()
        async with gateway(settings) as (app, _):
            await app(scope, receive, send)
    assert [message["type"] for message in sent] == ["websocket.close"]  # no websocket.accept
    assert not route.called and app.state.lifetime.stats().admitted == 0


async def test_stats_are_idle_after_requests_and_totals_are_right() -> None:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        ok = router.post(PATH).respond(200, json=OK)
        router.get("/v1/models").mock(side_effect=httpx.ConnectError("refused"))
        async with gateway() as (app, client):
            assert (await client.post(PATH, json=CHAT, headers={"x-session-id": "s"})).status_code == 200
            assert (await client.post(PATH, json=CHAT)).status_code == 200
            assert (await client.post(PATH, content=b"{oops", headers=JSON_HEADERS)).status_code == 400
            assert (await client.get("/v1/models")).status_code == 502
            response = await client.get("/lifetime/stats")
    assert ok.call_count == 2
    assert response.status_code == 200
    stats = response.json()
    for gauge in ("inflight_requests", "inflight_bytes", "retained_input_bytes", "live_resources", "pinned_sessions"):
        assert stats[gauge] == 0, gauge
    assert stats["admitted"] == 4
    assert stats["completed"] == 4
    assert stats["retried"] == 2  # the unreachable GET: 3 attempts
    assert stats["rejected"] == stats["aborted"] == stats["too_large"] == stats["refolded"] == 0
    [upstream] = stats["upstreams"]
    assert (upstream["url"], upstream["inflight"], upstream["requests"]) == (BASE, 0, 5)
    await assert_idle(app)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/", 404, "not_found"),
        ("POST", "/v2/chat/completions", 404, "not_found"),
        ("GET", "/healthz/x", 404, "not_found"),
        ("POST", "/healthz", 405, "method_not_allowed"),
    ],
)
async def test_errors_outside_the_forwarded_paths_are_json(method: str, path: str, status: int, code: str) -> None:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.route()
        async with gateway() as (app, client):
            response = await client.request(method, path)
    assert_json_error(response, status, code)
    assert not route.called
    await assert_idle(app)


def _host_app(kind: str, gateway_app: Any) -> Any:
    async def ping(request: Request) -> Response:
        return PlainTextResponse("pong")

    host: Starlette
    if kind == "fastapi":
        host = FastAPI()
        host.add_api_route("/ping", ping, methods=["GET"])
    else:
        host = Starlette(routes=[Route("/ping", ping)])
    host.mount("/llm", gateway_app)
    return host


@pytest.mark.parametrize("kind", ["starlette", "fastapi"])
async def test_mounted_in_an_existing_app(kind: str) -> None:
    gateway_app = create_app(make_settings())
    host = _host_app(kind, gateway_app)
    try:
        with respx.mock(base_url=BASE, assert_all_called=True) as router:
            route = router.post(PATH + "?q=1").respond(200, json=OK)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=host), base_url="http://testserver") as c:
                with anyio.fail_after(TIMEOUT):
                    response = await c.post("/llm" + PATH + "?q=1", json=CHAT)
                    ping = await c.get("/ping")
                    health = await c.get("/llm/healthz")
                    stats = await c.get("/llm/lifetime/stats")
                    missing = await c.get("/llm/v2/x")
    finally:
        await gateway_app.state.upstream.aclose()
    assert response.status_code == 200 and response.json() == OK
    assert str(route.calls[0].request.url) == BASE + PATH + "?q=1"
    assert ping.status_code == 200 and ping.text == "pong"
    assert health.json() == {"status": "ok"}
    assert stats.json()["admitted"] == 1 and stats.json()["live_resources"] == 0
    assert_json_error(missing, 404, "not_found")
    await assert_idle(gateway_app)


# --- bookkeeping ------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


async def test_bookkeeping_gets_scalars_with_the_fingerprint_of_the_bytes_received() -> None:
    body = b'{"model":"gpt-4o","messages":[{"role":"user","content":"hi there"}]}'

    def route_model(draft: Draft) -> None:
        draft.body["model"] = "gpt-4.1-mini"
        draft.mark_changed()

    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(200, json=OK)
        async with gateway(preparers=[route_model], bookkeeper=recorder) as (app, client):
            response = await client.post(PATH, content=body, headers={**JSON_HEADERS, "x-session-id": "sess-b"})
    assert response.status_code == 200
    assert route.calls[0].request.content != body  # the preparer changed what was sent...
    [outcome] = recorder.outcomes
    assert outcome.fingerprint.wire_hash == blake3(body).hexdigest()  # ...not what was fingerprinted
    assert outcome.fingerprint.size == len(body)
    assert outcome.fingerprint.text_comparable is True
    assert outcome.session_id == "sess-b"
    assert outcome.path == PATH
    assert outcome.status == 200
    assert outcome.attempts == 1
    assert outcome.upstream == BASE
    assert outcome.bytes_out == len(response.content) > 0
    assert outcome.outcome == "complete"
    assert outcome.started <= outcome.first_byte_at <= outcome.ended  # type: ignore[operator]
    assert app.state.book.get("sess-b") is None  # a custom bookkeeper replaces the default one
    await assert_idle(app)


async def test_bookkeeping_records_failures_and_retries() -> None:
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH)
        route.side_effect = [httpx.Response(503), httpx.Response(503), httpx.Response(200, json=OK)]
        router.post("/v1/embeddings").mock(side_effect=httpx.ConnectError("refused"))
        async with gateway(bookkeeper=recorder) as (app, client):
            assert (await client.post(PATH, json=CHAT)).status_code == 200
            assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 502
            assert (await client.post(PATH, content=b"{", headers=JSON_HEADERS)).status_code == 400
    retried, unreachable, malformed = recorder.outcomes
    assert (retried.status, retried.attempts, retried.outcome) == (200, 3, "complete")
    assert (unreachable.status, unreachable.outcome, unreachable.bytes_out) == (502, "error", 0)
    assert unreachable.fingerprint.wire_hash == blake3(b'{"input":"x"}').hexdigest()
    assert (malformed.status, malformed.outcome, malformed.first_byte_at) == (400, "error", None)
    await assert_idle(app)


async def test_a_failing_bookkeeper_does_not_break_the_response() -> None:
    class Broken:
        def record(self, outcome: Outcome) -> None:
            raise RuntimeError("metrics backend down")

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).respond(200, json=OK)
        async with gateway(bookkeeper=Broken()) as (app, client):
            response = await client.post(PATH, json=CHAT, headers={"x-session-id": "s"})
    assert response.status_code == 200 and response.json() == OK
    await assert_idle(app)


async def test_same_session_concurrency() -> None:
    n, session = 10, "sess-concurrent"
    arrived = 0
    all_in = anyio.Event()
    peak_pins: list[int] = []
    apps: list[Any] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        if arrived == n:
            peak_pins.append(apps[0].state.lifetime.stats().pinned_sessions)
            all_in.set()
        await all_in.wait()  # every request is in flight at once
        if request.headers.get("x-fail") == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if request.headers.get("x-fail") == "drop":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json=OK)

    results: dict[int, int] = {}
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(side_effect=upstream)
        async with gateway(make_settings(max_attempts=1)) as (app, client):
            apps.append(app)

            async def one(i: int) -> None:
                fail = "500" if i % 4 == 1 else "drop" if i == 6 else ""
                headers = {"x-session-id": session, **({"x-fail": fail} if fail else {})}
                response = await client.post(PATH, json={**CHAT, "n": i}, headers=headers)
                results[i] = response.status_code

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
    assert peak_pins == [n]
    assert sorted(results) == list(range(n))
    assert [results[i] for i in range(n)] == [200, 500, 200, 200, 200, 500, 502, 200, 200, 500]
    entry = app.state.book.get(session)
    assert entry is not None
    assert entry.requests == n
    assert app.state.book.recomputations == n  # every body differs, so every hash changed
    await assert_idle(app)


def _running() -> set[tuple[int, str | None]]:
    # With the name: trio may give a new task the id of one that ended.
    return {(task.id, task.name) for task in anyio.get_running_tasks()}


class _RecordingStream(httpx.AsyncByteStream):
    """An upstream answer that notes the running tasks while the gateway relays it."""

    def __init__(self, chunks: list[bytes], seen: list[set[tuple[int, str | None]]]) -> None:
        self.chunks = chunks
        self.seen = seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.seen.append(_running())
            yield chunk

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("streamed", [True, False], ids=["event-stream", "json"])
async def test_one_helper_task_watches_the_client_from_forwarding_to_the_end_of_the_relay(streamed: bool) -> None:
    """Retries and the relay are watched by the same task: one helper task per request, not one per stage."""
    seen: list[set[tuple[int, str | None]]] = []
    if streamed:
        chunks = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"]
        headers = {"content-type": "text/event-stream"}
    else:
        chunks, headers = [json.dumps(OK).encode()], JSON_HEADERS

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(_running())  # while forwarding
        await anyio.lowlevel.checkpoint()
        return httpx.Response(200, headers=headers, stream=_RecordingStream(chunks, seen))

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(side_effect=answer)
        async with gateway() as (app, client):
            before = _running()
            response = await client.post(PATH, json={**CHAT, "stream": streamed})
    assert response.status_code == 200 and response.content == b"".join(chunks)
    assert len(seen) == 1 + len(chunks)
    helpers = [tasks - before for tasks in seen]
    assert len(helpers[0]) == 1 and all(each == helpers[0] for each in helpers), helpers
    await assert_idle(app)


_EVENTS = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("streamed", [True, False], ids=["event-stream", "json"])
async def test_the_client_watch_ends_by_itself_once_the_response_is_complete(
    streamed: bool, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """The server reports a disconnect once the response is complete: the request's watch task ends
    on it, and is not cancelled (each cancel costs anyio a repr of the cancelling task)."""
    from asgi_lifetime.gateway._relay import ClientWatch

    endings: list[str] = []
    real_run = ClientWatch.run

    async def run(self: ClientWatch) -> None:
        try:
            await real_run(self)
        except anyio.get_cancelled_exc_class():
            endings.append("cancelled")
            raise
        endings.append("gone" if self.gone else "ended")

    monkeypatch.setattr(ClientWatch, "run", run)

    def answer(request: httpx.Request) -> httpx.Response:
        if streamed:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_EVENTS)
        return httpx.Response(200, json=OK)

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(side_effect=answer)
        async with gateway() as (app, client):
            for _ in range(3):
                response = await client.post(PATH, json={**CHAT, "stream": streamed})
                assert response.status_code == 200
    if anyio_backend == "asyncio":
        assert endings == ["ended"] * 3
    else:  # trio may run the gateway's task again before the watch's: it is then cancelled, as before
        assert len(endings) == 3 and set(endings) <= {"ended", "cancelled"}, endings
    await assert_idle(app)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("paths", "path", "forwarded"),
    [
        # A prefix covers itself and what lies below it, whole segments only, with or without its final "/".
        (("/v1/responses",), "/v1/responses", True),  # was Starlette's 307 to /v1/responses/
        (("/v1/responses",), "/v1/responses/resp_1", True),
        (("/v1/responses",), "/v1/responsesX", False),  # was read and admitted by the middleware, then a 404
        (("/v1",), "/v1beta/models/g:generateContent", False),
        (("/v1",), "/v1/models", True),
        (("/v1/",), "/v1", True),  # was a 307 to /v1/
        (("/v1/",), "/v1/", True),
        (("/",), "/anything/at/all", True),
        (("/",), "/", True),
    ],
)
async def test_a_prefix_forwards_exactly_the_paths_the_middleware_handles(
    paths: tuple[str, ...], path: str, forwarded: bool
) -> None:
    with respx.mock(assert_all_called=False) as mock:
        route = mock.route(url__startswith=BASE).respond(200, json={"ok": True})
        async with gateway(make_settings(paths=paths)) as (app, client):
            response = await client.post(path, json={"x": 1})
            stats = app.state.lifetime.stats()
    assert response.status_code == (200 if forwarded else 404)
    assert route.called is forwarded
    if forwarded:
        assert route.calls.last.request.url == httpx.URL(BASE + path)
    # A path the gateway does not forward is not read or admitted either: one rule decides both.
    assert stats.admitted == (1 if forwarded else 0)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("content_type", "upstream_says", "client_gets"),
    [
        ("text/event-stream; charset=utf-8", [], ["no"]),
        ("text/event-stream", [("X-Accel-Buffering", "yes")], ["no"]),  # meant for the upstream's own proxies
        ("application/json", [], []),
        ("application/json", [("X-Accel-Buffering", "yes")], ["yes"]),  # not an event stream: the upstream's
    ],
)
async def test_an_event_stream_tells_nginx_not_to_buffer_it(
    content_type: str, upstream_says: list[tuple[str, str]], client_gets: list[str]
) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    body = event if "event-stream" in content_type else b"{}"
    with respx.mock:
        respx.post(url__startswith=BASE).respond(
            200, headers=[("content-type", content_type), *upstream_says], content=body
        )
        async with gateway() as (_, client):
            response = await client.post("/v1/chat/completions", json={"stream": True})
    assert response.status_code == 200
    assert response.headers.get_list("x-accel-buffering") == client_gets
