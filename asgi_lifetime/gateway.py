"""The standalone gateway: ``create_app()`` returns a Starlette app running the whole flow.

Run it configured only by the environment::

    ASGI_LIFETIME_UPSTREAM_URL=http://127.0.0.1:8000 uvicorn --factory asgi_lifetime.gateway:create_app

or mount it in an existing app::

    app.mount("/llm", create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:8000",))))

Every path under ``PATHS`` (default ``/v1/``) is forwarded with the path appended as-is to
the upstream base URL. ``GET /healthz`` and ``GET /lifetime/stats`` are served here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ._bookkeeping import Bookkeeper, SessionBook
from ._gateway import Forwarder
from ._middleware import Lifetime, LifetimeMiddleware
from ._prepare import Preparer
from ._settings import LifetimeSettings
from ._upstream import AttemptEvent, UpstreamClient

__all__ = ["create_app"]

_FORWARDED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def create_app(
    settings: LifetimeSettings | None = None,
    *,
    preparers: Sequence[Preparer] = (),
    bookkeeper: Bookkeeper | None = None,
    client: httpx.AsyncClient | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    listener: Callable[[AttemptEvent], None] | None = None,
) -> Starlette:
    """Build the gateway app.

    ``settings``: defaults to ``LifetimeSettings.from_environ()``. ``preparers`` may rewrite
    each parsed body (after it was fingerprinted). ``bookkeeper`` gets scalar outcomes (default:
    the in-memory ``SessionBook``). ``client`` / ``transport``: your own httpx client or
    transport for the upstream. ``listener`` sees every retry, refold and settle event.
    """
    if settings is None:
        settings = LifetimeSettings.from_environ()
    lifetime = Lifetime(settings)
    book = SessionBook(max_sessions=settings.bookkeeping_sessions, counters=lifetime.counters)
    upstream = UpstreamClient(
        settings=settings,
        client=client,
        transport=transport,
        counters=lifetime.counters,
        listener=listener,
    )
    forwarder = Forwarder(
        lifetime=lifetime,
        upstream=upstream,
        preparers=preparers,
        bookkeeper=bookkeeper if bookkeeper is not None else book,
        book=book,
    )

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        return JSONResponse({**lifetime.stats().as_dict(), "upstreams": upstream.describe()})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = exc.detail if isinstance(exc, HTTPException) else "internal error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        error = {"type": "invalid_request_error", "code": code, "message": f"{message}: {request.url.path}"}
        return JSONResponse({"error": error}, status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:
            await upstream.aclose()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/lifetime/stats", stats, methods=["GET"]),
            *(Route(prefix.rstrip("/") + "/{path:path}", forwarder, methods=_FORWARDED_METHODS)
              for prefix in settings.paths),
        ],
        middleware=[Middleware(LifetimeMiddleware, lifetime=lifetime, handoff_parsed=True)],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
    )
    app.state.lifetime = lifetime
    app.state.book = book
    app.state.upstream = upstream
    return app
