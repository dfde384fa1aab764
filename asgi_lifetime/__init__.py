"""asgi_lifetime: the lifetime of a request's input as a designed, tested property.

A request's life, one module per stage: read (``_body``), fingerprint (``_fingerprint``),
prepare (``_prepare``), forward (``_upstream``), relay (``_relay``), bookkeep (``_bookkeeping``);
admission and per-request resources (``_admission``, ``_scope``) span them all.
See docs/design.md for where each piece of input is released.
"""

from ._body import parse_content_length, read_body
from ._exceptions import (
    AdmissionRejected,
    AuthenticationError,
    BodyAborted,
    BodyIdleTimeout,
    BodyTooLarge,
    LifetimeError,
    MalformedBody,
    RequestError,
    StarvationError,
    UpstreamError,
    UpstreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from ._fingerprint import UNPARSED, Fingerprint, fingerprint, text_comparable, wire_hash
from ._middleware import Lifetime, LifetimeMiddleware, RequestLifetime
from ._scope import RequestScope, Resource
from ._settings import GiB, KiB, LifetimeSettings, MiB
from ._stats import LifetimeStats

__version__ = "0.1.0.dev0"

__all__ = [
    "UNPARSED",
    "AdmissionRejected",
    "AuthenticationError",
    "BodyAborted",
    "BodyIdleTimeout",
    "BodyTooLarge",
    "Fingerprint",
    "GiB",
    "KiB",
    "Lifetime",
    "LifetimeError",
    "LifetimeMiddleware",
    "LifetimeSettings",
    "LifetimeStats",
    "MalformedBody",
    "MiB",
    "RequestError",
    "RequestLifetime",
    "RequestScope",
    "Resource",
    "StarvationError",
    "UpstreamError",
    "UpstreamStalled",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "__version__",
    "fingerprint",
    "parse_content_length",
    "read_body",
    "text_comparable",
    "wire_hash",
]
