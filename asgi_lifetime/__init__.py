"""asgi_lifetime: the lifetime of a request's input as a designed, tested property.

The middleware core: ``LifetimeMiddleware`` reads each request's body within bounds, takes its
fingerprint before anything can change it, and releases what the request acquired the moment
it settles. The standalone gateway lives in ``asgi_lifetime.gateway`` (the ``gateway`` extra),
test helpers and the pytest plugin in ``asgi_lifetime.testing``.
See docs/design.md for where each piece of input is released.
"""

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
    UnsupportedEncoding,
    UpstreamError,
    UpstreamStalled,
    UpstreamStarved,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from ._fingerprint import UNPARSED, Fingerprint, fingerprint, text_comparable, wire_hash
from ._middleware import Lifetime, LifetimeMiddleware, RequestLifetime
from ._publish import publish as _publish
from ._resources import RequestResources, Resource
from ._settings import GiB, KiB, LifetimeSettings, MiB
from ._stats import LifetimeStats

__version__ = "0.1.0.dev0"

__all__ = [
    "AdmissionRejected",
    "AuthenticationError",
    "BodyAborted",
    "BodyIdleTimeout",
    "BodyTimeout",
    "BodyTooComplex",
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
    "RequestResources",
    "Resource",
    "UNPARSED",
    "UnsupportedEncoding",
    "UpstreamError",
    "UpstreamStalled",
    "UpstreamStarved",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "__version__",
    "fingerprint",
    "text_comparable",
    "wire_hash",
]

# Reprs, tracebacks, pickles and the API reference show the public path, not the private module.
_publish(globals())
