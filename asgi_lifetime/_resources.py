"""Per-request resources (RAII).

Everything a request acquires (its admission, a session pin, the upstream response,
retained input bytes, anything a preparer registers) is registered with the request's
``RequestResources``. Closing it releases what is still held, last acquired first,
exactly once, and it is closed the moment the request settles: on success, error,
timeout, disconnect and cancellation alike. Nothing waits for process shutdown.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any

import anyio

from ._stats import Counters

__all__ = ["RequestResources", "Resource"]

logger = logging.getLogger(__name__)

# Async releases (closing an upstream response) are shielded from cancellation so a
# cancelled request still releases, but bounded so a wedged peer cannot hang settlement.
_ASYNC_RELEASE_TIMEOUT = 5.0


class Resource:
    """A handle to one registered resource; ``await handle.release()`` releases it early."""

    __slots__ = ("_release", "_counters", "_gauge", "_amount")

    def __init__(
        self,
        release: Callable[[], object] | None,
        counters: Counters | None = None,
        gauge: str = "live_resources",
        amount: int = 1,
    ) -> None:
        # Made by ``RequestResources.add`` / ``retain``, which pass the middleware's counters.
        counters = counters if counters is not None else Counters()
        self._release: Callable[[], object] | None = release
        self._counters = counters
        self._gauge = gauge
        self._amount = amount
        setattr(counters, gauge, getattr(counters, gauge) + amount)

    @property
    def released(self) -> bool:
        return self._release is None

    async def release(self) -> None:
        """Release now (idempotent). Never raises: a failing release is logged."""
        result = self._call()
        if result is not None:
            try:
                with anyio.move_on_after(_ASYNC_RELEASE_TIMEOUT, shield=True):
                    await result
            except Exception:
                logger.exception("releasing a request resource failed")

    def release_now(self) -> None:
        """Release from synchronous code (idempotent); for resources with a sync release callable."""
        result = self._call()
        if result is not None:
            result.close()
            logger.error("release_now() used on a resource whose release is async; it was not awaited")

    def _call(self) -> Coroutine[Any, Any, object] | None:
        release, self._release = self._release, None
        if release is None:
            return None
        setattr(self._counters, self._gauge, getattr(self._counters, self._gauge) - self._amount)
        try:
            result = release()
        except Exception:
            logger.exception("releasing a request resource failed")
            return None
        if inspect.iscoroutine(result):
            return result
        if isinstance(result, Awaitable):
            return _await(result)
        return None


def _noop() -> None:
    return None


async def _await(awaitable: Awaitable[object]) -> object:
    return await awaitable


class RequestResources:
    """The resources one request holds, released together when it settles.

    ```python
    async with RequestResources() as resources:
        resources.add(pins.unpin_callback)      # sync or async release callable
        held = resources.retain(len(raw))       # counts toward retained_input_bytes
        ...
        await held.release()                    # release early, e.g. at the settle point
    ```
    """

    __slots__ = ("_counters", "_resources", "_closed")

    def __init__(self, counters: Counters | None = None) -> None:
        # The middleware passes its counters; standalone (a test, a script) it counts for itself.
        self._counters = counters if counters is not None else Counters()
        self._resources: list[Resource] = []
        self._closed = False

    def add(self, release: Callable[[], object]) -> Resource:
        """Register a release callable (sync, or returning an awaitable); counted as a live resource."""
        return self._register(release, "live_resources", 1)

    def retain(self, nbytes: int) -> Resource:
        """Account ``nbytes`` of request input held by the package until released."""
        return self._register(_noop, "retained_input_bytes", nbytes)

    def retain_on_disk(self, nbytes: int) -> Resource:
        """Account ``nbytes`` of request input held in a temporary file (``retained_disk_bytes``), not in RAM."""
        return self._register(_noop, "retained_disk_bytes", nbytes)

    def _register(self, release: Callable[[], object], gauge: str, amount: int) -> Resource:
        if self._closed:
            # A resource acquired after settlement would never be released: refuse it.
            raise RuntimeError("the request's resources are already released")
        resource = Resource(release, self._counters, gauge, amount)
        self._resources.append(resource)
        return resource

    @property
    def held(self) -> int:
        return sum(not r.released for r in self._resources)

    async def aclose(self) -> None:
        """Release everything still held, last acquired first. Safe to call more than once."""
        self._closed = True
        resources, self._resources = self._resources, []
        for resource in reversed(resources):
            await resource.release()

    async def __aenter__(self) -> RequestResources:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
