"""Where the gateway's own time goes: ``python -m benchmarks.profile [--requests N] [--concurrency C]``.

Starts the demo upstream (no delay between events) and the gateway, each in its own uvicorn
subprocess (``benchmarks/servers.py``; the gateway with ``BENCH_PROBE=1``), warms the gateway up,
then profiles it with cProfile (``/_probe/profile-start`` .. ``profile-stop``, in the gateway
process only) while N small streamed requests (section 3's: 1 KiB, 16 tokens) go through it over
C keep-alive connections. Prints the top functions by own time (``tottime``) and by cumulative time,
measured in the gateway thread's CPU time (wall time would charge a send() the moments the process
waited for a core), and the gateway process's CPU time per request with and without the profiler (psutil).

``--http h11`` / ``--loop asyncio``: the gateway's uvicorn parser and loop (default: uvicorn's
``auto``, httptools and uvloop when installed). ``--out FILE`` keeps the ``pstats`` dump (for
``snakeviz`` or ``python -m pstats``). cProfile slows every Python call by about the same amount, so
compare the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import pstats
import sys
import tempfile
import time

import anyio
import httpx
import psutil

from benchmarks.bodies import small_body
from benchmarks.client import Connection
from benchmarks.servers import Server

PATH = "/v1/chat/completions"


async def _load(url: str, body: bytes, requests: int, concurrency: int) -> int:
    """Send ``requests`` requests over ``concurrency`` keep-alive connections; the count answered 200."""
    left = requests
    ok = 0

    async def worker() -> None:
        nonlocal left, ok
        async with Connection(url) as conn:
            while left > 0:
                left -= 1
                result = await conn.post(PATH, body)
                ok += result.status == 200

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return ok


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def profile(args: argparse.Namespace) -> None:
    body = small_body(size=1024, max_tokens=16)
    out = args.out or os.path.join(tempfile.gettempdir(), f"asgi-lifetime-profile-{os.getpid()}.prof")
    server_args = ["--http", args.http, "--loop", args.loop]
    env = {"BENCH_PROBE": "1", "BENCH_PROFILE_OUT": out, "BENCH_PROFILE_CLOCK": "cpu"}
    with Server("demo", tokens_per_second=1e6, extra_args=server_args) as upstream:
        gateway = Server("gateway", upstream=upstream.url, retain=args.retain, env=env, extra_args=server_args)
        with gateway:
            await _load(gateway.url, body, 200, args.concurrency)  # warm-up: imports, pools, caches
            started = _cpu(gateway.pid)
            ok = await _load(gateway.url, body, args.requests, args.concurrency)
            plain = (_cpu(gateway.pid) - started) / max(ok, 1)
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                await client.post("/_probe/profile-start")
                started = _cpu(gateway.pid)
                ok = await _load(gateway.url, body, args.requests, args.concurrency)
                profiled = (_cpu(gateway.pid) - started) / max(ok, 1)
                await client.post("/_probe/profile-stop")
    print(
        f"{ok} requests at c={args.concurrency} (http={args.http}, loop={args.loop}, retain={args.retain}): "
        f"gateway CPU {plain * 1000:.2f} ms per request, {profiled * 1000:.2f} ms under cProfile"
    )
    stats = pstats.Stats(out, stream=sys.stdout)
    stats.strip_dirs()
    for key in ("tottime", "cumulative"):
        print(f"\n--- top {args.top} by {key} ---")
        stats.sort_stats(key).print_stats(args.top)
    if not args.out:
        os.unlink(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="profiled requests (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=1, help="keep-alive connections (default %(default)s)")
    parser.add_argument("--top", type=int, default=30, help="functions listed (default %(default)s)")
    parser.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto")
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    parser.add_argument("--retain", choices=["memory", "disk", "off"], default="disk", help="RETAIN_OUTBOUND")
    parser.add_argument("--out", help="keep the pstats dump here")
    args = parser.parse_args()
    started = time.monotonic()
    anyio.run(profile, args)
    print(f"\n({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
