"""Several workers: the gateway's live state mirrored into prometheus_client's multiprocess files.

Imported only when ``PROMETHEUS_MULTIPROC_DIR`` is set (``GatewayMetrics`` decides); the module
docstring of ``_metrics`` explains the mode. Per process: one ``Process`` (metric objects, the
``Source`` of each ``GatewayMetrics`` instance, the sync thread), rebuilt after a fork.

The same thread writes each ``/lifetime/stats`` report of the process (``_workers``, a
``Writer``), and the same check drops what a dead worker left behind: its ``live*`` gauge
files and its ``stats-<pid>-*.json`` reports (``remove_dead_processes``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Protocol, cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import values as _prometheus_values
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .._stats import SHED_REASONS, LifetimeStats
from ._bookkeeping import StoreState
from ._metrics import (
    _GAUGES,
    _SHED,
    _STORE_FALLBACKS,
    _STORE_LOCAL,
    _STORE_UP,
    _TOTALS,
    _UPSTREAM_ATTEMPTS,
    _UPSTREAM_DOWN,
    _UPSTREAM_FAILURES,
    _UPSTREAM_INFLIGHT,
    PREFIX,
    _RequestMetrics,
    _upstream_views,
    _UpstreamLabels,
    _UpstreamView,
)

__all__ = [
    "STATS_PREFIX",
    "Process",
    "SharedFilesCollector",
    "Source",
    "Writer",
    "process_for",
    "remove_dead_processes",
    "retire",
]

logger = logging.getLogger(__name__)

STATS_PREFIX = "stats-"
"""``/lifetime/stats`` reports are ``stats-<pid>-<n>.json`` in the directory (``_workers``)."""


class Writer(Protocol):
    """Something the sync thread writes to the directory every interval (a worker's stats report)."""

    def write(self) -> None: ...

    def remove(self) -> None: ...


class _Mirror:
    """Several workers: the live state as multiprocess ``Gauge`` / ``Counter`` objects."""

    __slots__ = (
        "gauges",
        "totals",
        "shed",
        "upstream_inflight",
        "upstream_down",
        "upstream_attempts",
        "upstream_failures",
        "_store",
    )

    def __init__(self) -> None:
        self.gauges = {
            name: Gauge(PREFIX + name, doc, registry=None, multiprocess_mode="livesum") for name, _, doc in _GAUGES
        }
        self.totals = {name: Counter(PREFIX + name, doc, registry=None) for name, _, doc in _TOTALS}
        name, doc = _SHED
        self.shed = Counter(PREFIX + name, doc, ["reason"], registry=None)
        name, doc = _UPSTREAM_INFLIGHT
        self.upstream_inflight = Gauge(PREFIX + name, doc, ["upstream"], registry=None, multiprocess_mode="livesum")
        name, doc = _UPSTREAM_DOWN
        self.upstream_down = Gauge(PREFIX + name, doc, ["upstream"], registry=None, multiprocess_mode="livemax")
        name, doc = _UPSTREAM_ATTEMPTS
        self.upstream_attempts = Counter(PREFIX + name, doc, ["upstream"], registry=None)
        name, doc = _UPSTREAM_FAILURES
        self.upstream_failures = Counter(PREFIX + name, doc, ["upstream"], registry=None)
        self._store: tuple[Gauge, Counter, Counter] | None = None

    def store(self) -> tuple[Gauge, Counter, Counter]:
        """``session_store_up``, ``_fallbacks``, ``_local_records``: made when an instance with a session
        store first copies, not before. prometheus_client writes 0 to the file when it makes the gauge,
        so a worker without a store (or one not yet synced) reported the store down to the fleet."""
        if self._store is None:
            # The store is up only if it is up in every live worker: one on its own memory is down.
            name, doc = _STORE_UP
            up = Gauge(PREFIX + name, doc, registry=None, multiprocess_mode="livemin")
            name, doc = _STORE_FALLBACKS
            fallbacks = Counter(PREFIX + name, doc, registry=None)
            name, doc = _STORE_LOCAL
            self._store = (up, fallbacks, Counter(PREFIX + name, doc, registry=None))
        return self._store


class Source:
    """One ``GatewayMetrics``' live state, as the process-wide mirror sees it (no reference back)."""

    __slots__ = ("stats", "describe", "store", "synced", "upstreams", "__weakref__")

    def __init__(
        self,
        stats: Callable[[], LifetimeStats],
        describe: Callable[[], list[dict[str, object]]],
        store: Callable[[], StoreState] | None = None,
    ) -> None:
        self.stats = stats
        self.describe = describe
        self.store = store
        self.synced: dict[tuple[str, str], int] = {}
        """The value of each total at the last copy; the mirror counters advance by the difference."""
        self.upstreams: dict[str, _UpstreamView] = {}
        """The last ``describe()`` that succeeded."""

    def advance(self, counter: Counter, key: tuple[str, str], value: int) -> None:
        delta = value - self.synced.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self.synced[key] = value


class Process:
    """The multiprocess state of this process: metric objects, the instances' sources, the sync thread."""

    def __init__(self, directory: str, value_class: object) -> None:
        self.directory = directory
        self.value_class = value_class
        self.labels = _UpstreamLabels()
        self.metrics = _RequestMetrics(None)
        self.mirror = _Mirror()
        self.sources: set[Source] = set()
        self.writers: set[Writer] = set()
        self.failing: set[Writer] = set()  # writers whose last write failed (logged once)
        # A process that had this pid before (a restart on a directory not emptied: containers reuse pids)
        # left its live gauges in the files this one writes to. Its upstreams go to 0 at the first sync,
        # as does any upstream no instance reports any more; they stayed at its last values.
        self.seen_upstreams: set[str] = _upstreams_left_behind(directory)
        self.interval = float("inf")
        self.lock = threading.RLock()  # RLock: a finalizer may run retire() from a GC inside sync()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.thread_pid = 0

    def add(self, source: Source, interval: float) -> None:
        with self.lock:
            self.sources.add(source)
            self._shorten(interval)
        self.ensure_thread()

    def add_writer(self, writer: Writer, interval: float) -> None:
        with self.lock:
            self.writers.add(writer)
            self._shorten(interval)
        self.ensure_thread()

    def remove_writer(self, writer: Writer) -> None:
        """Stop writing ``writer`` and remove what it wrote (a worker that exits leaves no report)."""
        with self.lock:
            self.writers.discard(writer)
            self.failing.discard(writer)
            writer.remove()
            if not self.writers and not self.sources:
                self.wake.set()

    def _shorten(self, interval: float) -> None:
        if interval < self.interval:
            self.interval = interval
            self.wake.set()  # a sleeping thread picks the shorter interval up

    def retire(self, source: Source) -> None:
        """Final copy of ``source``'s totals; its gauges leave the sums."""
        with self.lock:
            if source not in self.sources:
                return
            self._copy_source(source)
            self.sources.discard(source)
            self.sync()
            if not self.sources and not self.writers:
                self.wake.set()

    def ensure_thread(self) -> None:
        thread = self.thread
        if thread is not None and thread.is_alive() and self.thread_pid == os.getpid():
            return
        with self.lock:
            thread = self.thread
            idle = not self.sources and not self.writers
            if idle or (thread is not None and thread.is_alive() and self.thread_pid == os.getpid()):
                return
            self.thread = threading.Thread(target=self._run, name="asgi_lifetime.metrics-sync", daemon=True)
            self.thread_pid = os.getpid()
            self.thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            self.wake.wait(self.interval)
            self.wake.clear()
            with self.lock:
                if self.thread is not me or not (self.sources or self.writers):
                    if self.thread is me:
                        self.thread = None
                    return
            try:
                self.sync()
            except Exception:
                logger.exception("copying the gateway counters to the multiprocess metrics failed")
            self.write_reports()

    def write_reports(self) -> None:
        with self.lock:
            writers = list(self.writers)
        for writer in writers:
            try:
                writer.write()
            except Exception:
                # Once per outage, not every interval (the directory removed: a traceback a second, forever).
                if writer not in self.failing:
                    self.failing.add(writer)
                    logger.exception("writing this worker's stats report failed (logged once until a write succeeds)")
            else:
                self.failing.discard(writer)

    def sync(self) -> None:
        """Copy every source's live state into the mirror."""
        with self.lock:
            gauges = dict.fromkeys(self.mirror.gauges, 0)
            inflight: dict[str, int] = {}
            down: dict[str, int] = {}
            store_up: int | None = None
            for source in list(self.sources):
                if source.store is not None:
                    store_up = min(1 if store_up is None else store_up, int(source.store().up))
                stats = source.stats()
                for name, field, _ in _GAUGES:
                    gauges[name] += getattr(stats, field)
                self._copy_source(source, stats)
                for label, view in source.upstreams.items():
                    inflight[label] = inflight.get(label, 0) + view.inflight
                    down[label] = max(down.get(label, 0), 1 if view.down else 0)
            for name, value in gauges.items():
                self.mirror.gauges[name].set(value)
            if store_up is not None:
                self.mirror.store()[0].set(store_up)
            self.seen_upstreams.update(inflight)
            for label in self.seen_upstreams:  # an upstream no instance reports any more goes to 0
                self.mirror.upstream_inflight.labels(upstream=label).set(inflight.get(label, 0))
                self.mirror.upstream_down.labels(upstream=label).set(down.get(label, 0))

    def _copy_source(self, source: Source, stats: LifetimeStats | None = None) -> None:
        if stats is None:
            stats = source.stats()
        for name, field, _ in _TOTALS:
            source.advance(self.mirror.totals[name], (name, ""), getattr(stats, field))
        for reason, field in SHED_REASONS.items():
            source.advance(self.mirror.shed.labels(reason=reason), (_SHED[0], reason), getattr(stats, field))
        try:
            source.upstreams = _upstream_views(source.describe, self.labels)
        except Exception:
            logger.debug("describe_upstreams failed; keeping its last answer", exc_info=True)
        mirror = self.mirror
        if source.store is not None:
            state = source.store()
            _, fallbacks, local = mirror.store()
            source.advance(fallbacks, ("session_store_fallbacks", ""), state.fallbacks)
            source.advance(local, ("session_store_local_records", ""), state.local_records)
        for label, view in source.upstreams.items():
            source.advance(mirror.upstream_attempts.labels(upstream=label), ("upstream_attempts", label), view.attempts)
            source.advance(mirror.upstream_failures.labels(upstream=label), ("upstream_failures", label), view.failures)

    def remove_dead(self) -> None:
        """Before a render: drop what workers that died without cleaning up left in the gauges."""
        remove_dead_processes(self.directory)

    def after_fork(self) -> None:
        # The thread did not survive the fork and the lock may be held by it: start over.
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.thread = None


def _upstreams_left_behind(directory: str) -> set[str]:
    """The ``upstream`` labels in this pid's live gauge files, written by an earlier process with this pid."""
    names = {PREFIX + _UPSTREAM_INFLIGHT[0], PREFIX + _UPSTREAM_DOWN[0]}
    found: set[str] = set()
    for path in glob.glob(os.path.join(glob.escape(directory), f"gauge_live*_{os.getpid()}.db")):
        try:
            entries = MmapedDict.read_all_values_from_file(path)  # type: ignore[no-untyped-call]
            for key, *_ in entries:
                name, _, labels, _ = json.loads(key)
                if name in names and isinstance(labels.get("upstream"), str):
                    found.add(labels["upstream"])
        except Exception:
            continue  # unreadable: SharedFilesCollector leaves it out and says so
    return found


_process_lock = threading.Lock()
_process: Process | None = None
_fork_hook = False


def process_for(directory: str) -> Process:
    """This process's multiprocess state for ``directory`` and the current prometheus value storage."""
    global _process, _fork_hook
    value_class = _prometheus_values.ValueClass
    with _process_lock:
        if not _fork_hook and hasattr(os, "register_at_fork"):
            # Registered on first use, not at import: importing the package changes nothing process-wide.
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook = True
        if _process is None or _process.directory != directory or _process.value_class is not value_class:
            _process = Process(directory, value_class)
        return _process


def _after_fork_in_child() -> None:
    global _process_lock
    _process_lock = threading.Lock()
    if _process is not None:
        _process.after_fork()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # e.g. PermissionError: it exists, as another user
    return True


def remove_dead_processes(directory: str) -> None:
    """Drop what workers that died without cleaning up left behind (POSIX only).

    Their ``live*`` gauge files (their totals stay: counter semantics) and their stats reports.
    """
    if os.name != "posix":
        return  # os.kill(pid, 0) would terminate the process on Windows
    own = os.getpid()
    found: dict[int, list[str]] = {}  # pid -> its stats report files
    prefix = os.path.join(glob.escape(directory), "")
    for path in glob.glob(prefix + "gauge_live*_*.db"):
        suffix = os.path.basename(path)[: -len(".db")].rsplit("_", 1)[-1]
        if suffix.isdigit():
            found.setdefault(int(suffix), [])
    for path in glob.glob(prefix + STATS_PREFIX + "*"):  # stats-<pid>-<n>.json and its .tmp
        digits = os.path.basename(path)[len(STATS_PREFIX) :].split("-", 1)[0]
        if digits.isdigit():
            found.setdefault(int(digits), []).append(path)
    for pid, reports in found.items():
        if pid == own or _process_exists(pid):
            continue
        for path in reports:
            with contextlib.suppress(OSError):  # another worker removed it first
                os.remove(path)
        try:
            mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except OSError:
            pass  # another worker removed them first


class SharedFilesCollector(MultiProcessCollector):
    """prometheus_client's collector, minus the files another process is creating this instant,
    and minus files it cannot read.

    A worker creates a metric's file when it first writes to it (its sync thread does, at any
    time): the file exists, empty, until that worker sizes it. Reading it then raised
    ``struct.error`` and the whole scrape failed. An empty file holds no values yet: skip it.
    A file removed between listing and reading (a dead worker's, by another worker) is retried.

    A ``*.db`` file that is not a readable metrics file (truncated, garbage, not ours) made every
    scrape fail, for good: it is left out, with one warning naming it, and the others are served.
    A directory that is gone fails the scrape: served empty, every series would vanish unnoticed.
    """

    def __init__(self, registry: CollectorRegistry, directory: str) -> None:
        super().__init__(registry, path=directory)  # type: ignore[no-untyped-call]
        self._directory = directory
        self._unreadable: set[str] = set()  # warned about once each

    def collect(self) -> Iterable[Metric]:
        try:
            return self._merge()
        except FileNotFoundError:  # removed after it was listed: list again
            return self._merge()

    def _merge(self) -> Iterable[Metric]:
        if not os.path.isdir(self._directory):
            raise RuntimeError(f"the metrics directory {self._directory!r} is gone: restart the server")
        files = [path for path in glob.glob(os.path.join(glob.escape(self._directory), "*.db")) if _sized(path)]
        try:
            return self._read(files)
        except FileNotFoundError:
            raise
        except Exception:
            # Some file cannot be read: find which (one at a time, only on this path) and leave it out.
            return self._read([path for path in files if self._readable(path)])

    def _read(self, files: list[str]) -> Iterable[Metric]:
        # merge() builds the whole list: a bad file raises here, not while the registry renders.
        return list(cast(Iterable[Metric], self.merge(files, accumulate=True)))  # type: ignore[no-untyped-call]

    def _readable(self, path: str) -> bool:
        try:
            self._read([path])
        except FileNotFoundError:
            return False
        except Exception as exc:
            if path not in self._unreadable:
                self._unreadable.add(path)
                logger.warning("left out of /metrics: %s is not a readable metrics file (%s)", path, exc)
            return False
        return True


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def retire(process: Process, source: Source) -> None:
    try:
        process.retire(source)
    except Exception:
        logger.debug("final copy of the gateway counters failed", exc_info=True)
