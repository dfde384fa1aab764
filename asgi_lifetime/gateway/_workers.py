"""``GET /lifetime/stats`` with several workers: every worker's report and the total.

A request reaches one worker process, and a worker can only count what it holds itself. So
when the workers share a directory (``PROMETHEUS_MULTIPROC_DIR``, the one the multiprocess
metrics use; ``asgi-lifetime serve --workers N`` creates one when it is not set), each worker
writes its report there, ``stats-<pid>-<n>.json``, scalars only, atomically (a temporary file,
then ``os.replace``): from the metrics sync thread every ``sync_interval`` seconds, and when it
answers ``/lifetime/stats`` itself. The answering worker then reads every report, after dropping
those of workers that no longer exist (the same check as the metrics' gauges,
``_multiprocess.remove_dead_processes``), and answers::

    {"inflight_requests": 3, ..., "upstreams": [...],     # totals over the live workers
     "scope": "workers", "process": {"pid": 41},          # who answered
     "workers": [{"pid": 41, "age": 0.0, "inflight_requests": 1, ...},
                 {"pid": 42, "age": 0.61, "inflight_requests": 2, ...}]}

``age`` is how many seconds old a worker's report is (at most about ``sync_interval``, except the
answering worker's, which is fresh). The totals are over the workers alive now: a worker that
exits takes its report with it (``/metrics`` keeps past workers' totals, as counters should).
Per upstream, counts are summed and ``down_for`` is the longest cool-off any worker has.

Without a shared directory the payload is this process's, and says so: ``"scope": "process"``.
The top-level fields are the same in both scopes.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Report", "WorkerReport", "WorkerStats", "merge_upstreams", "read_reports"]

Report = dict[str, Any]
"""One worker's scalars (``LifetimeStats`` fields and ``session_changes``) plus ``upstreams``."""

_SERIAL = itertools.count()
_SUFFIX: Final = ".json"


class _ReportFile:
    """What the sync thread holds: the report callable and the file name (not the ``WorkerStats``,
    whose finalizer takes it out of the thread's set).

    Written from the sync thread and from the endpoint's worker thread: the lock keeps the two
    off one temporary file, and a write that comes after ``remove()`` from leaving a report behind.
    """

    __slots__ = ("directory", "report", "serial", "_lock", "_removed")

    def __init__(self, directory: str, report: Callable[[], Report]) -> None:
        self.directory = directory
        self.report = report
        self.serial = next(_SERIAL)
        self._lock = threading.Lock()
        self._removed = False

    def path(self) -> str:
        # The pid is read at every write: a forked child writes a report of its own.
        from ._multiprocess import STATS_PREFIX

        return os.path.join(self.directory, f"{STATS_PREFIX}{os.getpid()}-{self.serial}{_SUFFIX}")

    def write(self) -> None:
        report = self.report()
        data = json.dumps({"pid": os.getpid(), "written_at": time.time(), "report": report}).encode()
        with self._lock:
            if self._removed:
                return
            path = self.path()
            temporary = path + ".tmp"  # outside the readers' glob: a reader sees the old file or the new one
            with open(temporary, "wb") as file:
                file.write(data)
            os.replace(temporary, path)

    def remove(self) -> None:
        with self._lock:
            self._removed = True
            path = self.path()
            for each in (path, path + ".tmp"):
                with contextlib.suppress(OSError):
                    os.remove(each)


def _retire(process: Any, writer: _ReportFile) -> None:
    with contextlib.suppress(Exception):
        process.remove_writer(writer)


class WorkerStats:
    """The ``/lifetime/stats`` payload: this process's report, or every worker's and the total.

    ```python
    workers = WorkerStats(report, directory=os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    payload = workers.payload()     # blocking file IO with a directory: call it in a thread
    workers.close()                 # at shutdown: this worker's report leaves the totals
    ```

    ``report`` returns this process's scalars and its ``upstreams`` list (``describe()``);
    it is called from the metrics sync thread too, so it must only read plain values.
    """

    def __init__(self, report: Callable[[], Report], *, directory: str | None, sync_interval: float = 1.0) -> None:
        self._report = report
        self.directory = directory or None
        """The shared directory, or ``None`` (the payload is this process's)."""
        self._file: _ReportFile | None = None
        if self.directory is None:
            return
        from . import _multiprocess  # the directory is the multiprocess metrics': the same thread writes

        self._process = _multiprocess.process_for(self.directory)
        self._file = _ReportFile(self.directory, report)
        self._process.add_writer(self._file, sync_interval)
        self._finalizer = weakref.finalize(self, _retire, self._process, self._file)

    def payload(self) -> dict[str, Any]:
        own = {"pid": os.getpid()}
        if self._file is None or self.directory is None:
            return {**self._report(), "scope": "process", "process": own}
        from ._multiprocess import remove_dead_processes

        self._file.write()  # this worker's entry is fresh; the others are at most an interval old
        remove_dead_processes(self.directory)
        workers = read_reports(self.directory)
        totals: dict[str, int] = {}
        for worker in workers:
            for name, value in worker.scalars.items():
                totals[name] = totals.get(name, 0) + value
        return {
            **totals,
            "upstreams": merge_upstreams(workers),
            "scope": "workers",
            "process": own,
            "workers": [{"pid": w.pid, "age": round(w.age, 3), **w.scalars} for w in workers],
        }

    def close(self) -> None:
        """Take this worker's report out of the directory (it leaves the totals). Idempotent."""
        if self._file is not None:
            self._finalizer()


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's report as read back: its scalars and its upstreams' views."""

    pid: int
    age: float
    """Seconds since the worker wrote it."""
    scalars: dict[str, int]
    upstreams: list[dict[str, Any]]


def read_reports(directory: str) -> list[WorkerReport]:
    """Every report in ``directory``, by pid; a file that is not a report is skipped."""
    from ._multiprocess import STATS_PREFIX

    now = time.time()
    reports: list[WorkerReport] = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{STATS_PREFIX}*{_SUFFIX}")):
        try:
            with open(path, "rb") as file:
                data = json.loads(file.read())
            report = data["report"]
            scalars = {k: v for k, v in report.items() if type(v) is int}
            upstreams = [u for u in report.get("upstreams", []) if isinstance(u, dict)]
            reports.append(
                WorkerReport(int(data["pid"]), max(0.0, now - float(data["written_at"])), scalars, upstreams)
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # removed since the listing (a worker exited), or not ours
    reports.sort(key=lambda r: r.pid)
    return reports


def merge_upstreams(workers: Sequence[WorkerReport]) -> list[dict[str, Any]]:
    """Per upstream URL: counts summed over the workers; ``down_for`` the longest cool-off left."""
    merged: dict[str, dict[str, Any]] = {}
    for worker in workers:
        for view in worker.upstreams:
            url = view.get("url")
            if not isinstance(url, str):
                continue
            into = merged.setdefault(url, {"url": url, "inflight": 0, "down_for": None, "requests": 0, "failures": 0})
            for name in ("inflight", "requests", "failures"):
                value = view.get(name)
                into[name] += value if type(value) is int else 0
            down_for = view.get("down_for")
            if isinstance(down_for, (int, float)) and down_for - worker.age > 0:
                into["down_for"] = max(into["down_for"] or 0.0, down_for - worker.age)
    return list(merged.values())
