"""httpcore's network streams, watched for an answer that comes while the request is still being sent.

httpcore writes the whole request before it reads a byte of the answer. An upstream that answers
before it has read the body (nginx's 413 past ``client_max_body_size``, an auth proxy's 401, an
overloaded API's 429/503) and then stops reading left that write blocked until the write timeout:
the client got a 504 after ``max_attempts`` full re-sends instead of the upstream's answer. One that
answered and closed lost its answer on asyncio: anyio reads a socket only while a task receives, so
the answer was still in the kernel when the write failed on the reset, and the failed write closed
the socket with it (a 502 after ``max_attempts`` re-sends). aiohttp reads while it writes: it
relayed both.

httpcore already treats a ``WriteError`` during the request as "the server may have answered
early" and goes on to read the response. So each write here races a read: if the upstream sends
anything (or hangs up) before the write completes, the write is abandoned with a ``WriteError`` and
httpcore reads the answer, those bytes first. h11 never saw the request end, so httpcore closes
the connection after that answer: it is never reused. (RFC 9112 9.5: a client that sees a response
while it sends the body should stop sending it.)

Only plain TCP streams are watched: anyio's TLS stream does not take a receive and a send at once
(both may touch the socket), so a TLS upstream keeps httpcore's behaviour.

    pool = httpcore.AsyncConnectionPool(network_backend=WatchingBackend())
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import anyio.abc
import httpcore
from httpcore._backends.auto import AutoBackend

__all__ = ["WatchingBackend"]

# What one watching read takes: httpcore's own read size.
_READ = 64 * 1024
# Writes smaller than this are not watched (a task per write cost a small request 0.3 ms of CPU
# each): a request this small fits the socket buffers (ours, and the upstream's receive window)
# whatever the upstream does, so its write neither blocks nor races an answer for long. Once one
# write of a request is this large, the rest of its writes are watched too (the buffers may be full).
_WATCH_FROM = 64 * 1024


class _WatchedStream(httpcore.AsyncNetworkStream):
    """A TCP stream whose writes stop when the upstream answers (or hangs up) during them."""

    __slots__ = ("_stream", "_early", "_failure", "_watching")

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._early: bytes | None = None  # read by the watcher, not yet by httpcore (b"": the upstream's EOF)
        self._failure: Exception | None = None  # how the watcher's read failed (a reset), raised at the next read
        self._watching = False  # this request's writes are watched (see _WATCH_FROM)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 (httpcore's)
        self._watching = False  # the request is sent (or given up): the next one starts unwatched
        early, self._early = self._early, None
        if early is not None:
            return early
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 (httpcore's)
        if not buffer:
            return
        if self._answered():
            raise httpcore.WriteError("the upstream answered before the request was sent")
        if not self._watching and len(buffer) < _WATCH_FROM:
            await self._stream.write(buffer, timeout)
            return
        self._watching = True
        written = False
        error: Exception | None = None
        async with anyio.create_task_group() as group:
            # The watcher reads before this writes. On asyncio, anyio reads a socket only while a task
            # receives, and a write that meets the upstream's reset closes the socket at once, with
            # the answer still unread in it: the answer must be read when it comes, not after.
            await group.start(self._watch, group.cancel_scope)
            if self._stream.get_extra_info("is_readable"):
                await anyio.sleep_forever()  # it came already: the watcher reads it and ends this
            try:
                await self._stream.write(buffer, timeout)
                written = True
            except Exception as exc:  # raised after the group: inside it, anyio would wrap it in a group
                error = exc
            group.cancel_scope.cancel()
        if written:
            return  # what the watcher read, if anything, is the answer httpcore reads next
        if error is not None and not self._answered():
            raise error
        raise httpcore.WriteError("the upstream answered before the request was sent")

    async def _watch(self, scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()  # and on into the read: anyio's asyncio stream reads the socket from here on
        try:
            # No timeout: the write's end cancels it.
            self._early = await self._stream.read(_READ)
        except Exception as exc:  # httpcore's ReadError: the upstream reset the connection
            self._failure = exc
        scope.cancel()  # the write, if it is still waiting

    def _answered(self) -> bool:
        return self._early is not None or self._failure is not None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
    ) -> httpcore.AsyncNetworkStream:
        return await self._stream.start_tls(ssl_context, server_hostname, timeout)  # not watched: see above

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._answered():
            return True
        return self._stream.get_extra_info(info)


class WatchingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's own backend (anyio's, or trio's on trio) with watched TCP streams."""

    def __init__(self) -> None:
        self._backend = AutoBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        return _WatchedStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _WatchedStream(
            await self._backend.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)
        )

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)
