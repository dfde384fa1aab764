"""The gateway's operator features as wired by create_app: metrics, keys, draining, and a client
that leaves while retries are still running."""

from __future__ import annotations

import base64
import gc
import json
import logging
import socket
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._shutdown import request_shutdown, reset_shutdown
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

from .._asgi import json_scope
from ..reliability.test_faults import assert_idle, running

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def settings(**changes: Any) -> LifetimeSettings:
    base = LifetimeSettings(
        upstream_url=("http://upstream.test",),
        backoff_base=0.01,
        backoff_max=0.02,
        admission_timeout=1,
        stall_timeout=5,
    )
    return base.replace(**changes)


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def completion(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        },
    )


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found.append((dict(sample.labels), sample.value))
    return found


@pytest.mark.anyio
async def test_metrics_endpoint_counts_requests_and_attempts() -> None:
    calls = 0

    def flaky(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503) if calls == 1 else completion(request)

    app = create_app(settings(), transport=httpx.MockTransport(flaky))
    async with client_for(app) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.post("/v1/chat/completions", content=b"{bad")).status_code == 400
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    requests = samples(metrics.text, "asgi_lifetime_requests_total")
    by_status = {labels["status"]: value for labels, value in requests}
    assert by_status == {"200": 1.0, "400": 1.0}
    assert ("upstream", "http://upstream.test") in {(k, v) for labels, _ in requests for k, v in labels.items()}
    retries = samples(metrics.text, "asgi_lifetime_attempts_total")
    assert [value for labels, value in retries if labels["kind"] == "retry"] == [1.0]
    assert samples(metrics.text, "asgi_lifetime_inflight_requests") == [({}, 0.0)]


@pytest.mark.anyio
async def test_gateway_keys_guard_the_injected_upstream_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    app = create_app(
        settings(upstream_api_key="sk-up-SECRET", gateway_keys=("client-1",)), transport=httpx.MockTransport(upstream)
    )
    async with client_for(app) as client:
        refused = await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"})
        missing = await client.post("/v1/chat/completions", json=CHAT)
        accepted = await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer client-1"})
        health = await client.get("/healthz")
    assert refused.status_code == missing.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert accepted.status_code == 200 and health.status_code == 200
    assert len(seen) == 1  # nothing forwarded for the refused requests
    assert seen[0].headers["authorization"] == "Bearer sk-up-SECRET"
    for response in (refused, missing, accepted):
        assert "sk-up-SECRET" not in response.text
    assert caplog.records  # the access log and friends did log these requests...
    assert "sk-up-SECRET" not in caplog.text and "client-1" not in caplog.text  # ...but never a key
    assert app.state.lifetime.stats().admitted == 1  # refused before admission


@pytest.mark.anyio
async def test_upstream_key_without_gateway_keys_serves_loopback_only() -> None:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    app = create_app(settings(upstream_api_key="sk-up-SECRET"), transport=httpx.MockTransport(upstream))
    remote = httpx.ASGITransport(app=app, client=("192.0.2.7", 5555))
    async with httpx.AsyncClient(transport=remote, base_url="http://testserver") as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 401
    local = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
    async with httpx.AsyncClient(transport=local, base_url="http://testserver") as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert [r.headers["authorization"] for r in seen] == ["Bearer sk-up-SECRET"]


@pytest.mark.anyio
async def test_client_leaving_during_backoff_stops_the_retries() -> None:
    calls = 0

    def always_busy(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503, headers={"retry-after": "30"})

    app = create_app(
        settings(max_attempts=5, retry_after_cap=30, retry_deadline=120), transport=httpx.MockTransport(always_busy)
    )
    body = json.dumps(CHAT).encode()
    sent: list[Message] = []
    queue: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await anyio.sleep(0.3)  # the client hangs up while the gateway waits out Retry-After
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = json_scope(body, "/v1/chat/completions", app=app)
    started = time.monotonic()
    with anyio.fail_after(5):
        await app(scope, receive, send)
    assert time.monotonic() - started < 3  # not 30 s of backoff for a client that is gone
    assert calls == 1
    assert sent == []  # nothing to deliver to a client that left
    stats = app.state.lifetime.stats()
    assert stats.idle and stats.retained_input_bytes == 0


@pytest.fixture
def shutdown_flag() -> Iterator[None]:
    reset_shutdown()
    try:
        yield
    finally:
        reset_shutdown()


def test_draining_ends_streams_after_the_grace_and_refuses_new_requests(shutdown_flag: None) -> None:
    upstream_app = create_demo_upstream(tokens_per_second=20)
    with serve_in_thread(upstream_app) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream,), shutdown_grace=0.5, keepalive_interval=5))
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=10) as client:
            stream_body = {**CHAT, "stream": True, "max_tokens": 400}  # about 20 s at this pace
            with client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
                chunks = response.iter_text()
                first = next(chunks)
                assert '"content"' in first
                started = time.monotonic()
                request_shutdown()
                deadline = time.monotonic() + 5
                while client.get("/healthz").status_code != 503 and time.monotonic() < deadline:
                    time.sleep(0.02)
                refused = client.post("/v1/chat/completions", json=CHAT)
                rest = "".join(chunks)
                ended_after = time.monotonic() - started
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert "shutting down" in refused.json()["error"]["message"]
            assert "event: error" in rest and "shutting_down" in rest
            assert 0.4 < ended_after < 3  # given its grace, then ended; not the ~20 s stream
            deadline = time.monotonic() + 5
            while not app.state.lifetime.stats().idle and time.monotonic() < deadline:
                time.sleep(0.02)
            assert app.state.lifetime.stats().idle


# --- client-chosen session ids are bounded and kept only as a digest ----------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("limit", "length", "accepted"),
    [(None, 256, True), (None, 257, False), (None, 60 * 1024, False), (16, 16, True), (16, 17, False)],
)
async def test_a_session_id_over_the_limit_is_a_400(limit: int | None, length: int, accepted: bool) -> None:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    changes = {} if limit is None else {"max_session_id_bytes": limit}
    app = create_app(settings(**changes), transport=httpx.MockTransport(upstream))
    session = "s" * length
    async with client_for(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": session})
    if accepted:
        assert response.status_code == 200
        assert len(seen) == 1 and seen[0].headers["x-session-id"] == session
        assert session in app.state.book
    else:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "session_id_too_long"
        assert f"{length} bytes" in error["message"] and session not in response.text
        assert seen == [] and len(app.state.book) == 0
    assert app.state.lifetime.stats().idle


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("values", "status"),
    [(["a", "b"], 400), (["a", "a"], 200), (["a", " a "], 200), (["", "a"], 200)],
    ids=["different", "repeated", "padded", "one-empty"],
)
async def test_two_different_session_ids_are_a_400(values: list[str], status: int) -> None:
    """Pinned by one, forwarded as both: the upstream and the gateway would disagree on the session."""
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    app = create_app(settings(), transport=httpx.MockTransport(upstream))
    headers = [("x-session-id", value) for value in values]
    async with client_for(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == status
    if status == 400:
        assert response.json()["error"]["code"] == "conflicting_session_id" and seen == []
        assert len(app.state.book) == 0
    else:
        assert len(seen) == 1 and "a" in app.state.book
    assert app.state.lifetime.stats().idle


def test_session_id_limit_is_a_validated_setting() -> None:
    assert LifetimeSettings().max_session_id_bytes == 256
    assert LifetimeSettings.from_mapping({"MAX_SESSION_ID_BYTES": "1KiB"}).max_session_id_bytes == 1024
    for bad in ("0", "-1", "lots"):
        with pytest.raises(ValueError, match="ASGI_LIFETIME_MAX_SESSION_ID_BYTES"):
            LifetimeSettings.from_mapping({"MAX_SESSION_ID_BYTES": bad})


@pytest.mark.anyio
@pytest.mark.parametrize("body", [b"{not json", json.dumps(CHAT).encode()], ids=["invalid", "valid"])
async def test_unique_long_session_ids_leave_nothing_behind(body: bytes) -> None:
    # Each request carries its own 32 KiB session id. Kept whole, 400 of them stayed behind
    # (12.5 MiB); keyed by a 16-byte digest, what stays is a small entry per session.
    count, length = 400, 32 * 1024
    big_headers = {"h11_max_incomplete_event_size": 256 * 1024}
    with running(max_session_id_bytes=64 * 1024, serve=big_headers) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:

            async def send(i: int) -> int:
                session = f"{i:08d}".ljust(length, "x")
                headers = {"x-session-id": session, "content-type": "application/json"}
                return (await client.post("/v1/chat/completions", content=body, headers=headers)).status_code

            for i in range(10):  # warm up: connection pools, caches, lazily built objects
                await send(-i - 1)
            await assert_idle(stack.app, stack.url)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                statuses = {await send(i) for i in range(count)}
                await assert_idle(stack.app, stack.url)
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
    assert statuses == ({400} if body.startswith(b"{not") else {200})
    assert len(stack.app.state.book) == count + 10
    assert grown < 2 * 1024 * 1024, f"{grown / 1024:.0f} KiB left after {count} requests of {length} byte ids"


# --- a password in UPSTREAM_URL is never readable -------------------------------------------------

PASSWORD = "pw-SECRET-7c1e"


def recording_upstream() -> tuple[Starlette, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    async def endpoint(request: Request) -> Response:
        await request.body()
        seen.append(dict(request.headers))
        return JSONResponse({"object": "chat.completion", "choices": []})

    return Starlette(routes=[Route("/v1/{path:path}", endpoint, methods=["GET", "POST"])]), seen


def basic(userinfo: str) -> str:
    return "Basic " + base64.b64encode(userinfo.encode()).decode()


def assert_secret_free(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text and base64.b64encode(f"user:{PASSWORD}".encode()).decode() not in text


@pytest.mark.anyio
async def test_upstream_password_is_sent_as_basic_auth_and_shown_nowhere(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: ours, httpx, httpcore, uvicorn
    upstream_app, seen = recording_upstream()
    with serve_in_thread(upstream_app, log_level="debug") as upstream:
        userinfo_url = upstream.replace("http://", f"http://user:{PASSWORD}@") + "/"
        config = LifetimeSettings(upstream_url=(userinfo_url,), session_header="x-session-id")
        assert config.upstream_url == (upstream + "/",)
        app = create_app(config)
        with serve_in_thread(app, log_level="debug") as base:
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                plain = await client.post("/v1/chat/completions", json=CHAT)
                own = await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer mine"})
                keyed = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "mine"})
                surfaces = [await client.get(path) for path in ("/lifetime/stats", "/metrics", "/healthz", "/nope")]
    assert plain.status_code == own.status_code == keyed.status_code == 200
    assert seen[0]["authorization"] == basic(f"user:{PASSWORD}")  # no credential of its own: the URL's
    assert seen[1]["authorization"] == "Bearer mine"  # the client's credential is not replaced
    assert "authorization" not in seen[2] and seen[2]["x-api-key"] == "mine"
    stats = surfaces[0].json()
    assert [u["url"] for u in stats["upstreams"]] == [upstream + "/"]
    assert_secret_free(
        *(r.text for r in (plain, own, keyed, *surfaces)),
        caplog.text,
        repr(config),
        str(config),
        repr(config.public_items()),
        repr(app.state.upstream.describe()),
    )
    assert ("ASGI_LIFETIME_UPSTREAM_URL", userinfo_url.replace(PASSWORD, "***")) in config.public_items()
    assert any(r.name.startswith("httpx") for r in caplog.records)  # httpx did log its request URLs


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models?key=abc"])
async def test_unreachable_upstream_with_a_password_errors_and_logs_without_it(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    app = create_app(settings(upstream_url=(f"http://user:{PASSWORD}@127.0.0.1:{port}",), max_attempts=2))
    async with client_for(app) as client:
        async with app.router.lifespan_context(app):
            response = await client.post(path, json=CHAT)
            stats = await client.get("/lifetime/stats")
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_unreachable"
    assert_secret_free(response.text, stats.text, caplog.text)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("upstream_url", "api_key", "expected"),
    [
        ("http://us%40er:p%3Ass@upstream.test/base", None, basic("us@er:p:ss")),  # percent-decoded
        ("http://user@upstream.test/base", None, basic("user:")),  # a user without a password
        ("http://user:pw@upstream.test/base", "sk-up", "Bearer sk-up"),  # a configured key wins
        ("http://upstream.test/base", None, None),
    ],
)
async def test_upstream_user_info_becomes_basic_auth(
    upstream_url: str, api_key: str | None, expected: str | None
) -> None:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    config = settings(upstream_url=(upstream_url,), upstream_api_key=api_key)
    app = create_app(config, transport=httpx.MockTransport(upstream))
    async with client_for(app) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert seen[0].url == httpx.URL("http://upstream.test/base/v1/chat/completions")
    assert seen[0].headers.get("authorization") == expected


def test_user_info_survives_replace_and_export_and_is_masked() -> None:
    configured = f"https://user:{PASSWORD}@api.example.com:8443/v1"
    settings_ = LifetimeSettings(upstream_url=(configured, "http://other:8000"))
    assert settings_.upstream_url == ("https://api.example.com:8443/v1", "http://other:8000")
    assert settings_.shown_upstream_urls() == ("https://user:***@api.example.com:8443/v1", "http://other:8000")
    assert settings_.upstream_urls_with_userinfo() == (configured, "http://other:8000")
    copied = settings_.replace(max_attempts=2)
    assert copied.upstream_authorization("https://api.example.com:8443/v1") == basic(f"user:{PASSWORD}")
    assert copied.upstream_authorization("http://other:8000") is None
    assert settings_.replace(upstream_url=("http://other:8000",)).upstream_userinfo == ()
    again = LifetimeSettings.from_mapping({"UPSTREAM_URL": ",".join(settings_.upstream_urls_with_userinfo())})
    assert again == settings_
    with pytest.raises(ValueError) as info:
        LifetimeSettings(upstream_url=(f"ftp://user:{PASSWORD}@host",))
    assert PASSWORD not in str(info.value) and "user:***@host" in str(info.value)


@pytest.mark.anyio
async def test_user_info_keeps_the_guarded_pool_and_reaches_a_client_of_your_own() -> None:
    """The user info is added where the request is built: the gateway's own transport stays the one
    that never reuses a desynchronised connection, and a client= of the caller's sends it too."""
    from asgi_lifetime.gateway._transport import UpstreamTransport

    config = settings(upstream_url=("http://user:pw@upstream.test/base",))
    app = create_app(config)
    try:
        assert isinstance(app.state.upstream._client._transport, UpstreamTransport)
    finally:
        await app.state.upstream.aclose()
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion(request)

    own = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    app = create_app(config, client=own)
    async with client_for(app) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    await own.aclose()
    assert seen[0].headers["authorization"] == basic("user:pw")
