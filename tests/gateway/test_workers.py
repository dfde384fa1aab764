"""``/lifetime/stats`` across workers: reports in a shared directory, totals, dead workers dropped.

In one process here (several ``WorkerStats`` stand for several workers; a pid no process can have
stands for a dead one). ``tests/cli/test_workers.py`` runs real worker processes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._stats import LifetimeStats
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._workers import Report, WorkerReport, WorkerStats, merge_upstreams, read_reports

from .test_metrics import multiproc_dir as multiproc_dir  # a fixture: PROMETHEUS_MULTIPROC_DIR set, cleaned after

DEAD_PID = 4194305  # above Linux's pid_max (2**22): no process can have it
BASE = "http://upstream.test"
FIELDS = [*LifetimeStats().as_dict(), "session_changes"]


def fake_report(inflight: int, admitted: int, upstream_inflight: int = 0, down_for: float | None = None) -> Report:
    stats = {**LifetimeStats(inflight_requests=inflight, admitted=admitted).as_dict(), "session_changes": admitted}
    view = {"url": BASE, "inflight": upstream_inflight, "down_for": down_for, "requests": admitted, "failures": 0}
    return {**stats, "upstreams": [view]}


def test_without_a_directory_the_payload_is_this_process_and_says_so() -> None:
    workers = WorkerStats(lambda: fake_report(1, 2), directory=None)
    payload = workers.payload()
    assert payload["scope"] == "process" and payload["process"] == {"pid": os.getpid()}
    assert payload["inflight_requests"] == 1 and payload["admitted"] == 2 and "workers" not in payload
    workers.close()  # nothing to remove


def test_reports_are_summed_and_listed_per_worker(multiproc_dir: Path) -> None:
    a = WorkerStats(lambda: fake_report(1, 5, upstream_inflight=1), directory=str(multiproc_dir), sync_interval=60)
    b = WorkerStats(lambda: fake_report(2, 7, upstream_inflight=2, down_for=3.0), directory=str(multiproc_dir))
    b.payload()  # writes b's report
    payload = a.payload()
    assert payload["scope"] == "workers" and payload["process"] == {"pid": os.getpid()}
    assert payload["inflight_requests"] == 3 and payload["admitted"] == 12 and payload["session_changes"] == 12
    assert [w["inflight_requests"] for w in payload["workers"]] in ([1, 2], [2, 1])
    assert all(set(w) == {"pid", "age", *FIELDS} for w in payload["workers"])
    assert all(0 <= w["age"] < 60 for w in payload["workers"])
    (upstream,) = payload["upstreams"]
    assert upstream["inflight"] == 3 and upstream["requests"] == 12 and 0 < upstream["down_for"] <= 3.0
    # The same top-level fields as one process has, plus the workers.
    assert set(payload) == {*FIELDS, "upstreams", "scope", "process", "workers"}

    b.close()
    b.close()  # idempotent
    after = a.payload()
    assert after["inflight_requests"] == 1 and len(after["workers"]) == 1
    a.close()
    assert list(multiproc_dir.glob("stats-*")) == []


def test_a_dead_workers_report_is_dropped_and_removed(multiproc_dir: Path) -> None:
    live = WorkerStats(lambda: fake_report(1, 1), directory=str(multiproc_dir), sync_interval=60)
    dead = {"pid": DEAD_PID, "written_at": time.time(), "report": fake_report(5, 50)}
    (multiproc_dir / f"stats-{DEAD_PID}-0.json").write_text(json.dumps(dead))
    (multiproc_dir / f"stats-{DEAD_PID}-0.json.tmp").write_text("{half a wri")  # killed while writing
    (multiproc_dir / f"gauge_livesum_{DEAD_PID}.db").write_bytes(b"")
    payload = live.payload()
    assert payload["inflight_requests"] == 1 and [w["pid"] for w in payload["workers"]] == [os.getpid()]
    assert sorted(p.name for p in multiproc_dir.iterdir() if str(DEAD_PID) in p.name) == []
    live.close()


@pytest.mark.parametrize(
    ("name", "content"),
    [
        (f"stats-{os.getpid()}-999.json", "{not json"),
        (f"stats-{os.getpid()}-998.json", json.dumps({"pid": os.getpid()})),
        (f"stats-{os.getpid()}-997.json", json.dumps([1, 2])),
        (f"stats-{os.getpid()}-996.json", json.dumps({"pid": "x", "written_at": 0, "report": {}})),
        ("stats-notes.json", "{}"),
    ],
)
def test_a_file_that_is_not_a_report_is_skipped(multiproc_dir: Path, name: str, content: str) -> None:
    live = WorkerStats(lambda: fake_report(1, 1), directory=str(multiproc_dir), sync_interval=60)
    (multiproc_dir / name).write_text(content)
    payload = live.payload()
    assert payload["inflight_requests"] == 1 and len(payload["workers"]) == 1
    live.close()


def test_the_sync_thread_writes_reports_without_being_asked(multiproc_dir: Path) -> None:
    counter = {"admitted": 0}

    def report() -> Report:
        counter["admitted"] += 1
        return fake_report(0, counter["admitted"])

    workers = WorkerStats(report, directory=str(multiproc_dir), sync_interval=0.02)
    deadline = time.monotonic() + 10
    seen: list[int] = []
    while len(set(seen)) < 3 and time.monotonic() < deadline:  # three different reports written
        seen += [r.scalars["admitted"] for r in read_reports(str(multiproc_dir))]
        time.sleep(0.01)
    assert len(set(seen)) >= 3
    workers.close()
    assert list(multiproc_dir.glob("stats-*")) == []


def test_merge_upstreams_sums_counts_and_keeps_the_longest_cool_off() -> None:
    def view(inflight: int, down_for: float | None) -> dict[str, Any]:
        return {"url": BASE, "inflight": inflight, "down_for": down_for, "requests": 1, "failures": 1}

    other = {"url": "http://other", "inflight": 1, "down_for": None, "requests": 0, "failures": 0}
    reports = [
        WorkerReport(1, 0.0, {}, [view(1, None), other]),
        WorkerReport(2, 1.0, {}, [view(2, 5.0), {"inflight": 9}]),  # no url: not an upstream
        WorkerReport(3, 10.0, {}, [view(0, 5.0)]),  # its cool-off ended since it wrote
    ]
    assert merge_upstreams(reports) == [
        {"url": BASE, "inflight": 3, "down_for": 4.0, "requests": 3, "failures": 3},
        other,
    ]


SETTINGS = LifetimeSettings(upstream_url=(BASE,))
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def post_and_read_stats(app: Any, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post("/v1/chat/completions").respond(200, json={"ok": True})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            for body in bodies:
                response = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s1"})
                assert response.status_code == 200
            stats: dict[str, Any] = (await client.get("/lifetime/stats")).json()
    await app.state.upstream.aclose()
    return stats


CHANGED = {"model": "m", "messages": [{"role": "user", "content": "hello again"}]}


@pytest.mark.anyio
async def test_the_gateway_counts_session_changes_in_one_process() -> None:
    stats = await post_and_read_stats(create_app(SETTINGS), [CHAT, CHAT, CHANGED, CHANGED])
    assert stats["scope"] == "process" and stats["process"] == {"pid": os.getpid()}
    assert stats["session_changes"] == 2  # new session, then one change; repeats are not changes
    assert stats["admitted"] == 4 and [u["requests"] for u in stats["upstreams"]] == [4]


@pytest.mark.anyio
async def test_the_gateway_reports_every_worker_with_a_multiproc_directory(multiproc_dir: Path) -> None:
    neighbour = WorkerStats(lambda: fake_report(2, 3, upstream_inflight=2), directory=str(multiproc_dir))
    app = create_app(SETTINGS)
    try:
        stats = await post_and_read_stats(app, [CHAT])
    finally:
        app.state.workers.close()
        app.state.metrics.close()
        neighbour.close()
    assert stats["scope"] == "workers" and len(stats["workers"]) == 2
    assert stats["admitted"] == 1 + 3 and stats["inflight_requests"] == 2
    assert stats["session_changes"] == 1 + 3
    assert stats["upstreams"] == [{"url": BASE, "inflight": 2, "down_for": None, "requests": 1 + 3, "failures": 0}]
