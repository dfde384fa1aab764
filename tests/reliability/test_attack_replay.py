"""The middleware's replay attacked through the receivers real apps put between it and the body:
middlewares that take messages ahead of the app, record them, or hand them to another task.

Found here:

- the replayed ``http.request`` message was emptied (``body`` set to ``b""``) when anyone asked
  for the next message while something still held it. A disconnect poller that queues messages for
  the app (FastAPI discussion 11360's ``RequestCancelledMiddleware``, copied into many services, and
  its anyio form) asks for the next message before the app has read the one it queued: the app got
  an empty body (``{"len": 0}`` for 1061 bytes, under uvicorn and hypercorn). A middleware that
  records the messages and logs the body after the response, and an app that hands the message to
  a task and then listens for the disconnect, read ``b""`` too. The replay no longer changes a
  message once it is handed out.

- an invalid setting (``app.state.lifetime_settings`` or ``ASGI_LIFETIME_*``) failed the startup only
  when the app reported the error it got at ``lifespan.startup.complete``: a raw ASGI app that lets
  it out of its lifespan reads to uvicorn and hypercorn as "lifespan unsupported", and they served,
  a 500 for every request. The middleware reports the failure to the server itself; a mapping's
  error names ``app.state.lifetime_settings`` (it named the environment variable only).

Held up: Starlette's own receivers (``Request.stream``/``body``/``form``/``json``,
``BaseHTTPMiddleware``'s ``wrapped_receive``, ``RequestBodyLimitMiddleware``, the WSGI adapter,
``StreamingResponse``/``FileResponse`` listeners) and FastAPI's telemetry wrapper read ``body`` before
they ask again; none keeps a message across a ``receive()``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings
from asgi_lifetime.testing import serve_in_thread
from tests._servers import served

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 1000 + b'"}]}'


class RequestCancelledMiddleware:
    """FastAPI discussion 11360's disconnect poller, as services copy it (asyncio only)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        queue: asyncio.Queue[Message] = asyncio.Queue()

        async def message_poller(handler_task: asyncio.Task[None]) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    handler_task.cancel()
                    return
                await queue.put(message)

        async def handle() -> None:
            await self.app(scope, queue.get, send)

        handler_task = asyncio.create_task(handle())
        poller = asyncio.create_task(message_poller(handler_task))
        try:
            await handler_task
        except asyncio.CancelledError:
            pass
        finally:
            poller.cancel()


class CancelOnDisconnect:
    """The same poller with anyio: messages go to the app through a memory stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sender, receiver = anyio.create_memory_object_stream[Message](math.inf)

        async def poll() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return
                await sender.send(message)

        async def handle() -> None:
            await self.app(scope, receiver.receive, send)
            tg.cancel_scope.cancel()

        async with sender, receiver, anyio.create_task_group() as tg:
            tg.start_soon(poll)
            tg.start_soon(handle)


class AuditLog:
    """Records the request's messages and logs the body once the response is sent."""

    def __init__(self, app: ASGIApp, *, logged: list[bytes]) -> None:
        self.app = app
        self.logged = logged

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received: list[Message] = []

        async def recording() -> Message:
            message = await receive()
            received.append(message)
            return message

        await self.app(scope, recording, send)
        self.logged.append(b"".join(m.get("body", b"") for m in received))


def fastapi_app(inside: Callable[..., ASGIApp] | None = None, **options: Any) -> FastAPI:
    """A FastAPI app behind ``LifetimeMiddleware``, with ``inside`` between the two."""
    app = FastAPI()
    if inside is not None:
        app.add_middleware(inside, **options)
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(paths=("/v1/",)))

    @app.post("/v1/len")
    async def length(request: Request) -> dict[str, int]:
        return {"len": len(await request.body())}

    @app.post("/v1/stream")
    async def stream(request: Request) -> StreamingResponse:
        size = len(await request.body())

        async def chunks() -> AsyncIterator[bytes]:
            yield str(size).encode()

        return StreamingResponse(chunks())

    return app


@pytest.mark.parametrize(
    ("poller", "server"),
    [(RequestCancelledMiddleware, s) for s in ("uvicorn-h11", "uvicorn-httptools", "hypercorn-asyncio")]
    + [(CancelOnDisconnect, s) for s in ("uvicorn-h11", "hypercorn-asyncio", "hypercorn-trio")],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
def test_a_disconnect_poller_that_queues_messages_hands_the_app_the_body(poller: type, server: str) -> None:
    # RequestCancelledMiddleware queues them on an asyncio.Queue, CancelOnDisconnect on an anyio stream.
    with served(fastapi_app(inside=poller), server) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            response = client.post("/v1/len", content=BODY, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json() == {"len": len(BODY)}


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn-asyncio", "hypercorn-trio"])
def test_a_recorded_message_still_has_its_body_after_the_response(server: str) -> None:
    # Under uvicorn (ASGI 2.3) StreamingResponse's disconnect listener asks for the next message
    # after the endpoint has read the body; the recorder still holds the replayed message.
    logged: list[bytes] = []
    with served(fastapi_app(inside=AuditLog, logged=logged), server) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            response = client.post("/v1/stream", content=BODY, headers={"content-type": "application/json"})
    assert response.text == str(len(BODY))
    assert logged == [BODY]


@pytest.mark.anyio
async def test_a_message_handed_to_a_task_keeps_its_body() -> None:
    # A raw app: the message goes to a worker task, the app itself listens for the disconnect.
    seen: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        parsed = anyio.Event()
        ask_again = anyio.Event()

        async def work(message: Message) -> None:
            await ask_again.wait()  # the body is read after the app asked for the next message
            seen.append(len(message["body"]))
            parsed.set()

        async def listen() -> None:
            ask_again.set()
            assert (await receive())["type"] == "http.disconnect"

        async with anyio.create_task_group() as tg:
            tg.start_soon(work, message)
            del message
            tg.start_soon(listen)
            await parsed.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    middleware = LifetimeMiddleware(app, settings=LifetimeSettings(paths=("/",)))
    messages: list[Message] = [{"type": "http.request", "body": BODY}, {"type": "http.disconnect"}]

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        pass

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "raw_path": b"/",
        "query_string": b"",
        "headers": [(b"content-length", str(len(BODY)).encode())],
    }
    await middleware(scope, receive, send)
    assert seen == [len(BODY)]


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A raw ASGI app with a lifespan and no framework: an error in it goes out as it is."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn-asyncio", "hypercorn-trio"])
def test_an_invalid_setting_fails_the_startup_of_an_app_that_does_not_report_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, server: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env
    monkeypatch.setenv("ASGI_LIFETIME_MAX_BODY_BYTES", "lots")
    app = LifetimeMiddleware(raw_app)
    if server.startswith("uvicorn-"):
        with pytest.raises(RuntimeError, match="failed to start"), serve_in_thread(app, startup_timeout=10):
            pass
    else:
        with pytest.raises(AssertionError, match="LifespanFailure"), served(app, server):
            pass


class Chat(BaseModel):
    model: str
    messages: list[dict[str, str]]


async def raw_length(request: Request) -> int:
    return len(await request.body())


async def reads_in_dispatch(request: Request, call_next: RequestResponseEndpoint) -> Response:
    assert len(await request.body()) == len(BODY)  # cached by _CachedRequest, replayed to the app
    return await call_next(request)


def stacked_app(stack: str) -> FastAPI:
    """Starlette's and FastAPI's receivers between the middleware and an endpoint that takes a body
    model and a dependency on the raw body, then streams (Starlette's disconnect listener under
    uvicorn, ASGI 2.3)."""
    app = FastAPI()
    if stack == "base-http-middleware":
        app.add_middleware(BaseHTTPMiddleware, dispatch=reads_in_dispatch)
    elif stack == "gzip":
        app.add_middleware(GZipMiddleware, minimum_size=1)
    elif stack == "body-limit":
        app.add_middleware(RequestBodyLimitMiddleware, max_body_size=len(BODY))
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(paths=("/v1/",)))

    @app.post("/v1/chat")
    async def chat(chat: Chat, size: int = Depends(raw_length)) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield f"{len(chat.messages[0]['content'])} {size}".encode()

        return StreamingResponse(chunks())

    return app


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn-trio"])
@pytest.mark.parametrize("stack", ["plain", "base-http-middleware", "gzip", "body-limit"])
def test_starlette_and_fastapi_receivers_get_the_body(stack: str, server: str) -> None:
    with served(stacked_app(stack), server) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            response = client.post("/v1/chat", content=BODY, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.text == f"1000 {len(BODY)}"
