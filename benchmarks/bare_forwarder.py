"""The lower bound for one extra loopback hop in Python: read the body, forward it, relay bytes.

No parsing, no checks, no bookkeeping: what any Python proxy must at least spend. It sends over
the gateway's own upstream transport (``UpstreamTransport``, ``UPSTREAM_TRANSPORT=auto``: aiohttp
on asyncio, httpcore on trio) unless told ``transport="httpx"`` (httpx's default transport), so
that comparing the gateway with it measures the gateway's own work, not a transport's.
"""

from __future__ import annotations

from typing import Literal

import httpx
from starlette.types import Receive, Scope, Send

__all__ = ["BareForwarder", "TRANSPORTS"]

TRANSPORTS = ("same", "httpx")


def _transport(kind: Literal["same", "httpx"]) -> httpx.AsyncBaseTransport | None:
    if kind == "httpx":
        return None
    try:
        from asgi_lifetime.gateway._transport import UpstreamTransport
    except ImportError:  # an older checkout (benchmarks.before_after): httpx's own
        return None
    return UpstreamTransport(choice="auto", limits=httpx.Limits(max_connections=100, max_keepalive_connections=100))


def transport_name(kind: Literal["same", "httpx"]) -> str:
    """How the page names the bare forwarder's transport."""
    return "httpx's default transport" if kind == "httpx" else "the gateway's upstream transport (aiohttp on asyncio)"


class BareForwarder:
    """A raw ASGI app forwarding every HTTP request to ``upstream_url`` with httpx streaming."""

    def __init__(self, upstream_url: str, *, transport: Literal["same", "httpx"] = "same") -> None:
        self.client = httpx.AsyncClient(
            base_url=upstream_url, timeout=httpx.Timeout(120.0, read=None), transport=_transport(transport)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks: list[bytes] = []
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more_body = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        request = self.client.build_request(
            scope["method"], scope["path"], content=body, headers={"content-type": "application/json"}
        )
        del body
        response = await self.client.send(request, stream=True)
        try:
            headers = [(b"content-type", response.headers.get("content-type", "").encode())]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
