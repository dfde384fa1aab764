"""ASGI chores, each done once: header names as ASGI promises them, header field lookup, JSON or not, the
mounted path, waiting for a disconnect, work with a task beside it, sending an error. The middleware and
the gateway both use them.

``send_error`` is the one way a request is refused (401, 400, 408, 413, 415, 503): an outer layer
that puts an observer in the scope under ``REFUSED`` (the gateway's ``Refusals``) hears of each.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Final
from urllib.parse import unquote

import anyio
import anyio.abc
from starlette.types import Receive, Scope, Send

from ._exceptions import LifetimeError, MalformedBody, error_shape

__all__ = [
    "FIELD_NAME",
    "OWS",
    "REFUSED",
    "Headers",
    "is_json",
    "list_field",
    "normalize_headers",
    "route_path",
    "send_error",
    "single_field",
    "task_group",
    "upstream_path",
    "wait_disconnect",
]

REFUSED: Final = "asgi_lifetime.refused"
"""Scope key of a refusal observer, ``observer(scope, exc)``, called by ``send_error`` after it answered.

Set by an outer layer; ``LifetimeMiddleware`` removes it from the scope it hands the app, whose
own bookkeeping records what happens from then on (the gateway's ``Forwarder``: one ``Outcome``).
"""

Headers = Iterable[tuple[bytes, bytes]]
"""ASGI header lines: lowercase names (``normalize_headers`` sees to it), raw values, in the order received."""

FIELD_NAME: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header field name: an HTTP token (RFC 9110 5.1, 5.6.2); match it with ``fullmatch``."""

OWS: Final = b" \t"
"""Optional whitespace around a field value, not part of it (RFC 9110 5.5, 5.6.3): ``value.strip(OWS)``."""


def normalize_headers(scope: Scope) -> None:
    """Make ``scope["headers"]`` what every reader of it assumes: lower-case names (the ASGI spec says
    servers lowercase them, but a raw scope or another server may not), and one ``cookie`` line.

    Called where a layer first reads the headers, so that no comparison downstream needs its own
    ``.lower()``: ``Authorization`` is then the credential that is replaced, ``Content-Encoding`` the
    coding that is decoded. Over HTTP/2 each cookie may be a field of its own; they are joined with
    ``"; "`` (RFC 9113 8.2.3) as HTTP/1.1, and an upstream, expect one field. Any other repeated field
    stays as it is. Replaced in place, so that layers outside see the same; when nothing needs it (the
    usual case: one scan, nothing allocated), the scope is left alone.
    """
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    cookies = 0
    for name, _ in headers:
        if name == b"cookie":
            cookies += 1
        elif not name.islower():  # also a name with no letter at all: rebuilt the same, harmlessly
            break
    else:
        if cookies < 2:
            return
    normal = [(name.lower(), value) for name, value in headers]
    cookie = [value.strip(OWS) for name, value in normal if name == b"cookie"]
    if len(cookie) > 1:
        at = next(index for index, (name, _) in enumerate(normal) if name == b"cookie")
        normal = [pair for pair in normal if pair[0] != b"cookie"]
        normal.insert(at, (b"cookie", b"; ".join(value for value in cookie if value)))
    scope["headers"] = normal


def list_field(headers: Headers, name: bytes) -> str | None:
    """A list-valued field as one lowercased value: its lines joined with ", " (RFC 9110 5.3),
    empty lines left out; ``None`` when no line has that name.

    Reading only the first line would let a second one (``Content-Encoding:`` then ``gzip``)
    reach whoever reads them all, the app behind or the upstream, describing the body otherwise.
    """
    values = [value.decode("latin-1").strip().lower() for key, value in headers if key == name]
    if not values:
        return None
    return ", ".join(value for value in values if value)


def single_field(
    headers: Headers, name: bytes, *, conflict: Callable[[], LifetimeError], skip_empty: bool = False
) -> bytes | None:
    """A single-valued field's value (stripped), ``None`` when absent.

    Lines repeating one value are that value; lines with different values raise ``conflict()``:
    the gateway would judge by one line while the upstream may read another.
    """
    values = {value.strip() for key, value in headers if key == name}
    if skip_empty:
        values.discard(b"")
    if len(values) > 1:
        raise conflict()
    return values.pop() if values else None


def _conflicting_content_type() -> MalformedBody:
    return MalformedBody("conflicting Content-Type headers", code="conflicting_content_type")


def is_json(headers: Headers) -> bool:
    """Whether the body is taken for JSON: ``Content-Type`` absent or naming JSON.

    Several different Content-Type lines are refused (400): the gateway would skip the parse
    and every preparer for ``text/plain`` while the upstream may read ``application/json``.
    """
    # Media types are case-insensitive (RFC 9110 8.3.1): "Application/JSON" twice is one type.
    lowered = ((key, value.lower()) for key, value in headers)
    value = single_field(lowered, b"content-type", conflict=_conflicting_content_type)
    return value is None or b"json" in value


def _strip_root(scope: Scope, path: str) -> str:
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def route_path(scope: Scope) -> str:
    """The request path relative to where the app is mounted (``root_path`` removed)."""
    return _strip_root(scope, scope["path"])


def upstream_path(scope: Scope) -> str:
    """The path and query to append to an upstream base URL: as the client sent it, minus the mount."""
    path: str = scope["path"]
    raw: bytes | None = scope.get("raw_path")
    if raw is not None:
        encoded = raw.decode("latin-1")
        # Keep the client's encoding (a %2F or %3F inside a segment must stay one) when raw_path matches.
        if unquote(encoded) == path and encoded.startswith(scope.get("root_path", "")):
            path = encoded
    path = _strip_root(scope, path)
    query: bytes = scope.get("query_string", b"")
    return path + "?" + query.decode("latin-1") if query else path


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects; anything else received meanwhile (a late
    ``http.request``) is of no interest to a response in progress."""
    while (await receive())["type"] != "http.disconnect":
        pass


@asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for work with tasks beside it: an exception of the block cancels the tasks and is
    raised as it is, not wrapped in the ExceptionGroup anyio raises (callers catch ``LifetimeError``
    and its kin by type). An exception of a task is wrapped as anyio does."""
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        try:
            yield tg
        except Exception as exc:
            failure = exc
            tg.cancel_scope.cancel()
    try:
        if failure is not None:
            raise failure
    finally:
        # Its traceback holds this frame: kept in a local here, the error (and the frames it went
        # through, with the request's body) would live on in a cycle until the collector found it.
        failure = None


async def send_error(
    scope: Scope, send: Send, exc: LifetimeError, *, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Send ``exc`` as a complete JSON error response, in the shape the client of ``scope`` parses,
    and tell the scope's ``REFUSED`` observer, if any."""
    start, body = exc.asgi_response(extra_headers, shape=error_shape(scope["path"], scope["headers"]))
    try:
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})
    finally:  # refused all the same when the client is gone before the answer
        observer: Callable[[Scope, LifetimeError], None] | None = scope.get(REFUSED)
        if observer is not None:
            observer(scope, exc)
