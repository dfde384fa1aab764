"""One server per process, so its RSS is its own: ``python -m benchmarks.servers KIND [options]``.

Kinds: ``demo`` (the package's demo upstream), ``sink`` (an upstream that reads the body
without parsing it and answers at once: isolates a proxy's own time to first byte),
``slots`` (an upstream with a fixed capacity: ``--slots`` answers at once, each streamed over
``--service-seconds``, the rest wait in its FIFO queue, as a model server's batch does),
``gateway`` (``asgi_lifetime.gateway.create_app`` with a preparer that injects a system
message), ``gateway-unchanged`` (no preparer: the body is forwarded as received),
``ordinary`` (benchmarks/ordinary_proxy.py), ``bare`` (benchmarks/bare_forwarder.py, over the gateway's
upstream transport) and ``bare-httpx`` (the same over httpx's default transport).

The server binds a free loopback port, prints ``READY http://127.0.0.1:PORT`` and serves
with uvicorn until terminated. ``Server`` starts one from the driver.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["Server", "inject_system"]

_SINK_EVENTS = [
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


def inject_system(draft: Any) -> None:
    """The benchmark preparer: the same change the ordinary proxy makes (spliced into the received
    bytes: it reads nothing of the body, ``without_parse``)."""
    from benchmarks.ordinary_proxy import SYSTEM

    draft.conversation.prepend(dict(SYSTEM))


try:
    from asgi_lifetime.gateway import without_parse

    inject_system = without_parse(inject_system)
except ImportError:  # a version of the package before without_parse (benchmarks.before_after)
    pass


async def sink(scope: Any, receive: Any, send: Any) -> None:
    """Read the request body (discarding it) and stream a tiny SSE answer."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more_body = message.get("more_body", False)
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in _SINK_EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def slots_upstream(slots: int, seconds: float, events: int = 10) -> Any:
    """An upstream that serves ``slots`` requests at a time (FIFO queue for the rest), each streaming
    ``events`` content events over ``seconds``. ``GET /_stats``: ``{"active": n, "waiting": m}``."""
    import json

    import anyio

    state = {"active": 0, "waiting": 0}
    limiter: list[anyio.Semaphore] = []  # made on first use, in the server's event loop
    content = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/_stats":
            body = json.dumps(state).encode()
            json_headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": body})
            return
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            more_body = message.get("more_body", False)
        if not limiter:
            limiter.append(anyio.Semaphore(slots))
        state["waiting"] += 1
        waiting = True
        try:
            async with limiter[0]:
                state["waiting"] -= 1
                waiting = False
                state["active"] += 1
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    await send({"type": "http.response.body", "body": _SINK_EVENTS[0], "more_body": True})
                    for _ in range(events):
                        await anyio.sleep(seconds / events)
                        await send({"type": "http.response.body", "body": content, "more_body": True})
                    for event in _SINK_EVENTS[2:]:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                finally:
                    state["active"] -= 1
        finally:
            if waiting:
                state["waiting"] -= 1

    return app


def build_app(
    kind: str,
    *,
    upstream: str | None,
    retain: str,
    tokens_per_second: float,
    trim: bool = True,
    settings_changes: dict[str, str] | None = None,
    slots: int = 16,
    service_seconds: float = 0.5,
) -> Any:
    if kind == "slots":
        return slots_upstream(slots, service_seconds)
    if kind == "demo":
        from asgi_lifetime.testing._upstream import create_demo_upstream

        return create_demo_upstream(tokens_per_second=tokens_per_second, default_tokens=16)
    if kind == "sink":
        return sink
    if upstream is None:
        raise SystemExit(f"{kind} needs --upstream")
    if kind in ("gateway", "gateway-unchanged"):
        from asgi_lifetime import GiB, LifetimeSettings, MiB
        from asgi_lifetime.gateway import create_app

        settings = LifetimeSettings(
            upstream_url=(upstream,),
            max_body_bytes=256 * MiB,
            max_inflight_bytes=2 * GiB,
            retain_outbound=retain,
            malloc_trim=trim,
        )
        if settings_changes:
            settings = LifetimeSettings.from_mapping(settings_changes, base=settings)
        client = None
        if os.environ.get("BENCH_KEEPALIVE"):  # diagnosis only: the upstream pool's keep-alive size
            import httpx

            keepalive = int(os.environ["BENCH_KEEPALIVE"])
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10, read=None, write=120, pool=10),
                limits=httpx.Limits(max_connections=settings.max_inflight, max_keepalive_connections=keepalive),
            )
            for name in ("accept", "accept-encoding", "user-agent"):
                del client.headers[name]
        if os.environ.get("BENCH_TRIM_THRESHOLD"):  # diagnosis only: the request size from which a request trims
            from asgi_lifetime.gateway import _memory

            _memory.TRIM_THRESHOLD = int(os.environ["BENCH_TRIM_THRESHOLD"])  # read at each call
        return create_app(settings, preparers=[inject_system] if kind == "gateway" else [], client=client)
    if kind == "ordinary":
        from benchmarks.ordinary_proxy import create_app as create_ordinary

        return create_ordinary(upstream)
    if kind in ("bare", "bare-httpx"):
        from benchmarks.bare_forwarder import BareForwarder

        return BareForwarder(upstream, transport="httpx" if kind == "bare-httpx" else "same")
    raise SystemExit(f"unknown server kind {kind!r}")


class _Probe:
    """Debugging hooks, only with ``BENCH_PROBE=1``: ``GET /_probe/mem`` (RSS, tracemalloc top),
    ``POST /_probe/trim`` (``malloc_trim(0)``, timed), ``POST /_probe/gc``."""

    profiler: Any = None

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/_probe/"):
            await self.app(scope, receive, send)
            return
        import ctypes
        import gc
        import json
        import tracemalloc

        import psutil

        process = psutil.Process()
        result: dict[str, Any] = {"rss": process.memory_info().rss}
        action = scope["path"].rsplit("/", 1)[-1]
        if action == "trim":
            started = time.perf_counter()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            result["seconds"] = time.perf_counter() - started
            result["rss_after"] = process.memory_info().rss
        elif action == "gc":
            result["collected"] = gc.collect()
            result["rss_after"] = process.memory_info().rss
        elif action == "profile-start":
            import cProfile

            # BENCH_PROFILE_CLOCK=cpu: this thread's CPU time, not wall time (on a shared machine a send()
            # that wakes the peer is often preempted, and wall time charges the wait to it).
            clock = time.thread_time if os.environ.get("BENCH_PROFILE_CLOCK") == "cpu" else time.perf_counter
            _Probe.profiler = cProfile.Profile(clock)
            _Probe.profiler.enable()
        elif action == "profile-stop":
            _Probe.profiler.disable()
            _Probe.profiler.dump_stats(os.environ.get("BENCH_PROFILE_OUT", "/tmp/bench.prof"))
        elif action == "arenas":
            import tempfile

            with tempfile.TemporaryFile() as f:
                saved = os.dup(2)
                os.dup2(f.fileno(), 2)
                try:
                    sys._debugmallocstats()
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
                f.seek(0)
                lines = f.read().decode().splitlines()
            result["arenas"] = [line for line in lines if "arena" in line or "bytes in" in line or "Total" in line][:20]
        elif action == "mem" and tracemalloc.is_tracing():
            current, peak = tracemalloc.get_traced_memory()
            result.update(traced=current, traced_peak=peak)
            top = tracemalloc.take_snapshot().statistics("traceback")[:8]
            result["top"] = [[stat.size, stat.count, stat.traceback.format()[-6:]] for stat in top]
            tracemalloc.reset_peak()
        body = json.dumps(result).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("--upstream")
    # RETAIN_OUTBOUND; "on" is memory (what it meant when it was a bool: before_after.py runs older checkouts).
    parser.add_argument("--retain", choices=["on", "memory", "disk", "off"], default="on")
    parser.add_argument("--tokens-per-second", type=float, default=50.0)
    parser.add_argument("--no-trim", action="store_true", help="gateway: MALLOC_TRIM off (no malloc_trim at all)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="gateway: a setting")
    parser.add_argument("--slots", type=int, default=16, help="slots: requests served at once")
    parser.add_argument("--service-seconds", type=float, default=0.5, help="slots: seconds each answer streams")
    parser.add_argument("--http", default="auto", help="uvicorn's HTTP implementation (auto: httptools if installed)")
    parser.add_argument("--loop", default="auto", help="uvicorn's event loop (auto: uvloop if installed)")
    args = parser.parse_args()
    app = build_app(
        args.kind,
        upstream=args.upstream,
        retain="memory" if args.retain == "on" else args.retain,
        tokens_per_second=args.tokens_per_second,
        trim=not args.no_trim,
        settings_changes=dict(item.split("=", 1) for item in args.set),
        slots=args.slots,
        service_seconds=args.service_seconds,
    )

    if os.environ.get("BENCH_PROBE") == "1":
        app = _Probe(app)
    if os.environ.get("BENCH_TRACEMALLOC"):
        import tracemalloc

        tracemalloc.start(int(os.environ["BENCH_TRACEMALLOC"]))

    import uvicorn

    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP (else Nagle and
    # delayed ACKs add 40 ms to every streamed response on a kept-alive connection).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=60,
        http=args.http,
        loop=args.loop,
    )
    server = uvicorn.Server(config)
    print(f"READY http://127.0.0.1:{port}", flush=True)
    server.run(sockets=[sock])


class Server:
    """A server subprocess: ``with Server("gateway", upstream=url) as s: s.url, s.pid``."""

    def __init__(
        self,
        kind: str,
        *,
        upstream: str | None = None,
        retain: str = "memory",
        tokens_per_second: float = 50.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        trim: bool = True,
        settings: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.kind = kind
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.servers",
            kind,
            "--retain",
            "on" if retain == "memory" else retain,
            "--tokens-per-second",
            str(tokens_per_second),
        ]
        if upstream:
            cmd += ["--upstream", upstream]
        if not trim:
            cmd.append("--no-trim")
        for name, value in (settings or {}).items():
            cmd += ["--set", f"{name}={value}"]
        cmd += extra_args or []
        self._cmd = cmd
        self._env = {**os.environ, **(env or {})}
        self._cwd = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, text=True, cwd=self._cwd, env=self._env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        while line and not line.startswith("READY "):  # a wrapper (memray) may print first
            line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"{self.kind} server failed to start: {line!r}")
        self.url = line.split()[1]
        _wait_listening(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_listening(url: str, timeout: float = 20.0) -> None:
    host, port = url.rsplit("/", 1)[-1].split(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


if __name__ == "__main__":
    main()
