"""The standalone gateway and its extension points.

``create_app()`` returns a Starlette app running the whole flow: read, fingerprint, prepare,
forward with retries, relay, bookkeep. It is configured by ``asgi_lifetime.LifetimeSettings``
(the middleware's settings plus the upstream's) and extended by preparers, a refold factory,
a bookkeeper and an attempt listener.

Run it configured only by the environment:

    ASGI_LIFETIME_UPSTREAM_URL=http://127.0.0.1:8000 uvicorn --factory asgi_lifetime.gateway:create_app

Needs the ``gateway`` extra: ``pip install 'asgi-lifetime[gateway]'`` (and for a session store in
Redis, ``SESSION_STORE=redis://...``, the ``redis`` extra).
"""

from .._extras import missing_extra as _missing_extra
from .._publish import publish as _publish

try:
    from ._access_log import AccessLog
    from ._app import create_app
    from ._auth import GatewayAuth
    from ._bookkeeping import Bookkeeper, Outcome, SessionBook, SessionEntry
    from ._metrics import GatewayMetrics
    from ._prepare import ConversationView, Draft, Prepared, Preparer, Spliced, without_parse
    from ._refold import Conversation, Refold, RemapRole, default_refold, default_remap_role
    from ._session_store import RedisSessionBook
    from ._upstream import AttemptEvent, UpstreamClient
except ModuleNotFoundError as _exc:
    # A core-only install: name the extra rather than the module deep in the import chain that missed it.
    _error = _missing_extra(_exc, "gateway", __name__)
    if _error is None:
        raise
    raise _error from None

__all__ = [
    "AccessLog",
    "AttemptEvent",
    "Bookkeeper",
    "Conversation",
    "ConversationView",
    "Draft",
    "GatewayAuth",
    "GatewayMetrics",
    "Outcome",
    "Prepared",
    "Preparer",
    "RedisSessionBook",
    "Refold",
    "RemapRole",
    "SessionBook",
    "SessionEntry",
    "Spliced",
    "UpstreamClient",
    "create_app",
    "default_refold",
    "default_remap_role",
    "without_parse",
]

# Reprs, tracebacks, pickles and the API reference show the public path, not the private module.
_publish(globals())
