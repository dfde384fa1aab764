"""Many agents: coding agents re-posting their whole conversation every turn, at once.

``python -m benchmarks.run --only agents`` runs it (``--quick``: shorter runs). For each
number of clients and each target, in turn (one fresh uvicorn process per target and
concurrency, one demo upstream for the section): ``clients`` keep-alive connections each
send a many-turn conversation of about ``body_size`` bytes (``benchmarks/bodies.py``), read
its answer (the demo upstream streams ``tokens`` tokens over about ``stream_seconds``) and
post again at once with the conversation grown by one turn, for ``seconds``. The clients
start spread over one answer's duration, as agents that did not start together would.

Each conversation is built once: one shared many-turn body, a per-agent tag in its system
message and a per-agent tail of turns that grows by a few KiB each turn (so no two bodies
are the same, and the client only joins bytes: it must not take the cores it measures).

Figures (RSS of the target's process above its warm baseline, sampled every 20 ms):

- *steady window*: from one answer's duration after the last client started to the end of
  the load (every agent has then been through a whole turn);
- *held per in-flight request*: the median RSS in the steady window over the median number
  of requests in flight then (sent and not yet answered to the last byte, counted by the
  client) times the mean wire size of the bodies sent;
- *peak*: the highest RSS from the first request to the last answer;
- *after*: the median RSS over the last second of ``after_seconds`` of quiet after the last
  answer; *drift*: that minus the median of the first second (a flat line is about 0).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import psutil

from benchmarks.bodies import make_body, small_body
from benchmarks.client import Connection
from benchmarks.rss import Sampler
from benchmarks.servers import Server

__all__ = ["CONFIGS", "TARGETS", "AgentsConfig", "bench_agents", "conversation_parts"]

MiB = 1024 * 1024
PATH = "/v1/chat/completions"
SAMPLE_INTERVAL = 0.02  # seconds between RSS samples
PLOT_STEP = 0.1  # seconds between the points kept for the plot

# key: (server kind, RETAIN_OUTBOUND, environment)
TARGETS: dict[str, tuple[str, str, dict[str, str]]] = {
    "gw_disk": ("gateway", "disk", {}),
    "gw_on": ("gateway", "memory", {}),
    "gw_off": ("gateway", "off", {}),
    # Diagnosis: retain disk with malloc_trim from 1 MiB requests (the package trims from 8 MiB,
    # asgi_lifetime.gateway._memory.TRIM_THRESHOLD), to show what the untrimmed heap costs here.
    "gw_trim1": ("gateway", "disk", {"BENCH_TRIM_THRESHOLD": str(MiB)}),
    "ordinary": ("ordinary", "memory", {}),
}


@dataclass(frozen=True)
class AgentsConfig:
    clients: tuple[int, ...]
    seconds: float  # load duration per target and concurrency
    body_size: int  # bytes of the shared conversation
    stream_seconds: float  # one answer's duration
    tokens: int  # one answer's length (tokens at tokens / stream_seconds per second)
    targets: tuple[str, ...]
    after_seconds: float  # quiet after the last answer, for the after figure


CONFIGS = {
    "full": AgentsConfig(
        (16, 64), 60.0, 4 * MiB, 10.0, 20, ("gw_disk", "gw_on", "gw_off", "gw_trim1", "ordinary"), 5.0
    ),
    "quick": AgentsConfig(
        (16, 64), 20.0, 4 * MiB, 5.0, 10, ("gw_disk", "gw_on", "gw_off", "gw_trim1", "ordinary"), 3.0
    ),
    "smoke": AgentsConfig((4,), 3.0, 256 * 1024, 1.0, 4, ("gw_disk", "ordinary"), 1.5),
}


# -- the conversations ---------------------------------------------------------------------------------------


def conversation_parts(size: int, tokens: int) -> tuple[bytes, bytes]:
    """The shared body, split just inside the system message's text (where each agent's tag goes) and
    without its closing ``]}`` (where each agent's turns go): ``head + tag + middle + turns + b"]}"``."""
    body = make_body("turns", size, max_tokens=tokens)
    marker = b'"content":"You are a coding agent. '
    at = body.index(marker) + len(marker)
    if not body.endswith(b"]}"):
        raise RuntimeError("a many-turn body ends with its messages array")
    return body[:at], body[at:-2]


def _turn(rng: random.Random, agent: int, turn: int) -> bytes:
    """One more turn of an agent's conversation: a prompt, a tool call and its result (about 1-5 KiB)."""
    call_id = f"call_a{agent}_t{turn}"
    text = " ".join(
        rng.choice(("edit", "the", "test", "fails", "at", "line", str(turn), "src/app.py")) for _ in range(60)
    )
    messages = [
        {"role": "user", "content": f"agent {agent}, turn {turn}: {text}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/agent_{agent}.py"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": text * rng.randint(2, 10)},
    ]
    return b"".join(b"," + json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() for m in messages)


# -- one run -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Request:
    started: float
    first_byte: float
    ended: float
    size: int
    ok: bool


async def _warm_up(url: str) -> None:
    """As the other sections warm up (two small requests and a 64 KiB conversation), with one-token
    answers: the upstream streams slowly here."""
    async with Connection(url) as conn:
        for body in (small_body(max_tokens=1), small_body(max_tokens=1), make_body("turns", 64 * 1024, max_tokens=1)):
            result = await conn.post(PATH, body)
            if result.status != 200:
                raise RuntimeError(f"warm-up request to {url} failed with {result.status}")


async def _agent(
    url: str,
    index: int,
    parts: tuple[bytes, bytes],
    start_at: float,
    deadline: float,
    give_up: float,
    requests: list[_Request],
    failures: list[str],
) -> None:
    """One agent: post the conversation, read the answer, grow the conversation by a turn, again."""
    head, middle = parts
    tag = f"[agent {index}] ".encode()
    turns = b""
    rng = random.Random(index)
    await anyio.sleep(max(0.0, start_at - time.monotonic()))
    turn = 0
    conn: Connection | None = None
    try:
        while time.monotonic() < deadline:
            turn += 1
            turns += _turn(rng, index, turn)
            body = b"".join((head, tag, middle, turns, b"]}"))
            if conn is None:
                conn = await Connection(url).__aenter__()
            started = time.monotonic()
            try:
                with anyio.fail_after(give_up):
                    result = await conn.post(PATH, body, {"x-session-id": f"agent-{index}"})
            except (OSError, TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, ValueError) as exc:
                failures.append(f"agent {index} turn {turn}: {type(exc).__name__}: {exc}")
                requests.append(_Request(started, time.monotonic(), time.monotonic(), len(body), False))
                await conn.__aexit__(None, None, None)
                conn = None
                continue
            ok = result.status == 200 and result.tail.endswith(b"data: [DONE]\n\n")
            if not ok:
                failures.append(f"agent {index} turn {turn}: status {result.status}, ended with {result.tail[-20:]!r}")
            requests.append(_Request(result.started, result.first_byte, result.ended, len(body), ok))
            del body
    finally:
        if conn is not None:
            await conn.__aexit__(None, None, None)


def _in_flight(requests: list[_Request], times: list[float], *, until_first_byte: bool = False) -> list[int]:
    """For each time (sorted), the number of requests sent and not yet answered to the last byte (or,
    ``until_first_byte``, not yet answered at all: received, parsed, prepared or waiting for the CPU)."""
    events = sorted(
        [(r.started, 1) for r in requests] + [(r.first_byte if until_first_byte else r.ended, -1) for r in requests]
    )
    counts, current, at = [], 0, 0
    for t in times:
        while at < len(events) and events[at][0] <= t:
            current += events[at][1]
            at += 1
        counts.append(current)
    return counts


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def one_run(
    key: str, clients: int, config: AgentsConfig, upstream: str, parts: tuple[bytes, bytes], log: Any
) -> dict[str, Any]:
    """``clients`` agents against a fresh ``key`` process for ``config.seconds``; the figures above."""
    kind, retain, env = TARGETS[key]
    # Admission is not what this measures: room for every agent (the default MAX_INFLIGHT is 64, and an
    # agent re-posts before the gateway has finished the bookkeeping of its last answer).
    settings = {"MAX_INFLIGHT": str(max(64, 2 * clients))} if kind == "gateway" else {}
    requests: list[_Request] = []
    failures: list[str] = []
    stats: dict[str, Any] = {}
    with Server(kind, upstream=upstream, retain=retain, settings=settings, env=env) as server:
        process = psutil.Process(server.pid)
        with Sampler(server.pid, interval=SAMPLE_INTERVAL) as sampler:
            await _warm_up(server.url)
            await anyio.sleep(0.5)
            now = time.monotonic()
            base = sampler.median(now - 0.3, now)
            cpu_before = sum(process.cpu_times()[:2])
            load_before = os.getloadavg()[0]
            t0 = time.monotonic()
            deadline = t0 + config.seconds
            give_up = 3 * config.stream_seconds + 60.0
            async with anyio.create_task_group() as tg:
                for index in range(clients):
                    start_at = t0 + index * config.stream_seconds / clients
                    tg.start_soon(_agent, server.url, index, parts, start_at, deadline, give_up, requests, failures)
            last = time.monotonic()
            cpu = sum(process.cpu_times()[:2]) - cpu_before
            await anyio.sleep(config.after_seconds)
            end = time.monotonic()
            if kind == "gateway":
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                    totals = (await client.get("/lifetime/stats")).json()
                stats = {k: totals[k] for k in ("spilled", "spill_failures", "retried", "completed") if k in totals}
        samples = list(sampler.samples)
    load_after = os.getloadavg()[0]

    steady_from = t0 + config.stream_seconds * 1.5  # every agent started and through one whole turn
    steady = [(t, rss) for t, rss in samples if steady_from <= t <= deadline]
    if len(steady) < 10:  # a very short run (smoke): the whole load
        steady = [(t, rss) for t, rss in samples if t0 <= t <= last]
    flight = _in_flight(requests, [t for t, _ in steady])
    waiting = _in_flight(requests, [t for t, _ in steady], until_first_byte=True)
    median_rss = statistics.median(rss for _, rss in steady) - base
    median_flight = statistics.median(flight) if flight else 0
    wire = statistics.fmean(r.size for r in requests) if requests else 0.0
    ok = [r for r in requests if r.ok]
    loaded = [rss for t, rss in samples if t0 <= t <= last]
    quiet = [(t, rss) for t, rss in samples if last <= t <= end]
    first_second = [rss for t, rss in quiet if t <= last + 1.0]
    last_second = [rss for t, rss in quiet if t >= end - 1.0]
    after = statistics.median(last_second) - base
    plot, next_at = [], t0 - 1.0
    flight_all = _in_flight(requests, [t for t, _ in samples])
    for (t, rss), n in zip(samples, flight_all, strict=True):
        if t >= next_at and t0 - 1.0 <= t <= end:
            plot.append((round(t - t0, 3), round((rss - base) / MiB, 2), n))
            next_at = t + PLOT_STEP
    record: dict[str, Any] = {
        "gateway": key,
        "clients": clients,
        "settings": settings,
        "base": base,
        "requests": len(ok),
        "errors": len(requests) - len(ok),
        "failures": failures[:10],
        "throughput": len(ok) / (last - t0),
        "wire_mib_per_second": sum(r.size for r in ok) / MiB / (last - t0),
        "wire_size": wire,
        "median_steady": median_rss,
        "median_in_flight": median_flight,
        # Of those, how many had no answer yet (their bodies received or being received, parsed, prepared).
        "median_before_first_byte": statistics.median(waiting) if waiting else 0,
        "mean_before_first_byte": statistics.fmean(waiting) if waiting else 0.0,
        "held_per_request": median_rss / (median_flight * wire) if median_flight and wire else None,
        "peak": max(loaded) - base if loaded else 0,
        "after": after,
        "drift": statistics.median(last_second) - statistics.median(first_second) if first_second else 0.0,
        "ttfb_p50": _percentile([r.first_byte - r.started for r in ok], 50),
        "ttfb_p99": _percentile([r.first_byte - r.started for r in ok], 99),
        "latency_p50": _percentile([r.ended - r.started for r in ok], 50),
        "cpu_per_request": cpu / max(1, len(requests)),
        "load_seconds": last - t0,
        "steady_window": [steady_from - t0, deadline - t0],
        "load": [load_before, load_after],
        "stats": stats,
        "samples": plot,
        "load_ended_at": deadline - t0,
        "last_answer_at": last - t0,
    }
    held = record["held_per_request"]
    log(
        f"agents c={clients} {key}: {record['requests']} requests, {record['errors']} errors, "
        f"{record['throughput']:.2f} req/s; steady {median_rss / MiB:.1f} MiB over {median_flight} in flight "
        f"({record['mean_before_first_byte']:.1f} before their first byte) "
        f"({'-' if held is None else f'{held:.3f}x'}), peak {record['peak'] / MiB:.0f} MiB, "
        f"after {after / MiB:.1f} MiB (drift {record['drift'] / MiB:+.1f})"
    )
    return record


async def bench_agents(mode: str, results: dict[str, Any], log: Any, *, seconds: float | None = None) -> None:
    """The section: every target at every concurrency, in turn, each in a fresh process; ``seconds``
    overrides the mode's load duration."""
    from benchmarks.run import machine

    config = CONFIGS[mode]
    if seconds is not None:
        config = AgentsConfig(
            config.clients,
            seconds,
            config.body_size,
            config.stream_seconds,
            config.tokens,
            config.targets,
            config.after_seconds,
        )
    started = time.monotonic()
    date = machine()["date"]
    parts = conversation_parts(config.body_size, config.tokens)
    runs: list[dict[str, Any]] = []
    tokens_per_second = config.tokens / config.stream_seconds
    with Server("demo", tokens_per_second=tokens_per_second) as upstream:
        for clients in config.clients:
            for key in config.targets:
                runs.append(await one_run(key, clients, config, upstream.url, parts, log))
    results["agents"] = {
        "date": date,
        "seconds": time.monotonic() - started,
        "run_seconds": config.seconds,
        "body_size": len(parts[0]) + len(parts[1]) + 2,
        "stream_seconds": config.stream_seconds,
        "tokens": config.tokens,
        "tokens_per_second": tokens_per_second,
        "after_seconds": config.after_seconds,
        "sample_interval": SAMPLE_INTERVAL,
        "clients": list(config.clients),
        "runs": runs,
    }
