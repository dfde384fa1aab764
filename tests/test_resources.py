from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from asgi_lifetime import _resources
from asgi_lifetime._resources import RequestResources
from asgi_lifetime._stats import GAUGES, Counters, LifetimeStats

anyio_mark = pytest.mark.anyio


def recorder(log: list[str], name: str) -> Callable[[], None]:
    def release() -> None:
        log.append(name)

    return release


@anyio_mark
async def test_releases_last_acquired_first() -> None:
    counters = Counters()
    log: list[str] = []
    async with RequestResources(counters) as scope:
        for name in ["admission", "pin", "response"]:
            scope.add(recorder(log, name))
        assert log == []
        assert scope.held == 3
    assert log == ["response", "pin", "admission"]
    assert scope.held == 0


@anyio_mark
async def test_each_resource_released_once() -> None:
    counters = Counters()
    log: list[str] = []
    scope = RequestResources(counters)
    scope.add(recorder(log, "a"))
    scope.add(recorder(log, "b"))
    await scope.aclose()
    await scope.aclose()
    async with scope:
        pass
    assert log == ["b", "a"]
    assert counters.live_resources == 0


@anyio_mark
async def test_early_release_then_aclose_does_not_release_twice() -> None:
    counters = Counters()
    log: list[str] = []
    scope = RequestResources(counters)
    scope.add(recorder(log, "a"))
    handle = scope.add(recorder(log, "b"))
    scope.add(recorder(log, "c"))
    assert not handle.released
    await handle.release()
    assert handle.released
    assert log == ["b"]
    assert counters.live_resources == 2
    assert scope.held == 2
    await handle.release()
    assert counters.live_resources == 2
    await scope.aclose()
    assert log == ["b", "c", "a"]
    assert counters.live_resources == 0


@anyio_mark
async def test_sync_and_async_release_callables() -> None:
    counters = Counters()
    log: list[str] = []

    async def close_response() -> None:
        await anyio.lowlevel.checkpoint()
        log.append("async")

    async with RequestResources(counters) as scope:
        scope.add(recorder(log, "sync"))
        scope.add(close_response)
        scope.add(recorder(log, "sync-last"))
    assert log == ["sync-last", "async", "sync"]
    assert counters.live_resources == 0


@anyio_mark
async def test_failing_release_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    counters = Counters()
    log: list[str] = []

    def broken_sync() -> None:
        raise RuntimeError("sync boom")

    async def broken_async() -> None:
        await anyio.lowlevel.checkpoint()
        raise OSError("async boom")

    caplog.set_level(logging.ERROR, logger="asgi_lifetime._resources")
    async with RequestResources(counters) as scope:
        scope.add(recorder(log, "first"))
        scope.add(broken_sync)
        scope.add(recorder(log, "middle"))
        scope.add(broken_async)
        scope.add(recorder(log, "last"))
    assert log == ["last", "middle", "first"]
    assert counters.live_resources == 0
    records = [r for r in caplog.records if r.name == "asgi_lifetime._resources"]
    assert [r.getMessage() for r in records] == ["releasing a request resource failed"] * 2
    assert [type(r.exc_info[1]) for r in records if r.exc_info] == [OSError, RuntimeError]


@anyio_mark
async def test_async_release_runs_when_the_scope_is_cancelled() -> None:
    counters = Counters()
    log: list[str] = []

    async def close_response() -> None:
        await anyio.sleep(0.01)  # a real wait: it would be cancelled if not shielded
        log.append("closed")

    with anyio.fail_after(2):
        with anyio.CancelScope() as cancel_scope:
            async with RequestResources(counters) as scope:
                scope.add(close_response)
                scope.add(close_response)
                cancel_scope.cancel()
                await anyio.sleep_forever()
    assert cancel_scope.cancelled_caught
    assert log == ["closed", "closed"]
    assert counters.live_resources == 0


@anyio_mark
async def test_async_release_of_a_cancelled_task() -> None:
    counters = Counters()
    log: list[str] = []
    entered = anyio.Event()

    async def close_response() -> None:
        await anyio.sleep(0.01)
        log.append("closed")

    async def request() -> None:
        async with RequestResources(counters) as scope:
            scope.add(recorder(log, "unpin"))
            scope.add(close_response)
            entered.set()
            await anyio.sleep_forever()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await entered.wait()
            tg.cancel_scope.cancel()
    assert log == ["closed", "unpin"]
    assert counters.live_resources == 0


@anyio_mark
@pytest.mark.parametrize("cancelled", [False, True])
async def test_async_release_is_bounded(monkeypatch: pytest.MonkeyPatch, cancelled: bool) -> None:
    monkeypatch.setattr(_resources, "_ASYNC_RELEASE_TIMEOUT", 0.05)
    counters = Counters()
    log: list[str] = []

    async def wedged() -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(2):
        with anyio.CancelScope() as cancel_scope:
            async with RequestResources(counters) as scope:
                scope.add(recorder(log, "after"))
                scope.add(wedged)
                if cancelled:
                    cancel_scope.cancel()
                    await anyio.sleep_forever()
    assert log == ["after"]
    assert counters.live_resources == 0


@anyio_mark
async def test_add_after_close_is_refused() -> None:
    counters = Counters()
    log: list[str] = []
    scope = RequestResources(counters)
    scope.add(recorder(log, "a"))
    await scope.aclose()
    with pytest.raises(RuntimeError, match="already released"):
        scope.add(recorder(log, "late"))
    with pytest.raises(RuntimeError, match="already released"):
        scope.retain(100)
    assert counters.live_resources == 0
    assert counters.retained_input_bytes == 0
    assert scope.held == 0
    await scope.aclose()
    assert log == ["a"]


@anyio_mark
async def test_gauges_go_up_and_back_to_zero() -> None:
    counters = Counters()
    async with RequestResources(counters) as scope:
        scope.add(recorder([], "a"))
        scope.add(recorder([], "b"))
        body = scope.retain(100)
        scope.retain(50)
        assert counters.live_resources == 2
        assert counters.retained_input_bytes == 150
        assert scope.held == 4
        assert not counters.snapshot().idle
        await body.release()
        assert counters.retained_input_bytes == 50
        assert counters.live_resources == 2
    assert counters.live_resources == 0
    assert counters.retained_input_bytes == 0
    assert counters.snapshot().idle


@anyio_mark
async def test_retain_on_disk_counts_retained_disk_bytes_until_released() -> None:
    counters = Counters()
    async with RequestResources(counters) as scope:
        on_disk = scope.retain_on_disk(300)
        assert (counters.retained_disk_bytes, counters.retained_input_bytes) == (300, 0)
        assert not counters.snapshot().idle  # a file still open is not idle
        on_disk.release_now()
        assert counters.retained_disk_bytes == 0
        scope.retain_on_disk(40)
    assert counters.retained_disk_bytes == 0 and counters.snapshot().idle
    with pytest.raises(RuntimeError, match="already released"):
        scope.retain_on_disk(1)


@anyio_mark
async def test_scopes_share_counters() -> None:
    counters = Counters()
    first = RequestResources(counters)
    second = RequestResources(counters)
    first.retain(10)
    second.retain(20)
    first.add(recorder([], "x"))
    assert (counters.retained_input_bytes, counters.live_resources) == (30, 1)
    await first.aclose()
    assert (counters.retained_input_bytes, counters.live_resources) == (20, 0)
    await second.aclose()
    assert counters.retained_input_bytes == 0


@anyio_mark
async def test_exception_in_body_still_releases() -> None:
    counters = Counters()
    log: list[str] = []
    with pytest.raises(ZeroDivisionError):
        async with RequestResources(counters) as scope:
            scope.add(recorder(log, "a"))
            1 / 0  # noqa: B018
    assert log == ["a"]
    assert counters.live_resources == 0


# ---------------------------------------------------------------------------------------------
# LifetimeStats

TOTALS = [f.name for f in dataclasses.fields(LifetimeStats) if f.name not in GAUGES]


def test_fresh_stats_are_idle() -> None:
    assert LifetimeStats().idle
    assert Counters().snapshot().idle
    assert Counters().snapshot() == LifetimeStats()


@pytest.mark.parametrize("gauge", GAUGES)
def test_any_held_gauge_is_not_idle(gauge: str) -> None:
    assert not LifetimeStats(**{gauge: 1}).idle


def test_totals_do_not_affect_idle() -> None:
    assert TOTALS  # admitted, rejected, ...
    assert LifetimeStats(**dict.fromkeys(TOTALS, 7)).idle


def test_as_dict() -> None:
    counters = Counters()
    counters.inflight_requests = 2
    counters.admitted = 5
    counters.stalled = 1
    stats = counters.snapshot()
    as_dict = stats.as_dict()
    assert list(as_dict) == [f.name for f in dataclasses.fields(LifetimeStats)]
    assert as_dict["inflight_requests"] == 2
    assert as_dict["admitted"] == 5
    assert as_dict["stalled"] == 1
    assert sum(as_dict.values()) == 8
    as_dict["admitted"] = 0  # a copy: the snapshot is unchanged
    assert stats.admitted == 5


def test_snapshot_is_frozen_and_independent() -> None:
    counters = Counters()
    stats = counters.snapshot()
    counters.live_resources = 3
    assert stats.live_resources == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.live_resources = 1  # type: ignore[misc]
