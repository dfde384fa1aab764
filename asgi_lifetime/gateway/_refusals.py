"""Refused requests, seen: one access-log line and one ``refused_total`` count each.

A request refused before it reaches the forwarder (a wrong or missing gateway key, a head that cannot
be forwarded, a body refused as too large, badly framed or encoded, too slow, admission shedding) is
answered by ``send_error`` in ``GatewayAuth``, ``RequestHead`` or ``LifetimeMiddleware``, and never
becomes an ``Outcome``.
``Refusals``, outermost, puts an observer in the scope (``_asgi.REFUSED``) that ``send_error``
calls after answering: one hook for every refusal, whoever refuses. A request that reaches the
forwarder is recorded by its ``Outcome`` instead (``LifetimeMiddleware`` takes the observer out
of the scope it hands on), so no request is logged twice.

What is recorded: the path (without query string), status, the error's code and the time since
the request arrived. Never a header: the key a client presented is not in the line or a label.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from .._asgi import REFUSED
from .._exceptions import LifetimeError
from ._access_log import AccessLog
from ._metrics import GatewayMetrics

__all__ = ["Refusals"]

logger = logging.getLogger(__name__)

_ARRIVED: Final = "asgi_lifetime.arrived"
"""Scope key: ``time.monotonic()`` when the request reached ``Refusals``."""


class Refusals:
    """Pure ASGI, outermost: every request refused inside it is logged and counted once.

    ```python
    app = Refusals(GatewayAuth(RequestHead(LifetimeMiddleware(app, ...), ...), ...), access_log=..., metrics=...)
    ```
    """

    def __init__(self, app: ASGIApp, *, access_log: AccessLog, metrics: GatewayMetrics) -> None:
        self.app = app
        self._access_log = access_log
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Two keys on the server's scope, no object per request: the benchmarks count CPU per request.
            scope[REFUSED] = self._refused
            scope[_ARRIVED] = time.monotonic()
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope, exc: LifetimeError) -> None:
        try:
            duration = time.monotonic() - scope.get(_ARRIVED, time.monotonic())
            self._metrics.refused(exc.status_code, exc.code)
            self._access_log.refused(scope["path"], exc.status_code, exc.code, duration)
        except Exception:  # recording must never turn a refusal into a 500
            logger.exception("recording a refused request failed")
