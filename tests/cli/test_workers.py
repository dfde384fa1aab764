"""``asgi-lifetime serve --workers N``: ``/lifetime/stats`` reports every worker and the total.

Real worker processes (uvicorn's supervisor, spawned workers) on a loopback port, in front of a
demo upstream in this process. Whichever worker answers, the totals count every live worker;
the per-worker list says which one holds what; a worker killed with SIGKILL leaves the list.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from asgi_lifetime._stats import GAUGES
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream
from tests._gateways import Gateway, eventually, gateway_process

# A stream that lasts minutes unless cut: 1000 tokens at 2 per second.
LONG_STREAM = {"model": "demo", "stream": True, "max_tokens": 1000, "messages": [{"role": "user", "content": "hold"}]}


def two_workers(gateway: Gateway) -> bool:
    stats = gateway.stats()
    return stats["scope"] == "workers" and len(stats["workers"]) == 2


def metric(gateway: Gateway, name: str) -> float:
    text = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    found = re.search(rf"^asgi_lifetime_{name} (\S+)$", text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


def test_stats_report_every_worker_and_a_killed_worker_leaves_them(tmp_path: Path) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=2)) as upstream:
        with gateway_process(
            ["--upstream", upstream, "--workers", "2"], tmp_path / "serve.log", ready=two_workers
        ) as gateway:
            idle = gateway.stats()
            pids = {worker["pid"] for worker in idle["workers"]}
            assert idle["process"]["pid"] in pids and gateway.process.pid not in pids  # workers, not the supervisor
            assert all(idle[name] == 0 for name in GAUGES)

            with httpx.Client(timeout=30) as client:
                request = client.build_request("POST", f"{gateway.base}/v1/chat/completions", json=LONG_STREAM)
                response = client.send(request, stream=True)
                try:
                    assert response.status_code == 200

                    # One request in flight somewhere: every answer, from either worker, counts it once
                    # in the total and attributes it to one worker.
                    def holding() -> dict[str, Any] | None:
                        stats = gateway.stats()
                        owners = [w for w in stats["workers"] if w["inflight_requests"]]
                        return stats if stats["inflight_requests"] == 1 and len(owners) == 1 else None

                    answers = [eventually(holding, seconds=10, what="the held stream counted") for _ in range(6)]
                    owners = {w["pid"] for a in answers for w in a["workers"] if w["inflight_requests"]}
                    assert len(owners) == 1 and owners <= pids
                    (owner,) = owners
                    assert all(a["process"]["pid"] in pids for a in answers)
                    assert all(a["upstreams"][0]["inflight"] == 1 for a in answers)  # summed per upstream too
                    # /metrics agrees, once the holder's sync thread (every second) has written its gauges.
                    eventually(lambda: metric(gateway, "inflight_requests") == 1, seconds=10, what="/metrics: 1")

                    os.kill(owner, signal.SIGKILL)

                    def gone() -> dict[str, Any] | None:
                        stats = gateway.stats()
                        listed = {w["pid"] for w in stats["workers"]}
                        return stats if owner not in listed and stats["inflight_requests"] == 0 else None

                    after = eventually(gone, seconds=20, what=f"worker {owner}'s entry removed")
                    assert all(after[name] == 0 for name in GAUGES)
                    assert after["upstreams"][0]["inflight"] == 0
                    with pytest.raises(httpx.HTTPError):  # the stream died with its worker
                        for _ in response.iter_raw():
                            pass
                finally:
                    response.close()

            # uvicorn's supervisor replaces the dead worker; the newcomer is listed with the survivor.
            def replaced() -> bool:
                listed = {w["pid"] for w in gateway.stats()["workers"]}
                return len(listed) == 2 and owner not in listed and bool(listed & pids)

            eventually(replaced, seconds=30, what="a replacement worker listed")
            eventually(lambda: metric(gateway, "inflight_requests") == 0, seconds=10, what="/metrics: 0")
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_serve_creates_the_shared_directory_and_removes_it(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with gateway_process(
            ["--upstream", upstream, "--workers", "2"],
            tmp_path / "serve.log",
            env={"TMPDIR": str(temporary), "ASGI_LIFETIME_DRAIN_DELAY": "0"},
            ready=two_workers,
        ) as gateway:
            (directory,) = temporary.iterdir()
            assert directory.name.startswith("asgi-lifetime-workers-")
            assert len(list(directory.glob("stats-*.json"))) == 2
            gateway.process.send_signal(signal.SIGTERM)
            assert gateway.process.wait(30) == 0
    assert list(temporary.iterdir()) == []


def test_one_worker_says_its_stats_are_its_own(tmp_path: Path) -> None:
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with gateway_process(["--upstream", upstream], tmp_path / "serve.log") as gateway:
            stats = gateway.stats()
    assert stats["scope"] == "process" and "workers" not in stats
    assert stats["process"]["pid"] == gateway.process.pid
