"""The upstream transport: httpx's own, over a connection pool that never reuses a desynchronised connection.

httpcore puts an HTTP/1.1 connection back in its pool as soon as h11 has parsed a complete
response. Whatever the upstream sent *after* that response (a second response, a body on a
HEAD/204/304 answer, the bytes past a Content-Length counted in characters) stays in h11's
buffer, and h11 parses it as the answer to the next request sent on that connection: another
client gets it. httpcore only notices leftovers that are still unread on the socket when the
connection is next picked (``has_expired``), never those h11 already buffered.

Here every connection checks, when its response is closed and before the pool can hand it to a
waiting request, whether anything is left over (buffered by h11, or readable on the socket); if
so it is closed, never reused (nginx does the same). This uses httpcore internals (the HTTP/1.1
connection inside ``AsyncHTTPConnection`` and its ``h11.Connection``), so ``pyproject.toml``
pins httpcore to the 1.0 series; ``tests/test_transport.py`` fails if they move.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import h11
import httpcore
import httpx

from ._watched import WatchingBackend

__all__ = [
    "CLOSE_TIMEOUT",
    "GuardedTransport",
    "UpstreamTransport",
    "aiohttp_available",
    "close_response",
    "stop_reading",
]

logger = logging.getLogger(__name__)

# How long closing an upstream response may take, even inside a cancelled scope.
CLOSE_TIMEOUT = 5.0


async def close_response(response: httpx.Response) -> None:
    """Close ``response`` within ``CLOSE_TIMEOUT``, even inside a cancelled scope; never raises."""
    if response.is_closed:
        return  # its aclose() does nothing: no shielded scope and timer for it (a response read to its end)
    with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
        try:
            await response.aclose()
        except Exception:  # a failing close must not mask how reading ended
            logger.debug("closing the upstream response failed", exc_info=True)


async def stop_reading(response: httpx.Response, iterator: AsyncIterator[bytes], *, finished: bool) -> None:
    """Stop reading ``response`` through ``iterator`` (its ``aiter_raw()``) and close it; never raises.

    ``finished``: the iterator's last ``__anext__`` ended it (its end, an error or a cancellation
    raised inside it ends every generator it passes through). Otherwise httpx's and httpcore's
    generators under it are suspended half-way, and closing only the outermost would abandon
    the inner ones (trio warns about each when they are collected): the response is closed, so
    the transport ends the chain, and the chain is drained (what is read meanwhile is dropped).
    """
    if finished and response.is_closed:
        # Read to its end: httpx closed the response as its last chunk went, and the chain of
        # generators has ended (nothing to close). The common case: no shielded scope and timer.
        return
    with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
        try:
            if not finished:
                await response.aclose()
                with contextlib.suppress(Exception):  # StopAsyncIteration, or how the closed transport says it
                    while True:
                        await iterator.__anext__()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:
            logger.debug("stopping an upstream read failed", exc_info=True)
    await close_response(response)


def _leftover(connection: httpcore.AsyncConnectionInterface) -> Literal["", "bytes", "closed", "readable"]:
    """What follows the response that just ended: ``"bytes"`` buffered in h11 (the upstream
    misbehaved), the upstream ``"closed"`` (a close-delimited body: nothing wrong), the socket
    ``"readable"`` (bytes or an EOF not read yet), or nothing (``""``: the connection may be reused)."""
    inner = getattr(connection, "_connection", None)  # AsyncHTTPConnection -> AsyncHTTP11Connection
    state = getattr(inner, "_h11_state", None)
    if not isinstance(state, h11.Connection):
        return ""  # not HTTP/1.1 (or not connected): nothing of ours to check
    if state.our_state is not h11.DONE or state.their_state is not h11.DONE:
        return ""  # httpcore closes a connection whose exchange did not complete
    data, closed = state.trailing_data
    if data:
        return "bytes"
    if closed:
        return "closed"
    stream = getattr(inner, "_network_stream", None)
    # An idle HTTP/1.1 connection has nothing to read; readable means extra bytes (or EOF).
    return "readable" if stream is not None and stream.get_extra_info("is_readable") else ""


class _CheckedStream:
    """A response body that, when closed, closes its connection instead of pooling it if bytes are left over."""

    def __init__(self, stream: Any, connection: httpcore.AsyncConnectionInterface) -> None:
        self._stream = stream
        self._connection = connection

    def __aiter__(self) -> AsyncIterator[bytes]:
        # The inner iterator itself: one more generator in httpx's chain would be one more to
        # finalize when a read stops early.
        iterator: AsyncIterator[bytes] = self._stream.__aiter__()
        return iterator

    async def aclose(self) -> None:
        # Checked before the inner close marks the connection idle. Between that and our aclose()
        # below nothing yields, and a request handed the connection meanwhile would find it
        # closed (ConnectionNotAvailable), which the pool answers by picking another.
        leftover = _leftover(self._connection)
        try:
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
        finally:
            if leftover:
                if leftover == "bytes":
                    logger.warning("the upstream sent bytes after a complete response: connection closed, not reused")
                await self._connection.aclose()


class _GuardedConnection(httpcore.AsyncConnectionInterface):
    """Delegates to httpcore's connection; wraps each response body in ``_CheckedStream``."""

    def __init__(self, connection: httpcore.AsyncConnectionInterface) -> None:
        self._connection = connection

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        response = await self._connection.handle_async_request(request)
        return httpcore.Response(
            status=response.status,
            headers=response.headers,
            content=_CheckedStream(response.stream, self._connection),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._connection.aclose()

    def can_handle_request(self, origin: httpcore.Origin) -> bool:
        return self._connection.can_handle_request(origin)

    def is_available(self) -> bool:
        return self._connection.is_available()

    def has_expired(self) -> bool:
        return self._connection.has_expired()

    def is_idle(self) -> bool:
        return self._connection.is_idle()

    def is_closed(self) -> bool:
        return self._connection.is_closed()

    def info(self) -> str:
        return self._connection.info()

    def __repr__(self) -> str:
        return f"<guarded {self._connection!r}>"


class _GuardedPool(httpcore.AsyncConnectionPool):
    def create_connection(self, origin: httpcore.Origin) -> httpcore.AsyncConnectionInterface:
        return _GuardedConnection(super().create_connection(origin))


class GuardedTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` (direct connections) whose pooled connections are closed,
    not reused, when the upstream sent anything after a complete response.

    ```python
    client = httpx.AsyncClient(transport=GuardedTransport(limits=httpx.Limits(max_connections=64)))
    ```
    """

    def __init__(self, *, limits: httpx.Limits, verify: bool = True, trust_env: bool = True) -> None:
        super().__init__(limits=limits, verify=verify, trust_env=trust_env)
        plain: httpcore.AsyncConnectionPool = self._pool
        self._pool = _GuardedPool(
            ssl_context=plain._ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            # Reads while it writes: an upstream's early answer (413, 401, 429...) is relayed, not
            # lost to a write that blocks or fails (see _watched).
            network_backend=WatchingBackend(),
        )

    def busy(self) -> list[str]:
        """The pooled connections in a request (idle keep-alive ones are fine), and the requests
        the pool serves or queues."""
        pool: httpcore.AsyncConnectionPool = self._pool
        busy = [repr(conn) for conn in pool.connections if not (conn.is_idle() or conn.is_closed())]
        busy += [f"pool request {request!r}" for request in list(pool._requests)]
        return busy


# httpcore's pool as imported: a mock of httpcore (respx's default) replaces it while it is active.
_POOL_SEND = httpcore.AsyncConnectionPool.handle_async_request


def _httpcore_mocked() -> bool:
    """Whether httpcore's pool is mocked now (``respx.mock``): ``auto`` then sends through httpcore,
    so tests that mock the upstream with respx keep working whatever the transport."""
    return httpcore.AsyncConnectionPool.handle_async_request is not _POOL_SEND


def aiohttp_available() -> bool:
    """Whether aiohttp can be imported (found without importing it: that takes a tenth of a second)."""
    try:
        return importlib.util.find_spec("aiohttp") is not None
    except (ImportError, ValueError):  # an import hook refused it, or a half-removed install
        return False


def _on_trio() -> bool:
    """Whether the running event loop is trio's (anyio runs on asyncio or trio)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


class UpstreamTransport(httpx.AsyncBaseTransport):
    """The transport ``UPSTREAM_TRANSPORT`` names, chosen in the event loop that serves requests.

    ``auto``: aiohttp (``_aiohttp.AiohttpTransport``) on asyncio when it is installed, else
    httpcore (``GuardedTransport``); ``aiohttp``: aiohttp, and a ``ValueError`` if it is not
    installed (here) or the loop is trio's (at ``choose()``, which the gateway calls at startup);
    ``httpcore``: ``GuardedTransport``. While httpcore is mocked (``respx.mock``), ``auto`` sends
    through httpcore, where the mock answers.

    ```python
    client = httpx.AsyncClient(transport=UpstreamTransport(choice="auto", limits=httpx.Limits()))
    ```
    """

    def __init__(self, *, choice: str, limits: httpx.Limits) -> None:
        if choice == "aiohttp" and not aiohttp_available():
            raise ValueError(
                "ASGI_LIFETIME_UPSTREAM_TRANSPORT=aiohttp needs aiohttp: pip install 'asgi-lifetime[gateway]' "
                "(or set it to auto or httpcore)"
            )
        self._choice = choice
        self._limits = limits
        self._chosen: httpx.AsyncBaseTransport | None = None
        self._mocked: GuardedTransport | None = None  # auto's httpcore while httpcore is mocked

    @property
    def name(self) -> Literal["aiohttp", "httpcore"] | None:
        """The transport in use, once chosen."""
        if self._chosen is None:
            return None
        return "httpcore" if isinstance(self._chosen, GuardedTransport) else "aiohttp"

    def choose(self) -> httpx.AsyncBaseTransport:
        """The transport of this event loop, chosen on the first call (in the serving loop)."""
        if self._chosen is None:
            trio = _on_trio()
            if self._choice == "aiohttp" and trio:
                raise ValueError(
                    "ASGI_LIFETIME_UPSTREAM_TRANSPORT=aiohttp is invalid on trio: aiohttp runs on asyncio only "
                    "(set it to auto or httpcore)"
                )
            if self._choice == "aiohttp" or (self._choice == "auto" and not trio and aiohttp_available()):
                from ._aiohttp import AiohttpTransport  # imported only where it runs

                self._chosen = AiohttpTransport(limits=self._limits)
            else:
                self._chosen = GuardedTransport(limits=self._limits)
        return self._chosen

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        chosen = self._chosen or self.choose()
        if self._choice == "auto" and not isinstance(chosen, GuardedTransport) and _httpcore_mocked():
            if self._mocked is None:
                self._mocked = GuardedTransport(limits=self._limits)
            chosen = self._mocked
        return await chosen.handle_async_request(request)

    def busy(self) -> list[str]:
        """The pooled connections in a request, and the requests waiting for one (for idle checks)."""
        busy: list[str] = []
        for transport in (self._chosen, self._mocked):
            if transport is not None:
                busy += transport.busy()  # type: ignore[attr-defined]  # both transports have it
        return busy

    async def aclose(self) -> None:
        chosen, mocked = self._chosen, self._mocked
        try:
            if chosen is not None:
                await chosen.aclose()
        finally:
            if mocked is not None:
                await mocked.aclose()
