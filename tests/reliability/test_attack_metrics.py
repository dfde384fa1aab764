"""The metrics an operator scrapes, attacked as a fleet member: ``asgi-lifetime serve --workers 2`` and
``uvicorn --workers 2 --factory asgi_lifetime.gateway:create_app`` with ``PROMETHEUS_MULTIPROC_DIR``,
scraped by a Prometheus stand-in (every scrape parsed with prometheus_client's parser, each compared
with the one before), plus ``/lifetime/stats``. Real worker processes on loopback ports; the
hostile-directory cases in this process (``multiproc_dir``).

Found here:

- an upstream whose reason phrase had a byte above 0x7f (obs-text, allowed by RFC 9112) got a 500
  ``internal_error`` for every answer under ``UPSTREAM_TRANSPORT=aiohttp`` (the default): the
  transport encoded aiohttp's surrogate-escaped phrase as latin-1. It gives back the bytes received.
- an upstream status outside 100-599 (600-999: h11 parses them) was relayed: uvicorn with httptools
  raised on it and dropped the client's connection with nothing sent, and ``requests_total`` said
  ``status="0"``. It is a malformed answer: 502, counted as such, never retried unless safe to.
- one ``*.db`` file in the directory that is not a readable metrics file (truncated, garbage) made
  every scrape a 500, for good: it is left out with one warning, the other files are served.
- the directory removed at runtime: ``/metrics`` answered 200 with an empty body (every series gone,
  no alert fires on that) and every worker logged a traceback a second, forever. The scrape fails
  now, and the failing report write is logged once.
- ``GatewayMetrics`` without a session store, with several workers, reported ``session_store_up 0``
  (prometheus_client writes 0 when the gauge is made): the fleet's ``livemin`` read "store down",
  where one process reports no such series. The store's metrics are made when a store first syncs.
- a worker that got the pid of a dead one from a run on the same directory (containers reuse pids)
  showed the dead one's ``upstream_inflight`` / ``upstream_down`` for good, for the upstreams only
  the dead one reported: they go to 0 when the new worker starts.
- a directory the workers cannot write to: every worker failed on its first metric file with a
  traceback, restarted by uvicorn's supervisor for ever (18 in 12 s), the port answering nothing.
  ``GatewayMetrics`` tries the directory with a temporary file and says why; ``asgi-lifetime serve``
  tries it before starting workers and exits with that line (status 2).

Held up (kept as tests): no counter went back in any scrape (66-68 a run per server kind) while a
worker was SIGKILLed mid-stream, another stopped cleanly (SIGTERM) and uvicorn's supervisor replaced
both, scrapes racing each exit; a dead worker's gauges vanished and a live worker's stayed; ``requests_total``
by status equalled what the clients counted; a server restarted on a leftover directory and a
second server on the same one only ever added to the totals.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway import _multiprocess
from asgi_lifetime.gateway._bookkeeping import StoreState
from asgi_lifetime.gateway._metrics import GatewayMetrics
from asgi_lifetime.gateway._workers import WorkerStats
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

from .._gateways import STARTUP, Gateway, clean_env, eventually, gateway_process
from .._servers import free_port
from ..gateway._raw_upstream import CLOSE, RawRequest, Script, raw_upstream
from ..gateway.test_metrics import make_metrics as make_metrics  # fixtures: a multiprocess directory, cleaned after
from ..gateway.test_metrics import multiproc_dir as multiproc_dir
from .test_faults import PATH, assert_idle, running

ROOT = str(Path(__file__).resolve().parents[2])  # the worker processes import this checkout's package
CHAT: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# A stream that lasts minutes unless cut: 1000 tokens at 2 per second.
LONG_STREAM = {**CHAT, "stream": True, "max_tokens": 1000}
DEAD_PID = 4194305  # above Linux's pid_max (2**22): no process can have it

Key = tuple[str, str, tuple[tuple[str, str], ...]]  # (family type, sample name, labels)


def scrape(base: str) -> dict[Key, float]:
    """One Prometheus scrape, parsed (a body the parser refuses fails the test)."""
    response = httpx.get(f"{base}/metrics", timeout=10, headers={"connection": "close"})  # any worker may answer
    response.raise_for_status()
    return {
        (family.type, sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def went_back(before: dict[Key, float], after: dict[Key, float]) -> list[tuple[Key, float, float | None]]:
    """Counter and histogram samples that dropped or vanished: Prometheus reads either as a reset."""
    return [
        (key, value, after.get(key))
        for key, value in before.items()
        if key[0] in ("counter", "histogram") and (after.get(key) is None or after[key] < value)
    ]


def one(samples: dict[Key, float], name: str, **labels: str) -> float | None:
    """A sample's value, ``None`` when absent."""
    return samples.get(next((k for k in samples if k[1] == name and dict(k[2]) == labels), ("", "", ())))


def requests_by_status(samples: dict[Key, float]) -> dict[int, float]:
    totals: dict[int, float] = {}
    for (_, name, labels), value in samples.items():
        if name == "asgi_lifetime_requests_total":
            status = int(dict(labels)["status"])
            totals[status] = totals.get(status, 0) + value
    return totals


class Prometheus:
    """Scrapes ``base`` in a thread until stopped, comparing every scrape with the one before."""

    def __init__(self, bases: Sequence[str]) -> None:
        self.bases = bases
        self.scrapes = 0
        self.failed = 0  # scrapes that reached a worker as it died
        self.backwards: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prometheus", daemon=True)

    def _run(self) -> None:
        last: dict[Key, float] | None = None
        while not self._stop.is_set():
            for base in self.bases:
                try:
                    now = scrape(base)
                except httpx.TransportError:
                    self.failed += 1
                    continue
                if last is not None:
                    self.backwards.extend(went_back(last, now))
                last = now
                self.scrapes += 1

    def __enter__(self) -> Prometheus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class Clients:
    """Sends requests and counts the answers by status, as the clients saw them."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.seen: dict[int, int] = {}

    def send(self, count: int) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as client:
            for n in range(count):
                # Every fourth one answered 400 by the demo upstream (relayed as sent, never retried).
                headers = {"x-demo-behaviour": "status=400"} if n % 4 == 0 else {}
                status = client.post(PATH, json=CHAT, headers=headers).status_code
                self.seen[status] = self.seen.get(status, 0) + 1


def worker_pids(gateway: Gateway) -> set[int]:
    return {worker["pid"] for worker in gateway.stats()["workers"]}


def replaced(gateway: Gateway, gone: int) -> set[int]:
    """Wait for uvicorn's supervisor to have replaced worker ``gone``: two workers listed, not it."""

    def listed() -> set[int] | None:
        pids = worker_pids(gateway)
        return pids if len(pids) == 2 and gone not in pids else None

    found: set[int] = eventually(listed, seconds=STARTUP, what=f"worker {gone} replaced", every=0.1)
    return found


@contextlib.contextmanager
def uvicorn_workers(upstream: str, directory: Path, log: Path) -> Iterator[Gateway]:
    """``uvicorn --workers 2 --factory asgi_lifetime.gateway:create_app``, configured from the environment."""
    port = free_port()
    env = clean_env(
        {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": ROOT, "ASGI_LIFETIME_UPSTREAM_URL": upstream}
    )
    argv = ["--workers", "2", "--factory", "asgi_lifetime.gateway:create_app", "--port", str(port)]
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", *argv, "--log-level", "warning"],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        gateway = Gateway(process, port, log)
        try:
            eventually(lambda: _two_workers(gateway), seconds=STARTUP, what="uvicorn's two workers", every=0.1)
            yield gateway
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _two_workers(gateway: Gateway) -> bool:
    assert gateway.process.poll() is None, gateway.log.read_text()
    try:
        return len(worker_pids(gateway)) >= 2  # two servers on one directory list each other's workers too
    except (httpx.TransportError, httpx.HTTPStatusError, KeyError):
        return False


@contextlib.contextmanager
def serve_workers(upstream: str, directory: Path, log: Path) -> Iterator[Gateway]:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": ROOT, "ASGI_LIFETIME_DRAIN_DELAY": "0"}
    with gateway_process(["--upstream", upstream, "--workers", "2"], log, env=env, ready=_two_workers) as gateway:
        yield gateway


SERVERS: dict[str, Callable[[str, Path, Path], contextlib.AbstractContextManager[Gateway]]] = {
    "asgi-lifetime serve": serve_workers,
    "uvicorn --factory": uvicorn_workers,
}


# ---------------------------------------------------------------------------------------------
# Real workers


@pytest.mark.parametrize("server", SERVERS)
def test_counters_never_go_back_as_workers_die_and_are_replaced(server: str, tmp_path: Path) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    with (
        serve_in_thread(create_demo_upstream(tokens_per_second=2)) as upstream,
        SERVERS[server](upstream, directory, tmp_path / "server.log") as gateway,
        Prometheus([gateway.base]) as prometheus,
    ):
        clients = Clients(gateway.base)
        clients.send(12)
        first = worker_pids(gateway)

        # A stream held on each worker (connections land where the kernel puts them: open until both hold one).
        streams: list[httpx.Response] = []
        with httpx.Client(base_url=gateway.base, timeout=30) as client:
            try:

                def both_hold() -> dict[str, Any] | None:
                    request = client.build_request("POST", PATH, json=LONG_STREAM, headers={"connection": "close"})
                    streams.append(client.send(request, stream=True))
                    assert streams[-1].status_code == 200
                    stats = eventually(
                        lambda: (s := gateway.stats())["inflight_requests"] == len(streams) and s,
                        seconds=10,
                        what="the streams counted",
                    )
                    holders = [w for w in stats["workers"] if w["inflight_requests"]]
                    return stats if len(holders) == 2 else None

                stats = eventually(both_hold, seconds=30, what="a stream on each worker", every=0)
                held = {w["pid"]: w["inflight_requests"] for w in stats["workers"]}
                victim = min(held)
                survivor_holds = held[max(held)]
                eventually(
                    lambda: one(scrape(gateway.base), "asgi_lifetime_inflight_requests") == len(streams),
                    seconds=10,
                    what="/metrics: every stream in flight",
                )

                os.kill(victim, signal.SIGKILL)  # mid-stream, while Prometheus scrapes
                # Its gauges vanish; the survivor's stay (its streams are still in flight).
                eventually(
                    lambda: (
                        one(s := scrape(gateway.base), "asgi_lifetime_inflight_requests") == survivor_holds
                        and one(s, "asgi_lifetime_upstream_inflight", upstream=upstream) == survivor_holds
                    ),
                    seconds=20,
                    what=f"/metrics: the survivor's {survivor_holds} stream(s) only",
                )
            finally:
                for stream in streams:
                    stream.close()
        second = replaced(gateway, victim)
        clients.send(12)

        survivor = (first - {victim}).pop()
        os.kill(survivor, signal.SIGTERM)  # a clean exit: it retires its totals and gauges
        replaced(gateway, survivor)
        clients.send(12)
        assert second != first

        # What the clients saw is what /metrics says, once every worker has synced: plus the streams the
        # survivor held (200s the client closed); the victim's died with it, unrecorded.
        expected = {**clients.seen, 200: clients.seen[200] + survivor_holds}

        # Another worker's gauges are up to its sync interval old: both are polled.
        def agree() -> bool:
            samples = scrape(gateway.base)
            return requests_by_status(samples) == expected and one(samples, "asgi_lifetime_inflight_requests") == 0

        eventually(agree, seconds=20, what=f"requests_total by status == {expected}, nothing in flight")
    assert prometheus.backwards == [], prometheus.backwards[:5]
    assert prometheus.scrapes > 0
    assert "Traceback" not in gateway.log.read_text()


def test_a_restart_on_a_leftover_directory_and_a_second_server_only_add(tmp_path: Path) -> None:
    # The documented setup empties the directory before a start; an operator who does not, or who
    # points two servers at one directory, gets one set of totals for both: never a counter going back.
    directory = tmp_path / "prometheus"
    directory.mkdir()
    with serve_in_thread(create_demo_upstream(tokens_per_second=1000)) as upstream:
        with serve_workers(upstream, directory, tmp_path / "first.log") as gateway:
            clients = Clients(gateway.base)
            clients.send(8)
            before = eventually(
                lambda: (s := scrape(gateway.base)) and requests_by_status(s) == clients.seen and s,
                seconds=20,
                what="the first run counted",
            )

            # No worker died: /lifetime/stats (live workers) and /metrics (all) count the same.
            def same() -> bool:
                samples, stats = scrape(gateway.base), gateway.stats()
                return all(
                    one(samples, f"asgi_lifetime_{name}_total") == stats[field] == 8
                    for name, field in (("admitted", "admitted"), ("completed", "completed"))
                )

            eventually(same, seconds=20, what="/metrics and /lifetime/stats agree")
            gateway.kill()  # every worker at once: their gauge files stay behind

        with (
            serve_workers(upstream, directory, tmp_path / "again.log") as again,
            serve_workers(upstream, directory, tmp_path / "second.log") as second,
            Prometheus([again.base, second.base]) as prometheus,
        ):
            for each in (again, second):
                samples = scrape(each.base)
                assert went_back(before, samples) == []
                assert one(samples, "asgi_lifetime_inflight_requests") == 0  # the dead run's gauges are gone
            Clients(second.base).send(8)
            second.kill()
            Clients(again.base).send(8)
    assert prometheus.backwards == [], prometheus.backwards[:5]
    assert prometheus.scrapes > 0


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_upstream_statuses_and_reason_phrases_are_relayed_or_refused_and_counted(transport: str) -> None:
    # The status comes from the upstream's status line (the client's request says which); the reason
    # phrase carries obs-text bytes, as RFC 9112 allows.
    def answer(request: RawRequest) -> Script:
        status = int(json.loads(request.body)["messages"][0]["content"])
        head = b"HTTP/1.1 %d Odd \xff\xe9 phrase\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % status
        return [head, CLOSE]

    relayed = [200, 204, 299, 304, 399, 418, 499, 599]
    invalid = [600, 700, 999]
    with raw_upstream(answer) as upstream, running(upstream_url=upstream.url, upstream_transport=transport) as stack:
        seen: dict[int, int] = {}
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            for status in relayed + invalid:
                body = {**CHAT, "messages": [{"role": "user", "content": str(status)}]}
                got = (await client.post(PATH, json=body)).status_code
                assert got == (status if status in relayed else 502), status
                seen[got] = seen.get(got, 0) + 1
            # Counted once the response is sent: poll (a blocking scrape; the gateway runs in its own thread).
            eventually(lambda: requests_by_status(scrape(stack.url)) == seen, seconds=10, what=f"counted: {seen}")
        await assert_idle(stack.app, stack.url)


# ---------------------------------------------------------------------------------------------
# The directory, in this process


def _worker(make_metrics: Callable[..., GatewayMetrics]) -> GatewayMetrics:
    counters = Counters()
    counters.admitted = 3
    metrics = make_metrics(counters)
    metrics.sync()
    return metrics


def _parse(metrics: GatewayMetrics) -> dict[Key, float]:
    body = metrics.render()[0].decode()
    return {
        (family.type, sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


@pytest.mark.parametrize("cut", ["empty-ish", "header", "entry", "last-byte", "garbage", "bad-key", "not-ours"])
def test_an_unreadable_file_is_left_out_not_every_scrape_failed(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path, cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = _worker(make_metrics)
    own = (multiproc_dir / f"counter_{os.getpid()}.db").read_bytes()
    used = int.from_bytes(own[:4], "little")
    content = {
        "empty-ish": own[:5],
        "header": own[:20],
        "entry": own[: used // 2],
        "last-byte": own[: used - 1],
        "garbage": b"garbage!" * 10,
        "bad-key": own[:12] + b"X" + own[13:],  # the first key's JSON, broken
        "not-ours": b"# notes, not a metrics file\n" * 4,
    }[cut]
    name = "notes_from_an_operator.db" if cut == "not-ours" else f"counter_{DEAD_PID}.db"
    (multiproc_dir / name).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=_multiprocess.__name__):
        for _ in range(3):
            assert one(_parse(metrics), "asgi_lifetime_admitted_total") == 3
    warnings = [r for r in caplog.records if "not a readable metrics file" in r.getMessage()]
    assert len(warnings) == 1 and name in warnings[0].getMessage()  # once, not every scrape


def test_a_removed_directory_fails_the_scrape_and_the_report_failure_is_logged_once(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = _worker(make_metrics)
    workers = WorkerStats(lambda: {"admitted": 3, "upstreams": []}, directory=str(multiproc_dir), sync_interval=60)
    try:
        process = _multiprocess.process_for(str(multiproc_dir))
        shutil.rmtree(multiproc_dir)
        # Served empty, every series would vanish from Prometheus with nothing to alert on.
        with pytest.raises(RuntimeError, match="is gone"):
            metrics.render()
        with caplog.at_level(logging.ERROR, logger=_multiprocess.__name__):
            for _ in range(3):
                process.write_reports()  # what the sync thread does every interval
        assert len([r for r in caplog.records if "stats report failed" in r.getMessage()]) == 1
        multiproc_dir.mkdir()  # back: the next failure is logged again
        process.write_reports()
        shutil.rmtree(multiproc_dir)
        with caplog.at_level(logging.ERROR, logger=_multiprocess.__name__):
            process.write_reports()
        assert len([r for r in caplog.records if "stats report failed" in r.getMessage()]) == 2
    finally:
        multiproc_dir.mkdir(exist_ok=True)
        workers.close()


def test_without_a_session_store_no_worker_reports_the_store_down(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path
) -> None:
    metrics = _worker(make_metrics)
    samples = _parse(metrics)
    assert not [key for key in samples if "session_store" in key[1]]  # as in one process: no such series
    # A worker with a store, beside it: up, as that worker says (the other has no say in livemin).
    with_store = GatewayMetrics(
        stats=Counters().snapshot,
        describe_upstreams=list,
        sync_interval=60,
        session_store=lambda: StoreState(up=True, fallbacks=0, local_records=0),
    )
    try:
        assert one(_parse(metrics), "asgi_lifetime_session_store_up") == 1
    finally:
        with_store.close()


def test_many_dead_workers_files_one_scrape_removes_their_gauges_and_keeps_their_totals(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path
) -> None:
    # A server whose workers keep being replaced (crashes, --limit-max-requests) leaves files behind.
    metrics = _worker(make_metrics)
    for own in multiproc_dir.glob(f"*_{os.getpid()}.db"):
        for n in range(500):
            shutil.copy(own, own.with_name(own.name.replace(str(os.getpid()), str(DEAD_PID + n))))
    samples = _parse(metrics)
    assert one(samples, "asgi_lifetime_admitted_total") == 3 * 501
    assert set(multiproc_dir.glob("gauge_live*")) == set(multiproc_dir.glob(f"gauge_live*_{os.getpid()}.db"))
    assert went_back(samples, _parse(metrics)) == []


_LEFTOVER = """
import os
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway._metrics import GatewayMetrics
counters = Counters()
counters.admitted = 5
counters.inflight_requests = 2
upstreams = [{"url": "http://old:1", "inflight": 3, "down_for": 5.0, "requests": 4, "failures": 1}]
metrics = GatewayMetrics(stats=counters.snapshot, describe_upstreams=lambda: upstreams)
metrics.sync()  # (kept referenced: collected, it would retire its gauges)
print(os.getpid(), flush=True)
os._exit(0)  # killed: its gauges left in the files
"""


def test_a_worker_reusing_a_dead_pid_does_not_inherit_its_gauges(
    make_metrics: Callable[..., GatewayMetrics], multiproc_dir: Path
) -> None:
    # A restart on a directory not emptied, in a container: the new worker gets the pid the old one had.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir), "PYTHONPATH": ROOT}
    child = subprocess.run([sys.executable, "-c", _LEFTOVER], env=env, capture_output=True, text=True, check=True)
    old = int(child.stdout)
    for path in multiproc_dir.glob(f"*_{old}.db"):  # this process plays the worker that got its pid
        path.rename(path.with_name(path.name.replace(f"_{old}.db", f"_{os.getpid()}.db")))
    new = "http://new:1"
    metrics = make_metrics(
        Counters(), lambda: [{"url": new, "inflight": 0, "down_for": None, "requests": 0, "failures": 0}]
    )
    samples = _parse(metrics)
    assert one(samples, "asgi_lifetime_inflight_requests") == 0
    for name in ("asgi_lifetime_upstream_inflight", "asgi_lifetime_upstream_down"):
        assert one(samples, name, upstream="http://old:1") == 0, name  # they were 3 and 1, for good
    # Its totals carry on (counters never go back).
    assert one(samples, "asgi_lifetime_admitted_total") == 5
    assert one(samples, "asgi_lifetime_upstream_attempts_total", upstream="http://old:1") == 4


# A directory no process can write to, even as root (CI may run as root: a mode would not stop it).
UNWRITABLE = "/proc/self/fdinfo"


@pytest.mark.skipif(not os.path.isdir(UNWRITABLE), reason="needs Linux's /proc")
def test_an_unwritable_directory_is_refused_at_once_not_a_worker_crash_loop(tmp_path: Path) -> None:
    # Each worker failed on its first metric file with a traceback, and uvicorn's supervisor started
    # another, for ever (18 in 12 s), the port answering nothing.
    env = clean_env({"PROMETHEUS_MULTIPROC_DIR": UNWRITABLE, "PYTHONPATH": ROOT})
    argv = ["serve", "--port", str(free_port()), "--workers", "2", "--upstream", "http://127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-m", "asgi_lifetime", *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"PROMETHEUS_MULTIPROC_DIR={UNWRITABLE!r} is not a directory this process can write to" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not os.path.isdir(UNWRITABLE), reason="needs Linux's /proc")
def test_gateway_metrics_refuse_an_unwritable_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", UNWRITABLE)  # uvicorn --factory: the worker says why
    with pytest.raises(ValueError, match="is not a directory this process can write to"):
        GatewayMetrics(stats=Counters().snapshot, describe_upstreams=list)
