"""CI-sized soak: 5,000 mixed requests with seeded client and upstream faults, on each backend.

The soak itself is ``scripts/soak.py`` (run it directly for a longer one); see its docstring
and docs/reliability.md. Here it must end with the gateway idle (every gauge zero, nothing in
flight upstream or in the httpx pool), no request past its deadline, every answer the one its
faults call for, and the process's RSS not growing after warm-up.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

REQUESTS = 5000
CONCURRENCY = 16
SEED = 20261202
BIG = 10  # of them with an 8-16 MiB body
RSS_GROWTH_LIMIT = 64 * 1024 * 1024
# Minutes, not seconds: CI runs the slow tests as their own step (``-m slow``); ``bash dev test`` runs them too.
pytestmark = pytest.mark.slow


def load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("asgi_lifetime_soak_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


soak = load_soak()


@pytest.mark.anyio
async def test_soak() -> None:
    summary = await soak.soak(requests=REQUESTS, concurrency=CONCURRENCY, seed=SEED, big=BIG)
    print(summary.report())  # pytest shows it with -s, and on failure
    assert sum(summary.outcomes.values()) == REQUESTS
    assert summary.deadline_misses == 0
    assert summary.mismatches == []
    assert summary.leaks == []
    assert summary.rss_growth < RSS_GROWTH_LIMIT, summary.report()
    # Every kind of fault was exercised.
    assert set(summary.faults) >= {
        "fail=2",
        "fail=9",
        "starve",
        "stall",
        "reset",
        "hangup-mid-body",
        "hangup-mid-stream",
    }


def test_plans_are_seeded_and_mixed() -> None:
    plans = soak.plans(REQUESTS, SEED, BIG)
    assert plans == soak.plans(REQUESTS, SEED, BIG)
    assert sum(p.size > 8 * 1024 * 1024 - 1 for p in plans) == BIG
    assert sum(1024 <= p.size <= 8 * 1024 for p in plans) == REQUESTS - BIG
    assert 0.4 < sum(p.stream for p in plans) / REQUESTS < 0.65
    assert soak.main(["--requests", "40", "--concurrency", "4", "--big", "0", "--seed", "3"]) == 0


@pytest.mark.anyio
async def test_small_exchanges_do_not_wait_for_delayed_acks() -> None:
    """serve_in_thread's sockets get TCP_NODELAY. Without it every response waited for the
    client's delayed ACK (40 ms on Linux): the soak then did 5,000 requests in minutes, not seconds."""
    with serve_in_thread(create_demo_upstream(default_tokens=4)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            latencies = []
            for _ in range(10):
                started = time.perf_counter()
                response = await client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4})
                latencies.append(time.perf_counter() - started)
                assert response.status_code == 200
    assert min(latencies) < 0.02, latencies
