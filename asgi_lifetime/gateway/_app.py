"""The standalone gateway: ``create_app()`` returns a Starlette app running the whole flow.

Run it configured only by the environment:

    ASGI_LIFETIME_UPSTREAM_URL=http://127.0.0.1:8000 uvicorn --factory asgi_lifetime.gateway:create_app

or mount it in an existing app:

    app.mount("/llm", create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:8000",))))

Every path under ``PATHS`` (default ``/v1/``) is forwarded with the path appended as-is to
the upstream base URL. ``GET /healthz``, ``GET /lifetime/stats`` and ``GET /metrics``
are served here. With several workers sharing ``PROMETHEUS_MULTIPROC_DIR``, ``/lifetime/stats``
reports every worker and the total, as ``/metrics`` does (``_workers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from .._asgi import route_path
from .._exceptions import LifetimeError, error_body, error_shape
from .._fingerprint import Fingerprint
from .._middleware import Lifetime, LifetimeMiddleware
from .._settings import LifetimeSettings
from ._access_log import AccessLog
from ._auth import GatewayAuth, holds_credential, open_beyond_loopback
from ._bookkeeping import Bookkeeper
from ._forward import Forwarder
from ._head import RequestHead
from ._metrics import MULTIPROC_DIR_ENV, GatewayMetrics, make_metrics_route
from ._prepare import Preparer, is_without_parse
from ._refold import Conversation, Refold, default_refold
from ._refusals import Refusals
from ._session_store import RedisSessionBook, make_session_book
from ._shutdown import StopSignal, StopUploads, grace_starts_at, shutdown_requested
from ._upstream import AttemptEvent, UpstreamClient
from ._workers import Report, WorkerStats

__all__ = ["create_app"]

logger = logging.getLogger("asgi_lifetime.gateway")  # the public module's name, as before the layout moved

_FORWARDED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
_ROUTED_METHODS = frozenset({*_FORWARDED_METHODS, "HEAD"})  # Starlette routes HEAD where it routes GET
_DRAIN_POLL = 0.05
# The gateway's own GET endpoints, routed before the forwarded prefixes.
_HEALTHZ, _STATS, _METRICS = "/healthz", "/lifetime/stats", "/metrics"
_OWN_PATHS = frozenset({_HEALTHZ, _STATS, _METRICS})


class _GatewayLifetime(Lifetime):
    """The gateway's ``Lifetime``: it handles what the router forwards, a forwarded method on a path PATHS
    covers, except the gateway's own GET endpoints (routed first). Otherwise an OPTIONS was admitted and its
    body read, then answered 405; under PATHS=/ a health check queued for admission, or got a 503, under load."""

    def handles(self, scope: Scope) -> bool:
        method = scope.get("method")
        if method not in _ROUTED_METHODS or (method in ("GET", "HEAD") and route_path(scope) in _OWN_PATHS):
            return False
        return super().handles(scope)


def _forwarded_routes(paths: Sequence[str], forwarder: Forwarder) -> list[Route]:
    """The routes of the forwarded prefixes: each prefix itself and every path below it, the paths
    ``LifetimeMiddleware.handles`` takes (a prefix alone is forwarded, not redirected to its slash)."""
    routes = []
    for prefix in paths:
        base = prefix.rstrip("/")
        if base:
            routes.append(Route(base, forwarder, methods=_FORWARDED_METHODS))
        routes.append(Route(base + "/{path:path}", forwarder, methods=_FORWARDED_METHODS))
    return routes


def create_app(
    settings: LifetimeSettings | None = None,
    *,
    preparers: Sequence[Preparer] = (),
    bookkeeper: Bookkeeper | None = None,
    client: httpx.AsyncClient | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    listener: Callable[[AttemptEvent], None] | None = None,
    refold_factory: Callable[[Conversation], Refold] = default_refold,
    on_change: Callable[[str, Fingerprint], None] | None = None,
) -> Starlette:
    """Build the gateway app.

    ``settings``: defaults to ``LifetimeSettings.from_environ()``. ``preparers`` may rewrite
    each parsed body (after it was fingerprinted). ``bookkeeper`` gets scalar outcomes (default:
    the in-memory ``SessionBook``; the access log and metrics get them too). ``client`` /
    ``transport``: your own httpx client or transport for the upstream. ``listener`` sees every
    retry, refold, role remap and settle event. ``refold_factory`` builds the context-overflow
    refold from a request's conversation (default: drop the oldest turns). ``on_change(session_id,
    fingerprint)`` runs when a session's wire hash changes (once in the fleet with
    ``SESSION_STORE=redis://...``; see docs/deploy.md).
    """
    if settings is None:
        settings = LifetimeSettings.from_environ()
    lifetime = _GatewayLifetime(settings)  # first: it checks that settings is a LifetimeSettings
    gap = open_beyond_loopback(settings)
    if gap is not None:
        # With a credential of its own and no gateway keys, GatewayAuth serves loopback clients only.
        logger.warning("%s%s", gap, " (only loopback clients will be served)" if holds_credential(settings) else "")
    book = make_session_book(settings, lifetime=lifetime, on_change=on_change)
    listeners: list[Callable[[AttemptEvent], None]] = [] if listener is None else [listener]
    upstream = UpstreamClient(
        settings=settings,
        client=client,
        transport=transport,
        lifetime=lifetime,
        listener=lambda event: _fan_out(listeners, event),
    )
    metrics = GatewayMetrics(stats=lifetime.stats, describe_upstreams=upstream.describe, session_store=book.store_state)
    listeners.append(metrics.on_attempt)
    lifetime.admission.on_admitted(metrics.on_admission_wait)

    def report() -> Report:
        # Read from the metrics sync thread too: plain values only.
        return {**lifetime.stats().as_dict(), "session_changes": book.recomputations, "upstreams": upstream.describe()}

    # The metrics validated the directory; without one the stats are this process's, and say so.
    workers = WorkerStats(report, directory=os.environ.get(MULTIPROC_DIR_ENV) if metrics.multiprocess else None)
    drain = _Drain(lifetime)
    access_log = AccessLog()
    forwarder = Forwarder(
        lifetime=lifetime,
        upstream=upstream,
        preparers=preparers,
        bookkeepers=(bookkeeper if bookkeeper is not None else book, metrics, access_log),
        book=book,
        refold_factory=refold_factory,
    )

    async def healthz(request: Request) -> Response:
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        if workers.directory is None:
            return JSONResponse(workers.payload())
        return JSONResponse(await anyio.to_thread.run_sync(workers.payload))  # reads every worker's file

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = exc.detail if isinstance(exc, HTTPException) else "internal error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        shape = error_shape(request.url.path, request.scope["headers"])
        body = error_body(shape, status, "invalid_request_error", code, f"{message}: {request.url.path}")
        return JSONResponse(body, status_code=status)

    async def internal_error(request: Request, exc: Exception) -> Response:
        # The last resort (Starlette's ServerErrorMiddleware calls it, then re-raises for the server
        # to log too): an OpenAI-style JSON 500 that says nothing of the exception, which is logged.
        logger.error("unexpected %s serving %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
        body = LifetimeError("internal error").json_body(error_shape(request.url.path, request.scope["headers"]))
        return Response(body, status_code=500, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        upstream.start()  # UPSTREAM_TRANSPORT is chosen in this loop: one it cannot run fails startup
        try:
            async with anyio.create_task_group() as tg:
                # Created here: it cancels scopes of the loop that serves requests, and is set in it.
                forwarder.stop = drain.stop = StopSignal()
                tg.start_soon(drain.watch)
                if isinstance(book, RedisSessionBook):
                    await tg.start(book.run)  # waits at most SESSION_STORE_TIMEOUT for Redis
                try:
                    yield {}
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            workers.close()
            metrics.close()

    app = Starlette(
        routes=[
            Route(_HEALTHZ, healthz, methods=["GET"]),
            Route(_STATS, stats, methods=["GET"]),
            make_metrics_route(metrics, path=_METRICS),
            *_forwarded_routes(settings.paths, forwarder),
        ],
        middleware=[
            # Around every refuser: a request refused before the forwarder is logged and counted here.
            Middleware(Refusals, access_log=access_log, metrics=metrics),
            # Then: a stranger is refused before admission or body reading.
            Middleware(
                GatewayAuth,
                gateway_keys=settings.gateway_keys,
                upstream_api_key=settings.upstream_api_key,
                upstream_auth=settings.upstream_auth,
                upstream_user_info=bool(settings.upstream_userinfo),
                open_paths=(_HEALTHZ, _METRICS),  # for a probe and a scraper without a key; the stats are not
                body_limits=settings,
            ),
            # Then: a head that cannot be forwarded is refused before admission or body reading.
            Middleware(RequestHead, lifetime=lifetime),
            # Then: a body still arriving when the drain's grace ends is refused.
            Middleware(StopUploads, stop=lambda: drain.stop),
            Middleware(LifetimeMiddleware, lifetime=lifetime, handoff_parsed=_handoff(preparers, refold_factory)),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.lifetime = lifetime
    app.state.book = book
    app.state.upstream = upstream
    app.state.metrics = metrics
    app.state.workers = workers
    app.state.drain = drain
    return app


def _handoff(
    preparers: Sequence[Preparer], refold_factory: Callable[[Conversation], Refold]
) -> Literal["on_demand", True]:
    """Parse every JSON body at once when a preparer reads ``draft.body`` or a custom refold factory
    gets the parse (the lazy walk would only come first); else only when the walk cannot tell."""
    if refold_factory is default_refold and all(is_without_parse(preparer) for preparer in preparers):
        return "on_demand"
    return True


def _fan_out(listeners: Sequence[Callable[[AttemptEvent], None]], event: AttemptEvent) -> None:
    for each in listeners:
        try:
            each(event)
        except Exception:  # one broken listener must not silence the others or the request
            logger.exception("an attempt listener failed")


class _Drain:
    """Graceful shutdown: once the server's signal handler asks for it, stop admitting (503 with
    ``Retry-After``), give in-flight streams ``SHUTDOWN_GRACE`` seconds, then end the rest
    with an in-band error (the relays watch ``stop``)."""

    def __init__(self, lifetime: Lifetime) -> None:
        self.lifetime = lifetime
        self.stop: StopSignal | None = None  # set up by the lifespan; no lifespan, no draining
        self.draining = False

    async def watch(self) -> None:
        # The signal arrives in a signal handler, outside the event loop (and for any number of
        # apps in the process): poll the process-wide flag rather than wire an Event to it.
        while not shutdown_requested():  # noqa: ASYNC110
            await anyio.sleep(_DRAIN_POLL)
        await self.drain()

    async def drain(self) -> None:
        """Stop admitting, wait for in-flight requests up to the grace period, then stop them."""
        self.draining = True
        self.lifetime.admission.close("the gateway is shutting down")
        counters = self.lifetime.counters
        logger.warning(
            "shutting down: %d request(s) in flight get up to %gs after the server stops listening",
            counters.inflight_requests,
            self.lifetime.settings.shutdown_grace,
        )
        # The server may keep accepting for DRAIN_DELAY (new requests get 503) before it stops
        # listening; in-flight streams get SHUTDOWN_GRACE from then.
        grace = self.lifetime.settings.shutdown_grace
        while counters.inflight_requests and time.monotonic() < grace_starts_at() + grace:  # noqa: ASYNC110
            await anyio.sleep(_DRAIN_POLL)  # a plain counter; polled only while draining
        if counters.inflight_requests:
            logger.warning("shutdown grace over: ending %d stream(s)", counters.inflight_requests)
        if self.stop is not None:
            self.stop.set()
