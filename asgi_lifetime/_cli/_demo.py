"""``asgi-lifetime demo``: watch one large request's input being released, offline.

The DEMO upstream and the gateway run on loopback ports in this process. One many-turn
conversation (default 64 MiB) goes through the gateway as a streaming chat request; the
upstream first answers 503 (the gateway retries), then a context overflow (the gateway
refolds: drops the oldest turns), then streams. The display shows the fingerprint, each
retry and refold, the moment the input is released, the tokens arriving, and memory: the
process RSS and the gateway's own count of retained input (``/lifetime/stats``). The client
produces the body while sending it (pieces of at most ~64 KiB; a dry run gives the
Content-Length), so the demo process holds no client-side copy of it::

    python -m asgi_lifetime demo --size-mib 2 --tokens 20 --plain
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import httpx
import psutil

from .._fingerprint import Fingerprint
from .._settings import GiB, KiB, LifetimeSettings, MiB
from .._stats import LifetimeStats
from ..gateway import create_app
from ..gateway._prepare import Draft
from ..gateway._upstream import AttemptEvent
from ..testing._serve import serve_in_thread
from ..testing._upstream import create_demo_upstream

__all__ = ["DESCRIPTION", "add_arguments", "main", "run"]

DESCRIPTION = """\
Send one large many-turn conversation through the gateway to the built-in DEMO
upstream, all on loopback (no network, no API key), and watch its input's lifetime:
the fingerprint, a retry (the upstream answers 503 once), a refold (then a context
overflow), the moment the input is released, the streamed tokens, and memory."""

SESSION_ID = "demo-session-1"
SYSTEM_PROMPT = "You are a concise assistant. Answer from the conversation only."
_FINAL_QUESTION = "Summarise our conversation so far in a few words."
_TEXT = (
    "The deploy went out at noon and the error rate stayed flat. We moved the cache in front of the "
    "session store, which halved the p99 latency, but the nightly batch still saturates the disk. "
    "Can you check whether the retry budget covers the upstream's maintenance window? The migration "
    "script needs a dry run against a copy of production before Friday. I attached the logs from the "
    "last incident: the queue backed up after the third consumer restarted, and the alerts fired late "
    "because the threshold was tuned for weekday traffic. Let us write the postmortem together. "
)
_POLL_INTERVAL = 0.1
_RSS_INTERVAL = 0.01
_PROGRESS_INTERVAL = 1.0
_IDLE_TIMEOUT = 10.0

# Phases, in order; RSS and retained-input peaks are kept per phase.
BEFORE, PREPARING, STREAMING, AFTER = "before sending", "sending and preparing", "streaming", "after"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size-mib", type=float, default=64.0, metavar="N", help="request body size in MiB (default %(default)g)"
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens to stream back (default %(default)s)")
    parser.add_argument(
        "--tokens-per-second", type=float, default=50.0, metavar="N", help="upstream pace (default %(default)g)"
    )
    parser.add_argument("--plain", action="store_true", help="plain text lines, even on a terminal")
    parser.add_argument("--no-faults", action="store_true", help="no 503 and no overflow: one attempt")
    parser.add_argument(
        "--retain-outbound",
        action="store_true",
        help="keep the outbound body in memory while streaming (RETAIN_OUTBOUND=memory, for one blind "
        "re-issue); off here, so retained input drops to 0 at release",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asgi-lifetime demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 if the stream completed and the gateway was idle afterwards."""
    if not (0 < args.size_mib <= 1024 and math.isfinite(args.size_mib)):
        print("asgi-lifetime demo: --size-mib must be between 0 and 1024", file=sys.stderr)
        return 2
    if not 1 <= args.tokens <= 4096:
        print("asgi-lifetime demo: --tokens must be between 1 and 4096", file=sys.stderr)
        return 2
    if not (args.tokens_per_second > 0 and math.isfinite(args.tokens_per_second)):
        print("asgi-lifetime demo: --tokens-per-second must be greater than 0", file=sys.stderr)
        return 2
    conversation = _Conversation(int(args.size_mib * MiB), tokens=args.tokens)
    watch = _Watch(total=conversation.size, tokens=args.tokens)
    display: _Display = _PlainDisplay(watch) if args.plain or not sys.stdout.isatty() else _RichDisplay(watch)

    upstream = create_demo_upstream(tokens_per_second=args.tokens_per_second)
    overflow = int(conversation.size * 0.9)
    if not args.no_faults:
        # Attempt 1: 503 (retried). Attempt 2: the body is over `overflow` bytes, 400 context
        # overflow; the refold targets 90% of the stated window, so attempt 3 fits and streams.
        upstream.state.behaviour = f"fail=1,overflow={overflow}"
    with serve_in_thread(upstream, shutdown_timeout=5.0) as upstream_url:
        settings = LifetimeSettings(
            upstream_url=(upstream_url,),
            max_body_bytes=max(64 * MiB, conversation.size),
            max_inflight_bytes=max(GiB, conversation.size),
            backoff_base=0.2,
            backoff_max=1.0,
            # The demo shows the retained body as retained input: kept in memory, not moved to disk.
            retain_outbound="memory" if args.retain_outbound else "off",
        )
        gateway = create_app(settings, preparers=[watch.inject_system_prompt], listener=watch.on_attempt)
        watch.stats_source = gateway.state.lifetime.stats
        with serve_in_thread(gateway, shutdown_timeout=5.0) as gateway_url:
            display.header(
                [
                    f"asgi-lifetime demo: a {_size(conversation.size)} conversation ({conversation.turns} turns)",
                    f"  client -> gateway {gateway_url} -> DEMO upstream {upstream_url} (loopback, not a real model)",
                    "  upstream script: "
                    + (
                        "none (--no-faults)"
                        if args.no_faults
                        else f"503 once, then 400 context overflow above {_size(overflow)}, then stream"
                    ),
                    f"  RETAIN_OUTBOUND={'memory' if args.retain_outbound else 'off'}",
                ]
            )
            sampler = _RssSampler(watch)
            sampler.start()
            try:
                anyio.run(_drive, watch, display, conversation, gateway_url)
            except KeyboardInterrupt:
                print("asgi-lifetime demo: interrupted", file=sys.stderr)
                return 130
            finally:
                sampler.stop()
        watch.final_body_size = upstream.state.stats.last_body_size
    lines, ok = watch.summary(retain_outbound=args.retain_outbound)
    display.summary(lines)
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# The request body: built while it is sent, never held whole by the client
# ---------------------------------------------------------------------------


class _Conversation:
    """A deterministic many-turn chat request of about ``size`` bytes, produced piece by piece."""

    def __init__(self, target: int, *, tokens: int) -> None:
        self.target = target
        self.tokens = tokens
        self.message_bytes = min(64 * KiB, max(512, target // 256))
        reps = (self.message_bytes + len(_TEXT)) // len(_TEXT) + 2
        self._text = _TEXT * reps
        self.size = 0
        self.turns = 0
        for piece in self.pieces():  # a dry run: the exact Content-Length, without keeping the body
            self.size += len(piece)

    def pieces(self) -> Iterator[bytes]:
        head = {"model": "demo", "stream": True, "max_tokens": self.tokens, "stream_options": {"include_usage": True}}
        opening = json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"messages":['
        closing = json.dumps({"role": "user", "content": _FINAL_QUESTION}, separators=(",", ":")).encode() + b"]}"
        yield opening
        produced, index = len(opening), 0
        while True:
            role = "user" if index % 2 == 0 else "assistant"
            offset = (index * 131) % len(_TEXT)
            content = f"Turn {index // 2 + 1} ({role}): " + self._text[offset : offset + self.message_bytes]
            piece = json.dumps({"role": role, "content": content}, separators=(",", ":")).encode() + b","
            # Stop after an assistant message once the next pair would overshoot (at least two turns).
            if index >= 4 and index % 2 == 0 and produced + 2 * len(piece) + len(closing) > self.target:
                break
            yield piece
            produced += len(piece)
            index += 1
        self.turns = index // 2 + 1
        yield closing


# ---------------------------------------------------------------------------
# What was observed: written from the gateway's thread (listener, preparer), read here
# ---------------------------------------------------------------------------


class _Watch:
    def __init__(self, *, total: int, tokens: int) -> None:
        self.start = time.monotonic()
        self.total = total
        self.tokens_expected = tokens
        self.phase = BEFORE
        self._lock = threading.Lock()
        self._pending: list[tuple[float, str]] = []
        self.stats_source: Callable[[], LifetimeStats] | None = None
        self.fingerprint: Fingerprint | None = None
        self.events: list[AttemptEvent] = []
        self.sent = 0
        self.send_started: float | None = None
        self.settled_at: float | None = None
        self.settle_stats: LifetimeStats | None = None
        self.status: int | None = None
        self.error: str | None = None
        self.tokens = 0
        self.first_token_at: float | None = None
        self.done_at: float | None = None
        self.final_body_size = 0
        self.idle_stats: LifetimeStats | None = None
        self.rss_now = 0
        self.rss_before = 0
        self.rss_after = 0
        self.rss_max = 0
        self.rss_peak: dict[str, int] = {}
        self.retained_now = 0
        self.retained_peak: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.start

    def say(self, text: str) -> None:
        with self._lock:
            self._pending.append((self.now(), text))

    def take_lines(self) -> list[tuple[float, str]]:
        with self._lock:
            lines, self._pending = self._pending, []
        return lines

    def note_retained(self, phase: str, retained: int) -> None:
        self.retained_now = retained
        self.retained_peak[phase] = max(self.retained_peak.get(phase, 0), retained)

    def _gateway_stats(self) -> LifetimeStats | None:
        return self.stats_source() if self.stats_source is not None else None

    # Called by the gateway, on its own thread.

    def inject_system_prompt(self, draft: Draft) -> None:
        """The demo's preparer: records the fingerprint and puts a system prompt first."""
        fp = draft.fingerprint
        self.fingerprint = fp
        self.say(
            f"fingerprint: wire {fp.wire_hash[:16]}... (blake3, of the bytes as received), "
            f"text comparable: {'yes' if fp.text_comparable else 'no'}, size {fp.size:,} bytes"
        )
        body = draft.body
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            body["messages"].insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            draft.mark_changed()
            self.say("prepare: preparer injected a system prompt (body changed: serialized once for the upstream)")

    def on_attempt(self, event: AttemptEvent) -> None:
        self.events.append(event)
        stats = self._gateway_stats()
        if event.kind == "settled":
            self.settled_at = self.now()
            self.settle_stats = stats
            self.phase = STREAMING
            held = _size(stats.retained_input_bytes) if stats is not None else "?"
            self.say(
                f"RELEASED: retries settled after {event.attempt} attempt{'s' if event.attempt != 1 else ''} "
                f"({event.reason}), input released before the answer streams; gateway retained input {held}"
            )
            return
        if stats is not None:  # exact, taken at the event on the gateway's thread
            self.note_retained(PREPARING, stats.retained_input_bytes)
        held = f"; gateway holds {_size(stats.retained_input_bytes)} of input" if stats is not None else ""
        if event.kind == "retry":
            self.say(
                f"retry: attempt {event.attempt} answered {event.status} ({event.reason}), "
                f"retrying in {event.delay:.2f} s{held}"
            )
        elif event.kind == "refold":
            self.say(
                f"refold: attempt {event.attempt} answered {event.status} ({event.reason}), "
                f"dropped the oldest turns and re-sent{held}"
            )
        else:
            self.say(f"{event.kind}: attempt {event.attempt} answered {event.status} ({event.reason}){held}")

    # The report.

    def summary(self, *, retain_outbound: bool) -> tuple[list[str], bool]:
        kinds = [event.kind for event in self.events]
        retries, refolds = kinds.count("retry"), kinds.count("refold")
        idle = self.idle_stats is not None and self.idle_stats.idle
        completed = self.done_at is not None and self.status == 200
        lines = ["summary"]
        lines.append(f"  request       {_size(self.total)} ({self.total:,} bytes), streaming, session {SESSION_ID}")
        if self.fingerprint is not None:
            fp = self.fingerprint
            lines.append(f"  fingerprint   wire {fp.wire_hash}")
            lines.append(
                f"                text comparable: {'yes' if fp.text_comparable else 'no'}, size {fp.size:,} bytes"
            )
        attempts = max((event.attempt for event in self.events if event.kind == "settled"), default=0)
        lines.append(
            f"  attempts      {attempts}: {retries} retr{'y' if retries == 1 else 'ies'}, "
            f"{refolds} refold{'' if refolds == 1 else 's'}; the upstream got {_size(self.final_body_size)} "
            "on the last attempt"
        )
        if self.settled_at is not None and self.send_started is not None:
            before_first = (
                "before the first token"
                if self.first_token_at is None or self.settled_at <= self.first_token_at
                else "after the first token"
            )
            lines.append(
                f"  released      {self.settled_at - self.send_started:.2f} s after sending began, {before_first}"
            )
        if completed and self.first_token_at is not None and self.done_at is not None:
            lines.append(
                f"  stream        {self.tokens} tokens in {self.done_at - self.first_token_at:.2f} s, completed"
            )
        else:
            lines.append(f"  stream        NOT completed: {self.error or 'no [DONE]'} ({self.tokens} tokens)")
        if self.idle_stats is not None:
            s = self.idle_stats
            lines.append(
                f"  gateway after {'idle' if idle else 'NOT idle'}: {s.inflight_requests} in flight, "
                f"{_size(s.retained_input_bytes)} retained, {s.live_resources} resources, "
                f"{s.pinned_sessions} pinned sessions; totals: {s.retried} retried, {s.refolded} refolded, "
                f"{s.completed} completed"
            )
        lines.append("")
        lines.append(f"  memory                          {'process RSS':>12}    gateway retained input")
        rows = [
            (BEFORE, self.rss_before, self.retained_peak.get(BEFORE, 0)),
            (f"peak, {PREPARING}", self.rss_peak.get(PREPARING, 0), self.retained_peak.get(PREPARING, 0)),
            (f"peak, {STREAMING}", self.rss_peak.get(STREAMING, 0), self.retained_peak.get(STREAMING, 0)),
            ("after (idle, gc.collect)", self.rss_after, self.retained_peak.get(AFTER, 0)),
        ]
        for label, rss, retained in rows:
            lines.append(f"    {label:<28}  {_size(rss):>12}    {_size(retained):>10}")
        lines += [
            "",
            "  RSS is the whole demo process: this client, the gateway AND the demo upstream, which",
            "  parses every body it receives; Python's allocator also keeps freed memory for reuse, so",
            "  RSS falls slowly. 'Gateway retained input' is the gateway's own count of request bytes",
            "  it still holds (retained_input_bytes in /lifetime/stats): it is the one to watch drop",
            "  at release"
            + (" (RETAIN_OUTBOUND keeps the outbound body until the stream ends)." if retain_outbound else "."),
        ]
        ok = completed and idle
        lines += ["", "result: OK" if ok else "result: FAILED (the stream did not complete or the gateway is not idle)"]
        return lines, ok


class _RssSampler:
    """Samples this process's RSS every 10 ms on a thread, keeping the peak per phase."""

    def __init__(self, watch: _Watch) -> None:
        self._watch = watch
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asgi-lifetime-demo-rss", daemon=True)

    def rss(self) -> int:
        return int(self._process.memory_info().rss)

    def start(self) -> None:
        self._watch.rss_now = self.rss()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        watch = self._watch
        while not self._stop.wait(_RSS_INTERVAL):
            rss, phase = self.rss(), watch.phase
            watch.rss_now, watch.rss_max = rss, max(watch.rss_max, rss)
            watch.rss_peak[phase] = max(watch.rss_peak.get(phase, 0), rss)


# ---------------------------------------------------------------------------
# The client side
# ---------------------------------------------------------------------------


async def _drive(watch: _Watch, display: _Display, conversation: _Conversation, gateway_url: str) -> None:
    timeout = httpx.Timeout(10.0, read=120.0, write=120.0)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=timeout) as client:
        await _poll_once(client, watch)
        watch.rss_before = psutil.Process().memory_info().rss
        async with anyio.create_task_group() as tg:
            tg.start_soon(_poll_stats, client, watch)
            tg.start_soon(display.run)
            await _send(client, watch, conversation)
            await _wait_idle(client, watch)
            gc.collect()
            watch.rss_after = psutil.Process().memory_info().rss
            tg.cancel_scope.cancel()
    display.flush()


async def _send(client: httpx.AsyncClient, watch: _Watch, conversation: _Conversation) -> None:
    async def body() -> AsyncIterator[bytes]:
        for piece in conversation.pieces():
            watch.sent += len(piece)
            yield piece

    headers = {
        "content-type": "application/json",
        "content-length": str(conversation.size),
        "accept": "text/event-stream",
        "x-session-id": SESSION_ID,
    }
    watch.phase = PREPARING
    watch.send_started = watch.now()
    watch.say(f"sending {_size(conversation.size)} as a streaming chat request (session {SESSION_ID})")
    try:
        async with client.stream("POST", "/v1/chat/completions", content=body(), headers=headers) as response:
            watch.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                watch.error = f"status {response.status_code}: {text[:200]}"
                watch.say(f"the gateway answered {watch.error}")
                return
            watch.say("response headers: 200, text/event-stream")
            await _read_stream(response, watch)
    except httpx.HTTPError as exc:
        watch.error = f"{type(exc).__name__}: {exc}"
        watch.say(f"request failed: {watch.error}")


async def _read_stream(response: httpx.Response, watch: _Watch) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ': keep-alive' comments
        data = line[5:].strip()
        if data == "[DONE]":
            watch.done_at = watch.now()
            watch.say(f"stream complete: {watch.tokens} tokens, [DONE]")
            return
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if "error" in event:
            watch.error = f"in-band error: {event['error']}"
            watch.say(watch.error)
            continue
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            words = len(content.split())
            if words and watch.first_token_at is None:
                watch.first_token_at = watch.now()
                released = "input already released" if watch.settled_at is not None else "input NOT yet released"
                watch.say(f"first token ({released})")
            watch.tokens += words
    watch.error = "the stream ended without [DONE]"


async def _poll_once(client: httpx.AsyncClient, watch: _Watch) -> LifetimeStats | None:
    phase = watch.phase
    try:
        response = await client.get("/lifetime/stats")
        data: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    names = set(LifetimeStats.__dataclass_fields__)
    stats = LifetimeStats(**{k: v for k, v in data.items() if k in names})
    if watch.phase == phase:  # a sample taken across a phase change belongs to neither
        watch.note_retained(phase, stats.retained_input_bytes)
    return stats


async def _poll_stats(client: httpx.AsyncClient, watch: _Watch) -> None:
    while True:
        await _poll_once(client, watch)
        await anyio.sleep(_POLL_INTERVAL)


async def _wait_idle(client: httpx.AsyncClient, watch: _Watch) -> None:
    """The request settles just after the stream ends; wait (bounded) for every gauge to be 0."""
    watch.phase = AFTER
    with anyio.move_on_after(_IDLE_TIMEOUT):
        while True:
            stats = await _poll_once(client, watch)
            if stats is not None:
                watch.idle_stats = stats
                if stats.idle:
                    break
            await anyio.sleep(0.02)
    if watch.idle_stats is not None:
        watch.say(f"gateway stats: {'idle' if watch.idle_stats.idle else 'NOT idle'}")


# ---------------------------------------------------------------------------
# Displays
# ---------------------------------------------------------------------------


class _Display:
    def __init__(self, watch: _Watch) -> None:
        self.watch = watch

    def header(self, lines: list[str]) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def summary(self, lines: list[str]) -> None:
        raise NotImplementedError


class _PlainDisplay(_Display):
    """Timestamped lines, and a progress line every second: for logs, pipes and tests."""

    def header(self, lines: list[str]) -> None:
        for line in lines:
            print(line, flush=True)

    async def run(self) -> None:
        next_progress = self.watch.now() + _PROGRESS_INTERVAL
        while True:
            self.flush()
            if self.watch.now() >= next_progress:
                next_progress += _PROGRESS_INTERVAL
                self._progress()
            await anyio.sleep(0.05)

    def _progress(self) -> None:
        w = self.watch
        if w.phase == PREPARING:
            doing = f"sent {_size(w.sent)} / {_size(w.total)}"
        elif w.phase == STREAMING:
            doing = f"tokens {w.tokens} / {w.tokens_expected}"
        else:
            return
        print(
            f"[{w.now():7.2f}s] progress: {doing} | RSS {_size(w.rss_now)} | "
            f"gateway retained input {_size(w.retained_now)}",
            flush=True,
        )

    def flush(self) -> None:
        for at, text in self.watch.take_lines():
            print(f"[{at:7.2f}s] {text}", flush=True)

    def summary(self, lines: list[str]) -> None:
        print(flush=True)
        for line in lines:
            print(line, flush=True)


class _RichDisplay(_Display):
    """A live panel (progress bars, memory, events) on a terminal."""

    def __init__(self, watch: _Watch, console: Any = None) -> None:
        super().__init__(watch)
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.lines: list[tuple[float, str]] = []

    def header(self, lines: list[str]) -> None:
        self.console.print(lines[0], style="bold", highlight=False)
        for line in lines[1:]:
            self.console.print(line, style="dim", highlight=False)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        w = self.watch
        bars = Table.grid(padding=(0, 1))
        bars.add_column(style="bold", justify="right")
        bars.add_column()
        bars.add_column()
        bars.add_row(
            "upload", ProgressBar(total=w.total, completed=w.sent, width=40), f"{_size(w.sent)} / {_size(w.total)}"
        )
        bars.add_row(
            "input held",
            ProgressBar(total=w.total, completed=w.retained_now, width=40, complete_style="yellow"),
            f"[bold]{_size(w.retained_now)}[/bold] retained by the gateway ({w.phase})",
        )
        bars.add_row(
            "tokens",
            ProgressBar(total=w.tokens_expected, completed=w.tokens, width=40),
            f"{w.tokens} / {w.tokens_expected}",
        )
        bars.add_row("RSS", f"{_size(w.rss_now)}, peak {_size(w.rss_max)}", "whole process (client, gateway, upstream)")
        events = Table.grid(padding=(0, 1))
        events.add_column(style="dim", justify="right")
        events.add_column()
        for at, text in self.lines[-14:]:
            style = (
                "bold green"
                if text.startswith("RELEASED")
                else "yellow"
                if text.startswith(("retry", "refold"))
                else ""
            )
            events.add_row(f"{at:6.2f}s", f"[{style}]{_escape(text)}[/{style}]" if style else _escape(text))
        return Panel(Group(bars, "", events), title="asgi-lifetime demo", border_style="cyan")

    async def run(self) -> None:
        from rich.live import Live

        with Live(console=self.console, get_renderable=self._render, refresh_per_second=10):
            while True:
                self.flush()
                await anyio.sleep(0.05)

    def flush(self) -> None:
        self.lines += self.watch.take_lines()

    def summary(self, lines: list[str]) -> None:
        self.flush()
        self.console.print()
        for line in lines:
            style = "bold green" if line == "result: OK" else "bold red" if line.startswith("result:") else None
            style = "bold" if line in ("summary",) else style
            self.console.print(line, style=style, highlight=False)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _size(n: int) -> str:
    if n < KiB:
        return f"{n} B"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
