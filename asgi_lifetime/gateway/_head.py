"""What the gateway refuses from the request head alone, before admission and before the body.

A request the forwarder could not send as it came is refused (400) while only its head has been
seen: ``GatewayAuth`` has let it in, and not one body message has been taken from the server, nor
a slot or a byte of the budget from admission. Judged later, after ``LifetimeMiddleware`` had read
and charged the whole body, a hostile client could make the gateway read up to ``MAX_BODY_BYTES``
for a refusal its first bytes decided.

- ``invalid_path``: a ``.`` or ``..`` path segment (httpx would resolve it, and the request would
  leave the forwarded prefix); a path or query with an ASCII control character, or too long a one,
  which httpx refuses to make a URL of (a 500 after the body, before): h2 passes ``\\x01``-``\\x1f``
  but CR and LF, uvicorn's h11 a 64 KiB query, a raw scope anything;
- ``invalid_header``: a header field HTTP/1.1 cannot carry, as h11 checks it before httpcore sends
  anything (the aiohttp transport hands such fields to httpcore): a name that is not a token
  (``FIELD_NAME``), a value with a NUL, CR, LF or other whitespace than spaces and tabs. Every line
  is judged, forwarded or not: a server gave it, and no client needs one. Over HTTP/1.1 the servers
  refuse these themselves; HTTP/2 (h2) passes ``\\x0b``, ``\\x0c`` and non-token names, and a raw
  ASGI scope anything;
- ``conflicting_session_id``, ``session_id_too_long``: two different session ids (the gateway would key
  by one while the upstream is sent both), or one over ``MAX_SESSION_ID_BYTES`` (``session_id``, which
  the forwarder reads the id with).
"""

from __future__ import annotations

import re
from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from .._asgi import FIELD_NAME, BodyWatch, Headers, normalize_headers, send_error, single_field, upstream_path
from .._exceptions import MalformedBody, RequestError
from .._middleware import Lifetime
from .._settings import LifetimeSettings

__all__ = ["RequestHead", "session_id"]

# Spaces and tabs around a value (OWS) are not part of it and are dropped when it is forwarded; inside
# it they are allowed, and so is every other byte (obs-text included) but these.
_NOT_IN_VALUE: Final = re.compile(rb"[\x00\n\r\x0b\x0c]")
# What httpx refuses in a URL (``httpx._urlparse``): any ASCII character that is not printable, and more
# than 65,536 characters in all, the upstream's base URL included.
_NOT_IN_URL: Final = re.compile(r"[\x00-\x1f\x7f]")
_MAX_URL: Final = 65536
# A "." or ".." segment of the decoded path, as some upstream would read it: a server on Windows (and a
# WHATWG URL parser) also splits at a backslash, a Java servlet container drops a ";" parameter ("..;" is
# ".." to Tomcat). Forwarded, it would climb out of the prefix PATHS covers, to any path of the upstream.
_DOT_SEGMENT: Final = re.compile(r"(?:^|[/\\])\.\.?(?=[/\\;]|$)")


class RequestHead:
    """Pure ASGI, between ``GatewayAuth`` and ``LifetimeMiddleware``: refuses (400) a request to a
    forwarded path whose head cannot be forwarded, or names a session the gateway refuses, before its
    body is read.

    ```python
    app = GatewayAuth(RequestHead(LifetimeMiddleware(forwarder, lifetime=lifetime), lifetime=lifetime), ...)
    ```
    """

    def __init__(self, app: ASGIApp, *, lifetime: Lifetime) -> None:
        self.app = app
        self._lifetime = lifetime
        # The longest path and query every upstream's URL can take.
        self._longest_target = _MAX_URL - max((len(base) for base in lifetime.settings.upstream_url), default=0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._lifetime.handles(scope):
            normalize_headers(scope)  # done already when GatewayAuth read them; the session header by name
            problem = _unforwardable(scope, self._longest_target) or _session_refused(scope, self._lifetime.settings)
            if problem is not None:
                # The body is unread: the server must not parse it as the next request (HTTP/1.1),
                # nor fail the connection for the data still coming (HTTP/2).
                settings = self._lifetime.settings
                unread = BodyWatch(receive, settings.body_idle_timeout, settings.body_timeout)
                await send_error(scope, send, problem, unread=unread)
                return
        await self.app(scope, receive, send)


def session_id(headers: Headers, settings: LifetimeSettings) -> str | None:
    """The client's session id (``SESSION_HEADER``), ``None`` without one; two different ids, or one over
    ``MAX_SESSION_ID_BYTES``, raise the client's 400 (``RequestHead`` refuses them before the body)."""
    name = settings.session_header.lower().encode("latin-1")
    value = single_field(headers, name, conflict=lambda: _conflicting_ids(settings), skip_empty=True)
    if value is None:
        return None
    if len(value) > settings.max_session_id_bytes:
        raise RequestError(
            f"the {settings.session_header} header is {len(value)} bytes long; "
            f"at most {settings.max_session_id_bytes} are accepted",
            code="session_id_too_long",
        )
    return value.decode("latin-1")


def _session_refused(scope: Scope, settings: LifetimeSettings) -> RequestError | None:
    try:
        session_id(scope["headers"], settings)
    except RequestError as exc:
        return exc
    return None


def _conflicting_ids(settings: LifetimeSettings) -> RequestError:
    return RequestError(f"conflicting {settings.session_header} headers", code="conflicting_session_id")


def _unforwardable(scope: Scope, longest_target: int = _MAX_URL) -> RequestError | None:
    """Why the forwarder could not send this request as it came, or ``None``. A value is never quoted:
    it may be a credential (a query's key too)."""
    path: str = scope["path"]
    if "." in path and _DOT_SEGMENT.search(path) is not None:
        return MalformedBody("the request path has '.' or '..' segments", code="invalid_path")
    target = upstream_path(scope)  # what the forwarder appends to the upstream's base URL
    if _NOT_IN_URL.search(target) is not None:
        return MalformedBody("the request path or query has a control character", code="invalid_path")
    if len(target) > longest_target:
        return MalformedBody(
            f"the request path and query are {len(target)} characters long; at most {longest_target} can be forwarded",
            code="invalid_path",
        )
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    if not headers:
        return None
    # Judged all at once, as this runs for every request (twice as fast as line by line): names are tokens
    # when none is empty and their concatenation is all token characters; no value has a forbidden byte
    # when their concatenation has none. Only a refusal looks line by line, for the name to give.
    names = [name for name, _ in headers]
    if (
        all(names)
        and FIELD_NAME.fullmatch(b"".join(names))
        and not _NOT_IN_VALUE.search(b"".join([value for _, value in headers]))
    ):
        return None
    for name, value in headers:
        if FIELD_NAME.fullmatch(name) is None:
            return RequestError(
                "a request header name is not an HTTP token, so it cannot be forwarded", code="invalid_header"
            )
        if _NOT_IN_VALUE.search(value) is not None:
            break
    return RequestError(
        f"the request header {name.decode('latin-1')!r} has a value HTTP/1.1 cannot carry (a NUL, a line"
        " break, or another control whitespace), so it cannot be forwarded",
        code="invalid_header",
    )
