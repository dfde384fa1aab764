"""Overload, open loop: requests arrive at a fixed rate, whatever happened to the earlier ones.

``python -m benchmarks.run --only overload`` runs it (``--quick``: short runs). The upstream
(``servers.py`` kind ``slots``) serves ``SLOTS`` requests at a time, each streamed over
``SERVICE_SECONDS``, and queues the rest (FIFO), as a model server does; the gateway's
``MAX_INFLIGHT`` is the same ``SLOTS``. First the capacity is measured closed loop (``SLOTS``
x 2 keep-alive workers, as fast as answers come, through the gateway with shedding off); then
each target gets 0.5x, 1x and 2x that rate, one new connection per request (``connection:
close``), sent at its scheduled time whether or not earlier ones were answered. A request not
answered within ``CLIENT_TIMEOUT`` of its scheduled time is a timeout. Latency is from the
scheduled time to the last byte of the answer. Targets run interleaved (each rate: every
target in turn), each against its own upstream.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import anyio
import psutil

from benchmarks.bodies import small_body
from benchmarks.client import Connection
from benchmarks.servers import Server

__all__ = ["CONFIGS", "TARGETS", "bench_overload"]

PATH = "/v1/chat/completions"
SLOTS = 16
SERVICE_SECONDS = 0.5
CLIENT_TIMEOUT = 20.0  # seconds from the scheduled arrival: a client that gives up

TARGETS: dict[str, tuple[str, dict[str, str]]] = {
    # key: (server kind, settings)
    "gw_shed": ("gateway", {}),  # the defaults: ADMISSION_TARGET_DELAY, ADMISSION_INTERVAL
    "gw_fifo": ("gateway", {"ADMISSION_TARGET_DELAY": "0"}),  # shedding off: the FIFO queue of before
    "ordinary": ("ordinary", {}),
}


@dataclass(frozen=True)
class Config:
    seconds: float  # per run
    rates: tuple[float, ...]  # multiples of the capacity
    rounds: int
    capacity_seconds: float


CONFIGS = {
    "full": Config(20.0, (0.5, 1.0, 2.0), 2, 8.0),
    "quick": Config(6.0, (0.5, 1.0, 2.0), 1, 4.0),
    "smoke": Config(1.0, (0.5, 2.0), 1, 1.0),
}


@dataclass(slots=True)
class Answer:
    status: int  # 0: timed out, -1: connection error, -2: a 200 whose stream did not end with [DONE]
    latency: float  # scheduled arrival -> last byte
    retry_after: bool
    lag: float  # how late the request was sent (the driver's own delay)


def _head(host: str, port: int, body: bytes) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


async def _one(host: str, port: int, request: bytes, scheduled: float, give_up: float) -> Answer:
    lag = time.monotonic() - scheduled
    data = bytearray()
    with anyio.move_on_after(max(0.0, scheduled + give_up - time.monotonic())) as scope:
        try:
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(request)
                while True:
                    try:
                        data += await stream.receive(65536)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
        except OSError:
            return Answer(-1, time.monotonic() - scheduled, False, lag)
    ended = time.monotonic()
    if scope.cancelled_caught:
        return Answer(0, ended - scheduled, False, lag)
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Answer(-1, ended - scheduled, False, lag)
    retry_after = any(line.lower().startswith(b"retry-after:") for line in lines[1:])
    if status == 200 and b"[DONE]" not in rest:
        status = -2
    return Answer(status, ended - scheduled, retry_after, lag)


async def open_loop(url: str, body: bytes, rate: float, seconds: float, give_up: float) -> list[Answer]:
    """Send ``rate`` requests per second for ``seconds``, each at its time on a new connection."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    request = _head(host, int(port), body)
    answers: list[Answer] = []

    async def one(scheduled: float) -> None:
        answers.append(await _one(host, int(port), request, scheduled, give_up))

    count = int(rate * seconds)
    start = time.monotonic() + 0.05
    async with anyio.create_task_group() as tg:
        for index in range(count):
            scheduled = start + index / rate
            delay = scheduled - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, scheduled)
    return answers


async def closed_loop_capacity(url: str, body: bytes, workers: int, seconds: float) -> float:
    """Answers (200) per second with ``workers`` keep-alive clients sending back to back."""
    done = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        async with Connection(url) as conn:
            while time.monotonic() < deadline:
                if (await conn.post(PATH, body)).status == 200:
                    done += 1

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(workers):
            tg.start_soon(worker)
    return done / (time.monotonic() - started)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(answers: list[Answer], seconds: float) -> dict[str, Any]:
    ok = [a.latency for a in answers if a.status == 200]
    shed = [a for a in answers if a.status == 503]
    return {
        "sent": len(answers),
        "ok": len(ok),
        "shed": len(shed),
        "shed_retry_after": sum(a.retry_after for a in shed),
        "timeouts": sum(a.status == 0 for a in answers),
        "errors": sum(a.status not in (0, 200, 503) for a in answers),
        "other_statuses": sorted({a.status for a in answers} - {0, 200, 503}),
        "ok_p50": _percentile(ok, 50),
        "ok_p99": _percentile(ok, 99),
        "shed_p50": _percentile([a.latency for a in shed], 50),
        "shed_p99": _percentile([a.latency for a in shed], 99),
        "goodput": len(ok) / seconds,
        "lag_p99": _percentile([a.lag for a in answers], 99),
        "lag_max": max((a.lag for a in answers), default=0.0),
    }


async def _get(url: str, path: str) -> bytes:
    host, port = url.rsplit("/", 1)[-1].split(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
        data = bytearray()
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                break
    return bytes(data).partition(b"\r\n\r\n")[2]


async def _idle(upstream: Server, seconds: float = 60.0) -> None:
    """Wait until the upstream has nothing active or queued (the ordinary proxy leaves work behind)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if b'"active": 0, "waiting": 0' in await _get(upstream.url, "/_stats"):
            return
        await anyio.sleep(0.2)
    raise RuntimeError("the upstream did not go idle")


async def _admission(url: str) -> dict[str, float]:
    """The gateway's admission metrics: queue wait buckets (cumulative), sum, count, and sheds by reason."""
    found: dict[str, float] = {}
    for line in (await _get(url, "/metrics")).decode().splitlines():
        if line.startswith("asgi_lifetime_admission_queue_seconds") or line.startswith(
            "asgi_lifetime_admission_shed_total"
        ):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def _queue_summary(metrics: dict[str, float]) -> dict[str, Any]:
    """The admitted requests' queue waits from the histogram: count, mean, and the bucket bound
    under which 99% fell (the histogram's resolution)."""
    prefix = "asgi_lifetime_admission_queue_seconds"
    count = metrics.get(f"{prefix}_count", 0.0)
    buckets = sorted(
        (float(name.split('le="', 1)[1].split('"', 1)[0]), value)
        for name, value in metrics.items()
        if name.startswith(f"{prefix}_bucket")
    )
    p99_bound = next((le for le, cumulative in buckets if count and cumulative >= 0.99 * count), None)
    reasons = {
        name.split('reason="', 1)[1].split('"', 1)[0]: int(value)
        for name, value in metrics.items()
        if name.startswith("asgi_lifetime_admission_shed_total")
    }
    return {
        "admitted": int(count),
        "mean_wait": metrics.get(f"{prefix}_sum", 0.0) / count if count else None,
        "wait_p99_under": p99_bound,
        "shed_by_reason": reasons,
    }


async def one_round(config: Config, log: Any) -> dict[str, Any]:
    body = small_body(size=1024, max_tokens=16)
    upstreams = {key: Server("slots", extra_args=["--slots", str(SLOTS), "--service-seconds", str(SERVICE_SECONDS)])
                 for key in TARGETS}  # fmt: skip
    servers: dict[str, Server] = {}
    load = os.getloadavg()[0]
    try:
        for key, (kind, settings) in TARGETS.items():
            upstreams[key].__enter__()
            changes = {"MAX_INFLIGHT": str(SLOTS), **settings} if kind == "gateway" else {}
            servers[key] = Server(kind, upstream=upstreams[key].url, settings=changes).__enter__()
        for key, server in servers.items():  # warm: a few answers through each
            await closed_loop_capacity(server.url, body, 2, 0.5)
            await _idle(upstreams[key])
        capacity = await closed_loop_capacity(servers["gw_fifo"].url, body, 2 * SLOTS, config.capacity_seconds)
        await _idle(upstreams["gw_fifo"])
        log(f"overload: capacity {capacity:.1f} req/s (the upstream's bound: {SLOTS / SERVICE_SECONDS:.1f})")
        runs: dict[str, dict[str, Any]] = {key: {} for key in TARGETS}
        for multiple in config.rates:
            for key, server in servers.items():
                gateway = TARGETS[key][0] == "gateway"
                before = await _admission(server.url) if gateway else {}
                process = psutil.Process(server.pid)
                cpu = sum(process.cpu_times()[:2])
                answers = await open_loop(server.url, body, multiple * capacity, config.seconds, CLIENT_TIMEOUT)
                summary = summarize(answers, config.seconds)
                summary["cpu_seconds"] = sum(process.cpu_times()[:2]) - cpu
                if gateway:
                    summary["admission"] = _queue_summary(_difference(await _admission(server.url), before))
                runs[key][f"{multiple:g}"] = summary
                log(
                    f"overload {multiple:g}x {key}: {summary['ok']} ok, {summary['shed']} 503 "
                    f"({summary['shed_retry_after']} with Retry-After), {summary['timeouts']} timeouts, "
                    f"{summary['errors']} errors; ok p99 {summary['ok_p99'] or 0:.2f} s, "
                    f"503 p99 {summary['shed_p99'] or 0:.2f} s, lag max {summary['lag_max'] * 1000:.0f} ms, "
                    f"cpu {summary['cpu_seconds']:.1f} s; {summary.get('admission', '')}"
                )
                await _idle(upstreams[key])
    finally:
        for server in [*servers.values(), *upstreams.values()]:
            server.__exit__(None, None, None)
    return {"capacity": capacity, "load": [load, os.getloadavg()[0]], "runs": runs}


async def bench_overload(mode: str, results: dict[str, Any], log: Any) -> None:
    config = CONFIGS[mode]
    from benchmarks.run import machine

    started = time.monotonic()
    rounds = []
    for index in range(config.rounds):
        log(f"overload round {index + 1} of {config.rounds}")
        rounds.append(await one_round(config, log))
    results["overload"] = {
        "date": machine()["date"],
        "seconds": time.monotonic() - started,
        "slots": SLOTS,
        "service_seconds": SERVICE_SECONDS,
        "client_timeout": CLIENT_TIMEOUT,
        "run_seconds": config.seconds,
        "settings": _gateway_settings(),
        "rounds": rounds,
    }


def _gateway_settings() -> dict[str, Any]:
    from asgi_lifetime import LifetimeSettings

    defaults = LifetimeSettings()
    return {
        "admission_timeout": defaults.admission_timeout,
        "admission_target_delay": defaults.admission_target_delay,
        "admission_interval": defaults.admission_interval,
    }
