from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from anyio.abc import TaskGroup

from asgi_lifetime._admission import Admission, Ticket, _QueueDelay
from asgi_lifetime._exceptions import AdmissionRejected, BodyAborted
from asgi_lifetime._middleware import _acquire_watching
from asgi_lifetime._stats import Counters

from ._asgi import receiving

pytestmark = pytest.mark.anyio

BUDGET = 1000


@pytest.fixture
def counters() -> Iterator[Counters]:
    counters = Counters()
    yield counters
    # Whatever a test did, everything it was granted has been given back.
    assert counters.inflight_requests == 0
    assert counters.inflight_bytes == 0


def make(counters: Counters, *, max_inflight: int = 10, timeout: float = 10.0) -> Admission:
    return Admission(max_inflight=max_inflight, max_inflight_bytes=BUDGET, timeout=timeout, counters=counters)


def queued(admission: Admission) -> int:
    return len(admission._arrivals) + len(admission._grows)


class Requester:
    """Acquires in a task; the test looks at ``admitted`` and releases through ``ticket``."""

    def __init__(self, admission: Admission, nbytes: int, log: list[str] | None = None, name: str = "") -> None:
        self.admission = admission
        self.nbytes = nbytes
        self.log = log
        self.name = name
        self.admitted = anyio.Event()
        self.ticket: Ticket | None = None
        self.error: AdmissionRejected | None = None
        self.done = anyio.Event()

    async def __call__(self) -> None:
        try:
            self.ticket = await self.admission.acquire(self.nbytes)
        except AdmissionRejected as exc:
            self.error = exc
        else:
            if self.log is not None:
                self.log.append(self.name)
            self.admitted.set()
        finally:
            self.done.set()

    def release(self) -> None:
        assert self.ticket is not None
        self.ticket.release()


async def start(tg: TaskGroup, requester: Requester) -> Requester:
    tg.start_soon(requester)
    await anyio.wait_all_tasks_blocked()
    return requester


async def test_admits_immediately_under_limits(counters: Counters) -> None:
    admission = make(counters)
    with anyio.fail_after(1):
        first = await admission.acquire(100)
        second = await admission.acquire(200)
    assert (first.nbytes, second.nbytes) == (100, 200)
    assert counters.inflight_requests == 2
    assert counters.inflight_bytes == 300
    assert counters.admitted == 2
    first.release()
    second.release()
    assert counters.snapshot().idle


async def test_request_larger_than_budget_is_charged_the_budget(counters: Counters) -> None:
    admission = make(counters)
    with anyio.fail_after(1):
        ticket = await admission.acquire(BUDGET * 5)
    assert ticket.nbytes == BUDGET
    assert counters.inflight_bytes == BUDGET
    ticket.release()


async def test_slot_limit(counters: Counters) -> None:
    admission = make(counters, max_inflight=1)
    first = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        second = await start(tg, Requester(admission, 1))
        assert not second.admitted.is_set()
        assert queued(admission) == 1
        assert counters.inflight_requests == 1
        first.release()
        with anyio.fail_after(1):
            await second.admitted.wait()
        assert counters.inflight_requests == 1
        assert queued(admission) == 0
        second.release()


async def test_byte_budget(counters: Counters) -> None:
    admission = make(counters)
    first = await admission.acquire(600)
    async with anyio.create_task_group() as tg:
        second = await start(tg, Requester(admission, 500))
        assert not second.admitted.is_set()
        assert counters.inflight_bytes == 600
        first.release()
        with anyio.fail_after(1):
            await second.admitted.wait()
        assert counters.inflight_bytes == 500
        second.release()


async def test_timeout_rejects_with_503(counters: Counters) -> None:
    admission = make(counters, max_inflight=1, timeout=0.05)
    holder = await admission.acquire(1)
    with anyio.fail_after(2), pytest.raises(AdmissionRejected) as info:
        await admission.acquire(1)
    assert info.value.status_code == 503
    assert info.value.headers == {"retry-after": "1"}  # the client may retry: nothing went upstream
    assert "not admitted within 0.05 seconds" in info.value.message
    assert counters.rejected == 1
    assert counters.admitted == 1
    assert queued(admission) == 0
    holder.release()
    # The rejected request left nothing behind: the next one is admitted at once.
    with anyio.fail_after(1):
        (await admission.acquire(1)).release()


@pytest.mark.parametrize(("timeout", "retry_after"), [(0, 1), (0.2, 1), (1, 1), (2.5, 3), (10, 10)])
def test_retry_after_rounds_timeout_up(timeout: float, retry_after: int) -> None:
    assert make(Counters(), timeout=timeout).retry_after == retry_after


async def test_fifo_order(counters: Counters) -> None:
    admission = make(counters, max_inflight=1)
    holder = await admission.acquire(1)
    log: list[str] = []

    class ReleasingRequester(Requester):
        async def __call__(self) -> None:
            await super().__call__()
            self.release()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for name in ["a", "b", "c"]:
                await start(tg, ReleasingRequester(admission, 1, log, name))
            assert log == []
            assert queued(admission) == 3
            holder.release()
    assert log == ["a", "b", "c"]
    assert counters.admitted == 4


async def test_large_head_waiter_is_not_overtaken(counters: Counters) -> None:
    admission = make(counters)
    holder = await admission.acquire(600)
    log: list[str] = []
    async with anyio.create_task_group() as tg:
        big = await start(tg, Requester(admission, 900, log, "big"))
        small = await start(tg, Requester(admission, 200, log, "small"))  # 800 would fit, but big is first
        assert log == []
        holder.release()
        with anyio.fail_after(1):
            await big.admitted.wait()
        await anyio.wait_all_tasks_blocked()
        assert not small.admitted.is_set()  # 900 + 200 > budget
        big.release()
        with anyio.fail_after(1):
            await small.admitted.wait()
        small.release()
    assert log == ["big", "small"]


async def test_cancelled_waiter_leaves_nothing_behind(counters: Counters) -> None:
    admission = make(counters, max_inflight=1)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        await start(tg, Requester(admission, 1))
        assert queued(admission) == 1
        tg.cancel_scope.cancel()
    assert queued(admission) == 0
    assert counters.inflight_requests == 1
    assert counters.rejected == 0
    holder.release()
    with anyio.fail_after(1):
        (await admission.acquire(1)).release()


async def test_cancelled_head_waiter_lets_the_next_in(counters: Counters) -> None:
    admission = make(counters)
    holder = await admission.acquire(600)
    async with anyio.create_task_group() as tg:
        big_scope = anyio.CancelScope()
        big = Requester(admission, 900)

        async def cancellable_big() -> None:
            with big_scope:
                await big()

        tg.start_soon(cancellable_big)
        await anyio.wait_all_tasks_blocked()
        small = await start(tg, Requester(admission, 200))
        assert not small.admitted.is_set()
        big_scope.cancel()
        with anyio.fail_after(1):
            await small.admitted.wait()  # fits next to the holder once the head is gone
        assert big.ticket is None
        assert counters.inflight_bytes == 800
        small.release()
    holder.release()


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_grant_racing_cancellation_is_given_back(counters: Counters, cancel_first: bool) -> None:
    admission = make(counters, max_inflight=1)
    holder = await admission.acquire(10)
    waiter_scope = anyio.CancelScope()

    async def waiter() -> None:
        with waiter_scope:
            ticket = await admission.acquire(10)
            try:
                await anyio.sleep_forever()
            finally:
                ticket.release()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert queued(admission) == 1
            # Same tick: the grant and the cancellation race.
            if cancel_first:
                waiter_scope.cancel()
                holder.release()
            else:
                holder.release()
                waiter_scope.cancel()
    assert queued(admission) == 0
    assert counters.inflight_requests == 0
    assert counters.inflight_bytes == 0
    with anyio.fail_after(1):
        (await admission.acquire(10)).release()


async def test_release_is_idempotent(counters: Counters) -> None:
    admission = make(counters, max_inflight=1)
    ticket = await admission.acquire(100)
    ticket.release()
    ticket.release()
    assert counters.inflight_requests == 0
    assert counters.inflight_bytes == 0
    # A second release does not hand out a slot it does not hold.
    first = await admission.acquire(1)
    ticket.release()
    async with anyio.create_task_group() as tg:
        second = await start(tg, Requester(admission, 1))
        assert not second.admitted.is_set()
        first.release()
        with anyio.fail_after(1):
            await second.admitted.wait()
        second.release()


async def test_grow_charges_bytes(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(100)
    with anyio.fail_after(1):
        await ticket.grow(50)
        assert (ticket.nbytes, counters.inflight_bytes) == (150, 150)
        await ticket.grow(0)
        await ticket.grow(-20)
        assert (ticket.nbytes, counters.inflight_bytes) == (150, 150)
        await ticket.grow(BUDGET * 3)  # capped: one request never holds more than the budget
        assert (ticket.nbytes, counters.inflight_bytes) == (BUDGET, BUDGET)
        await ticket.grow(1)
        assert ticket.nbytes == BUDGET
    assert counters.inflight_requests == 1
    ticket.release()
    await ticket.grow(100)  # after release: nothing charged
    assert counters.inflight_bytes == 0


async def test_grow_waits_when_over_budget(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(600)
    other = await admission.acquire(300)
    grown = anyio.Event()

    async def grow() -> None:
        await ticket.grow(300)
        grown.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(grow)
        await anyio.wait_all_tasks_blocked()
        assert not grown.is_set()
        assert counters.inflight_bytes == 900
        other.release()
        with anyio.fail_after(1):
            await grown.wait()
    assert ticket.nbytes == 900
    assert counters.inflight_bytes == 900
    ticket.release()


async def test_grow_that_fits_does_not_wait_behind_waiters(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(500)
    async with anyio.create_task_group() as tg:
        waiter = await start(tg, Requester(admission, 600))
        assert queued(admission) == 1
        with anyio.fail_after(1):
            await ticket.grow(100)  # 600 of 1000: there is room, nobody needs to release first
        assert ticket.nbytes == 600
        assert not waiter.admitted.is_set()
        ticket.release()
        with anyio.fail_after(1):
            await waiter.admitted.wait()
        waiter.release()


async def test_grow_goes_ahead_of_waiters(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(400)
    other = await admission.acquire(400)
    grown = anyio.Event()

    async def grow() -> None:
        await ticket.grow(300)
        grown.set()

    async with anyio.create_task_group() as tg:
        waiter = await start(tg, Requester(admission, 400))  # arrived first
        tg.start_soon(grow)
        await anyio.wait_all_tasks_blocked()
        assert not grown.is_set()
        other.release()  # 400 free: either the grow (300) or the waiter (400) could go
        with anyio.fail_after(1):
            await grown.wait()
        await anyio.wait_all_tasks_blocked()
        assert not waiter.admitted.is_set()  # 700 + 400 > budget
        ticket.release()
        with anyio.fail_after(1):
            await waiter.admitted.wait()
        waiter.release()


async def test_grows_are_served_in_order(counters: Counters) -> None:
    admission = make(counters)
    first = await admission.acquire(300)
    second = await admission.acquire(300)
    blocker = await admission.acquire(400)
    log: list[str] = []

    async def grow(ticket: Ticket, nbytes: int, name: str) -> None:
        await ticket.grow(nbytes)
        log.append(name)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(grow, first, 300, "first")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(grow, second, 200, "second")  # smaller, but later
            await anyio.wait_all_tasks_blocked()
            blocker.release()  # 400 free: room for the first grow, not both
            await anyio.wait_all_tasks_blocked()
            assert log == ["first"]
            first.release()
    assert log == ["first", "second"]
    assert second.nbytes == 500
    second.release()


async def test_release_while_grow_waits_does_not_leak(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(600)
    other = await admission.acquire(400)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticket.grow, 300)
        await anyio.wait_all_tasks_blocked()
        ticket.release()  # e.g. the request settled elsewhere while its body was being charged
    assert counters.inflight_bytes == 400
    other.release()
    assert counters.inflight_bytes == 0


async def test_timed_out_grow_is_rejected_and_forgotten(counters: Counters) -> None:
    admission = make(counters, timeout=0.05)
    ticket = await admission.acquire(600)
    other = await admission.acquire(400)
    with anyio.fail_after(2), pytest.raises(AdmissionRejected):
        await ticket.grow(100)
    assert ticket.nbytes == 600
    assert queued(admission) == 0
    assert counters.rejected == 1
    ticket.release()
    other.release()


async def test_close_rejects_waiting_and_new_requests(counters: Counters) -> None:
    admission = make(counters, max_inflight=1)
    holder = await admission.acquire(100)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        admission.close("draining for deploy")
        with anyio.fail_after(1):
            await waiting.done.wait()
    assert waiting.ticket is None
    assert waiting.error is not None
    assert waiting.error.status_code == 503
    assert waiting.error.message == "draining for deploy"
    assert "retry-after" in waiting.error.headers
    assert queued(admission) == 0

    with pytest.raises(AdmissionRejected, match="^draining for deploy$") as info:
        await admission.acquire(1)
    assert info.value.status_code == 503
    assert counters.rejected == 2

    # The admitted request carries on: its grows still work.
    with anyio.fail_after(1):
        await holder.grow(100)
    assert holder.nbytes == 200
    holder.release()
    with pytest.raises(AdmissionRejected):  # a freed slot does not reopen admission
        await admission.acquire(1)


async def test_close_default_reason(counters: Counters) -> None:
    admission = make(counters)
    admission.close()
    with pytest.raises(AdmissionRejected, match="shutting down"):
        await admission.acquire(1)
    assert counters.admitted == 0


async def test_close_keeps_waiting_grows(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(600)
    other = await admission.acquire(400)
    grown = anyio.Event()

    async def grow() -> None:
        await ticket.grow(300)
        grown.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(grow)
        await anyio.wait_all_tasks_blocked()
        admission.close()
        await anyio.wait_all_tasks_blocked()
        assert not grown.is_set()
        assert queued(admission) == 1
        other.release()
        with anyio.fail_after(1):
            await grown.wait()
    assert ticket.nbytes == 900
    assert counters.rejected == 0
    ticket.release()


async def test_shrink_to_gives_back_the_unused_reservation(counters: Counters) -> None:
    admission = make(counters)
    ticket = await admission.acquire(0)
    await ticket.grow_to(900)
    waiter = Requester(admission, 300)
    async with anyio.create_task_group() as tg:
        await start(tg, waiter)
        assert not waiter.admitted.is_set()
        ticket.shrink_to(600)  # the body ended up smaller than its last reserved step
        with anyio.fail_after(2):
            await waiter.admitted.wait()
    assert ticket.nbytes == 600 and counters.inflight_bytes == 900
    ticket.shrink_to(700)  # never grows
    ticket.shrink_to(-5)  # nor goes below nothing
    assert ticket.nbytes == 0 and counters.inflight_bytes == 300
    ticket.release()
    ticket.shrink_to(0)  # after release: nothing to give back twice
    waiter.release()


async def test_requests_stuck_mid_body_waiting_on_each_other_come_unstuck(counters: Counters) -> None:
    """Admitted with no bytes, each body charged as it arrives: when every request holding bytes
    waits for more, nobody could give any back before the timeout. The youngest is turned away at
    once (503) and its bytes go back, until the oldest can finish. Nothing waits for a timeout."""
    admission = make(counters, timeout=30)
    outcomes: dict[int, str] = {}
    halfway = [anyio.Event() for _ in range(3)]
    go = anyio.Event()

    async def body(index: int) -> None:
        ticket = await admission.acquire(0)
        try:
            await ticket.grow_to(300)  # 900 of 1000 held by the three
            halfway[index].set()
            await go.wait()
            for total in range(400, 1001, 100):  # each wants all of it
                await ticket.grow_to(total)
            outcomes[ticket.order] = "completed"
        except AdmissionRejected as exc:
            assert "waiting for each other" in exc.message
            outcomes[ticket.order] = "rejected"
        finally:
            ticket.release()  # as the middleware's request scope does

    with anyio.fail_after(2):  # far below the admission timeout
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(body, index)
            for event in halfway:
                await event.wait()
            assert counters.inflight_bytes == 900
            go.set()
    assert [outcomes[order] for order in sorted(outcomes)] == ["completed", "rejected", "rejected"]
    assert counters.rejected == 2


async def test_no_request_is_turned_away_while_a_holder_may_still_give_back(counters: Counters) -> None:
    """A grow waits (up to the timeout) while someone holding bytes is not itself waiting for more."""
    admission = make(counters, timeout=0.1)
    busy = await admission.acquire(0)
    await busy.grow_to(600)  # e.g. its body is read and the app is running
    waiting = await admission.acquire(0)
    await waiting.grow_to(300)
    with anyio.fail_after(2), pytest.raises(AdmissionRejected) as excinfo:
        await waiting.grow_to(500)
    assert "not admitted within" in excinfo.value.message  # the timeout, not the deadlock breaker
    waiting.release()
    busy.release()


# ---------------------------------------------------------------------------------------------
# Standing queue (CoDel-style shedding of new arrivals), driven by an injected clock

TARGET = 0.05
INTERVAL = 0.5


class Clock:
    """The admission's clock, moved by hand: queue delays without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def shedding(
    counters: Counters, clock: Clock, *, max_inflight: int = 1, timeout: float = 30.0, target: float = TARGET
) -> Admission:
    return Admission(
        max_inflight=max_inflight,
        max_inflight_bytes=BUDGET,
        timeout=timeout,
        counters=counters,
        target_delay=target,
        interval=INTERVAL,
        clock=clock,
    )


@pytest.mark.parametrize(
    ("waited", "standing"),
    [
        (0.0, False),
        (TARGET, False),
        (TARGET + INTERVAL - 0.01, False),  # above target, but not yet for a whole interval
        (TARGET + INTERVAL + 0.01, True),
        (60.0, True),
    ],
)
def test_queue_delay_standing_after_target_for_an_interval(waited: float, standing: bool) -> None:
    delay = _QueueDelay(TARGET, INTERVAL)
    assert not delay.standing(False, 100.0)  # an empty queue is good
    delay.new_oldest(100.0, 100.0)
    assert delay.standing(True, 100.0 + waited) is standing


def test_queue_delay_an_oldest_waiter_already_over_target_does_not_make_the_queue_good() -> None:
    """FIFO under overload: each waiter becomes the oldest after waiting longer than the target, so
    the queue has been bad since the first one passed it, however many have left since."""
    delay = _QueueDelay(TARGET, INTERVAL)
    delay.new_oldest(0.0, 0.0)  # A arrives at 0 (B at 0.2 changes nothing)
    delay.new_oldest(0.2, 0.4)  # A admitted at 0.4: B, waiting for 0.2 s already, is the oldest
    assert not delay.standing(True, TARGET + INTERVAL - 0.01)
    delay.new_oldest(0.5, 0.7)  # B admitted at 0.7: C (arrived at 0.5) is the oldest
    assert delay.standing(True, 0.7)  # bad since 0.05: for more than an interval


def test_queue_delay_an_oldest_waiter_within_target_makes_the_queue_good() -> None:
    delay = _QueueDelay(TARGET, INTERVAL)
    delay.new_oldest(0.0, 0.0)
    delay.new_oldest(0.38, 0.4)  # the next one had waited 0.02 s: good again until 0.43
    assert not delay.standing(True, 0.43 + INTERVAL - 0.01)
    assert delay.standing(True, 0.43 + INTERVAL + 0.01)


def test_queue_delay_an_empty_queue_is_good() -> None:
    delay = _QueueDelay(TARGET, INTERVAL)
    delay.new_oldest(0.0, 0.0)
    assert delay.standing(True, 5.0)
    delay.new_oldest(None, 5.0)  # emptied at 5
    assert not delay.standing(False, 5.5)
    delay.new_oldest(6.0, 6.0)
    assert not delay.standing(True, 6.0 + TARGET + INTERVAL - 0.01)
    assert delay.standing(True, 6.0 + TARGET + INTERVAL + 0.01)


def test_queue_delay_target_zero_never_stands() -> None:
    delay = _QueueDelay(0.0, INTERVAL)
    delay.new_oldest(0.0, 0.0)
    assert not delay.standing(True, 1e6)


async def test_standing_queue_refuses_new_arrivals_at_once(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock)
    waits: list[float] = []
    admission.on_admitted(waits.append)
    holder = await admission.acquire(1)  # e.g. a long stream: nothing drains
    async with anyio.create_task_group() as tg:
        first = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL - 0.01)
        assert not admission.standing()
        second = await start(tg, Requester(admission, 1))  # over target, not for an interval yet: queued
        assert counters.queued_requests == 2
        clock.advance(0.02)
        assert admission.standing()
        with anyio.fail_after(1), pytest.raises(AdmissionRejected) as info:
            await admission.acquire(1)  # refused without waiting: the fake clock never moves here
        assert info.value.status_code == 503
        assert info.value.headers == {"retry-after": "30"}
        assert "not draining" in info.value.message
        assert (counters.shed_standing_queue, counters.rejected, counters.queued_requests) == (1, 1, 2)
        # Those already waiting keep their place, in order.
        clock.advance(0.1)
        holder.release()
        with anyio.fail_after(1):
            await first.admitted.wait()
        assert not second.admitted.is_set()
        first.release()
        with anyio.fail_after(1):
            await second.admitted.wait()
        second.release()
    assert waits == [0.0, pytest.approx(TARGET + INTERVAL + 0.11), pytest.approx(0.12)]
    assert counters.shed_timeout == 0
    assert counters.queued_requests == 0


async def test_burst_draining_within_the_interval_is_queued_and_admitted(counters: Counters) -> None:
    """Over target, but draining: every request of the burst, and one arriving during it, is admitted."""
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        burst = [await start(tg, Requester(admission, 1)) for _ in range(3)]
        assert counters.queued_requests == 3
        previous = holder.release
        for index, requester in enumerate(burst):
            clock.advance(0.1)  # each waits 0.1 s more than the last: over TARGET
            previous()
            with anyio.fail_after(1):
                await requester.admitted.wait()
            if index == 1:  # 0.2 s into the burst: the queue is bad, but not for an interval
                assert not admission.standing()
                late = await start(tg, Requester(admission, 1))
                burst.append(late)
            previous = requester.release
        clock.advance(0.1)
        previous()
        with anyio.fail_after(1):
            await burst[-1].admitted.wait()
        burst[-1].release()
    assert counters.admitted == 5
    assert counters.rejected == 0


async def test_queue_stands_while_older_waiters_drain(counters: Counters) -> None:
    """Served in order under overload, each waiter has waited past the target by its turn: the queue
    stands once the first passed the target an interval ago, though requests keep being admitted."""
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        a = await start(tg, Requester(admission, 1))
        clock.advance(0.2)
        b = await start(tg, Requester(admission, 1))
        clock.advance(0.2)
        holder.release()
        with anyio.fail_after(1):
            await a.admitted.wait()
        clock.advance(0.1)
        c = await start(tg, Requester(admission, 1))  # 0.45 s over target: not an interval yet
        clock.advance(0.2)
        a.release()
        with anyio.fail_after(1):
            await b.admitted.wait()
        assert admission.standing()
        with pytest.raises(AdmissionRejected, match="not draining"):
            await admission.acquire(1)
        b.release()
        with anyio.fail_after(1):
            await c.admitted.wait()
        c.release()
    assert (counters.admitted, counters.shed_standing_queue) == (4, 1)


async def test_recovers_once_the_queue_drains(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL + 0.01)
        with pytest.raises(AdmissionRejected):
            await admission.acquire(1)
        holder.release()  # the queue drains
        with anyio.fail_after(1):
            await waiting.admitted.wait()
        assert not admission.standing()
        # A new request that must wait queues again (no standing queue), and is admitted.
        again = await start(tg, Requester(admission, 1))
        assert counters.queued_requests == 1
        clock.advance(0.01)
        waiting.release()
        with anyio.fail_after(1):
            await again.admitted.wait()
        again.release()
    assert counters.shed_standing_queue == 1
    assert counters.admitted == 3


async def test_back_within_target_while_the_queue_is_not_empty(counters: Counters) -> None:
    """Standing ends when the oldest waiter has waited less than the target, not only when empty."""
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        old = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL + 0.01)
        assert admission.standing()
        holder.release()
        with anyio.fail_after(1):
            await old.admitted.wait()
        recent = await start(tg, Requester(admission, 1))  # the queue is empty: it queues
        clock.advance(TARGET / 2)
        assert not admission.standing()
        newer = await start(tg, Requester(admission, 1))  # the oldest waited under target: queues too
        assert counters.queued_requests == 2
        for current, following in ((old, recent), (recent, newer)):
            current.release()
            with anyio.fail_after(1):
                await following.admitted.wait()
        newer.release()
    assert counters.rejected == 0


async def test_timeout_is_still_the_hard_cap_of_a_standing_queue(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock, timeout=0.05)  # real time: the waiters' cap
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL + 0.01)
        with pytest.raises(AdmissionRejected, match="not draining"):
            await admission.acquire(1)
        with anyio.fail_after(2):
            await waiting.done.wait()
    assert waiting.error is not None
    assert "not admitted within 0.05 seconds" in waiting.error.message
    assert (counters.shed_standing_queue, counters.shed_timeout, counters.rejected) == (1, 1, 2)
    assert counters.queued_requests == 0
    holder.release()


async def test_timeout_caps_the_wait_below_the_shedding_threshold() -> None:
    """Real clock: an ADMISSION_TIMEOUT shorter than target + interval ends every wait first."""
    counters = Counters()
    admission = Admission(
        max_inflight=1, max_inflight_bytes=BUDGET, timeout=0.05, counters=counters, target_delay=0.05, interval=5.0
    )
    holder = await admission.acquire(1)
    for _ in range(3):
        with anyio.fail_after(2), pytest.raises(AdmissionRejected, match="not admitted within"):
            await admission.acquire(1)
    assert (counters.shed_timeout, counters.shed_standing_queue) == (3, 0)
    holder.release()
    assert counters.snapshot().idle


async def test_target_zero_is_a_plain_fifo_queue(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock, target=0.0)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        first = await start(tg, Requester(admission, 1))
        clock.advance(3600)
        assert not admission.standing()
        second = await start(tg, Requester(admission, 1))  # queued, however long the queue has stood
        assert counters.queued_requests == 2
        holder.release()
        with anyio.fail_after(1):
            await first.admitted.wait()
        first.release()
        with anyio.fail_after(1):
            await second.admitted.wait()
        second.release()
    assert counters.rejected == 0


async def test_standing_queue_never_sheds_a_grow(counters: Counters) -> None:
    """An admitted request growing its byte budget is not a new arrival: it waits as before."""
    clock = Clock()
    admission = shedding(counters, clock, max_inflight=2)
    ticket = await admission.acquire(600)
    other = await admission.acquire(400)
    grown = anyio.Event()

    async def grow() -> None:
        await ticket.grow(300)
        grown.set()

    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))  # no slot free
        clock.advance(TARGET + INTERVAL + 0.01)
        assert admission.standing()
        tg.start_soon(grow)  # no budget free: waits, not refused
        await anyio.wait_all_tasks_blocked()
        assert not grown.is_set()
        assert counters.rejected == 0
        with anyio.fail_after(1):
            await ticket.grow(0)  # nothing to charge
            await other.grow(0)
        other.release()  # 400 back: the grow goes first, the waiter gets the slot
        with anyio.fail_after(1):
            await grown.wait()
            await waiting.admitted.wait()
        assert ticket.nbytes == 900
        ticket.release()
        waiting.release()
    assert counters.rejected == 0


async def test_grow_that_fits_is_served_at_once_even_when_the_queue_stands(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock)
    ticket = await admission.acquire(100)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        clock.advance(60)
        assert admission.standing()
        with anyio.fail_after(1):
            await ticket.grow(500)
        assert ticket.nbytes == 600
        ticket.release()
        with anyio.fail_after(1):
            await waiting.admitted.wait()
        waiting.release()


async def test_close_while_the_queue_stands(counters: Counters) -> None:
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL + 0.01)
        admission.close("draining for deploy")
        with anyio.fail_after(1):
            await waiting.done.wait()
    assert waiting.error is not None and waiting.error.message == "draining for deploy"
    with pytest.raises(AdmissionRejected, match="^draining for deploy$"):
        await admission.acquire(1)  # draining wins over the standing queue
    assert (counters.shed_draining, counters.shed_standing_queue, counters.queued_requests) == (2, 0, 0)
    holder.release()


async def test_cancelled_oldest_waiter_leaves_the_queue_delay_right(counters: Counters) -> None:
    """The oldest waiter giving up does not make a queue that still holds old waiters look good."""
    clock = Clock()
    admission = shedding(counters, clock)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        oldest = Requester(admission, 1)

        async def cancellable() -> None:
            with scope:
                await oldest()

        tg.start_soon(cancellable)
        await anyio.wait_all_tasks_blocked()
        clock.advance(0.2)
        younger = await start(tg, Requester(admission, 1))
        clock.advance(TARGET + INTERVAL)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert counters.queued_requests == 1
        assert admission.standing()  # the younger one has waited TARGET + INTERVAL too
        with pytest.raises(AdmissionRejected, match="not draining"):
            await admission.acquire(1)
        holder.release()
        with anyio.fail_after(1):
            await younger.admitted.wait()
        younger.release()


@pytest.mark.parametrize("how", ["granted", "timeout", "cancelled", "closed", "standing"])
async def test_queued_requests_gauge_returns_to_zero(how: str) -> None:
    counters = Counters()
    clock = Clock()
    admission = shedding(counters, clock, timeout=0.05 if how == "timeout" else 30.0)
    holder = await admission.acquire(1)
    async with anyio.create_task_group() as tg:
        waiting = await start(tg, Requester(admission, 1))
        assert counters.queued_requests == 1
        if how == "granted":
            holder.release()
            with anyio.fail_after(1):
                await waiting.admitted.wait()
            waiting.release()
        elif how == "cancelled":
            tg.cancel_scope.cancel()
        elif how == "closed":
            admission.close()
        elif how == "standing":
            clock.advance(60)
            with pytest.raises(AdmissionRejected):
                await admission.acquire(1)
            assert counters.queued_requests == 1  # the refused one never joined
            tg.cancel_scope.cancel()
    assert counters.queued_requests == 0
    holder.release()
    assert counters.snapshot().idle


async def test_a_failing_wait_listener_neither_refuses_nor_leaks(
    counters: Counters, caplog: pytest.LogCaptureFixture
) -> None:
    admission = make(counters)
    seen: list[float] = []

    def broken(seconds: float) -> None:
        raise RuntimeError("metrics backend down")

    admission.on_admitted(broken)
    admission.on_admitted(seen.append)
    with anyio.fail_after(1):
        ticket = await admission.acquire(10)
    assert seen == [0.0]  # the next listener still heard of it
    assert "admission wait listener" in caplog.text
    ticket.release()


# --- a queued request watching its client (LifetimeMiddleware._acquire_watching) -----------------


async def test_a_queued_request_cancelled_as_it_is_admitted_gives_its_slot_back() -> None:
    # The admission's listener runs inside acquire(), just before the ticket is handed over:
    # cancelling the request there is the narrowest window (a ticket won, nobody's yet).
    counters = Counters()
    admission = make(counters, max_inflight=1)
    held = await admission.acquire(0)
    with anyio.CancelScope() as request:
        admission.on_admitted(lambda waited: request.cancel())
        async with anyio.create_task_group() as tg:
            tg.start_soon(_acquire_watching, admission, receiving([{"type": "http.request", "body": b"{}"}]))
            await anyio.wait_all_tasks_blocked()
            assert counters.queued_requests == 1
            held.release()
    assert request.cancelled_caught
    assert (counters.inflight_requests, counters.queued_requests) == (0, 0)


async def test_a_queued_request_whose_client_leaves_is_aborted_and_its_body_so_far_returned() -> None:
    counters = Counters()
    admission = make(counters, max_inflight=1)
    held = await admission.acquire(0)
    body = {"type": "http.request", "body": b'{"a":', "more_body": True}
    with pytest.raises(BodyAborted):
        await _acquire_watching(admission, receiving([body, {"type": "http.disconnect"}]))
    assert counters.queued_requests == 0
    rest = {"type": "http.request", "body": b"1}"}
    async with anyio.create_task_group() as tg:

        async def admitted() -> None:
            ticket, early = await _acquire_watching(admission, receiving([body, rest]))
            assert early == [body, rest]  # read first, in order, once admitted
            ticket.release()

        tg.start_soon(admitted)
        await anyio.wait_all_tasks_blocked()
        assert counters.queued_requests == 1
        held.release()
    assert (counters.inflight_requests, counters.queued_requests) == (0, 0)
