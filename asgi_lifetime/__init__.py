"""asgi_lifetime: the lifetime of a request's input as a designed, tested property.

A request's life, one module per stage: read (``_body``), fingerprint (``_fingerprint``),
prepare (``_prepare``), forward (``_upstream``), relay (``_relay``), bookkeep (``_bookkeeping``);
admission and per-request resources (``_admission``, ``_scope``) span them all.
See docs/design.md for where each piece of input is released.
"""

from ._access_log import AccessLog
from ._auth import GatewayAuth
from ._body import parse_content_length, read_body
from ._bookkeeping import Bookkeeper, Outcome, SessionBook, SessionEntry
from ._exceptions import (
    AdmissionRejected,
    AuthenticationError,
    BodyAborted,
    BodyIdleTimeout,
    BodyTimeout,
    BodyTooComplex,
    BodyTooLarge,
    LifetimeError,
    MalformedBody,
    RequestError,
    StarvationError,
    UnsupportedEncoding,
    UpstreamError,
    UpstreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from ._fingerprint import UNPARSED, Fingerprint, fingerprint, text_comparable, wire_hash
from ._metrics import GatewayMetrics
from ._middleware import Lifetime, LifetimeMiddleware, RequestLifetime
from ._pool import UpstreamPool
from ._prepare import Draft, Prepared, Preparer, prepare
from ._refold import Conversation, default_refold, default_remap_role, match_overflow, match_rejected_role
from ._relay import RelayResult, collect_text, relay
from ._scope import RequestScope, Resource
from ._settings import GiB, KiB, LifetimeSettings, MiB
from ._stats import LifetimeStats
from ._upstream import AttemptEvent, UpstreamClient

__version__ = "0.1.0.dev0"

__all__ = [
    "AccessLog",
    "AdmissionRejected",
    "AttemptEvent",
    "AuthenticationError",
    "BodyAborted",
    "BodyIdleTimeout",
    "BodyTimeout",
    "BodyTooComplex",
    "BodyTooLarge",
    "Bookkeeper",
    "Conversation",
    "Draft",
    "Fingerprint",
    "GatewayAuth",
    "GatewayMetrics",
    "GiB",
    "KiB",
    "Lifetime",
    "LifetimeError",
    "LifetimeMiddleware",
    "LifetimeSettings",
    "LifetimeStats",
    "MalformedBody",
    "MiB",
    "Outcome",
    "Prepared",
    "Preparer",
    "RelayResult",
    "RequestError",
    "RequestLifetime",
    "RequestScope",
    "Resource",
    "SessionBook",
    "SessionEntry",
    "StarvationError",
    "UNPARSED",
    "UnsupportedEncoding",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamStalled",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "__version__",
    "collect_text",
    "default_refold",
    "default_remap_role",
    "fingerprint",
    "match_overflow",
    "match_rejected_role",
    "parse_content_length",
    "prepare",
    "read_body",
    "relay",
    "text_comparable",
    "wire_hash",
]
