from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from anyio.abc import TaskGroup

from asgi_lifetime._admission import Admission, Ticket
from asgi_lifetime._exceptions import AdmissionRejected
from asgi_lifetime._stats import Counters

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
