"""Apps for the retention probe's tests: each streams its answer, and keeps (or not) its request.

Shared by test_probe.py (``probe_retention`` in-process) and test_plugin.py (the pytest plugin,
in a pytester run that imports this module).
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings, MiB

PATH = "/v1/chat/completions"
CACHE: dict[str, Any] = {}  # a module-level cache (cleared by the tests that fill it)


class Remembered:
    last: Any = None  # a class attribute (cleared by the tests that set it)


async def read(request: Request) -> bytes:
    """The body, without Starlette's ``request.body()`` cache (``Request._body``)."""
    chunks = [chunk async for chunk in request.stream()]
    return b"".join(chunks)


def answer(*words: str) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        for word in words:
            yield f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return events()


def starlette_app(endpoint: Any, *, middleware: list[Middleware] | None = None) -> Starlette:
    return Starlette(routes=[Route(PATH, endpoint, methods=["POST"])], middleware=middleware)


def keeps_body() -> Starlette:
    """(a) ``body = await request.body()``, and the stream closes over ``body``."""

    async def chat(request: Request) -> Response:
        body = await request.body()

        async def stream() -> AsyncIterator[bytes]:
            yield f"data: {len(body)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return starlette_app(chat)


def keeps_parsed() -> Starlette:
    """(b) the parse kept: ``data = await request.json()``, used by the stream."""

    async def chat(request: Request) -> Response:
        data = await request.json()

        async def stream() -> AsyncIterator[bytes]:
            for message in data["messages"][:2]:
                yield f"data: {message['role']}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return starlette_app(chat)


def keeps_in_state() -> Starlette:
    """(c) the body on ``request.state``."""

    async def chat(request: Request) -> Response:
        request.state.body = await read(request)
        return StreamingResponse(answer("hello", "there"), media_type="text/event-stream")

    return starlette_app(chat)


def keeps_in_cache() -> Starlette:
    """(c) the body in a module-level cache."""

    async def chat(request: Request) -> Response:
        CACHE["last"] = await read(request)
        return StreamingResponse(answer("hello"), media_type="text/event-stream")

    return starlette_app(chat)


def well_behaved() -> Starlette:
    """(d) reads the body (without Starlette's cache), takes what it needs, lets go, streams."""

    async def chat(request: Request) -> Response:
        body = await read(request)
        request_json = json.loads(body)
        model, turns = str(request_json["model"]), len(request_json["messages"])
        del body, request_json
        return StreamingResponse(answer(model, str(turns)), media_type="text/event-stream")

    return starlette_app(chat)


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str
    messages: list[Message]
    stream: bool = False


def fastapi_app() -> FastAPI:
    """(e) a FastAPI endpoint with a pydantic body model that takes what it needs and streams."""
    app = FastAPI()

    @app.post(PATH)
    async def chat(chat: ChatRequest) -> StreamingResponse:
        model = chat.model
        return StreamingResponse(answer(model), media_type="text/event-stream")

    return app


def fastapi_keeps_the_model() -> FastAPI:
    """A FastAPI endpoint whose stream closes over the validated model."""
    app = FastAPI()

    @app.post(PATH)
    async def chat(chat: ChatRequest) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield f"data: {len(chat.messages)}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def lifetime_app() -> Starlette:
    """(f) ``LifetimeMiddleware`` in front of an endpoint that uses the request lifetime API."""

    async def chat(request: Request) -> Response:
        lifetime = request.state.lifetime
        body = await read(request)  # the middleware's replay: the whole body, once
        model = str(json.loads(body)["model"])
        del body
        words = (model, lifetime.fingerprint.wire_hash[:8], str(lifetime.size))
        return StreamingResponse(answer(*words), media_type="text/event-stream")

    settings = LifetimeSettings(paths=("/v1/",), max_body_bytes=64 * MiB)
    return starlette_app(chat, middleware=[Middleware(LifetimeMiddleware, settings=settings)])


def lifetime_take_parsed(*, drain: bool) -> Starlette:
    """``handoff_parsed=True``: the endpoint takes the middleware's parse; with ``drain`` it also
    takes (and drops) the replayed body, which otherwise waits for the next ``receive()``."""

    async def chat(request: Request) -> Response:
        model = str(request.state.lifetime.take_parsed()["model"])
        if drain:
            message = await request.receive()
            del message
        return StreamingResponse(answer(model), media_type="text/event-stream")

    settings = LifetimeSettings(paths=("/v1/",), max_body_bytes=64 * MiB)
    return starlette_app(chat, middleware=[Middleware(LifetimeMiddleware, settings=settings, handoff_parsed=True)])


def keeps_in_class() -> Starlette:
    async def chat(request: Request) -> Response:
        Remembered.last = io.BytesIO(await read(request))
        return StreamingResponse(answer("hello"), media_type="text/event-stream")

    return starlette_app(chat)


def keeps_a_view() -> Starlette:
    async def chat(request: Request) -> Response:
        view = memoryview(bytearray(await read(request)))[100:]

        async def stream() -> AsyncIterator[bytes]:
            yield f"data: {view.nbytes}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return starlette_app(chat)


def keeps_a_traceback() -> Starlette:
    """The body in a local of a frame that a kept exception's traceback holds."""

    async def chat(request: Request) -> Response:
        body = await read(request)
        try:
            json.loads(body[:10])
        except ValueError as exc:
            request.app.state.last_error = exc  # the traceback keeps this frame, and ``body``
        return StreamingResponse(answer(str(len(body) > 0)), media_type="text/event-stream")

    return starlette_app(chat)


class ThreadHolding:
    """An app whose endpoint hands the body to a thread that keeps it in a local until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[threading.Thread] = []
        self.app = starlette_app(self.chat)

    async def chat(self, request: Request) -> Response:
        def hold(body: bytearray) -> None:
            self.started.set()
            self.release.wait(30)
            del body

        thread = threading.Thread(target=hold, args=(bytearray(await read(request)),), name="holder", daemon=True)
        thread.start()
        self.threads.append(thread)
        self.started.wait(30)
        return StreamingResponse(answer("hello"), media_type="text/event-stream")

    def stop(self) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join(30)
