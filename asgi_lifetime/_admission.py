"""Admission: a slot and a byte budget per request, granted first come, first served.

A request waits at most ``ADMISSION_TIMEOUT`` for a slot, and as long again each time its
body needs more of the byte budget (bytes are charged as they arrive or decode, never from a
declared Content-Length); otherwise it is answered 503 with ``Retry-After`` and what it held
goes back. When every request holding bytes is waiting for more, none could give any back
before a timeout: the youngest is answered 503 at once, so the older ones can finish.
The ticket it gets is released exactly once, whatever way the request settles (the
middleware registers ``ticket.release`` with the request's scope).
"""

from __future__ import annotations

import math
from collections import deque

import anyio

from ._exceptions import AdmissionRejected
from ._stats import Counters

__all__ = ["Admission", "Ticket"]


class _Waiter:
    __slots__ = ("slots", "nbytes", "event", "granted", "ticket", "evicted")

    def __init__(self, slots: int, nbytes: int, ticket: Ticket | None = None) -> None:
        self.slots = slots
        self.nbytes = nbytes
        self.event = anyio.Event()
        self.granted = False
        self.ticket = ticket  # the admitted request a grow is for
        self.evicted = False


class Admission:
    """Limits requests in flight and the sum of their body sizes."""

    def __init__(self, *, max_inflight: int, max_inflight_bytes: int, timeout: float, counters: Counters) -> None:
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.timeout = timeout
        self._counters = counters
        self._waiters: deque[_Waiter] = deque()
        self._closed_reason: str | None = None
        self._admitted = 0  # tickets issued: their order of admission
        self._charged = 0  # live tickets holding bytes

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.timeout))

    def close(self, reason: str = "the gateway is shutting down") -> None:
        """Stop admitting: every later request (and every waiter) is rejected with 503."""
        self._closed_reason = reason
        # Requests still waiting for a slot are turned away; an admitted request growing
        # its byte budget keeps its place.
        for waiter in [w for w in self._waiters if w.slots]:
            self._waiters.remove(waiter)
            waiter.event.set()

    async def acquire(self, nbytes: int) -> Ticket:
        """Wait for a slot and ``nbytes`` of budget; raise ``AdmissionRejected`` after the timeout."""
        await self._wait(1, min(nbytes, self.max_inflight_bytes), front=False)
        self._counters.admitted += 1
        self._admitted += 1
        ticket = Ticket(self, 0, order=self._admitted)
        ticket._set(min(nbytes, self.max_inflight_bytes))
        return ticket

    def _fits(self, slots: int, nbytes: int) -> bool:
        c = self._counters
        return c.inflight_requests + slots <= self.max_inflight and c.inflight_bytes + nbytes <= self.max_inflight_bytes

    def _take(self, slots: int, nbytes: int) -> None:
        self._counters.inflight_requests += slots
        self._counters.inflight_bytes += nbytes

    def _give_back(self, slots: int, nbytes: int) -> None:
        self._counters.inflight_requests -= slots
        self._counters.inflight_bytes -= nbytes
        self._wake()

    def _wake(self) -> None:
        # Strict FIFO: the head waiter is served first, so a large request is not starved
        # by a stream of small ones.
        while self._waiters and self._fits(self._waiters[0].slots, self._waiters[0].nbytes):
            waiter = self._waiters.popleft()
            self._take(waiter.slots, waiter.nbytes)
            waiter.granted = True
            waiter.event.set()
        self._break_deadlock()

    def _break_deadlock(self) -> None:
        """If every request holding bytes waits for more, none can give any back until a timeout:
        turn the youngest away now (503), so its bytes let the older ones finish."""
        if not self._waiters or self._waiters[0].slots or self._charged == 0:
            return
        holders = [w for w in self._waiters if w.ticket is not None and w.ticket.nbytes > 0]
        if len(holders) < self._charged:
            return  # someone holding bytes is doing something else: it may still give them back
        victim = max(holders, key=lambda w: w.ticket.order if w.ticket is not None else 0)
        self._waiters.remove(victim)
        victim.evicted = True
        victim.event.set()

    async def _wait(self, slots: int, nbytes: int, *, front: bool, ticket: Ticket | None = None) -> None:
        if self._closed_reason is not None and slots:
            self._reject(self._closed_reason)
        if not self._waiters and self._fits(slots, nbytes):
            self._take(slots, nbytes)
            return
        waiter = _Waiter(slots, nbytes, ticket)
        if front:
            # Ahead of requests not yet admitted, behind earlier grows (FIFO among those too),
            # and served at once if it fits: nothing else would wake it.
            index = 0
            while index < len(self._waiters) and not self._waiters[index].slots:
                index += 1
            self._waiters.insert(index, waiter)
            self._wake()
        else:
            self._waiters.append(waiter)
        try:
            with anyio.move_on_after(self.timeout):
                await waiter.event.wait()
        except BaseException:
            # Cancelled while waiting: give back a grant that raced the cancellation.
            self._forget(waiter)
            raise
        if waiter.evicted:
            self._reject("server busy: the byte budget is held by requests waiting for each other")
        if not waiter.granted:
            self._forget(waiter)
            self._reject(self._closed_reason or f"server busy: not admitted within {self.timeout:g} seconds")

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.granted:
            self._give_back(waiter.slots, waiter.nbytes)
        elif waiter in self._waiters:
            self._waiters.remove(waiter)
            self._wake()  # the head may have left; whoever is next may fit now

    def _reject(self, message: str) -> None:
        self._counters.rejected += 1
        raise AdmissionRejected(message, retry_after=self.retry_after)


class Ticket:
    """One admitted request's share of the limits."""

    __slots__ = ("_admission", "nbytes", "order", "_released")

    def __init__(self, admission: Admission, nbytes: int, *, order: int = 0) -> None:
        self._admission = admission
        self.nbytes = nbytes
        self.order = order  # older requests are served before younger ones when the budget deadlocks
        self._released = False

    def _set(self, nbytes: int) -> None:
        """Change the charge the admission knows this ticket by (it counts the tickets holding bytes)."""
        self._admission._charged += (nbytes > 0) - (self.nbytes > 0)
        self.nbytes = nbytes

    async def grow(self, nbytes: int) -> None:
        """Charge ``nbytes`` more (a body of unknown length as it is read). Waits like admission,
        ahead of requests not yet admitted, since this one already holds a slot."""
        if self._released or nbytes <= 0:
            return
        extra = min(nbytes, self._admission.max_inflight_bytes - self.nbytes)
        if extra <= 0:
            return
        await self._admission._wait(0, extra, front=True, ticket=self)
        if self._released:  # released while this grow waited: the bytes are nobody's to keep
            self._admission._give_back(0, extra)
            return
        self._set(self.nbytes + extra)

    async def grow_to(self, total: int) -> None:
        """Grow the charge to ``total`` bytes if it is below that."""
        await self.grow(total - self.nbytes)

    def shrink_to(self, total: int) -> None:
        """Give back the charge above ``total`` bytes (a reservation the body did not use)."""
        extra = self.nbytes - max(total, 0)
        if self._released or extra <= 0:
            return
        self._set(self.nbytes - extra)
        self._admission._give_back(0, extra)

    def release(self) -> None:
        """Give the slot and bytes back (idempotent)."""
        if not self._released:
            self._released = True
            self._admission._charged -= self.nbytes > 0
            self._admission._give_back(1, self.nbytes)
