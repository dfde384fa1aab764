"""Soak the gateway: thousands of mixed requests with random client and upstream faults.

Everything runs in this process over real loopback sockets: the demo upstream and the
gateway each under uvicorn in a thread (``serve_in_thread``), the clients on this thread's
event loop. A seeded RNG picks, per request, streaming or not, the body size (mostly 1-8
KiB, ``--big`` of them 8-16 MiB), an optional upstream fault (``fail`` that recovers,
``fail`` that exhausts the attempts, ``starve``, ``stall``, ``reset``) and an optional client
fault (hang up mid-body, hang up mid-stream). Each request has a deadline.

At the end the gateway must be idle (every gauge of ``/lifetime/stats`` zero, no upstream
request in flight, no pooled connection in a request, the upstream has no response in
progress), no request may have missed its deadline, and every answer must be the one its
faults call for. The summary reports those and the process's RSS::

    python scripts/soak.py --requests 50000 --concurrency 32 --seed 7
    python scripts/soak.py --requests 5000 --concurrency 16 --seed 1 --big 10 --backend trio

Exit status 0 when all checks hold, 1 otherwise. ``tests/test_soak.py`` runs a CI-sized soak
through ``soak()``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from asgi_lifetime.testing._upstream import create_demo_upstream
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime._settings import KiB, LifetimeSettings, MiB
from asgi_lifetime.gateway._sse import SSEParser
from asgi_lifetime.gateway import create_app

PATH = "/v1/chat/completions"
GAUGES = ("inflight_requests", "inflight_bytes", "retained_input_bytes", "live_resources", "pinned_sessions")
SETTINGS: dict[str, Any] = {
    "stall_timeout": 0.5,
    "body_idle_timeout": 0.5,
    "admission_timeout": 5.0,
    "headers_timeout": 5.0,
    "connect_timeout": 2.0,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
    "retry_after_cap": 0.05,
    "max_attempts": 3,
    "retry_deadline": 10.0,
    "keepalive_interval": 5.0,
}
# Upstream faults (demo behaviours) and client faults, with their weights; None is "no fault".
UPSTREAM_FAULTS: dict[str | None, int] = {
    None: 82,
    "fail=2": 4,  # recovers on the third attempt
    "fail=9": 2,  # exhausts MAX_ATTEMPTS: the upstream's 503 is passed on
    "starve": 4,
    "stall": 2,
    "reset": 4,
    "gzip": 2,
}
CLIENT_FAULTS: dict[str | None, int] = {None: 92, "hangup-mid-body": 4, "hangup-mid-stream": 4}
DEADLINE = 10.0
BIG_DEADLINE = 30.0


@dataclass(frozen=True)
class Plan:
    index: int
    stream: bool
    size: int
    upstream_fault: str | None
    client_fault: str | None
    session: str | None

    @property
    def expected(self) -> str:
        """The outcome the client must see."""
        fault = self.upstream_fault
        if self.client_fault is not None:
            return "hung-up"
        if fault in (None, "fail=2", "gzip"):
            return "ok"
        if fault == "fail=9":
            return "http-503"
        if fault == "starve":
            return "inband-upstream_starved" if self.stream else "empty"
        if fault == "stall":
            return "inband-upstream_stalled" if self.stream else "truncated"
        if fault == "reset":
            return "inband-bad_gateway" if self.stream else "truncated"
        raise AssertionError(fault)


@dataclass
class Summary:
    requests: int
    concurrency: int
    seed: int
    big: int
    backend: str
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    deadline_misses: int = 0
    mismatches: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    rss_start: int = 0
    rss_warm: int = 0
    rss_end: int = 0
    rss_peak: int = 0
    upstream_requests: int = 0
    gateway: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.deadline_misses or self.mismatches or self.leaks)

    @property
    def rss_growth(self) -> int:
        """RSS at the end minus RSS after the first tenth of the requests (allocator warm-up)."""
        return self.rss_end - self.rss_warm

    def report(self) -> str:
        mib = 1024 * 1024
        lines = [
            f"soak: {self.requests} requests, concurrency {self.concurrency}, seed {self.seed}, "
            f"{self.big} big bodies, {self.backend}",
            f"  time        {self.seconds:.1f} s ({self.requests / max(self.seconds, 1e-9):.0f} requests/s)",
            f"  faults      {dict(sorted(self.faults.items()))}",
            f"  outcomes    {dict(sorted(self.outcomes.items()))}",
            f"  upstream    {self.upstream_requests} requests seen",
            f"  gateway     {self.gateway}",
            f"  deadline    {self.deadline_misses} missed",
            f"  mismatches  {len(self.mismatches)} {self.mismatches[:5]}",
            f"  leaks       {self.leaks or 'none: every gauge 0, no upstream request in flight'}",
            f"  rss         start {self.rss_start / mib:.0f} MiB, after warm-up {self.rss_warm / mib:.0f} MiB, "
            f"end {self.rss_end / mib:.0f} MiB (since warm-up {self.rss_growth / mib:+.1f} MiB, "
            f"since start {(self.rss_end - self.rss_start) / mib:+.1f} MiB), peak {self.rss_peak / mib:.0f} MiB",
            f"  result      {'PASS' if self.ok else 'FAIL'}",
        ]
        return "\n".join(lines)


def settle_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc keeps them per thread arena
    otherwise), so RSS shows live memory rather than the allocator's high-water mark."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def rss() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def plans(requests: int, seed: int, big: int) -> list[Plan]:
    rng = random.Random(seed)
    bigs = set(rng.sample(range(requests), min(big, requests)))
    result = []
    for index in range(requests):
        size = rng.randint(8 * MiB, 16 * MiB) if index in bigs else rng.randint(1 * KiB, 8 * KiB)
        upstream = rng.choices(list(UPSTREAM_FAULTS), weights=list(UPSTREAM_FAULTS.values()))[0]
        client = rng.choices(list(CLIENT_FAULTS), weights=list(CLIENT_FAULTS.values()))[0]
        stream = rng.random() < 0.5 or client == "hangup-mid-stream"
        session = f"session-{rng.randrange(100)}" if rng.random() < 0.5 else None
        result.append(Plan(index, stream, size, upstream, client, session))
    return result


_FILLER = ("lorem ipsum dolor sit amet " * 1024).encode()


def body_of(plan: Plan) -> bytes:
    """A chat request of about ``plan.size`` bytes."""
    overhead = 160
    filler = (_FILLER * (plan.size // len(_FILLER) + 1))[: max(0, plan.size - overhead)].decode()
    payload = {
        "model": "demo",
        "max_tokens": 8 + plan.index % 24,
        "stream": plan.stream,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": filler}],
    }
    return json.dumps(payload).encode()


def headers_of(plan: Plan) -> dict[str, str]:
    # delay=0: no token pacing (a paced stream sleeps per chunk, and each sleep costs a timer tick).
    behaviour = "delay=0" if plan.upstream_fault is None else f"{plan.upstream_fault},delay=0,id={plan.index}"
    headers = {"content-type": "application/json", "x-demo-behaviour": behaviour}  # id=: its own fail counter
    if plan.session is not None:
        headers["x-session-id"] = plan.session
    return headers


def classify(plan: Plan, status: int, body: bytes) -> str:
    if status >= 400:
        return f"http-{status}"
    if plan.stream:
        events = SSEParser().feed(body)
        errors = [event for event in events if event.event == "error"]
        if errors:
            return "inband-" + str(json.loads(errors[-1].data)["error"]["code"])
        return "ok" if events and events[-1].data == "[DONE]" else "stream-incomplete"
    if not body:
        return "empty"
    try:
        document = json.loads(body)
    except ValueError:
        return "not-json"
    return "ok" if document.get("choices") else "other"


async def hang_up(plan: Plan, port: int) -> str:
    """A raw client that leaves mid-body or mid-stream."""
    body = body_of(plan)
    head = [f"POST {PATH} HTTP/1.1", "host: soak", f"content-length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers_of(plan).items()]
    request = ("\r\n".join(head) + "\r\n\r\n").encode()
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        if plan.client_fault == "hangup-mid-body":
            await stream.send(request + body[: len(body) // 2])
            await anyio.sleep(0.01)
            return "hung-up"
        await stream.send(request + body)
        received = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            while b"\r\n\r\n" not in received or received.endswith(b"\r\n\r\n"):
                received += await stream.receive()
    return "hung-up"


async def run_one(plan: Plan, client: httpx.AsyncClient, port: int) -> str:
    if plan.client_fault is not None:
        return await hang_up(plan, port)
    request = client.build_request("POST", PATH, content=body_of(plan), headers=headers_of(plan))
    response = await client.send(request, stream=True)
    try:
        try:
            body = await response.aread()
        except httpx.RemoteProtocolError:
            return "truncated"
    finally:
        await response.aclose()
    return classify(plan, response.status_code, body)


def leaks(app: Any, upstream: Any) -> list[str]:
    stats = app.state.lifetime.stats().as_dict()
    problems = [f"{name}={stats[name]}" for name in GAUGES if stats[name]]
    problems += [
        f"upstream {u['url']} inflight={u['inflight']}" for u in app.state.upstream.describe() if u["inflight"]
    ]
    problems += app.state.upstream._client._transport.busy()  # aiohttp's pool or httpcore's
    if upstream.state.stats.active_streams:
        problems.append(f"upstream active_streams={upstream.state.stats.active_streams}")
    return problems


@contextlib.contextmanager
def stack(settings: dict[str, Any]) -> Iterator[tuple[Any, Any, str]]:
    upstream = create_demo_upstream(tokens_per_second=20_000, default_tokens=8)
    with serve_in_thread(upstream) as upstream_url:
        app = create_app(LifetimeSettings(upstream_url=(upstream_url,), **settings))
        with serve_in_thread(app) as url:
            yield app, upstream, url


async def soak(
    *,
    requests: int = 5000,
    concurrency: int = 16,
    seed: int = 0,
    big: int = 10,
    settle: float = 5.0,
    progress: bool = False,
) -> Summary:
    """Run the soak on the current event loop (asyncio or trio) and return its summary."""
    summary = Summary(requests, concurrency, seed, big, _backend())
    todo = plans(requests, seed, big)
    summary.faults.update(p.upstream_fault or "none" for p in todo)
    summary.faults.update(p.client_fault for p in todo if p.client_fault)
    settle_memory()
    summary.rss_start = rss()
    with stack(SETTINGS) as (app, upstream, url):
        port = int(url.rsplit(":", 1)[1])
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        send, receive = anyio.create_memory_object_stream[Plan](max_buffer_size=len(todo))
        for plan in todo:
            send.send_nowait(plan)
        send.close()
        done = 0
        started = time.monotonic()

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal done
            async for plan in receive:
                outcome = "deadline-missed"
                with anyio.move_on_after(BIG_DEADLINE if plan.size > MiB else DEADLINE):
                    try:
                        outcome = await run_one(plan, client, port)
                    except httpx.HTTPError as exc:
                        outcome = f"error-{type(exc).__name__}"
                if outcome == "deadline-missed":
                    summary.deadline_misses += 1
                summary.outcomes[outcome] += 1
                if outcome != plan.expected:
                    summary.mismatches.append(f"#{plan.index} {plan}: {outcome}")
                done += 1
                if done == max(1, requests // 10):
                    settle_memory()
                    summary.rss_warm = rss()
                if progress and done % 1000 == 0:
                    print(f"  {done} done, {time.monotonic() - started:.1f} s", file=sys.stderr)

        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=BIG_DEADLINE) as client:
            async with receive, anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(worker, client)
        summary.seconds = time.monotonic() - started
        deadline = anyio.current_time() + settle
        # Polled: the gauges change on the servers' threads, which have no event to wait on.
        while (problems := leaks(app, upstream)) and anyio.current_time() < deadline:  # noqa: ASYNC110
            await anyio.sleep(0.05)
        summary.leaks = problems
        summary.upstream_requests = upstream.state.stats.requests
        summary.gateway = {k: v for k, v in app.state.lifetime.stats().as_dict().items() if v and k not in GAUGES}
    settle_memory()
    summary.rss_end = rss()
    summary.rss_peak = peak_rss()
    return summary


def _backend() -> str:
    """The event loop running this task: trio if trio says so, else asyncio."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    return "asyncio"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000, help="requests in all (default 50000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault and size choices (default 0)")
    parser.add_argument("--big", type=int, default=100, help="requests with an 8-16 MiB body (default 100)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="the clients' event loop")
    parser.add_argument(
        "--log-level", default="critical", help="log records shown (default critical: faults log by design)"
    )
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:  # only if nobody (a test runner, an embedding) set logging up
        handler = logging.StreamHandler()
        handler.setLevel(args.log_level.upper())  # on the handler: uvicorn's loggers set their own levels
        logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    summary = anyio.run(
        lambda: soak(requests=args.requests, concurrency=args.concurrency, seed=args.seed, big=args.big, progress=True),
        backend=args.backend,
    )
    print(summary.report())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
