"""CPU per small request, side by side: ``python -m benchmarks.cpu_per_request [--before DIR] [--seconds S]``.

Section 3's request (1 KiB, streamed, 16 tokens from the demo upstream with no delay) at c=1 and
c=32 through each target, every target in its own uvicorn subprocess, in interleaved slices. The
figure is the target process's CPU time (user + system, psutil) over the requests it answered:
the steadiest one on a shared machine. Targets: the ordinary proxy, the bare forwarder (over the
gateway's upstream transport, aiohttp on asyncio, so the two differ only by the gateway's own work), the gateway
of this checkout and, with ``--before DIR`` (a directory holding another ``asgi_lifetime``, as for
``benchmarks.before_after``), the gateway of that version; each gateway under uvicorn's ``auto``
server (httptools and uvloop when installed) and under h11 + asyncio. Prints medians over the slices.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import psutil

from benchmarks.bodies import small_body
from benchmarks.client import Connection
from benchmarks.servers import Server

ROOT = Path(__file__).resolve().parent.parent
PATH = "/v1/chat/completions"
H11 = ["--http", "h11", "--loop", "asyncio"]


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _slice(url: str, body: bytes, concurrency: int, seconds: float) -> tuple[int, int]:
    ok = errors = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal ok, errors
        async with Connection(url) as conn:
            while time.monotonic() < deadline:
                if (await conn.post(PATH, body)).status == 200:
                    ok += 1
                else:
                    errors += 1

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return ok, errors


def _before_dir(before: Path, scratch: str) -> str:
    """A directory with ``before``'s package and this checkout's benchmarks (the same servers module)."""
    target = os.path.join(scratch, "before")
    os.mkdir(target)
    shutil.copytree(before / "asgi_lifetime", os.path.join(target, "asgi_lifetime"))
    os.symlink(ROOT / "benchmarks", os.path.join(target, "benchmarks"))
    return target


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    body = small_body(size=1024, max_tokens=16)
    records: dict[str, dict[int, list[float]]] = {}
    with ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        upstream = stack.enter_context(Server("demo", tokens_per_second=1e6))
        targets: dict[str, Server] = {
            "ordinary proxy": Server("ordinary", upstream=upstream.url),
            "bare forwarder (the gateway's transport)": Server("bare", upstream=upstream.url),
            "gateway (this checkout)": Server("gateway", upstream=upstream.url, retain=args.retain),
            "gateway (this checkout), h11 + asyncio": Server(
                "gateway", upstream=upstream.url, retain=args.retain, extra_args=H11
            ),
        }
        if args.before is not None:
            cwd = _before_dir(args.before.resolve(), scratch)
            targets["gateway (before)"] = Server("gateway", upstream=upstream.url, retain=args.retain, cwd=cwd)
            targets["gateway (before), h11 + asyncio"] = Server(
                "gateway", upstream=upstream.url, retain=args.retain, cwd=cwd, extra_args=H11
            )
        for server in targets.values():
            stack.enter_context(server)
        for name, server in targets.items():
            await _slice(server.url, body, 4, 1.0)  # warm-up
            records[name] = {c: [] for c in args.concurrency}
        for round_number in range(args.rounds):
            for concurrency in args.concurrency:
                for name, server in targets.items():
                    started = _cpu(server.pid)
                    ok, errors = await _slice(server.url, body, concurrency, args.seconds)
                    if errors:
                        raise RuntimeError(f"{name}: {errors} failed requests")
                    records[name][concurrency].append((_cpu(server.pid) - started) / max(ok, 1) * 1000)
            print(f"round {round_number + 1}/{args.rounds} done", flush=True)
    medians = {name: {c: statistics.median(v) for c, v in by_c.items()} for name, by_c in records.items()}
    return {"records": records, "medians": medians, "load": os.getloadavg()}


def _table(results: dict[str, Any], concurrency: list[int]) -> str:
    medians = results["medians"]
    lines = ["| target | " + " | ".join(f"c={c}: CPU ms/request" for c in concurrency) + " |"]
    lines.append("|---|" + "---|" * len(concurrency))
    for name, by_c in medians.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_c[c]:.2f}" for c in concurrency) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="a directory holding another asgi_lifetime package")
    parser.add_argument("--seconds", type=float, default=3.0, help="per slice (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--retain", choices=["memory", "disk", "off"], default="disk", help="RETAIN_OUTBOUND")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args()
    results = anyio.run(compare, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(_table(results, args.concurrency))


if __name__ == "__main__":
    main()
