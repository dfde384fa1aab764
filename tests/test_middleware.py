from __future__ import annotations

import contextlib
import gc
import gzip
import json
import random
import sys
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import httpx
import pytest
from blake3 import blake3
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from asgi_lifetime import (
    Fingerprint,
    Lifetime,
    LifetimeMiddleware,
    LifetimeSettings,
    RequestLifetime,
    fingerprint,
)
from asgi_lifetime._stats import GAUGES

from ._asgi import Recorder, body_receive, http_scope, json_scope, receiving
from ._spy import spy_parse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
CHAT_BYTES = json.dumps(CHAT).encode()


def settings(**changes: Any) -> LifetimeSettings:
    return LifetimeSettings(paths=("/v1/",), admission_timeout=1.0, body_idle_timeout=5.0).replace(**changes)


async def echo(request: Request) -> Response:
    lifetime: RequestLifetime = request.state.lifetime
    body = await request.body()
    return JSONResponse(
        {
            "size": len(body),
            "wire_hash": lifetime.fingerprint.wire_hash,
            "text_comparable": lifetime.fingerprint.text_comparable,
            "content_length": request.headers.get("content-length"),
            "content_encoding": request.headers.get("content-encoding"),
        }
    )


async def outside(request: Request) -> Response:
    return JSONResponse({"has_lifetime": hasattr(request.state, "lifetime"), "size": len(await request.body())})


def starlette_app(**changes: Any) -> Starlette:
    routes = [Route("/v1/echo", echo, methods=["POST"]), Route("/other", outside, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(LifetimeMiddleware, settings=settings(**changes))])


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.mark.anyio
async def test_starlette_app_gets_fingerprint_and_body() -> None:
    app = starlette_app()
    async with client_for(app) as client:
        response = await client.post("/v1/echo", content=CHAT_BYTES, headers={"content-type": "application/json"})
    assert response.status_code == 200
    expected = fingerprint(CHAT_BYTES)
    assert response.json()["size"] == len(CHAT_BYTES)
    assert response.json()["wire_hash"] == expected.wire_hash
    assert response.json()["text_comparable"] is True
    stats = app.state.lifetime.stats()
    assert stats.admitted == 1 and stats.completed == 1 and stats.idle


@pytest.mark.anyio
async def test_fastapi_request_json_keeps_working() -> None:
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=settings())

    @app.post("/v1/chat/completions")
    async def chat(request: FastAPIRequest) -> dict[str, Any]:
        data = await request.json()
        fp: Fingerprint = request.state.lifetime.fingerprint
        return {"model": data["model"], "turns": len(data["messages"]), "size": fp.size}

    async with client_for(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json()["model"] == "m" and response.json()["turns"] == 1
    assert response.json()["size"] > 0
    assert app.state.lifetime.stats().idle


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fastapi_with_testclient(backend: Literal["asyncio", "trio"]) -> None:
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=settings())

    @app.post("/v1/items")
    async def items(request: FastAPIRequest) -> dict[str, Any]:
        return {"got": await request.json(), "comparable": request.state.lifetime.fingerprint.text_comparable}

    with TestClient(app, backend=backend) as client:
        response = client.post("/v1/items", json={"input": [{"type": "input_image", "image_url": "x"}]})
        assert response.status_code == 200
        assert response.json()["comparable"] is False
        assert response.json()["got"]["input"][0]["type"] == "input_image"
        assert app.state.lifetime.stats().idle


@pytest.mark.anyio
async def test_paths_outside_prefix_pass_through_untouched() -> None:
    app = starlette_app()
    async with client_for(app) as client:
        response = await client.post("/other", content=b"x" * 100)
    assert response.json() == {"has_lifetime": False, "size": 100}
    assert app.state.lifetime.stats().admitted == 0


@pytest.mark.anyio
async def test_content_length_over_limit_is_413_before_reading() -> None:
    app = starlette_app(max_body_bytes=1000, max_inflight_bytes=1000)
    async with client_for(app) as client:
        response = await client.post("/v1/echo", content=b"x" * 1001)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert set(response.json()["error"]) == {"type", "code", "message"}
    stats = app.state.lifetime.stats()
    assert stats.too_large == 1 and stats.admitted == 0 and stats.idle


@pytest.mark.anyio
async def test_gzip_body_is_decoded_for_the_inner_app() -> None:
    app = starlette_app()
    packed = gzip.compress(CHAT_BYTES)
    async with client_for(app) as client:
        response = await client.post("/v1/echo", content=packed, headers={"content-encoding": "gzip"})
    data = response.json()
    assert data["size"] == len(CHAT_BYTES)
    assert data["content_length"] == str(len(CHAT_BYTES))
    assert data["content_encoding"] is None
    assert data["wire_hash"] == fingerprint(CHAT_BYTES).wire_hash


@pytest.mark.anyio
async def test_capitalised_header_names_from_a_server_are_the_same_fields() -> None:
    # ASGI servers lowercase names; one that does not (or a raw scope) sent "Content-Encoding" past the
    # decoder: the app got the gzip bytes, and a "Content-Type: text/plain" was taken for JSON.
    app = starlette_app()
    packed = gzip.compress(CHAT_BYTES)
    headers = [(b"Content-Encoding", b"gzip"), (b"Content-Length", str(len(packed)).encode())]
    out = Recorder()
    await app(http_scope("/v1/echo", headers), body_receive(packed), out)
    data = json.loads(out.body)
    assert (data["size"], data["content_length"], data["content_encoding"]) == (
        len(CHAT_BYTES),
        str(len(CHAT_BYTES)),
        None,
    )
    assert data["wire_hash"] == fingerprint(CHAT_BYTES).wire_hash
    plain = [(b"Content-Type", b"text/plain"), (b"Content-Length", b"5")]
    out = Recorder()
    await app(http_scope("/v1/echo", plain), body_receive(b"{bad}"), out)
    assert out.status == 200 and json.loads(out.body)["text_comparable"] is False


@pytest.mark.anyio
async def test_gzip_bomb_is_413() -> None:
    # Driven at the ASGI level: httpx's ASGITransport leaves its request-body generator
    # unfinalized under trio when the app answers before reading everything.
    middleware = LifetimeMiddleware(body_app, settings=settings(max_body_bytes=64 * 1024, max_inflight_bytes=64 * 1024))
    bomb = gzip.compress(b"\0" * (16 * 1024 * 1024))
    out = Recorder()
    headers = [(b"content-encoding", b"gzip"), (b"content-length", str(len(bomb)).encode())]
    await middleware(http_scope(headers=headers), receiving([{"type": "http.request", "body": bomb}]), out)
    assert out.status == 413
    assert middleware.stats().too_large == 1 and middleware.stats().idle


@pytest.mark.anyio
async def test_admission_timeout_is_503_with_retry_after() -> None:
    entered, leave = anyio.Event(), anyio.Event()

    async def slow(request: Request) -> Response:
        await request.body()
        entered.set()
        await leave.wait()
        return Response("done")

    app = Starlette(
        routes=[Route("/v1/slow", slow, methods=["POST"])],
        middleware=[Middleware(LifetimeMiddleware, settings=settings(max_inflight=1, admission_timeout=0.2))],
    )
    async with client_for(app) as client, anyio.create_task_group() as tg:
        tg.start_soon(client.post, "/v1/slow")
        with anyio.fail_after(5):
            await entered.wait()
        second = await client.post("/v1/slow", content=b"{}")
        leave.set()
    assert second.status_code == 503
    assert second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "overloaded"
    stats = app.state.lifetime.stats()
    assert stats.rejected == 1 and stats.idle


# Raw ASGI drivers: the transport-level paths (disconnects, cancellation) are easier to
# produce exactly without an HTTP client in between.


async def body_app(scope: Scope, receive: Receive, send: Send) -> None:
    assert scope["type"] == "http"
    received = b""
    while True:
        message = await receive()
        received += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(received)).encode()})


@pytest.mark.anyio
async def test_disconnect_mid_body_releases_slot_for_next_request() -> None:
    middleware = LifetimeMiddleware(body_app, settings=settings(max_inflight=1, admission_timeout=0.5))
    aborted = Recorder()
    await middleware(
        http_scope(),
        receiving([{"type": "http.request", "body": b"part", "more_body": True}, {"type": "http.disconnect"}]),
        aborted,
    )
    assert aborted.messages == []  # nothing is sent to a client that is gone
    assert middleware.stats().aborted == 1
    assert middleware.stats().inflight_requests == 0

    ok = Recorder()
    with anyio.fail_after(0.4):  # admitted at once, not after the admission timeout
        await middleware(http_scope(), receiving([{"type": "http.request", "body": b"{}"}]), ok)
    assert ok.status == 200
    assert middleware.stats().idle


@pytest.mark.anyio
async def test_inner_app_exception_releases_everything() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        raise RuntimeError("boom")

    middleware = LifetimeMiddleware(broken, settings=settings())
    with pytest.raises(RuntimeError, match="boom"):
        await middleware(http_scope(), receiving([{"type": "http.request", "body": CHAT_BYTES}]), Recorder())
    assert middleware.stats().idle


@pytest.mark.anyio
async def test_cancellation_while_inner_app_runs_releases_everything() -> None:
    started = anyio.Event()

    async def hang(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        started.set()
        await anyio.sleep_forever()

    middleware = LifetimeMiddleware(hang, settings=settings())
    async with anyio.create_task_group() as tg:
        tg.start_soon(middleware, http_scope(), receiving([{"type": "http.request", "body": b"{}"}]), Recorder())
        with anyio.fail_after(5):
            await started.wait()
        assert middleware.stats().inflight_requests == 1
        tg.cancel_scope.cancel()
    assert middleware.stats().idle


@pytest.mark.anyio
async def test_body_idle_timeout_is_408() -> None:
    middleware = LifetimeMiddleware(body_app, settings=settings(body_idle_timeout=0.05))
    out = Recorder()
    await middleware(http_scope(), receiving([{"type": "http.request", "body": b"x", "more_body": True}]), out)
    assert out.status == 408
    assert middleware.stats().timed_out == 1 and middleware.stats().idle


@pytest.mark.anyio
async def test_middleware_keeps_no_reference_to_the_body_after_replay() -> None:
    seen: dict[str, Any] = {}

    async def inspect(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        body = message["body"]
        del message
        gc.collect()
        seen["referrers"] = [type(r).__name__ for r in gc.get_referrers(body)]
        seen["refcount"] = sys.getrefcount(body)
        seen["retained"] = scope["state"]["lifetime"].resources._counters.retained_input_bytes
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(inspect, settings=settings())
    await middleware(http_scope(), receiving([{"type": "http.request", "body": b"x" * 5000}]), Recorder())
    # Only the inspecting frame's local refers to the body (plus getrefcount's argument):
    # no _Replay, message dict, list or suspended middleware frame.
    assert seen["referrers"] == []
    assert seen["refcount"] == 2
    assert seen["retained"] == 0


@pytest.mark.anyio
async def test_handoff_parsed_is_taken_once_and_dropped_at_settlement() -> None:
    taken: list[Any] = []

    async def take(scope: Scope, receive: Receive, send: Send) -> None:
        lifetime: RequestLifetime = scope["state"]["lifetime"]
        taken.append(lifetime.take_parsed())
        with pytest.raises(LookupError):
            lifetime.take_parsed()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(take, settings=settings(), handoff_parsed=True)
    await middleware(http_scope(), receiving([{"type": "http.request", "body": CHAT_BYTES}]), Recorder())
    assert taken == [CHAT]
    assert middleware.stats().idle

    # Not taken: dropped when the request settles, and the gauge returns to zero.
    kept: list[RequestLifetime] = []

    async def ignore(scope: Scope, receive: Receive, send: Send) -> None:
        kept.append(scope["state"]["lifetime"])
        assert kept[0].resources._counters.retained_input_bytes > 0
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(ignore, settings=settings(), handoff_parsed=True)
    await middleware(http_scope(), receiving([{"type": "http.request", "body": CHAT_BYTES}]), Recorder())
    with pytest.raises(LookupError):
        kept[0].take_parsed()
    assert middleware.stats().idle


@pytest.mark.anyio
async def test_without_handoff_nothing_is_parsed_for_the_app() -> None:
    async def take(scope: Scope, receive: Receive, send: Send) -> None:
        with pytest.raises(LookupError):
            scope["state"]["lifetime"].take_parsed()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(take, settings=settings())
    out = Recorder()
    await middleware(http_scope(), receiving([{"type": "http.request", "body": CHAT_BYTES}]), out)
    assert out.status == 204


@pytest.mark.anyio
async def test_non_http_scopes_pass_through_untouched() -> None:
    seen: list[tuple[Scope, Receive, Send]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope, receive, send))

    middleware = LifetimeMiddleware(app, settings=settings())
    scope: Scope = {"type": "websocket", "path": "/v1/ws"}
    receive, send = receiving([]), Recorder()
    await middleware(scope, receive, send)
    assert seen == [(scope, receive, send)]
    assert middleware.stats().admitted == 0


@pytest.mark.anyio
async def test_lifespan_passes_through_and_binds_after_the_startup() -> None:
    # The only thing the middleware does in the lifespan: resolve its settings once the app's
    # startup has run (which may set app.state.lifetime_settings), then publish app.state.lifetime.
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.lifetime_settings = {"MAX_BODY_BYTES": "10"}
        yield

    app = Starlette(middleware=[Middleware(LifetimeMiddleware)], lifespan=lifespan)
    messages: list[Message] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = Recorder()

    async def send(message: Message) -> None:
        if message["type"] == "lifespan.startup.complete":
            assert app.state.lifetime.settings.max_body_bytes == 10  # published before the server hears of it
        await sent(message)

    await app({"type": "lifespan", "app": app}, receiving(messages, then_block=False), send)
    assert [m["type"] for m in sent.messages] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


@pytest.mark.anyio
async def test_an_invalid_setting_from_the_lifespan_is_reported_once_and_says_where_it_was_set() -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.lifetime_settings = {"max_body_bytes": "lots"}
        yield

    app = Starlette(middleware=[Middleware(LifetimeMiddleware)], lifespan=lifespan)
    sent = Recorder()
    with pytest.raises(ValueError, match="app.state.lifetime_settings: ASGI_LIFETIME_MAX_BODY_BYTES=lots"):
        await app({"type": "lifespan", "app": app}, receiving([{"type": "lifespan.startup"}]), sent)
    # The middleware's report, not Starlette's second one (a server refuses a second startup answer).
    assert [m["type"] for m in sent.messages] == ["lifespan.startup.failed"]
    assert sent.messages[0]["message"].startswith("LifetimeMiddleware: app.state.lifetime_settings: ")


@pytest.mark.anyio
async def test_settings_from_app_state_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST"])], middleware=[Middleware(LifetimeMiddleware)])
    app.state.lifetime_settings = {"MAX_BODY_BYTES": "10", "MAX_INFLIGHT_BYTES": "10"}
    async with client_for(app) as client:
        assert (await client.post("/v1/echo", content=b"x" * 11)).status_code == 413
    assert app.state.lifetime.settings.max_body_bytes == 10

    monkeypatch.setenv("ASGI_LIFETIME_PATHS", "/api/")
    monkeypatch.chdir(anyio.Path(__file__).parent)  # no .env here
    env_app = Starlette(
        routes=[Route("/api/echo", echo, methods=["POST"])], middleware=[Middleware(LifetimeMiddleware)]
    )
    async with client_for(env_app) as client:
        response = await client.post("/api/echo", content=CHAT_BYTES)
    assert response.status_code == 200 and response.json()["text_comparable"] is True
    assert env_app.state.lifetime.settings.paths == ("/api/",)


@pytest.mark.anyio
async def test_bad_content_length_is_400() -> None:
    middleware = LifetimeMiddleware(body_app, settings=settings())
    out = Recorder()
    await middleware(http_scope(headers=[(b"content-length", b"-5")]), receiving([]), out)
    assert out.status == 400
    assert json.loads(out.messages[1]["body"])["error"]["code"] == "invalid_content_length"
    assert middleware.stats().idle


def _random_case(rng: random.Random) -> tuple[str, list[Message]]:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * rng.randint(0, 3000)}]}).encode()
    kind = rng.choice(["ok", "ok", "abort", "too_large", "idle", "app_error", "cancel"])
    if kind == "abort":
        return kind, [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
    if kind == "too_large":
        return kind, [{"type": "http.request", "body": b"x" * 5000, "more_body": False}]
    if kind == "idle":
        return kind, [{"type": "http.request", "body": body[:5], "more_body": True}]
    chunks = [body[i : i + 700] for i in range(0, len(body), 700)]
    messages: list[Message] = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages[-1]["more_body"] = False
    return kind, messages


@pytest.mark.anyio
async def test_two_hundred_requests_with_random_failures_leave_nothing_held() -> None:
    rng = random.Random(20261202)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["path"].rsplit("/", 1)[1]
        if kind == "ok":
            await body_app(scope, receive, send)
            return
        await receive()
        if kind == "app_error":
            raise ValueError("inner failure")
        await anyio.sleep_forever()  # "cancel": cancelled from outside below

    middleware = LifetimeMiddleware(
        app,
        settings=settings(max_inflight=8, max_body_bytes=4000, max_inflight_bytes=16_000, body_idle_timeout=0.05),
    )
    kinds: list[str] = []
    statuses: dict[str, list[int | None]] = {}

    async def one(kind: str, messages: list[Message]) -> None:
        out = Recorder()
        with anyio.move_on_after(0.2 if kind == "cancel" else 10):
            try:
                await middleware(http_scope(f"/v1/{kind}"), receiving(messages), out)
            except ValueError:
                assert kind == "app_error"
        statuses.setdefault(kind, []).append(out.status)

    async with anyio.create_task_group() as tg:
        for _ in range(200):
            kind, messages = _random_case(rng)
            kinds.append(kind)
            tg.start_soon(one, kind, messages)
    stats = middleware.stats()
    assert sum(len(v) for v in statuses.values()) == 200
    assert stats.inflight_requests == 0 and stats.inflight_bytes == 0
    assert stats.retained_input_bytes == 0 and stats.live_resources == 0
    assert stats.aborted == kinds.count("abort") > 0
    assert stats.too_large == kinds.count("too_large") > 0
    assert stats.timed_out == kinds.count("idle") > 0
    assert stats.completed == kinds.count("ok") > 0
    assert set(statuses["ok"]) == {200} and set(statuses["too_large"]) == {413} and set(statuses["idle"]) == {408}
    assert set(statuses["abort"]) == {None}


# --- state shared with outer middleware, settlement before the final message ---------------------


async def remember(request: Request) -> Response:
    request.state.handled_by = "handler"
    return JSONResponse({"size": request.state.lifetime.size})


class ReadsHandlerState(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        response.headers["x-handled-by"] = getattr(request.state, "handled_by", "unseen")
        return response


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("lifespan_state", [False, True])
def test_outer_base_http_middleware_sees_request_state_set_by_the_handler(
    backend: Literal["asyncio", "trio"], lifespan_state: bool
) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        yield {"db": "from lifespan"}

    app = Starlette(
        routes=[Route("/v1/x", remember, methods=["POST"])],
        middleware=[Middleware(ReadsHandlerState), Middleware(LifetimeMiddleware, settings=settings())],
        lifespan=lifespan if lifespan_state else None,
    )
    with TestClient(app, backend=backend) as client:  # runs the lifespan: Starlette puts its state in the scope
        response = client.post("/v1/x", content=CHAT_BYTES, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json() == {"size": len(CHAT_BYTES)}
    assert response.headers["x-handled-by"] == "handler"


@pytest.mark.anyio
@pytest.mark.parametrize("outer_state", [None, {"set": "outside"}])
async def test_inner_scope_state_is_the_outer_scopes_dict(outer_state: dict[str, str] | None) -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["state"])
        scope["state"]["x"] = 1
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = json_scope(CHAT_BYTES)
    if outer_state is not None:
        scope["state"] = outer_state
    await LifetimeMiddleware(app, settings=settings())(scope, body_receive(CHAT_BYTES), discard)
    assert seen[0] is scope["state"]
    assert scope["state"]["x"] == 1 and isinstance(scope["state"]["lifetime"], RequestLifetime)
    if outer_state is not None:
        assert scope["state"]["set"] == "outside"


async def discard(message: Message) -> None:
    return None


def final_body_variants() -> list[list[Message]]:
    return [
        [{"type": "http.response.body", "body": b"done"}],  # more_body absent
        [{"type": "http.response.body", "body": b"done", "more_body": False}],
        [
            {"type": "http.response.body", "body": b"a", "more_body": True},
            {"type": "http.response.body", "body": b"", "more_body": True},
            {"type": "http.response.body", "body": b"", "more_body": False},
        ],
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("bodies", final_body_variants(), ids=["absent", "false", "streamed"])
async def test_request_settles_before_the_final_body_message_reaches_the_server(bodies: list[Message]) -> None:
    middleware = LifetimeMiddleware(lambda s, r, d: None, settings=settings())  # type: ignore[arg-type,return-value]
    released: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["state"]["lifetime"].resources.add(lambda: released.append("resource"))
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for message in bodies:
            await send(message)

    middleware.app = app
    at_final: list[dict[str, int]] = []
    during: list[dict[str, int]] = []

    async def server_send(message: Message) -> None:
        stats = middleware.stats().as_dict()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            at_final.append(stats)
            assert released == ["resource"]
        else:
            during.append(stats)

    await middleware(json_scope(CHAT_BYTES), body_receive(CHAT_BYTES), server_send)
    assert all(s["inflight_requests"] == 1 for s in during)
    assert len(at_final) == 1
    final = at_final[0]
    assert final["completed"] == 1
    assert {g: final[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0)
    assert middleware.stats().completed == 1 and middleware.stats().idle


@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["raises", "returns_without_final", "no_response", "cancelled"])
async def test_paths_without_a_final_body_message_still_release_everything(ending: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["state"]["lifetime"].resources.add(lambda: None)
        await receive()
        if ending != "no_response":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
        if ending == "raises":
            raise RuntimeError("boom")
        if ending == "cancelled":
            await anyio.sleep_forever()

    middleware = LifetimeMiddleware(app, settings=settings())
    call = middleware(json_scope(CHAT_BYTES), body_receive(CHAT_BYTES), discard)
    if ending == "raises":
        with pytest.raises(RuntimeError, match="boom"):
            await call
    elif ending == "cancelled":
        with anyio.move_on_after(0.2):
            await call
    else:
        await call
    stats = middleware.stats()
    assert stats.idle, stats
    assert stats.completed == (1 if ending in ("returns_without_final", "no_response") else 0)  # returned normally


# A large conversation (the lazy walk answers bodies above 64 KiB), and hostile variants of it.
LARGE_MESSAGES = [{"role": "user", "content": "some words " * 1000}, {"role": "assistant", "content": "ok é"}] * 20
LARGE = json.dumps({"model": "m", "messages": LARGE_MESSAGES}, separators=(",", ":"), ensure_ascii=False).encode()
_AT = LARGE.index(b"some words")
LARGE_VARIANTS = {
    "plain": LARGE,
    "image part": LARGE.replace(b'"ok \xc3\xa9"', b'[{"type":"image_url","image_url":{"url":"x"}}]', 1),
    "invalid utf-8": LARGE[:_AT] + b"\xff" + LARGE[_AT:],
    "encoded surrogate": LARGE[:_AT] + b"\xed\xa0\x80" + LARGE[_AT:],
    "lone surrogate escape": LARGE[:_AT] + b"\\ud800" + LARGE[_AT:],
    "duplicate messages key": LARGE[:-1] + b',"messages":[{"type":"image"}]}',
    "duplicate, first invalid": b'{"messages":"\xff",' + LARGE[1:],
    "NaN": LARGE[:-1] + b',"t":NaN}',
    "huge int": LARGE[:-1] + b',"t":1' + b"0" * 5000 + b"}",
    "spaced": json.dumps({"model": "m", "messages": LARGE_MESSAGES}).encode(),
    "array at the top": b"[" + LARGE + b"]",
    "truncated": LARGE[:-1],
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(LARGE_VARIANTS))
@pytest.mark.parametrize("handoff", [False, "on_demand"])
async def test_a_large_body_gets_the_full_parse_verdict_without_the_parse(
    monkeypatch: pytest.MonkeyPatch, name: str, handoff: Literal[False, "on_demand"]
) -> None:
    """The verdict is the full parse's on every variant; a body the lazy walk can vouch for is not
    parsed at all (the others are, as before, and the gateway is handed what it was before)."""
    from asgi_lifetime import _json, _middleware
    from asgi_lifetime._fingerprint import fingerprint

    raw = LARGE_VARIANTS[name]
    parses = spy_parse(monkeypatch, _middleware)
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        lifetime: RequestLifetime = scope["state"]["lifetime"]
        try:
            seen.append(lifetime.take_parsed())
        except LookupError:
            seen.append(None)
        seen.append(lifetime.fingerprint)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(app, settings=settings(), handoff_parsed=handoff)
    out = Recorder()
    await middleware(http_scope(), receiving([{"type": "http.request", "body": raw}]), out)
    lazy = name in ("plain", "image part", "duplicate messages key", "spaced")
    assert parses == ([] if lazy else [raw])
    taken, fp = seen
    if name == "lone surrogate escape":
        # Over the full parse's bound (4 bytes per character): served unparsed, and since only the
        # parse could tell, not comparable (as a body that is not JSON).
        assert out.messages[0]["status"] == 204 and not fp.text_comparable
        assert fp.wire_hash == fingerprint(raw).wire_hash
        if handoff == "on_demand":
            from asgi_lifetime._lazy import DeferredParse

            assert isinstance(taken, DeferredParse) and not taken.shaped and taken.conversation is None
        return
    assert fp == fingerprint(raw)  # the full parse's verdict (fingerprint parses raw itself)
    if handoff == "on_demand":
        from asgi_lifetime._lazy import DeferredParse

        if lazy:
            assert isinstance(taken, DeferredParse) and taken.conversation == "messages"
        else:
            try:
                assert _json.dumps(taken) == _json.dumps(_json.loads(raw))  # NaN != NaN
            except _json.JSONDecodeFailure:
                assert taken is None
    else:
        assert taken is None
    assert middleware.stats().idle


MILLION_EMPTY = b'{"model":"m","messages":[' + b",".join([b"{}"] * 1_000_000) + b"]}"  # a 70 MiB parse


@pytest.mark.anyio
@pytest.mark.parametrize("handoff", [False, "on_demand", True])
async def test_a_body_too_costly_to_parse_is_refused_only_when_the_app_wants_the_parse(
    handoff: bool | Literal["on_demand"],
) -> None:
    """Nobody asked for the parse: the app gets the body, not comparable (only the parse could
    tell). ``handoff_parsed=True``: the app would get the parse, which the bound refuses: 413."""
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        lifetime: RequestLifetime = scope["state"]["lifetime"]
        seen.append((await receive())["body"])
        seen.append(lifetime.fingerprint.text_comparable)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    lifetime = Lifetime(settings())
    middleware = LifetimeMiddleware(app, lifetime=lifetime, handoff_parsed=handoff)
    out = Recorder()
    await middleware(http_scope(), receiving([{"type": "http.request", "body": MILLION_EMPTY}]), out)
    if handoff is True:
        assert out.messages[0]["status"] == 413 and b"body_too_complex" in out.messages[1]["body"]
        assert seen == []
    else:
        assert out.messages[0]["status"] == 204 and seen == [MILLION_EMPTY, False]
    assert lifetime.stats().idle


LARGE_CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": f"turn {i} " + "x" * 4000} for i in range(100)]}
).encode()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "content_type", "raw", "encoding"),
    [
        ("lazy look", b"application/json", LARGE_CHAT, None),
        ("lazy look, gzip", b"application/json", LARGE_CHAT, "gzip"),
        ("full parse", b"application/json", LARGE_CHAT.replace(b'"m"', b"NaN", 1), None),
        ("not JSON", b"application/octet-stream", bytes(range(256)) * 2048, None),
        ("not JSON, gzip", b"application/octet-stream", bytes(range(256)) * 2048, "gzip"),
    ],
)
@pytest.mark.parametrize("handoff", [False, "on_demand", True])
async def test_a_large_body_is_hashed_beside_the_look_as_received(
    kind: str, content_type: bytes, raw: bytes, encoding: str | None, handoff: bool | Literal["on_demand"]
) -> None:
    """From ``THREAD_THRESHOLD`` on, the hash runs in a worker thread beside the look: it is still
    the digest of the body as decoded, whatever path the look takes."""
    from asgi_lifetime._parse import THREAD_THRESHOLD

    assert len(raw) >= THREAD_THRESHOLD
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["state"]["lifetime"].fingerprint)
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    wire = gzip.compress(raw) if encoding else raw
    headers = [(b"content-type", content_type), (b"content-length", str(len(wire)).encode())]
    if encoding:
        headers.append((b"content-encoding", encoding.encode()))
    middleware = LifetimeMiddleware(app, settings=settings(), handoff_parsed=handoff)
    out = Recorder()
    chunks = [wire[i : i + 65536] for i in range(0, len(wire), 65536)]
    messages: list[Message] = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages[-1]["more_body"] = False
    with anyio.fail_after(30):
        await middleware(http_scope(headers=headers), receiving(messages), out)
    assert out.messages[0]["status"] == 204
    fp, body = seen
    assert body == raw
    assert fp == fingerprint(raw)  # its wire hash: blake3 of the decoded body; its verdict the full parse's
    assert fp.wire_hash == blake3(raw).hexdigest()
    assert middleware.stats().idle


@pytest.mark.anyio
async def test_the_replayed_message_keeps_its_body_after_the_next_receive() -> None:
    # An app may keep the message across its response start (an echo) and past its next receive():
    # the message is its own, never changed (tests/reliability/test_attack_replay.py).
    kept: list[Message] = []

    async def echo_then_listen(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message["body"], "more_body": True})
        kept.append(message)
        assert (await receive())["type"] == "http.disconnect"
        await send({"type": "http.response.body", "body": b""})

    out = Recorder()
    middleware = LifetimeMiddleware(echo_then_listen, settings=settings())
    await middleware(http_scope(), receiving([{"type": "http.request", "body": CHAT_BYTES}], then_block=False), out)
    assert out.body == CHAT_BYTES
    assert kept[0]["body"] == CHAT_BYTES


@pytest.mark.anyio
async def test_an_app_that_answers_before_it_reads_still_gets_the_body() -> None:
    # Releasing an untaken body at the response start would hand such an app an empty body, silently.
    received: list[Message] = []

    async def answers_first(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        received.append(await receive())
        await send({"type": "http.response.body", "body": received[0]["body"]})

    out = Recorder()
    middleware = LifetimeMiddleware(answers_first, settings=settings())
    messages: list[Message] = [{"type": "http.request", "body": CHAT_BYTES}]
    await middleware(http_scope(), receiving(messages, then_block=False), out)
    assert out.body == CHAT_BYTES and received[0]["more_body"] is False
    assert middleware.stats().idle
