"""Real ``asgi-lifetime serve`` processes on loopback ports, for the worker and fleet tests.

Each gateway runs in a session of its own, so it can be killed with its workers in one signal
(``kill``: SIGKILL to its process group, as a crashed host or an OOM-killed pod would die).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from asgi_lifetime._settings import ENV_PREFIX
from asgi_lifetime.gateway._metrics import MULTIPROC_DIR_ENV

from ._servers import free_port

STARTUP = 60.0  # seconds; two spawned workers import everything on a shared 2-core machine


def refused(port: int) -> bool:
    """True when nothing listens on the loopback ``port`` any more (every worker is gone)."""
    with socket.socket() as sock:
        sock.settimeout(1)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment minus what would configure the gateway from outside the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != MULTIPROC_DIR_ENV}
    env.update(extra or {})
    return env


def eventually(condition: Callable[[], Any], *, seconds: float, what: str, every: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something true (returned), or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        time.sleep(every)


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.base}/lifetime/stats", timeout=10)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def kill(self) -> None:
        """SIGKILL the supervisor and every worker at once; returns once nothing listens on the port."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        eventually(lambda: refused(self.port), seconds=10, what=f"port {self.port} closed after the kill")


@contextlib.contextmanager
def gateway_process(
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    ready: Callable[[Gateway], bool] | None = None,
) -> Iterator[Gateway]:
    """Run ``python -m asgi_lifetime serve ARGV`` on a free loopback port until ``/healthz`` answers
    (and ``ready``, if given, holds); killed with its workers on exit."""
    port = free_port() if port is None else port
    handle = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "asgi_lifetime", "serve", "--port", str(port), "--log-level", "warning", *argv],
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=log.parent,
        env=clean_env(env),
        start_new_session=True,
    )
    gateway = Gateway(process, port, log)

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"{gateway.base}/healthz", timeout=2).status_code != 200:
                return False
        except httpx.TransportError:
            return False
        return ready is None or ready(gateway)

    try:
        eventually(up, seconds=STARTUP, what=f"the gateway on port {port} ready", every=0.1)
        yield gateway
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        handle.close()
