"""Before/after for a package change: ``python -m benchmarks.before_after BEFORE_DIR [--size MiB]``.

``BEFORE_DIR`` holds another version of the package (``BEFORE_DIR/asgi_lifetime``). Both
versions run side by side in the same run, interleaved, on the same many-turn body:
memory (as in section 1 of docs/benchmarks.md, with the demo upstream) and time to first
byte (with the sink upstream). Results go to ``benchmarks/before_after.json``, which the
report shows under "What the measurements changed".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import anyio

from benchmarks.bodies import make_body
from benchmarks.client import Connection
from benchmarks.run import PATH, ROOT, TOKENS_PER_SECOND, _warm_up, large_request_on, log, machine
from benchmarks.servers import Server

MiB = 1024 * 1024


async def _memory(cwd: str | None, retain: bool, upstream: str, body: bytes) -> dict[str, float]:
    server = Server("gateway", upstream=upstream, retain="memory" if retain else "off", cwd=cwd)
    record = await large_request_on(server, body)
    return {key: record[key] for key in ("peak_prepare", "median_stream", "after")} | {"ttfb_demo": record["ttfb"]}


async def _ttfb(cwd: str | None, upstream: str, body: bytes, rounds: int) -> list[float]:
    times = []
    with Server("gateway", upstream=upstream, cwd=cwd) as server:
        await _warm_up(server.url)
        async with Connection(server.url) as conn:
            await conn.post(PATH, body)
        for _ in range(rounds):
            async with Connection(server.url) as conn:
                times.append((await conn.post(PATH, body)).ttfb)
    return times


async def compare(before: str, size: int, rounds: int) -> dict[str, Any]:
    body = make_body("turns", size * MiB, max_tokens=80)
    versions = {"before": before, "after": None}
    memory: dict[str, dict[str, list[dict[str, float]]]] = {v: {"on": [], "off": []} for v in versions}
    ttfb: dict[str, list[float]] = {v: [] for v in versions}
    with Server("demo", tokens_per_second=TOKENS_PER_SECOND) as upstream:
        for _ in range(rounds):
            for name, cwd in versions.items():
                for retain in (True, False):
                    record = await _memory(cwd, retain, upstream.url, body)
                    memory[name]["on" if retain else "off"].append(record)
                    log(
                        f"{name} retain={retain}: "
                        + ", ".join(f"{k} {v / MiB if k != 'ttfb_demo' else v:.2f}" for k, v in record.items())
                    )
    with Server("sink") as sink:
        for _ in range(rounds):
            for name, cwd in versions.items():
                ttfb[name] += await _ttfb(cwd, sink.url, body, 3)
    return {
        "size": len(body),
        "rounds": rounds,
        "memory": memory,
        "ttfb_sink": ttfb,
        "machine": machine(),
        "median": {
            name: {
                retain: {k: statistics.median(r[k] for r in memory[name][retain]) for k in memory[name][retain][0]}
                for retain in ("on", "off")
            }
            | {"ttfb_sink": statistics.median(ttfb[name])}
            for name in versions
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("--size", type=int, default=64, help="MiB (default 64)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    before = args.before.resolve()
    if not (before / "asgi_lifetime").is_dir():
        raise SystemExit(f"{before} has no asgi_lifetime package")
    link = before / "benchmarks"
    if not link.exists():
        os.symlink(ROOT / "benchmarks", link)  # the servers module must be importable from there
    results = anyio.run(compare, str(before), args.size, args.rounds)
    (ROOT / "benchmarks" / "before_after.json").write_text(json.dumps(results, indent=1))
    log(json.dumps(results["median"], indent=1))


if __name__ == "__main__":
    main()
