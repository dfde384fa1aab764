from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from asgi_lifetime.gateway._pool import UpstreamPool, UpstreamState

URLS = ("http://a:8000", "http://b:8000", "http://c:8000", "http://d:8000")
ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_pool(urls: tuple[str, ...] = URLS, *, cooloff: float = 30.0) -> tuple[UpstreamPool, FakeClock]:
    clock = FakeClock()
    return UpstreamPool(urls, cooloff=cooloff, clock=clock), clock


def sessions(n: int) -> list[str]:
    return [f"session-{i}" for i in range(n)]


def choices(pool: UpstreamPool, ids: list[str]) -> dict[str, str]:
    return {sid: pool.choose(sid) for sid in ids}


# -- affinity and spread ------------------------------------------------------------------


def test_same_session_same_upstream() -> None:
    pool, _ = make_pool()
    first = choices(pool, sessions(1000))
    for _ in range(3):
        assert choices(pool, sessions(1000)) == first
    # A fresh pool (and a different URL order) agrees: the choice is a pure function.
    assert choices(UpstreamPool(URLS[::-1], cooloff=30.0), sessions(1000)) == first


def test_sessions_spread_over_all_upstreams() -> None:
    pool, _ = make_pool()
    counts = Counter(choices(pool, sessions(4000)).values())
    assert set(counts) == set(URLS)
    for url in URLS:
        assert 0.15 * 4000 <= counts[url] <= 0.35 * 4000, counts


@pytest.mark.parametrize("session_id", ["", " ", "é-会话", "x" * 10_000, "\ud800", "a\x00b"])
def test_odd_session_ids(session_id: str) -> None:
    pool, _ = make_pool()
    url = pool.choose(session_id)
    assert url in URLS
    assert pool.choose(session_id) == url


@pytest.mark.parametrize("removed", URLS)
def test_removing_an_upstream_moves_only_its_sessions(removed: str) -> None:
    ids = sessions(4000)
    before = choices(UpstreamPool(URLS, cooloff=30.0), ids)
    after = choices(UpstreamPool([u for u in URLS if u != removed], cooloff=30.0), ids)
    for sid in ids:
        if before[sid] != removed:
            assert after[sid] == before[sid]
        else:
            assert after[sid] != removed


def test_adding_an_upstream_moves_sessions_only_to_it() -> None:
    ids = sessions(4000)
    new = "http://e:8000"
    before = choices(UpstreamPool(URLS, cooloff=30.0), ids)
    after = choices(UpstreamPool((*URLS, new), cooloff=30.0), ids)
    moved = [sid for sid in ids if after[sid] != before[sid]]
    assert all(after[sid] == new for sid in moved)
    assert 0.10 * len(ids) <= len(moved) <= 0.30 * len(ids), len(moved)


_CHILD = """
import json, sys
from asgi_lifetime.gateway._pool import UpstreamPool
urls, ids = json.load(sys.stdin)
pool = UpstreamPool(urls, cooloff=30.0)
json.dump({sid: pool.choose(sid) for sid in ids}, sys.stdout)
"""


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_choice_is_stable_across_processes(hashseed: str) -> None:
    ids = sessions(200)
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([list(URLS), ids]),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == choices(UpstreamPool(URLS, cooloff=30.0), ids)


# -- fail-over and cool-off ---------------------------------------------------------------


@pytest.mark.parametrize("sid", sessions(20))
def test_down_upstream_fails_over_to_second_choice_and_comes_back(sid: str) -> None:
    pool, clock = make_pool(cooloff=30.0)
    first = pool.choose(sid)
    # The second rendezvous choice is the first choice among the remaining upstreams.
    second = UpstreamPool([u for u in URLS if u != first], cooloff=30.0).choose(sid)
    assert second != first

    pool.mark_down(first)
    assert pool.is_down(first)
    assert pool.choose(sid) == second
    clock.now += 29.999
    assert pool.choose(sid) == second
    clock.now += 0.001
    assert not pool.is_down(first)
    assert pool.choose(sid) == first


def test_mark_up_clears_the_down_mark() -> None:
    pool, _ = make_pool()
    sid = "session-7"
    first = pool.choose(sid)
    pool.mark_down(first)
    assert pool.choose(sid) != first
    pool.mark_up(first)
    assert not pool.is_down(first)
    assert pool.choose(sid) == first


def test_marking_down_one_upstream_leaves_other_sessions_alone() -> None:
    pool, _ = make_pool()
    ids = sessions(1000)
    before = choices(pool, ids)
    pool.mark_down(URLS[0])
    after = choices(pool, ids)
    for sid in ids:
        if before[sid] != URLS[0]:
            assert after[sid] == before[sid]
        else:
            assert after[sid] != URLS[0]


@pytest.mark.parametrize("sid", sessions(20))
def test_exclude_fails_over_like_down(sid: str) -> None:
    pool, _ = make_pool()
    first = pool.choose(sid)
    second = pool.choose(sid, exclude=[first])
    assert second == UpstreamPool([u for u in URLS if u != first], cooloff=30.0).choose(sid)
    third = pool.choose(sid, exclude={first, second})
    assert third not in (first, second)
    # Excluding does not mark anything down.
    assert pool.choose(sid) == first


def test_all_down_still_returns_the_best_url() -> None:
    pool, _ = make_pool()
    sid = "session-3"
    first = pool.choose(sid)
    for url in URLS:
        pool.mark_down(url)
    assert pool.choose(sid) == first
    assert pool.choose(None) in URLS


def test_all_down_but_excluded_prefers_a_not_excluded_one() -> None:
    pool, _ = make_pool()
    sid = "session-3"
    first = pool.choose(sid)
    second = pool.choose(sid, exclude=[first])
    for url in URLS:
        pool.mark_down(url)
    assert pool.choose(sid, exclude=[first]) == second
    for _ in range(8):
        assert pool.choose(None, exclude=[first]) != first


def test_up_upstream_preferred_over_down_one_when_both_allowed() -> None:
    pool, _ = make_pool()
    for url in URLS[:3]:
        pool.mark_down(url)
    assert {pool.choose(sid) for sid in sessions(200)} == {URLS[3]}
    assert {pool.choose(None) for _ in range(8)} == {URLS[3]}


def test_everything_excluded_still_returns_a_url() -> None:
    pool, _ = make_pool()
    sid = "session-3"
    assert pool.choose(sid, exclude=URLS) == pool.choose(sid)
    assert pool.choose(None, exclude=URLS) in URLS


def test_zero_cooloff_never_skips() -> None:
    pool, _ = make_pool(cooloff=0.0)
    pool.mark_down(URLS[0])
    assert not pool.is_down(URLS[0])
    assert pool.snapshot()[0].failures == 1


# -- sessionless: least in flight, round-robin --------------------------------------------


def test_sessionless_picks_least_in_flight() -> None:
    pool, _ = make_pool()
    releases = [pool.acquire(URLS[0]), pool.acquire(URLS[0]), pool.acquire(URLS[1]), pool.acquire(URLS[2])]
    assert pool.choose(None) == URLS[3]
    assert pool.choose(None) == URLS[3]
    releases += [pool.acquire(URLS[3]), pool.acquire(URLS[3])]
    # b and c now have 1 in flight, the fewest; the tie alternates between them.
    assert {pool.choose(None) for _ in range(4)} == {URLS[1], URLS[2]}
    for release in releases:
        release()
    assert [pool.inflight(u) for u in URLS] == [0, 0, 0, 0]


def test_sessionless_skips_down_and_excluded() -> None:
    pool, _ = make_pool()
    pool.mark_down(URLS[0])
    picked = {pool.choose(None, exclude=[URLS[1]]) for _ in range(8)}
    assert picked == {URLS[2], URLS[3]}


def test_sessionless_ties_are_round_robin() -> None:
    pool, _ = make_pool()
    picked = [pool.choose(None) for _ in range(8)]
    assert Counter(picked) == {url: 2 for url in URLS}
    assert all(a != b for a, b in zip(picked, picked[1:], strict=False))


def test_sessionless_round_robin_at_concurrency_one() -> None:
    pool, _ = make_pool()
    picked = []
    for _ in range(12):
        url = pool.choose(None)
        release = pool.acquire(url)
        picked.append(url)
        release()
    assert Counter(picked) == {url: 3 for url in URLS}


def test_release_is_idempotent_and_counts_never_negative() -> None:
    pool, _ = make_pool()
    r1 = pool.acquire(URLS[0])
    r2 = pool.acquire(URLS[0])
    assert pool.inflight(URLS[0]) == 2
    r1()
    r1()
    r1()
    assert pool.inflight(URLS[0]) == 1
    r2()
    r2()
    assert pool.inflight(URLS[0]) == 0
    r1()
    assert pool.inflight(URLS[0]) == 0


def test_snapshot() -> None:
    pool, clock = make_pool(cooloff=10.0)
    release = pool.acquire(URLS[0])
    pool.acquire(URLS[0])()
    pool.mark_down(URLS[1])
    pool.mark_down(URLS[1])
    pool.mark_down(URLS[2])
    pool.mark_up(URLS[2])
    assert pool.snapshot() == [
        UpstreamState(url=URLS[0], inflight=1, down_until=None, total_requests=2, failures=0),
        UpstreamState(url=URLS[1], inflight=0, down_until=1010.0, total_requests=0, failures=2),
        UpstreamState(url=URLS[2], inflight=0, down_until=None, total_requests=0, failures=1),
        UpstreamState(url=URLS[3], inflight=0, down_until=None, total_requests=0, failures=0),
    ]
    clock.now += 10.0
    assert pool.snapshot()[1].down_until is None
    release()
    assert pool.snapshot()[0].inflight == 0


# -- concurrency --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_choose_acquire_release() -> None:
    pool, _ = make_pool()
    peak = 0

    async def worker(i: int) -> None:
        nonlocal peak
        url = pool.choose(f"session-{i}" if i % 2 else None)
        release = pool.acquire(url)
        try:
            peak = max(peak, sum(pool.inflight(u) for u in URLS))
            await anyio.lowlevel.checkpoint()
        finally:
            release()

    async with anyio.create_task_group() as tg:
        for i in range(500):
            tg.start_soon(worker, i)

    assert peak > 1
    assert [pool.inflight(u) for u in URLS] == [0, 0, 0, 0]
    assert sum(s.total_requests for s in pool.snapshot()) == 500


@pytest.mark.anyio
async def test_release_on_cancellation() -> None:
    pool, _ = make_pool()

    async def worker() -> None:
        release = pool.acquire(pool.choose(None))
        try:
            await anyio.sleep_forever()
        finally:
            release()

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(worker)
        await anyio.wait_all_tasks_blocked()
        assert sum(pool.inflight(u) for u in URLS) == 10
        tg.cancel_scope.cancel()

    assert [pool.inflight(u) for u in URLS] == [0, 0, 0, 0]


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("urls", "cooloff", "match"),
    [
        ([], 30.0, "at least one"),
        (("http://a:8000", "http://b:8000", "http://a:8000"), 30.0, "'http://a:8000' more than once"),
        (("http://a:8000", ""), 30.0, "empty"),
        (URLS, -1.0, "cooloff.*-1.0"),
        (URLS, math.nan, "cooloff.*nan"),
        (URLS, math.inf, "cooloff.*inf"),
    ],
)
def test_invalid_configuration(urls: tuple[str, ...], cooloff: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UpstreamPool(urls, cooloff=cooloff)


def test_single_string_is_rejected() -> None:
    with pytest.raises(TypeError, match="not a single string"):
        UpstreamPool("http://a:8000", cooloff=30.0)


@pytest.mark.parametrize("method", ["acquire", "mark_down", "mark_up", "is_down", "inflight"])
def test_unknown_url_is_rejected(method: str) -> None:
    pool, _ = make_pool()
    with pytest.raises(ValueError, match="'http://z:8000' is not an upstream"):
        getattr(pool, method)("http://z:8000")


def test_urls_attribute_and_single_upstream() -> None:
    pool = UpstreamPool(["http://only:8000"], cooloff=5.0)
    assert pool.urls == ("http://only:8000",)
    pool.mark_down("http://only:8000")
    assert pool.choose("s") == "http://only:8000"
    assert pool.choose(None, exclude=["http://only:8000"]) == "http://only:8000"
