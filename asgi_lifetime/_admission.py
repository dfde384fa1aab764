"""Admission: a slot and a byte budget per request, first come, first served, and no standing queue.

A request waits at most ``ADMISSION_TIMEOUT`` for a slot, and as long again each time its
body needs more of the byte budget (bytes are charged as they arrive or decode, never from a
declared Content-Length); otherwise it is answered 503 with ``Retry-After`` and what it held
goes back. When every request holding bytes is waiting for more, none could give any back
before a timeout: the youngest is answered 503 at once, so the older ones can finish.

The queue for slots absorbs bursts, not overload. When the request that has waited longest
has been waiting more than ``ADMISSION_TARGET_DELAY`` for a whole ``ADMISSION_INTERVAL``
(CoDel's test: the queue delay has stayed above target for an interval), the queue is not
draining: it is *standing*, and it would only add latency to whoever joins it. A new request
that cannot have a slot at once is then answered 503 at once. Requests already waiting keep
their place, served in order up to ``ADMISSION_TIMEOUT``: they joined a queue that was
draining, nobody joins behind them while it stands, and a 503 now would waste the wait they
have already spent. As soon as the queue is back within the target (or empty), new requests
queue again. A target of 0 turns this off: a plain FIFO queue bounded by ``ADMISSION_TIMEOUT``.

An admitted request growing its byte budget is never turned away by this rule (it is not a
new arrival); only the timeout and the deadlock rule above apply to it.

The ticket it gets is released exactly once, whatever way the request settles (the
middleware registers ``ticket.release`` with the request's scope).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import anyio

from ._exceptions import AdmissionRejected
from ._stats import SHED_REASONS, Counters

__all__ = ["Admission", "Ticket"]

logger = logging.getLogger(__name__)


class _Waiter:
    __slots__ = ("slots", "nbytes", "since", "event", "granted", "ticket", "refused")

    def __init__(self, slots: int, nbytes: int, since: float, ticket: Ticket | None = None) -> None:
        self.slots = slots
        self.nbytes = nbytes
        self.since = since  # when it started waiting (the admission's clock)
        self.event = anyio.Event()
        self.granted = False
        self.ticket = ticket  # the admitted request a grow is for
        self.refused: tuple[str, str] | None = None  # (reason, message) when turned away before its timeout


class _QueueDelay:
    """CoDel's question about the queue for slots: has it been within the target lately?

    The queue delay at a moment is how long its oldest waiter has waited (0 when empty). The
    queue is *good* while that is at most ``target``, and *standing* when it has not been good
    for ``interval``. CoDel asks this of the sojourn times of the packets leaving its queue;
    here the oldest waiter's wait is known at every moment, so the answer does not need anyone
    to leave (when every slot is held by a long stream, nobody does).

    The admission reports each change of the oldest waiter (``new_oldest``); between changes the
    delay only grows, so the last good moment is known exactly without a timer.
    """

    __slots__ = ("target", "interval", "_good_at", "_good_until")

    def __init__(self, target: float, interval: float) -> None:
        self.target = target
        self.interval = interval
        self._good_at = -math.inf  # the last good moment before the current oldest waiter
        self._good_until = -math.inf  # when the current oldest waiter's wait passes the target

    def new_oldest(self, since: float | None, now: float) -> None:
        """From ``now`` the oldest waiter is one waiting since ``since`` (``None``: the queue is empty)."""
        self._good_at = max(self._good_at, min(now, self._good_until))
        if since is None:
            self._good_at = now
            self._good_until = -math.inf
        else:
            # A waiter that is already over target when it becomes the oldest does not make the queue good.
            self._good_until = since + self.target if now - since <= self.target else -math.inf

    def standing(self, waiting: bool, now: float) -> bool:
        if self.target <= 0 or not waiting:
            return False
        good_at = max(self._good_at, min(now, self._good_until))
        return now - good_at >= self.interval


class Admission:
    """Limits requests in flight and the sum of their body sizes; sheds arrivals at a standing queue.

    ``target_delay`` 0 (the default here; settings give ``ADMISSION_TARGET_DELAY``) keeps a
    plain FIFO queue. ``clock`` is read for queue delays (tests pass their own).
    """

    def __init__(
        self,
        *,
        max_inflight: int,
        max_inflight_bytes: int,
        timeout: float,
        counters: Counters,
        target_delay: float = 0.0,
        interval: float = 1.0,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.timeout = timeout
        self._counters = counters
        self._clock = clock
        self._delay = _QueueDelay(target_delay, interval)
        self._arrivals: deque[_Waiter] = deque()  # requests waiting for a slot, oldest first
        self._grows: deque[_Waiter] = deque()  # admitted requests waiting for bytes: served first
        self._closed_reason: str | None = None
        self._admitted = 0  # tickets issued: their order of admission
        self._charged = 0  # live tickets holding bytes
        self._wait_listeners: list[Callable[[float], None]] = []

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.timeout))

    @property
    def target_delay(self) -> float:
        return self._delay.target

    @property
    def interval(self) -> float:
        return self._delay.interval

    def on_admitted(self, listener: Callable[[float], None]) -> None:
        """Call ``listener(seconds)`` with each admitted request's wait for its slot (0 when at once)."""
        self._wait_listeners.append(listener)

    def standing(self) -> bool:
        """Whether the queue for slots is standing now (a new request that must wait is refused)."""
        return self._delay.standing(bool(self._arrivals), self._clock())

    def close(self, reason: str = "the gateway is shutting down") -> None:
        """Stop admitting: every later request (and every waiter) is rejected with 503."""
        self._closed_reason = reason
        # Requests still waiting for a slot are turned away; an admitted request growing its
        # byte budget keeps its place.
        for waiter in list(self._arrivals):
            self._remove(waiter)
            waiter.refused = ("draining", reason)
            waiter.event.set()

    def admits_now(self) -> bool:
        """Whether a request arriving now would have a slot at once, without waiting (or being refused)."""
        return self._closed_reason is None and not self._grows and not self._arrivals and self._fits(1, 0)

    async def acquire(self, nbytes: int) -> Ticket:
        """Wait for a slot and ``nbytes`` of budget; raise ``AdmissionRejected`` when refused."""
        waited = await self._wait(1, min(nbytes, self.max_inflight_bytes))
        self._counters.admitted += 1
        self._admitted += 1
        ticket = Ticket(self, 0, order=self._admitted)
        ticket._set(min(nbytes, self.max_inflight_bytes))
        for listener in self._wait_listeners:
            try:
                listener(waited)
            except Exception:  # a metrics hook must not cost the request its slot (nor leak it)
                logger.exception("admission wait listener %r failed", listener)
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

    def _remove(self, waiter: _Waiter) -> None:
        if not waiter.slots:
            self._grows.remove(waiter)
            return
        arrivals = self._arrivals
        oldest = arrivals[0] is waiter
        arrivals.remove(waiter)
        self._counters.queued_requests -= 1
        if oldest:
            self._delay.new_oldest(arrivals[0].since if arrivals else None, self._clock())

    def _wake(self) -> None:
        # Strict FIFO, grows (requests already admitted) first: the head waiter is served first,
        # so a large request is not starved by a stream of small ones.
        while True:
            queue = self._grows or self._arrivals
            if not queue or not self._fits(queue[0].slots, queue[0].nbytes):
                break
            waiter = queue[0]
            self._remove(waiter)
            self._take(waiter.slots, waiter.nbytes)
            waiter.granted = True
            waiter.event.set()
        self._break_deadlock()

    def _break_deadlock(self) -> None:
        """If every request holding bytes waits for more, none can give any back until a timeout:
        turn the youngest away now (503), so its bytes let the older ones finish."""
        if not self._grows or self._charged == 0:
            return
        holders = [w for w in self._grows if w.ticket is not None and w.ticket.nbytes > 0]
        if len(holders) < self._charged:
            return  # someone holding bytes is doing something else: it may still give them back
        victim = max(holders, key=lambda w: w.ticket.order if w.ticket is not None else 0)
        self._remove(victim)
        victim.refused = ("budget_deadlock", "server busy: the byte budget is held by requests waiting for each other")
        victim.event.set()

    async def _wait(self, slots: int, nbytes: int, *, ticket: Ticket | None = None) -> float:
        """Wait for ``slots`` and ``nbytes``; the seconds waited. A grow (no slot) goes ahead of
        requests not yet admitted, behind earlier grows (FIFO among those too)."""
        if self._closed_reason is not None and slots:
            self._reject("draining", self._closed_reason)
        if not self._grows and (not slots or not self._arrivals) and self._fits(slots, nbytes):
            self._take(slots, nbytes)
            return 0.0
        now = self._clock()
        if slots and self._delay.standing(bool(self._arrivals), now):
            self._reject("standing_queue", "server busy: the admission queue is not draining")
        waiter = _Waiter(slots, nbytes, now, ticket)
        if slots:
            self._arrivals.append(waiter)
            self._counters.queued_requests += 1
            if len(self._arrivals) == 1:
                self._delay.new_oldest(now, now)
        else:
            self._grows.append(waiter)
            self._wake()  # served at once if it fits: nothing else would wake it
        try:
            with anyio.move_on_after(self.timeout):
                await waiter.event.wait()
        except BaseException:
            # Cancelled while waiting: give back a grant that raced the cancellation.
            self._forget(waiter)
            raise
        if waiter.refused is not None:
            self._reject(*waiter.refused)
        if not waiter.granted:
            self._forget(waiter)
            self._reject("timeout", self._closed_reason or f"server busy: not admitted within {self.timeout:g} seconds")
        return max(0.0, self._clock() - waiter.since)

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.granted:
            self._give_back(waiter.slots, waiter.nbytes)
        elif waiter in (self._arrivals if waiter.slots else self._grows):
            self._remove(waiter)
            self._wake()  # the head may have left; whoever is next may fit now

    def _reject(self, reason: str, message: str) -> NoReturn:
        counters = self._counters
        counters.rejected += 1
        field = SHED_REASONS[reason]
        setattr(counters, field, getattr(counters, field) + 1)
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
        await self._admission._wait(0, extra, ticket=self)
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
