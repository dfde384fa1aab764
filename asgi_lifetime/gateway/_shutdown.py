"""Process-wide shutdown signal, from the server's signal handler to the gateway apps.

uvicorn only tells an app about shutdown through lifespan, and that comes *after* open
connections have finished or been cut. To drain gracefully (stop admitting, let streams
finish up to ``SHUTDOWN_GRACE``, then end them with an in-band error) the gateway must
know the moment the signal arrives. The CLI's server calls ``request_shutdown()`` from
its signal handling; every gateway app in the process watches ``shutdown_requested()``.
Signals are process-wide, so this flag is too (and a ``threading.Event`` because signal
handlers and event loops may run in different threads).

The server may keep listening for a while after the signal (``DRAIN_DELAY``: load balancers
see ``/healthz`` answer 503 and move traffic away); it says when it will stop, and the
streams' grace is counted from that moment (``grace_starts_at()``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._exceptions import AdmissionRejected

__all__ = [
    "StopSignal",
    "StopUploads",
    "grace_starts_at",
    "request_shutdown",
    "reset_shutdown",
    "shutdown_requested",
    "shutting_down",
]

_requested = threading.Event()
_grace_starts = 0.0


def request_shutdown(*, stop_listening_in: float = 0.0) -> None:
    """Ask every gateway in this process to start draining. Safe from signal handlers.

    ``stop_listening_in``: seconds until the server stops accepting connections; in-flight
    streams get their ``SHUTDOWN_GRACE`` from then. A later call can only bring that moment closer.
    """
    global _grace_starts
    starts = time.monotonic() + max(0.0, stop_listening_in)
    if not _requested.is_set() or starts < _grace_starts:
        _grace_starts = starts
    _requested.set()


def shutdown_requested() -> bool:
    return _requested.is_set()


def grace_starts_at() -> float:
    """``time.monotonic()`` at which the server stops (or stopped) listening; meaningful once requested."""
    return _grace_starts


def reset_shutdown() -> None:
    """Clear the flag (tests, or an embedding that restarts a server in-process)."""
    _requested.clear()


def shutting_down() -> AdmissionRejected:
    """What a request still open when the drain's grace ends gets (503 ``shutting_down``, ``Retry-After``):
    its upload, its wait for the answer and its relay are ended with this one error."""
    return AdmissionRejected("the gateway is shutting down; retry the request", code="shutting_down")


class StopSignal:
    """An app's "end the streams now" (graceful shutdown out of grace), set once, in its event loop.

    A relay registers the scope to cancel while it runs (``cancels``) instead of keeping a task
    waiting on an event: one helper task per request fewer. ``set()`` cancels every registered scope.
    """

    __slots__ = ("_set", "_scopes")

    def __init__(self) -> None:
        self._set = False
        self._scopes: set[anyio.CancelScope] = set()

    def set(self) -> None:
        self._set = True
        for scope in list(self._scopes):
            scope.cancel()

    def is_set(self) -> bool:
        return self._set

    @contextmanager
    def cancels(self, scope: anyio.CancelScope) -> Iterator[None]:
        """While inside, ``set()`` cancels ``scope`` (at once if it is already set)."""
        if self._set:
            scope.cancel()
        self._scopes.add(scope)
        try:
            yield
        finally:
            self._scopes.discard(scope)


class StopUploads:
    """Pure ASGI, outside ``LifetimeMiddleware``: a request body still arriving when ``stop`` is set
    (graceful shutdown out of grace) is refused like one arriving at a draining gateway, a 503
    ``shutting_down`` (``connection: close``: its rest is never read), as ``stop`` ends the wait for
    an answer and the relays. Left to the server's backstop, the upload got its plain-text 500. Once a
    response has started (a refusal reading the rest of the body, as HTTP/2 needs) nothing is refused.

    ```python
    app = StopUploads(LifetimeMiddleware(forwarder, lifetime=lifetime), stop=lambda: drain.stop)
    ```
    """

    def __init__(self, app: ASGIApp, *, stop: Callable[[], StopSignal | None]) -> None:
        self.app = app
        self._stop = stop  # a getter: the signal is made by the lifespan, after the middleware

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stop = self._stop()
        if scope["type"] != "http" or stop is None:
            await self.app(scope, receive, send)
            return
        arrived = False  # the body's last message (or the client's leaving) went by: nothing more to end
        answered = False  # a response started (a refusal reading the rest, HTTP/2): a 503 now would be a second

        async def sending(message: Message) -> None:
            nonlocal answered
            answered = True
            await send(message)

        async def receiving() -> Message:
            nonlocal arrived
            if arrived or answered:
                return await receive()
            with anyio.CancelScope() as cut, stop.cancels(cut):
                message = await receive()  # a server's receive() loses nothing by being cancelled
                arrived = message["type"] != "http.request" or not message.get("more_body", False)
                return message
            raise shutting_down()

        await self.app(scope, receiving, sending)
