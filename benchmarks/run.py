"""The benchmark suite: ``python -m benchmarks.run [--quick | --smoke] [--out DIR]``.

Writes ``DIR/benchmarks.md`` (default ``docs/``), PNG plots next to it (not with
``--smoke``) and the raw results as ``benchmarks/results.json`` (``DIR/benchmarks.json``
when ``--out`` is given). ``--report-only`` rebuilds the page from the stored results.

Every gateway runs in its own uvicorn subprocess (``benchmarks/servers.py``), so the RSS
sampled (psutil, every 10 ms) is the gateway's alone; the upstream runs in another
subprocess and the client (``benchmarks/client.py``) in this one. The machine is shared:
compare within one run, side by side, never across runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

from benchmarks.agents import bench_agents
from benchmarks.bodies import SHAPES, make_body, small_body
from benchmarks.client import Connection, Result
from benchmarks.overload import bench_overload
from benchmarks.rss import Sampler
from benchmarks.servers import Server
from benchmarks.session_book import bench_sessions

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
PATH = "/v1/chat/completions"
TOKENS_PER_SECOND = 50.0  # the slow demo upstream of the memory benchmarks


@dataclass(frozen=True)
class Mode:
    name: str
    sizes: tuple[int, ...]  # MiB, memory grid
    shapes: tuple[str, ...]
    gateways: tuple[str, ...]
    stream_tokens: int  # answer length in the memory grid (tokens at TOKENS_PER_SECOND)
    lengths: tuple[int, ...]  # answer lengths (tokens) of the response-length sweep
    sweep_size: int  # MiB
    steady_size: int  # MiB
    steady_count: int
    overhead_seconds: float  # per target and concurrency
    overhead_slices: int
    concurrency: tuple[int, ...]
    ttfb_size: int  # MiB
    ttfb_rounds: int
    fingerprint_sizes: tuple[int, ...]
    codec_size: int  # MiB
    trim_sizes: tuple[int, ...]
    plots: bool
    retain_size: int = 64  # MiB, section 7: RETAIN_OUTBOUND disk vs memory vs off
    retain_rounds: int = 3
    parse_size: int = 16  # MiB, section 11: the parse working set by body shape


MODES = {
    "full": Mode(
        "full",
        (1, 16, 64, 128),
        SHAPES,
        ("gw_on", "gw_off", "ordinary"),
        80,
        (25, 100, 400),
        64,
        64,
        50,
        10.0,
        4,
        (1, 32),
        64,
        7,
        (1, 16, 64, 128),
        64,
        (16, 64, 128),
        True,
        retain_size=64,
        retain_rounds=5,
    ),
    "quick": Mode(
        "quick",
        (1, 16),
        SHAPES,
        ("gw_on", "gw_off", "ordinary"),
        50,
        (25, 100),
        16,
        16,
        10,
        2.0,
        2,
        (1, 32),
        16,
        3,
        (1, 16),
        16,
        (16,),
        True,
        retain_size=16,
        retain_rounds=2,
    ),
    "smoke": Mode(
        "smoke",
        (1,),
        ("turns",),
        ("gw_on", "ordinary"),
        10,
        (),
        1,
        1,
        3,
        0.5,
        1,
        (1, 8),
        1,
        1,
        (1,),
        1,
        (),
        False,
        retain_size=2,
        retain_rounds=1,
        parse_size=1,
    ),
}

LABELS = {
    "gw_on": "asgi_lifetime gateway, RETAIN_OUTBOUND=memory",
    "gw_disk": "asgi_lifetime gateway, RETAIN_OUTBOUND=disk (the default)",
    "gw_off": "asgi_lifetime gateway, RETAIN_OUTBOUND=off",
    "gw_unchanged": "asgi_lifetime gateway, body unchanged (no preparer)",
    "gw_notrim": "asgi_lifetime gateway, malloc_trim disabled",
    "gw_ka8": "asgi_lifetime gateway, upstream keep-alive pool capped at 8 (diagnosis)",
    "gw_httpcore": "asgi_lifetime gateway, UPSTREAM_TRANSPORT=httpcore (httpx's own transport)",
    "ordinary": "ordinary Starlette + httpx proxy",
    "bare": "bare forwarder (lower bound), on the gateway's upstream transport",
    "direct": "direct to upstream",
}


def server_for(key: str, upstream: str) -> Server:
    if key == "gw_on":
        return Server("gateway", upstream=upstream, retain="memory")
    if key == "gw_disk":
        return Server("gateway", upstream=upstream, retain="disk")
    if key == "gw_off":
        return Server("gateway", upstream=upstream, retain="off")
    if key == "gw_unchanged":
        return Server("gateway-unchanged", upstream=upstream, retain="memory")
    if key == "gw_notrim":
        return Server("gateway", upstream=upstream, retain="memory", trim=False)
    if key == "gw_ka8":
        return Server("gateway", upstream=upstream, retain="memory", env={"BENCH_KEEPALIVE": "8"})
    if key == "gw_httpcore":
        return Server("gateway", upstream=upstream, retain="memory", settings={"upstream_transport": "httpcore"})
    if key == "ordinary":
        return Server("ordinary", upstream=upstream)
    if key == "bare":
        return Server("bare", upstream=upstream)
    raise ValueError(key)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _warm_up(url: str) -> None:
    async with Connection(url) as conn:
        for body in (small_body(), small_body(), make_body("turns", 64 * 1024, max_tokens=2)):
            result = await conn.post(PATH, body)
            if result.status != 200:
                raise RuntimeError(f"warm-up request to {url} failed with {result.status}")


# -- 1. memory vs request size and answer length ---------------------------------------------------------


async def one_large_request(key: str, upstream: str, body: bytes, *, keep_samples: bool = False) -> dict[str, Any]:
    """A fresh gateway process, warmed up; one large request; its RSS above the warm baseline."""
    record = await large_request_on(server_for(key, upstream), body, keep_samples=keep_samples)
    return {"gateway": key, **record}


async def large_request_on(
    server: Server, body: bytes, *, keep_samples: bool = False, stats: bool = False
) -> dict[str, Any]:
    """Start ``server``, warm it up, send one large request; its RSS figures above the warm baseline.

    ``stats``: also record the gateway's ``/lifetime/stats`` totals after the request."""
    totals: dict[str, Any] = {}
    with server, Sampler(server.pid) as sampler:
        await _warm_up(server.url)
        await anyio.sleep(0.4)
        now = time.monotonic()
        base = sampler.median(now - 0.3, now)
        async with Connection(server.url) as conn:
            result = await conn.post(PATH, body)
        await anyio.sleep(1.0)
        end = time.monotonic()
        if stats:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                totals = (await client.get("/lifetime/stats")).json()
    if result.status != 200:
        raise RuntimeError(f"{server.kind}: large request failed with {result.status}")
    size = len(body)
    record: dict[str, Any] = {
        "size": size,
        "base": base,
        "ttfb": result.ttfb,
        "stream_seconds": result.ended - result.first_byte,
        "peak_prepare": sampler.peak(result.started, result.first_byte) - base,
        "median_stream": sampler.median(result.first_byte, result.ended) - base,
        "after": sampler.median(end - 0.3, end) - base,
        # Area above the baseline from request start to 1 s after the end: memory x time held.
        "mib_seconds": _area(sampler.samples, result.started, end, base) / MiB,
    }
    if stats:
        record["stats"] = {k: totals[k] for k in ("spilled", "spill_failures", "retried", "completed")}
    if keep_samples:
        record["samples"] = [
            (t - result.started, (rss - base) / MiB) for t, rss in sampler.samples if result.started - 0.2 <= t <= end
        ]
        record["first_byte_at"] = result.first_byte - result.started
        record["ended_at"] = result.ended - result.started
    return record


def _area(samples: list[tuple[float, int]], start: float, end: float, base: float) -> float:
    points = [(t, rss - base) for t, rss in samples if start <= t <= end]
    return sum((t2 - t1) * max(0.0, v1) for (t1, v1), (t2, _) in zip(points, points[1:], strict=False))


async def bench_memory(mode: Mode, results: dict[str, Any]) -> None:
    grid: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    with Server("demo", tokens_per_second=TOKENS_PER_SECOND) as upstream:
        for shape in mode.shapes:
            for size in mode.sizes:
                body = make_body(shape, size * MiB, max_tokens=mode.stream_tokens)
                plot = shape == "turns" and size == max(s for s in mode.sizes if s <= 64)
                for key in mode.gateways:
                    record = await one_large_request(key, upstream.url, body, keep_samples=plot)
                    record["shape"] = shape
                    if plot:
                        timeline.append(record)
                    else:
                        grid.append(record)
                    log(
                        f"memory {shape} {size} MiB {key}: peak {record['peak_prepare'] / MiB:.0f} MiB, "
                        f"streaming {record['median_stream'] / MiB:.0f} MiB, after {record['after'] / MiB:.0f} MiB, "
                        f"ttfb {record['ttfb']:.2f} s"
                    )
                del body
        sweep: list[dict[str, Any]] = []
        if mode.lengths:
            body = make_body("turns", mode.sweep_size * MiB)
            for tokens in mode.lengths:
                sized = body.replace(b'"max_tokens":40', f'"max_tokens":{tokens}'.encode(), 1)
                for key in mode.gateways:
                    record = await one_large_request(key, upstream.url, sized)
                    record["tokens"] = tokens
                    sweep.append(record)
                    log(
                        f"answer length {tokens} tokens {key}: streaming {record['median_stream'] / MiB:.0f} MiB, "
                        f"{record['mib_seconds']:.0f} MiB*s"
                    )
            del body
    results["memory"] = {
        "grid": grid + [{k: v for k, v in r.items() if k != "samples"} for r in timeline],
        "timeline": timeline,
        "sweep": sweep,
        "tokens_per_second": TOKENS_PER_SECOND,
        "stream_tokens": mode.stream_tokens,
    }


# -- 7. the retained outbound body: disk, memory, off -----------------------------------------------------


# The three settings with the demo preparer (it inserts a message), and the body forwarded unchanged.
RETAIN_KEYS = ("gw_disk", "gw_on", "gw_off", "gw_unchanged")


async def bench_retain(mode: Mode, results: dict[str, Any]) -> None:
    """RETAIN_OUTBOUND disk vs memory vs off on the many-turn target case: rounds interleaved, one fresh
    gateway process per request (RETAIN_DIR: the system temp dir)."""
    body = make_body("turns", mode.retain_size * MiB, max_tokens=mode.stream_tokens)
    records: list[dict[str, Any]] = []
    started, load = time.monotonic(), [os.getloadavg()[0]]
    date = time.strftime("%a %b %e %H:%M:%S UTC %Y", time.gmtime())  # as date(1) prints it
    with Server("demo", tokens_per_second=TOKENS_PER_SECOND) as upstream:
        for number in range(mode.retain_rounds):
            for key in RETAIN_KEYS:
                record = await large_request_on(server_for(key, upstream.url), body, stats=True)
                records.append({"gateway": key, "round": number, **record})
                log(
                    f"retain {key} round {number}: streaming {record['median_stream'] / MiB:.1f} MiB, "
                    f"peak {record['peak_prepare'] / MiB:.0f} MiB, ttfb {record['ttfb']:.2f} s, "
                    f"spilled {record['stats']['spilled']}"
                )
            load.append(os.getloadavg()[0])
    temp_dir = tempfile.gettempdir()
    results["retain"] = {
        "size": len(body),
        "rounds": mode.retain_rounds,
        "records": records,
        "stream_tokens": mode.stream_tokens,
        "tokens_per_second": TOKENS_PER_SECOND,
        "temp_dir": temp_dir,
        "temp_fs": _filesystem(temp_dir),
        "load": load,
        "date": date,
        "seconds": time.monotonic() - started,
    }


def _filesystem(path: str) -> str:
    """The type of the file system ``path`` is on (``ext4``, ``tmpfs``...), from /proc/self/mounts."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


# -- 2. steady state ---------------------------------------------------------------------------------------


async def bench_steady(mode: Mode, results: dict[str, Any]) -> None:
    body = make_body("turns", mode.steady_size * MiB, max_tokens=5)
    runs: dict[str, list[float]] = {}
    keys = ["gw_on", "gw_notrim", "ordinary"] if mode.name != "smoke" else ["gw_on"]
    with Server("demo", tokens_per_second=1000.0) as upstream:
        for key in keys:
            with server_for(key, upstream.url) as server, Sampler(server.pid, interval=0.05) as sampler:
                await _warm_up(server.url)
                await anyio.sleep(0.3)
                base = sampler.now()
                after: list[float] = []
                async with Connection(server.url) as conn:
                    for _ in range(mode.steady_count):
                        result = await conn.post(PATH, body)
                        if result.status != 200:
                            raise RuntimeError(f"steady {key}: status {result.status}")
                        await anyio.sleep(0.2)
                        after.append(sampler.now() - base)
            runs[key] = after
            log(
                f"steady {key}: after first {after[0] / MiB:.0f} MiB, after last {after[-1] / MiB:.0f} MiB, "
                f"max {max(after) / MiB:.0f} MiB"
            )
    results["steady"] = {"size": len(body), "count": mode.steady_count, "runs": runs}


# -- 3. overhead -------------------------------------------------------------------------------------------


async def _load(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[int, float, list[Result]]:
    results: list[Result] = []
    deadline = time.monotonic() + seconds
    errors = 0

    async def worker() -> None:
        nonlocal errors
        async with Connection(url) as conn:
            while time.monotonic() < deadline:
                result = await conn.post(PATH, body)
                if result.status == 200:
                    results.append(result)
                else:
                    errors += 1

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return errors, time.monotonic() - started, results


async def bench_overhead(mode: Mode, results: dict[str, Any]) -> None:
    body = small_body(size=1024, max_tokens=16)
    # gw_on sends over aiohttp (UPSTREAM_TRANSPORT=auto on uvicorn's asyncio), gw_httpcore over httpcore.
    keys = ["direct", "bare", "ordinary", "gw_on", "gw_httpcore"] + (["gw_ka8"] if mode.name != "smoke" else [])
    table: dict[str, dict[str, Any]] = {}
    with Server("demo", tokens_per_second=1e6) as upstream:
        servers = {key: server_for(key, upstream.url) for key in keys if key != "direct"}
        urls = {"direct": upstream.url}
        pids = {"direct": upstream.pid}
        try:
            for key, server in servers.items():
                server.__enter__()
                urls[key] = server.url
                pids[key] = server.pid
                await _warm_up(server.url)
            processes = {key: psutil.Process(pid) for key, pid in pids.items()}
            for concurrency in mode.concurrency:
                collected: dict[str, list[Result]] = {key: [] for key in keys}
                elapsed = dict.fromkeys(keys, 0.0)
                slice_rates: dict[str, list[float]] = {key: [] for key in keys}
                failures = dict.fromkeys(keys, 0)
                cpu = dict.fromkeys(keys, 0.0)
                for _ in range(mode.overhead_slices):
                    for key in keys:  # interleaved: every target sees the same background noise
                        before = sum(processes[key].cpu_times()[:2])
                        errors, seconds, got = await _load(
                            urls[key], body, concurrency, mode.overhead_seconds / mode.overhead_slices
                        )
                        cpu[key] += sum(processes[key].cpu_times()[:2]) - before
                        collected[key] += got
                        elapsed[key] += seconds
                        failures[key] += errors
                        slice_rates[key].append(len(got) / seconds)
                for key in keys:
                    latencies = sorted(r.latency for r in collected[key])
                    table[f"{key}@{concurrency}"] = {
                        "gateway": key,
                        "concurrency": concurrency,
                        "requests": len(latencies),
                        "errors": failures[key],
                        "rps": len(latencies) / elapsed[key],
                        "rps_slices": slice_rates[key],
                        "p50": _percentile(latencies, 50),
                        "p99": _percentile(latencies, 99),
                        "ttfb_p50": _percentile(sorted(r.ttfb for r in collected[key]), 50),
                        # CPU time of the proxy process (of the upstream for "direct") per request.
                        "cpu_per_request": cpu[key] / max(1, len(latencies)),
                    }
                    log(
                        f"overhead c={concurrency} {key}: {table[f'{key}@{concurrency}']['rps']:.0f} req/s, "
                        f"p50 {table[f'{key}@{concurrency}']['p50'] * 1000:.1f} ms"
                    )
        finally:
            for server in servers.values():
                server.__exit__(None, None, None)
    results["overhead"] = {
        "body_size": len(body),
        "seconds": mode.overhead_seconds,
        "table": table,
        "bare_transport": "same",  # benchmarks/bare_forwarder.py: the gateway's UpstreamTransport (auto)
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


# -- 4. time to first byte ---------------------------------------------------------------------------------


async def bench_ttfb(mode: Mode, results: dict[str, Any]) -> None:
    body = make_body("turns", mode.ttfb_size * MiB, max_tokens=5)
    keys = ["direct", "bare", "ordinary", "gw_on", "gw_unchanged"]
    times: dict[str, list[float]] = {key: [] for key in keys}
    with Server("sink") as upstream:
        servers = {key: server_for(key, upstream.url) for key in keys if key != "direct"}
        urls = {"direct": upstream.url}
        try:
            for key, server in servers.items():
                server.__enter__()
                urls[key] = server.url
                await _warm_up(server.url)
                async with Connection(server.url) as conn:  # one large request first: allocator warm
                    await conn.post(PATH, body)
            for _ in range(mode.ttfb_rounds):
                for key in keys:
                    async with Connection(urls[key]) as conn:
                        result = await conn.post(PATH, body)
                    if result.status != 200:
                        raise RuntimeError(f"ttfb {key}: status {result.status}")
                    times[key].append(result.ttfb)
                    await anyio.sleep(0.2)
        finally:
            for server in servers.values():
                server.__exit__(None, None, None)
    for key in keys:
        log(f"ttfb {key}: median {statistics.median(times[key]):.3f} s")
    # The gateway's own step between reading and sending, timed alone on the same body (in this process).
    from asgi_lifetime._lazy import shape

    look = []
    for _ in range(5):
        started = time.perf_counter()
        shape(body)
        look.append(time.perf_counter() - started)
    log(f"ttfb lazy look alone: median {statistics.median(look) * 1000:.0f} ms")
    results["ttfb"] = {"size": len(body), "times": times, "look_s": statistics.median(look)}


# -- 5. fingerprint cost -----------------------------------------------------------------------------------


def _median_time(function: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _fingerprint_row(shape: str, size: int) -> dict[str, Any]:
    from blake3 import blake3

    from asgi_lifetime import _json, text_comparable, wire_hash

    raw = make_body(shape, size * MiB)
    parsed = _json.loads(raw)
    repeat = 5 if size <= 64 else 3

    def chunked() -> str:
        hasher = blake3()
        with memoryview(raw) as view:
            for offset in range(0, len(view), 65536):  # as read_body feeds it: one ASGI chunk at a time
                hasher.update(view[offset : offset + 65536])
        return str(hasher.hexdigest())

    return {
        "shape": shape,
        "size": len(raw),
        "blake3_chunked": _median_time(chunked, repeat),
        "blake3_whole": _median_time(lambda: wire_hash(raw), repeat),
        "verdict": _median_time(lambda: text_comparable(parsed), repeat),
        "stdlib_loads": _median_time(lambda: json.loads(raw.decode("utf-8")), repeat),
        "codec_loads": _median_time(lambda: _json.loads(raw), repeat),
    }


def bench_fingerprint(mode: Mode, results: dict[str, Any]) -> None:
    rows = []
    for shape in ("turns", "image"):
        for size in mode.fingerprint_sizes:
            row = _fingerprint_row(shape, size)
            rows.append(row)
            log(
                f"fingerprint {shape} {size} MiB: blake3 {row['size'] / row['blake3_chunked'] / 1e9:.2f} GB/s, "
                f"verdict {row['verdict'] * 1000:.1f} ms, json.loads {row['stdlib_loads'] * 1000:.0f} ms"
            )
    results["fingerprint"] = rows


# -- 6. JSON codec and malloc_trim -------------------------------------------------------------------------


def bench_codec(mode: Mode, results: dict[str, Any]) -> None:
    codecs = ["stdlib", "msgspec", "asgi_lifetime"]
    try:
        import orjson  # noqa: F401

        codecs.insert(1, "orjson")
    except ImportError:
        pass
    rows = []
    trims = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = sorted({mode.codec_size, *mode.trim_sizes})
        for size in sizes:
            path = Path(tmp) / f"turns-{size}.json"
            path.write_bytes(make_body("turns", size * MiB))
            names = codecs if size == mode.codec_size else ["asgi_lifetime"]
            for name in names:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.codec", name, str(path)],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                row = json.loads(out)
                if size == mode.codec_size:
                    rows.append(row)
                if name == "asgi_lifetime" and size in mode.trim_sizes:
                    trims.append(row)
                log(
                    f"codec {name} {size} MiB: loads {row['loads_s'] * 1000:.0f} ms peak "
                    f"+{row['loads_peak'] / MiB:.0f} MiB, dumps {row['dumps_s'] * 1000:.0f} ms peak "
                    f"+{row['dumps_peak'] / MiB:.0f} MiB, trim {row['trim_s'] * 1000:.1f} ms "
                    f"{row['freed_rss'] / MiB:.0f} -> {row['trimmed_rss'] / MiB:.0f}"
                )
    results["codec"] = {"rows": rows, "trim": trims}


# -- 11. The parse working set by body shape ------------------------------------------------------------------


def bench_parse(mode: Mode, results: dict[str, Any]) -> None:
    from benchmarks.parse_shapes import SHAPES, measure

    rows = []
    for name in SHAPES:
        row = measure(name, mode.parse_size * MiB)
        rows.append(row)
        parsed = "refused" if row["parse_peak"] is None else f"{row['parse_peak'] / row['size']:.2f}x"
        log(
            f"parse {name}: look {row['verdict']} {row['look_peak'] / row['size']:.2f}x, "
            f"estimate {row['estimate'] / row['size']:.2f}x, parse {parsed}"
        )
    results["parse"] = {"size": mode.parse_size * MiB, "rows": rows}


# -- the report --------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for name in ("uvicorn", "starlette", "httpx", "h11", "msgspec", "blake3", "anyio"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = "?"
    return {
        "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libc": " ".join(platform.libc_ver()),
        "versions": versions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="1 and 16 MiB, short runs (a few minutes)")
    group.add_argument("--smoke", action="store_true", help="1 MiB, one shape, no plots (the test suite's check)")
    parser.add_argument("--out", type=Path, default=None, help="where benchmarks.md and the plots go (docs/)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated: memory,steady,overhead,ttfb,fingerprint,codec,overload,retain,sessions,agents,parse",
    )
    parser.add_argument(
        "--before",
        default=None,
        help="sessions: a checkout of the package before the fleet work (DIR/asgi_lifetime), measured beside",
    )
    parser.add_argument(
        "--agents-seconds", type=float, default=None, help="agents: load seconds per target and concurrency (60)"
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild the page from the stored results")
    args = parser.parse_args(argv)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    out = args.out if args.out is not None else ROOT / "docs"
    store = (out / "benchmarks.json") if args.out is not None else ROOT / "benchmarks" / "results.json"
    out.mkdir(parents=True, exist_ok=True)

    from benchmarks.report import write_report

    if args.report_only:
        stored = json.loads(store.read_text())
        write_report(stored, out, plots=MODES[stored["mode"]].plots)
        return 0

    only = {name for name in args.only.split(",") if name}
    results: dict[str, Any] = {"mode": mode.name, "machine": machine(), "command": _command(args)}
    partial = False
    if only and store.exists():  # a partial run updates the stored results
        previous = json.loads(store.read_text())
        if previous.get("mode") == mode.name:
            # The page's header stays the full run's (machine, date, duration); each section run
            # here records its own machine next to its results (the overload section its date too).
            partial = True
            here = results["machine"]
            results = {**previous, "command": previous.get("command")}
    started = time.monotonic()
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("memory", lambda: anyio.run(bench_memory, mode, results)),
        ("steady", lambda: anyio.run(bench_steady, mode, results)),
        ("overhead", lambda: anyio.run(bench_overhead, mode, results)),
        ("ttfb", lambda: anyio.run(bench_ttfb, mode, results)),
        ("fingerprint", lambda: bench_fingerprint(mode, results)),
        ("codec", lambda: bench_codec(mode, results)),
        ("overload", lambda: anyio.run(bench_overload, mode.name, results, log)),
        ("retain", lambda: anyio.run(bench_retain, mode, results)),
        ("sessions", lambda: anyio.run(bench_sessions, mode.name, results, log, args.before)),
        (
            "agents",
            lambda: anyio.run(functools.partial(bench_agents, mode.name, results, log, seconds=args.agents_seconds)),
        ),
        ("parse", lambda: bench_parse(mode, results)),
    ]
    for name, step in steps:
        if only and name not in only:
            continue
        log(f"== {name}")
        step_started = time.monotonic()
        step()
        results.setdefault("seconds", {})[name] = time.monotonic() - step_started
        if partial and isinstance(results.get(name), dict):
            results[name]["machine"] = here
    if not partial:
        results["total_seconds"] = time.monotonic() - started
    store.write_text(json.dumps(results, indent=1))
    write_report(results, out, plots=mode.plots, redraw=frozenset(only) if only else None)
    log(f"done in {time.monotonic() - started:.0f} s: {out / 'benchmarks.md'}")
    return 0


def _command(args: argparse.Namespace) -> str:
    flags = " --quick" if args.quick else " --smoke" if args.smoke else ""
    return f".venv/bin/python -m benchmarks.run{flags}"


if __name__ == "__main__":
    raise SystemExit(main())
