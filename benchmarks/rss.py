"""RSS sampling of another process with psutil, every ~10 ms, in a driver thread."""

from __future__ import annotations

import statistics
import threading
import time

import psutil

__all__ = ["Sampler"]

MiB = 1024 * 1024


class Sampler:
    """``with Sampler(pid) as s: ...``; ``s.samples`` is a list of (time.monotonic(), rss bytes)."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self._process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self._process.memory_info().rss
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), rss))
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def now(self) -> int:
        return int(self._process.memory_info().rss)

    def window(self, start: float, end: float) -> list[int]:
        return [rss for t, rss in self.samples if start <= t <= end]

    def peak(self, start: float, end: float) -> int:
        values = self.window(start, end)
        return max(values) if values else self.now()

    def median(self, start: float, end: float) -> float:
        values = self.window(start, end)
        return statistics.median(values) if values else float(self.now())
