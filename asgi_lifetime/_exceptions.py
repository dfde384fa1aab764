"""The package's one exception hierarchy.

Every error that can reach a client knows its HTTP status and renders an
OpenAI-style JSON body ``{"error": {"type", "code", "message"}}``::

    LifetimeError                      500 server_error
    ├── RequestError                   4xx, the client's request is at fault
    │   ├── BodyAborted                499 client closed before the body completed
    │   ├── BodyTooLarge               413
    │   │   └── BodyTooComplex         413 body_too_complex: its parse would take too much memory
    │   ├── BodyIdleTimeout            408 no body chunk for BODY_IDLE_TIMEOUT
    │   ├── BodyTimeout                408 body not complete within BODY_TIMEOUT
    │   ├── UnsupportedEncoding        415 Content-Encoding other than identity, gzip, deflate
    │   ├── MalformedBody              400 bad content-encoding, bad JSON, bad framing
    │   └── AuthenticationError        401
    ├── AdmissionRejected              503 with Retry-After
    └── UpstreamError                  502, the upstream is at fault
        ├── UpstreamUnreachable        502
        ├── UpstreamTimeout            504
        ├── UpstreamStalled            504 no bytes for STALL_TIMEOUT
        └── UpstreamStarved            502 the upstream produced no output

``BodyAborted`` is never delivered (the client is gone); it is logged and counted.
Messages never contain request bodies or keys.

The ``UpstreamError`` family answers with ``x-should-retry: false``: the gateway already
retried (or decided not to), and SDKs that honour the header (openai, anthropic) would
otherwise multiply its attempts by their own ``max_retries``. ``AdmissionRejected`` does not:
nothing reached the upstream, and its ``Retry-After`` asks the client to come back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal

__all__ = [
    "NO_CLIENT_RETRY",
    "ErrorShape",
    "AdmissionRejected",
    "AuthenticationError",
    "BodyAborted",
    "BodyIdleTimeout",
    "BodyTimeout",
    "BodyTooComplex",
    "BodyTooLarge",
    "LifetimeError",
    "MalformedBody",
    "RequestError",
    "UpstreamStarved",
    "UnsupportedEncoding",
    "UpstreamError",
    "UpstreamStalled",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "error_body",
    "error_shape",
]


ErrorShape = Literal["openai", "anthropic", "gemini"]

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# google.rpc.Code names Gemini puts in ``error.status``, by HTTP status.
_GOOGLE_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "INVALID_ARGUMENT",
    415: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


# Request headers only one provider's SDKs send, naming the error shape they parse. (Not a
# credential header: the gateway may inject those, e.g. x-goog-api-key for any client.)
_SHAPE_HEADERS: dict[bytes, ErrorShape] = {b"anthropic-version": "anthropic", b"x-goog-api-client": "gemini"}


def error_shape(path: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> ErrorShape:
    """The error body shape a client calling ``path`` with request ``headers`` parses.

    Anthropic's Messages API (``/v1/messages...``) and Gemini's model methods
    (``/models/<model>:generateContent`` and the like) have their own. Elsewhere the client's
    SDK says who it is: the anthropic SDKs send ``anthropic-version`` on every call (models,
    files, batches...), Google's send ``x-goog-api-client``. Everything
    else gets OpenAI's, which most gateways and SDKs speak.
    """
    if "/v1/messages" in path or path.endswith("/v1/complete"):
        return "anthropic"
    if "/models/" in path and ":" in path.rsplit("/", 1)[-1]:
        return "gemini"
    for name, _ in headers:
        shape = _SHAPE_HEADERS.get(name.lower())
        if shape is not None:
            return shape
    return "openai"


def error_body(shape: ErrorShape, status: int, error_type: str, code: str, message: str) -> dict[str, Any]:
    """An error body in ``shape``; ``code`` (the gateway's own) is kept in each, for operators."""
    if shape == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "code": code, "message": message}}
    if shape == "gemini":
        reason = _GOOGLE_STATUSES.get(status, "FAILED_PRECONDITION" if status < 500 else "INTERNAL")
        details = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": code, "domain": "asgi-lifetime"}]
        return {"error": {"code": status, "message": message, "status": reason, "details": details}}
    return {"error": {"type": error_type, "code": code, "message": message}}


class LifetimeError(Exception):
    """Base class of every error raised by asgi_lifetime."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def headers(self) -> dict[str, str]:
        """Extra response headers this error asks for (e.g. ``Retry-After``)."""
        return {}

    def to_dict(self, shape: ErrorShape = "openai") -> dict[str, Any]:
        """This error as the JSON body a client of ``shape`` parses (see ``error_shape()``)."""
        return error_body(shape, self.status_code, self.error_type, self.code, self.message)

    def json_body(self, shape: ErrorShape = "openai") -> bytes:
        return json.dumps(self.to_dict(shape), separators=(",", ":")).encode()

    def asgi_response(
        self, extra_headers: Sequence[tuple[bytes, bytes]] = (), *, shape: ErrorShape = "openai"
    ) -> tuple[dict[str, Any], bytes]:
        """The ``http.response.start`` message and the body of this error as a JSON response."""
        body = self.json_body(shape)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()),
            *extra_headers,
        ]
        return {"type": "http.response.start", "status": self.status_code, "headers": headers}, body


class RequestError(LifetimeError):
    """The client's request cannot be served as sent."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class BodyAborted(RequestError):
    """The client disconnected before the request body was complete."""

    status_code = 499  # nginx's "client closed request"; never actually delivered
    code = "request_aborted"

    def __init__(self, message: str = "request aborted before body completed", *, code: str | None = None) -> None:
        super().__init__(message, code=code)


class BodyTooLarge(RequestError):
    status_code = 413
    code = "request_too_large"

    def __init__(self, limit: int, *, code: str | None = None) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes", code=code)
        self.limit = limit


class BodyTooComplex(BodyTooLarge):
    """The body is within the size limit, but parsing it would take too much memory.

    Each JSON value becomes a Python object of 24-200 bytes: a body made of many tiny values
    (``[{},{},...]``) would multiply its size when parsed. Nothing is forwarded. ``valid``: the
    body was checked to be JSON without its parse (it may go on unparsed when nobody needs the parse).
    """

    code = "body_too_complex"

    def __init__(self, size: int, cost: int, *, valid: bool = False, code: str | None = None) -> None:
        RequestError.__init__(
            self,
            f"request body of {size} bytes is too complex: parsing it would take about {cost} bytes of memory;"
            " send fewer, larger JSON values",
            code=code,
        )
        self.limit = size
        self.cost = cost
        self.valid = valid


class BodyIdleTimeout(RequestError):
    status_code = 408
    code = "request_timeout"

    def __init__(self, timeout: float, *, code: str | None = None) -> None:
        super().__init__(f"no request body data received for {timeout:g} seconds", code=code)
        self.timeout = timeout


class MalformedBody(RequestError):
    status_code = 400
    code = "malformed_body"


class AuthenticationError(RequestError):
    status_code = 401
    code = "invalid_api_key"


# The gateway's own retry decision, for SDKs that would otherwise retry a 5xx on their own.
NO_CLIENT_RETRY = {"x-should-retry": "false"}


class AdmissionRejected(LifetimeError):
    """The gateway is at capacity (or shutting down) and could not admit the request in time."""

    status_code = 503
    error_type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = max(1, int(retry_after))

    @property
    def headers(self) -> dict[str, str]:
        # No x-should-retry: false here. Nothing was sent upstream, so a client's retry multiplies
        # no upstream attempt; an SDK that retries after Retry-After is what a 503 at capacity
        # (or during a drain, on a new connection) asks for.
        return {"retry-after": str(self.retry_after)}


class UpstreamError(LifetimeError):
    status_code = 502
    error_type = "upstream_error"
    code = "bad_gateway"

    @property
    def headers(self) -> dict[str, str]:
        return dict(NO_CLIENT_RETRY)


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class UpstreamStalled(UpstreamError):
    status_code = 504
    code = "upstream_stalled"


class UpstreamStarved(UpstreamError):
    """The upstream ended without producing any output (or without a terminal event)."""

    code = "upstream_starved"


class BodyTimeout(RequestError):
    """The whole request body did not arrive within ``BODY_TIMEOUT`` (a slow but never idle sender)."""

    status_code = 408
    code = "request_body_timeout"

    def __init__(self, timeout: float, *, code: str | None = None) -> None:
        super().__init__(f"request body not received in full within {timeout:g} seconds", code=code)
        self.timeout = timeout


class UnsupportedEncoding(RequestError):
    """A Content-Encoding the gateway cannot decode (RFC 9110 15.5.16: 415 Unsupported Media Type)."""

    status_code = 415
    code = "unsupported_encoding"
