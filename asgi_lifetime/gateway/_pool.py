"""Choosing an upstream replica for each request.

A conversation must reach the same replica every time so that replica's prefix cache is
reused. Requests with a session id are placed by **rendezvous (highest random weight)
hashing**: every upstream gets a score ``blake2b(url, session_id)`` and the highest score
wins. Compared with a modulo hash or a consistent-hash ring:

- adding or removing one upstream moves only that upstream's share of sessions (a modulo
  hash would reshuffle nearly all of them, and every prefix cache would go cold);
- there is no ring, no virtual nodes and no state to rebuild: the choice is a pure
  function of the session id and the URL list, so it is the same in every worker process
  and after every restart (``blake2b`` is stable; the built-in ``hash()`` is salted);
- fail-over is natural: when the winner is down or excluded (already tried), the session
  goes to its second-highest score, and comes back as soon as the winner is up again.

Requests without a session id have no cache to return to, so they go where they will wait
least: the upstream with the fewest requests in flight. Ties (the usual case at low load)
are broken round-robin, so load spreads even when requests arrive one at a time.

An upstream that failed to connect is marked down for ``cooloff`` seconds and skipped;
after that it is eligible again (a half-open retry), and a success clears the mark. If
every candidate is down, the best one is tried anyway: attempting beats failing outright.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from .._settings import check_argument, non_negative

__all__ = ["UpstreamPool", "UpstreamState"]


@dataclass(frozen=True, slots=True)
class UpstreamState:
    """A point-in-time view of one upstream, for ``/lifetime/stats`` and metrics."""

    url: str
    inflight: int
    down_until: float | None  # clock value until which the upstream is skipped, or None when up
    total_requests: int
    failures: int


class _Upstream:
    __slots__ = ("url", "seed", "inflight", "down_until", "total_requests", "failures")

    def __init__(self, url: str) -> None:
        self.url = url
        encoded = url.encode()
        # Length-prefixed, so no (url, session id) pair can collide with another by
        # shifting bytes across the boundary. Copied per session instead of rehashing the URL.
        self.seed = hashlib.blake2b(len(encoded).to_bytes(4, "big") + encoded, digest_size=8)
        self.inflight = 0
        self.down_until: float | None = None
        self.total_requests = 0
        self.failures = 0

    def score(self, session_id: bytes) -> int:
        h = self.seed.copy()
        h.update(session_id)
        return int.from_bytes(h.digest(), "big")


class UpstreamPool:
    """Upstream replicas with session affinity, least-in-flight balancing and cool-off.

    Only touched from the event loop thread, so plain ints suffice:

        pool = UpstreamPool(["http://a:8000", "http://b:8000"], cooloff=30.0)
        url = pool.choose(session_id)
        release = pool.acquire(url)
        try:
            ...  # forward the request to url; pool.mark_down(url) on a connect failure
        finally:
            release()
    """

    def __init__(self, urls: Sequence[str], *, cooloff: float, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(urls, str):
            raise TypeError("urls must be a sequence of upstream URLs, not a single string")
        if not urls:
            raise ValueError("urls must name at least one upstream")
        seen: set[str] = set()
        for url in urls:
            if not url:
                raise ValueError("urls must not contain an empty URL")
            if url in seen:
                raise ValueError(f"urls contains {url!r} more than once")
            seen.add(url)
        check_argument("cooloff", cooloff, non_negative)
        self.urls: tuple[str, ...] = tuple(urls)
        self.cooloff = cooloff
        self._clock = clock
        self._upstreams = [_Upstream(url) for url in self.urls]
        self._by_url = {u.url: u for u in self._upstreams}
        self._next = 0  # where the next round-robin scan starts

    def _get(self, url: str) -> _Upstream:
        try:
            return self._by_url[url]
        except KeyError:
            raise ValueError(f"{url!r} is not an upstream of this pool") from None

    def _candidates(self, exclude: Collection[str]) -> list[int]:
        """Indices to choose among: up and not excluded, else not excluded, else all."""
        now = self._clock()
        allowed = [i for i, u in enumerate(self._upstreams) if u.url not in exclude]
        up = [i for i in allowed if not self._down_at(self._upstreams[i], now)]
        return up or allowed or list(range(len(self._upstreams)))

    @staticmethod
    def _down_at(upstream: _Upstream, now: float) -> bool:
        return upstream.down_until is not None and now < upstream.down_until

    def choose(self, session_id: str | None, *, exclude: Collection[str] = ()) -> str:
        """The upstream for a request: by rendezvous hash with a session id, else least in flight.

        ``exclude`` holds upstreams already tried for this request. Down and excluded
        upstreams are avoided, but a URL is always returned.
        """
        candidates = self._candidates(exclude)
        if session_id is not None:
            key = session_id.encode("utf-8", "surrogatepass")
            best = max(candidates, key=lambda i: (self._upstreams[i].score(key), self._upstreams[i].url))
            return self._upstreams[best].url
        n = len(self._upstreams)
        allowed = set(candidates)
        chosen = -1
        for step in range(n):
            i = (self._next + step) % n
            if i in allowed and (chosen < 0 or self._upstreams[i].inflight < self._upstreams[chosen].inflight):
                chosen = i
        self._next = (chosen + 1) % n
        return self._upstreams[chosen].url

    def acquire(self, url: str) -> Callable[[], None]:
        """Count a request in flight on ``url``; the returned release may be called any number of times."""
        upstream = self._get(url)
        upstream.inflight += 1
        upstream.total_requests += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            upstream.inflight = max(0, upstream.inflight - 1)

        return release

    def mark_down(self, url: str) -> None:
        """Record a connect failure: skip ``url`` for ``cooloff`` seconds."""
        upstream = self._get(url)
        upstream.failures += 1
        upstream.down_until = self._clock() + self.cooloff

    def mark_up(self, url: str) -> None:
        """Record a success: ``url`` is eligible again at once."""
        self._get(url).down_until = None

    def is_down(self, url: str) -> bool:
        return self._down_at(self._get(url), self._clock())

    def inflight(self, url: str) -> int:
        return self._get(url).inflight

    def snapshot(self) -> list[UpstreamState]:
        now = self._clock()
        return [
            UpstreamState(
                url=u.url,
                inflight=u.inflight,
                down_until=u.down_until if self._down_at(u, now) else None,
                total_requests=u.total_requests,
                failures=u.failures,
            )
            for u in self._upstreams
        ]
