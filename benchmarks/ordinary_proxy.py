"""The baseline: the gateway as one would ordinarily write it with Starlette and httpx.

Idiomatic and honest: read the body, parse it, inject a system message, serialize, forward
with httpx streaming, relay the bytes with ``StreamingResponse``, and do the bookkeeping
(hash the body as received, decide whether it is plain text) in a background task after
the stream, with the raw body, like the gateways ``asgi_lifetime`` replaces.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

__all__ = ["SYSTEM", "create_app"]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


def create_app(upstream_url: str) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream_url, timeout=httpx.Timeout(120.0, read=None))
    sessions: dict[str, tuple[str, bool, int]] = {}

    def bookkeep(body: bytes, session_id: str) -> None:
        digest = hashlib.sha256(body).hexdigest()
        data = json.loads(body)
        text_only = all(isinstance(m.get("content"), str | None) for m in data.get("messages", []))
        sessions[session_id] = (digest, text_only, len(body))

    async def relay(response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    async def chat(request: Request) -> Response:
        body = await request.body()
        data: Any = json.loads(body)
        data["messages"].insert(0, SYSTEM)
        out = json.dumps(data).encode()
        upstream = client.build_request(
            "POST", "/v1/chat/completions", content=out, headers={"content-type": "application/json"}
        )
        response = await client.send(upstream, stream=True)
        return StreamingResponse(
            relay(response),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            background=BackgroundTask(bookkeep, body, request.headers.get("x-session-id", "")),
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan)
