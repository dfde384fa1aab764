"""ASGI chores, each done once: header names as ASGI promises them, header field lookup, JSON or not, the
mounted path, waiting for a disconnect, work with a task beside it, sending an error. The middleware and
the gateway both use them.

``send_error`` is the one way a request is refused (401, 400, 408, 413, 415, 503): an outer layer
that puts an observer in the scope under ``REFUSED`` (the gateway's ``Refusals``) hears of each. A
refusal that may come before the body was read is given the request's ``BodyWatch``, and its end waits
for the body on HTTP/2 (see ``BodyWatch``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote

import anyio
import anyio.abc
from starlette.types import Message, Receive, Scope, Send

from ._exceptions import LifetimeError, MalformedBody, error_shape

__all__ = [
    "FIELD_NAME",
    "BodyWatch",
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
    "under",
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
    stays as it is. The scope's list is replaced, never changed: a layer outside that kept it keeps what
    it read, and one that reads the scope afterwards sees what the app saw. When nothing needs it (the
    usual case, names with no letter included: one scan, nothing allocated), the scope is left alone.
    """
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    cookies = 0
    for name, _ in headers:
        if name == b"cookie":
            cookies += 1
        elif not name.islower() and name != name.lower():  # islower() is False without a letter too: ``-``
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


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, segment by segment (as Starlette's ``Mount``):
    ``/v1`` and ``/v1/`` both cover ``/v1`` and ``/v1/models``, neither covers ``/v1beta/models``.
    ``/`` covers every path but ``""``, the mount itself, which Starlette's router redirects to ``/``."""
    base = prefix.rstrip("/")
    return path.startswith(base + "/") or (base != "" and path == base)


# What a path may hold unencoded (RFC 3986 3.3 pchar and "/"; letters, digits and "-._~" are always kept).
_PATH_SAFE: Final = "/!$&'()*+,;=:@"


def _strip_root(scope: Scope, path: str) -> str:
    root: str = scope.get("root_path", "")
    # A mount at /api does not own /apix (Starlette's get_route_path draws the same line).
    return path[len(root) :] if root and under(path, root) else path


def route_path(scope: Scope) -> str:
    """The request path relative to where the app is mounted (``root_path`` removed)."""
    return _strip_root(scope, scope["path"])


def upstream_path(scope: Scope) -> str:
    """The path and query to append to an upstream base URL: as the client sent it, minus the mount.
    Whatever its form, the upstream decodes it to the path the gateway judged (``route_path``)."""
    path: str = scope["path"]
    raw: bytes | None = scope.get("raw_path")
    encoded = raw.decode("latin-1") if raw is not None else None
    # Keep the client's encoding (a %2F or %3F inside a segment must stay one) when raw_path matches.
    if encoded is not None and unquote(encoded) == path and encoded.startswith(scope.get("root_path", "")):
        path = _strip_root(scope, encoded)
    else:
        # The decoded path, encoded again: sent as it is, its "%", "?" and "#" would be decoded or cut once
        # more by the upstream (a mount spelled "/%61pi" turned "%252e%252e" into a ".." there).
        path = quote(_strip_root(scope, path), safe=_PATH_SAFE)
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


_CLOSE: Final = (b"connection", b"close")
_MULTIPLEXED: Final = ("2", "3")  # ASGI ``http_version``s whose connection carries other requests


@dataclass(eq=False)
class BodyWatch:
    """``receive`` that remembers whether the request's body has ended (its last message, or the
    client gone), for a refusal that may come before the body was read (``send_error(unread=...)``).

    Over HTTP/1.x such a refusal asks the server to close the connection: the unread bytes must not be
    parsed as the next request. Over HTTP/2 (and 3) the connection carries other streams (other
    clients', behind a load balancer), and the server closes a stream when its answer ends: hypercorn
    then fails the whole connection on the client's next DATA frame for it (a ``KeyError`` in its h2
    protocol, pgjones/hypercorn#329), cutting every other stream. So there the answer goes out at once,
    but its end waits until the client has sent its body, which is read and dropped one chunk at a
    time within the time limits the body had: ``idle_timeout`` between chunks, ``timeout`` in all.
    Past them the answer ends anyway. There is no byte limit: an honest client may have committed
    to a body well over the one refused (an SDK's upload), and cutting it there would cut the
    connection; what it sends costs no memory, and no admission slot is held meanwhile.
    """

    receive: Receive
    idle_timeout: float
    timeout: float
    ended: bool = False

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended = True
        return message

    async def discard(self) -> None:
        """Read and drop the rest of the body, within the time limits."""
        with anyio.move_on_after(self.timeout):
            while not self.ended:
                with anyio.fail_after(self.idle_timeout):
                    await self()


async def send_error(
    scope: Scope,
    send: Send,
    exc: LifetimeError,
    *,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    unread: BodyWatch | None = None,
) -> None:
    """Send ``exc`` as a complete JSON error response, in the shape the client of ``scope`` parses,
    and tell the scope's ``REFUSED`` observer, if any. ``unread``: the body may not have been read
    (see ``BodyWatch`` for what that changes)."""
    multiplexed = scope.get("http_version") in _MULTIPLEXED
    if unread is not None and not multiplexed:
        extra_headers = (*extra_headers, _CLOSE)
    start, body = exc.asgi_response(extra_headers, shape=error_shape(scope["path"], scope["headers"]))
    waits = unread is not None and multiplexed and not unread.ended
    try:
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": waits})
        if unread is not None and waits:
            with contextlib.suppress(TimeoutError):
                await unread.discard()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:  # refused all the same when the client is gone before the answer
        observer: Callable[[Scope, LifetimeError], None] | None = scope.get(REFUSED)
        if observer is not None:
            observer(scope, exc)
