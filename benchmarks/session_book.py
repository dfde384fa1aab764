"""The session book's cost per request: ``python -m benchmarks.run --only sessions [--before DIR]``.

Small streamed requests (about 1 KiB, 16 tokens from the demo upstream at 1e6 tokens/s), each with
an ``x-session-id`` (one session per client connection, so the book keeps, pins and decides on
every request), through three gateways side by side in one run:

- ``memory``: this checkout, ``SESSION_STORE=memory`` (the default);
- ``before``: the package before the fleet work (``--before DIR``: a checkout whose
  ``DIR/asgi_lifetime`` is that version, run as ``benchmarks/before_after.py`` runs one: its own
  ``benchmarks/servers.py`` from ``DIR``); left out without ``--before``;
- ``redis``: this checkout, ``SESSION_STORE=redis://`` (a ``redis-server`` on loopback started here,
  without persistence): the change claimed at admission, one round trip per request;
- ``before_redis``: the ``--before`` package with the same Redis, when it has ``SESSION_STORE`` (a
  ``--before`` later than the fleet work: how the claim at admission compares with what it replaced).

Each concurrency runs the targets interleaved in slices (every target sees the same background
noise); per slice, the gateway process's CPU time (user + system, psutil) per answered request and
its throughput. The report shows the medians over the slices and their ratios to ``before`` (or to
``memory`` without it). ``redis`` also shows the redis-server's CPU per request (its own process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import psutil

from benchmarks.bodies import small_body
from benchmarks.client import Connection
from benchmarks.servers import Server

__all__ = ["bench_sessions"]

PATH = "/v1/chat/completions"
SECONDS = {"full": 24.0, "quick": 6.0, "smoke": 1.0}  # per target and concurrency, over all slices
SLICES = {"full": 8, "quick": 4, "smoke": 1}
CONCURRENCY = {"full": (1, 16), "quick": (1, 16), "smoke": (4,)}


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int] | None]:
    """A private ``redis-server`` on a free loopback port, no persistence: its URL and pid (None if the
    binary is not installed: the section then measures the in-memory books only)."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if binary is None:
        yield None
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        process = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", process.pid
        finally:
            process.terminate()
            process.wait(10)


async def _load(url: str, body: bytes, concurrency: int, seconds: float, tag: str) -> tuple[int, int, float]:
    """Closed loop: ``concurrency`` keep-alive connections, one session each. (answered, errors, seconds)."""
    answered = errors = 0
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        nonlocal answered, errors
        headers = {"x-session-id": f"bench-{tag}-{index}"}
        async with Connection(url) as conn:
            while time.monotonic() < deadline:
                result = await conn.post(PATH, body, headers)
                if result.status == 200:
                    answered += 1
                else:
                    errors += 1

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for index in range(concurrency):
            tg.start_soon(worker, index)
    return answered, errors, time.monotonic() - started


def _store_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = ("asgi_lifetime_session_store_up", "asgi_lifetime_session_store_fallbacks_total")
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name.removeprefix("asgi_lifetime_")] = float(value)
    return found


async def bench_sessions(mode_name: str, results: dict[str, Any], log: Any, before: str | None) -> None:
    body = small_body(size=1024, max_tokens=16)
    seconds, slices = SECONDS[mode_name], SLICES[mode_name]
    table: dict[str, dict[str, Any]] = {}
    with Server("demo", tokens_per_second=1e6) as upstream, redis_server() as redis:
        servers: dict[str, Server] = {"memory": Server("gateway", upstream=upstream.url)}
        if before is not None:
            servers["before"] = Server("gateway", upstream=upstream.url, cwd=before)
        if redis is not None:
            servers["redis"] = Server("gateway", upstream=upstream.url, settings={"session_store": redis[0]})
            if before is not None and _has_session_store(before):  # a later "before": its Redis book beside
                store = {"session_store": redis[0]}
                servers["before_redis"] = Server("gateway", upstream=upstream.url, cwd=before, settings=store)
        else:
            log("sessions: redis-server is not installed (apt-get install redis-server): no Redis row")
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
                async with Connection(server.url) as conn:  # warm up: imports, pools, the script cache
                    for _ in range(20):
                        await conn.post(PATH, body, {"x-session-id": "warm-up"})
            processes = {key: psutil.Process(server.pid) for key, server in servers.items()}
            redis_process = psutil.Process(redis[1]) if redis is not None else None
            for concurrency in CONCURRENCY[mode_name]:
                rows: dict[str, dict[str, list[float]]] = {key: {"cpu": [], "rps": []} for key in servers}
                redis_cpu: dict[str, list[float]] = {key: [] for key in servers}
                errors = dict.fromkeys(servers, 0)
                for index in range(slices):
                    for key, server in servers.items():  # interleaved
                        cpu_before = sum(processes[key].cpu_times()[:2])
                        redis_before = sum(redis_process.cpu_times()[:2]) if redis_process else 0.0
                        tag = f"{key}-{concurrency}-{index}"
                        answered, failed, took = await _load(server.url, body, concurrency, seconds / slices, tag)
                        cpu = sum(processes[key].cpu_times()[:2]) - cpu_before
                        rows[key]["cpu"].append(cpu / max(1, answered))
                        rows[key]["rps"].append(answered / took)
                        errors[key] += failed
                        if key in ("redis", "before_redis") and redis_process is not None:
                            redis_cpu[key].append(
                                (sum(redis_process.cpu_times()[:2]) - redis_before) / max(1, answered)
                            )
                for key in servers:
                    table[f"{key}@{concurrency}"] = {
                        "target": key,
                        "concurrency": concurrency,
                        "cpu_per_request": rows[key]["cpu"],
                        "rps": rows[key]["rps"],
                        "errors": errors[key],
                        "median_cpu_per_request": statistics.median(rows[key]["cpu"]),
                        "median_rps": statistics.median(rows[key]["rps"]),
                    }
                    if redis_cpu[key]:
                        table[f"{key}@{concurrency}"]["redis_cpu_per_request"] = statistics.median(redis_cpu[key])
                    row = table[f"{key}@{concurrency}"]
                    log(
                        f"sessions c={concurrency} {key}: {row['median_rps']:.0f} req/s, "
                        f"{row['median_cpu_per_request'] * 1e3:.3f} ms CPU/request, {errors[key]} errors"
                    )
            store = await anyio.to_thread.run_sync(_store_metrics, servers["redis"].url) if redis is not None else {}
    results["sessions"] = {
        "body_size": len(body),
        "seconds": seconds,
        "slices": slices,
        "before": before,
        "before_commit": _commit(before),
        "redis_store": store,
        "table": table,
    }


def _has_session_store(directory: str) -> bool:
    """Whether the package in ``directory`` has SESSION_STORE (a version after the fleet work began)."""
    settings = os.path.join(directory, "asgi_lifetime", "_settings.py")
    with open(settings, encoding="utf-8") as f:
        return '"session_store"' in f.read()


def _commit(directory: str | None) -> str | None:
    if directory is None:
        return None
    done = subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None
