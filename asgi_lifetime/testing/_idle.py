"""Nothing left held: the gauges of ``LifetimeStats.idle`` and the upstreams' in-flight counts.

An app object is read directly (``app.state.lifetime``, ``app.state.upstream``); a served
gateway through ``GET /lifetime/stats``. The state of a served app changes in the server's
thread, with no event to wait on across threads: ``wait_idle`` polls, bounded by ``within`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import anyio
import httpx

from .._middleware import Lifetime, LifetimeMiddleware
from .._settings import check_argument, positive
from .._stats import GAUGES

__all__ = ["GAUGES", "assert_idle", "held", "wait_idle"]

# What ``LifetimeStats.idle`` looks at: each is 0 between requests.
_POLL = 0.01  # seconds between two looks at an app object (an attribute read)
_POLL_URL = 0.02  # between two GET /lifetime/stats


def held(app: object) -> list[str]:
    """What ``app`` holds right now, one ``"name=value"`` per non-zero gauge or busy upstream;
    empty when idle.

    ``app``: an app built by ``asgi_lifetime.gateway.create_app``, an app with
    ``LifetimeMiddleware`` that has seen a request or its lifespan (the middleware publishes
    ``app.state.lifetime`` then), a ``LifetimeMiddleware`` or a ``Lifetime``. Synchronous: for a
    test whose server runs in another thread, or in a ``lambda`` of your own polling.
    """
    return _held_in(_stats(app))


async def wait_idle(
    target: object,
    *,
    within: float = 5.0,
    extra: Callable[[], Iterable[str]] | None = None,
    client: httpx.AsyncClient | None = None,
) -> dict[str, Any]:
    """Wait until nothing is held, at most ``within`` seconds; return the last stats.

    ```python
    await wait_idle(app)                       # an app object (see ``held``)
    await wait_idle("http://127.0.0.1:8080")   # a served gateway: GET /lifetime/stats
    ```

    The stats are ``/lifetime/stats``'s: the ``LifetimeStats`` fields and ``"upstreams"``.
    ``extra``: more to wait for, a callable returning what else is held (empty when idle),
    e.g. busy connections of a pool of yours. ``client``: for a URL, the client to ask with
    (its base URL and headers are used as they are; otherwise one is made for ``target``).
    Raises ``AssertionError`` listing what is still held after ``within``.
    """
    check_argument("within", within, positive)
    async with _Reader(target, client, within) as read:
        with anyio.move_on_after(within):
            while True:
                stats = await read()
                if not _busy(stats, extra):
                    return stats
                await anyio.sleep(read.poll)
        stats = await read()  # one last look: the deadline may have cut a poll short
        busy = _busy(stats, extra)
        if not busy:
            return stats
        raise AssertionError(f"not idle after {within} s: {', '.join(busy)}")


async def assert_idle(
    target: object,
    *,
    extra: Callable[[], Iterable[str]] | None = None,
    client: httpx.AsyncClient | None = None,
    within: float = 5.0,
) -> dict[str, Any]:
    """Check once that nothing is held (no waiting); return the stats.

    The middleware settles a request before its response's last message goes out, so right
    after a complete response the app is idle. For a response cut short (a disconnect, an
    upstream failure), settling runs on in the server: use ``wait_idle``. ``target``, ``extra``
    and ``client`` as for ``wait_idle``; ``within`` bounds the request to a URL. Raises
    ``AssertionError`` listing what is held.
    """
    async with _Reader(target, client, within) as read:
        stats = await read()
    busy = _busy(stats, extra)
    if busy:
        raise AssertionError(f"not idle: {', '.join(busy)}")
    return stats


def _stats(app: object) -> dict[str, Any]:
    state = getattr(app, "state", None)
    lifetime: object = app if isinstance(app, Lifetime) else getattr(state, "lifetime", None)
    if isinstance(app, LifetimeMiddleware):
        lifetime = app.lifetime
    if not isinstance(lifetime, Lifetime):
        raise TypeError(
            f"no asgi_lifetime state on {app!r}: pass an app from asgi_lifetime.gateway.create_app, an app with "
            "LifetimeMiddleware that has seen a request (it publishes app.state.lifetime), a LifetimeMiddleware, "
            "a Lifetime, or a served gateway's base URL"
        )
    stats: dict[str, Any] = {**lifetime.stats().as_dict(), "upstreams": []}
    describe = getattr(getattr(state, "upstream", None), "describe", None)
    if callable(describe):
        stats["upstreams"] = describe()
    return stats


def _held_in(stats: dict[str, Any]) -> list[str]:
    busy = [f"{gauge}={stats[gauge]}" for gauge in GAUGES if stats.get(gauge)]
    busy += [f"upstream {u['url']} inflight={u['inflight']}" for u in stats.get("upstreams", ()) if u.get("inflight")]
    return busy


def _busy(stats: dict[str, Any], extra: Callable[[], Iterable[str]] | None) -> list[str]:
    return _held_in(stats) + (list(extra()) if extra is not None else [])


class _Reader:
    """Reads the stats of an app object or of a URL (with one client for all the polls)."""

    def __init__(self, target: object, client: httpx.AsyncClient | None, within: float) -> None:
        self.target = target
        self.client = client
        self.within = within
        self.own_client: httpx.AsyncClient | None = None
        self.poll = _POLL_URL if isinstance(target, str) else _POLL
        if not isinstance(target, str):
            _stats(target)  # a wrong target fails now, not at the deadline

    async def __aenter__(self) -> _Reader:
        if isinstance(self.target, str) and self.client is None:
            self.own_client = self.client = httpx.AsyncClient(base_url=self.target, timeout=self.within)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.own_client is not None:
            await self.own_client.aclose()

    async def __call__(self) -> dict[str, Any]:
        if not isinstance(self.target, str):
            return _stats(self.target)
        if self.client is None:  # pragma: no cover - set in __aenter__
            raise RuntimeError("use _Reader as an async context manager")
        url = "/lifetime/stats" if self.own_client is not None else f"{self.target.rstrip('/')}/lifetime/stats"
        response = await self.client.get(url)
        if response.status_code != 200:
            raise AssertionError(f"GET {response.request.url} answered {response.status_code}: {response.text[:200]}")
        stats: dict[str, Any] = response.json()
        return stats
