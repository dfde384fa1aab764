"""Real servers for the tests: the rule for a binary a test needs, ``redis-server``, and loopback
servers run in threads (``threaded_server`` for a hand-written TCP peer, ``hypercorn_in_thread``).

The real parts (``redis-server``, ``nginx``) come from Debian packages; ``.ci/run`` installs them
when they are missing. A test that needs one calls ``require_binary(name, apt_package)`` first:
under ``CI=true`` a missing binary fails the test (CI must not pass by skipping); elsewhere the
test is skipped with one line that says how to install it.

``redis_server()`` starts a private ``redis-server`` on a free loopback port, in a temporary
directory, without persistence, and stops it on exit::

    with redis_server() as redis:
        book = RedisSessionBook(redis.url, max_sessions=100)
        redis.kill()        # SIGKILL: the "Redis died" case
        redis.start()       # again, on the same port (empty: nothing was saved)

``threaded_server(handle)`` hands each connection it accepts to ``handle(sock, n)`` in a thread::

    with threaded_server(lambda sock, n: sock.close()) as url:
        ...                 # every connection to url is closed at once
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

__all__ = [
    "RedisServer",
    "free_port",
    "hypercorn_in_thread",
    "in_ci",
    "redis_ping",
    "redis_server",
    "require_binary",
    "threaded_server",
]

_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


def in_ci() -> bool:
    """True under CI (``CI=true``), where a missing real server is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_binary(name: str, apt_package: str) -> str:
    """The path of the executable ``name``; if it is missing, fail under ``CI=true``, else skip
    with a one-line reason saying how to install it (``apt_package`` is its Debian package)."""
    path = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.is_file() and os.access(p, os.X_OK)),
        None,
    )
    if path is not None:
        return path
    reason = f"{name} is not installed: apt-get install {apt_package} (bash .ci/run installs it)"
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextlib.contextmanager
def threaded_server(
    handle: Callable[[socket.socket, int], None], *, name: str = "loopback-server", join: float | None = None
) -> Iterator[str]:
    """A TCP server on a free loopback port, yielding its ``http://`` URL: each connection it accepts goes
    to ``handle(sock, n)`` (``n``: 0, 1, ... in the order accepted) in a daemon thread of its own.

    On exit it stops accepting and closes the listener; with ``join``, it then waits up to ``join``
    seconds for each connection's thread (a handler must end by itself: the test releases it first).
    """
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    listener.settimeout(0.05)  # how soon the accept loop sees ``stop``
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            number = len(threads)
            thread = threading.Thread(target=handle, args=(sock, number), name=f"{name}-{number}", daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, name=name, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        if join is not None:
            for thread in threads:
                thread.join(join)


@contextlib.contextmanager
def hypercorn_in_thread(app: Any, worker: str) -> Iterator[int]:
    """hypercorn serving ``app`` on a loopback socket bound here, in a thread running its own ``worker``
    event loop (asyncio or trio); yields the port. Connections queue until hypercorn accepts."""
    import hypercorn.asyncio
    import hypercorn.config
    import hypercorn.trio

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = hypercorn.config.Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]  # hypercorn closes the one it is given
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 1
    stop = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        async def shutdown_trigger() -> None:
            await anyio.to_thread.run_sync(stop.wait, abandon_on_cancel=True)

        serve = hypercorn.asyncio.serve if worker == "asyncio" else hypercorn.trio.serve
        await serve(app, config, shutdown_trigger=shutdown_trigger)

    def run() -> None:
        try:
            anyio.run(main, backend=worker)
        except BaseException as exc:  # reported when the test leaves
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"hypercorn-{worker}", daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(10)
        sock.close()
        # Async generators the app abandoned are finalized (and warned about, on trio) now,
        # in the test that left them, not whenever the collector next runs.
        gc.collect()
    assert not thread.is_alive(), "hypercorn did not stop"
    assert not failure, failure


@contextlib.contextmanager
def served(app: Any, server: str) -> Iterator[str]:
    """``app`` under ``server`` (``uvicorn-h11``, ``uvicorn-httptools``, ``hypercorn-asyncio``,
    ``hypercorn-trio``) on a loopback port; yields its base URL once startup has run."""
    from asgi_lifetime.testing import serve_in_thread  # uvicorn: imported by the tests that serve with it

    if server.startswith("uvicorn-"):
        with serve_in_thread(app, http=server.removeprefix("uvicorn-")) as url:
            yield url
    else:
        with hypercorn_in_thread(app, server.removeprefix("hypercorn-")) as port:
            yield f"http://127.0.0.1:{port}"


def redis_ping(port: int, *, timeout: float = 1.0) -> bool:
    """True if a Redis server on 127.0.0.1:``port`` answers ``PING`` (an inline command, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """A ``redis-server`` process of the tests: ``start()``, ``stop()``, ``kill()``, on one port."""

    binary: str
    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start it (again) on ``port`` and wait until it answers ``PING``."""
        if self.running:
            raise RuntimeError("redis-server is already running")
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 (the process writes it; closed below)
        with log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "yes",
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while not redis_ping(self.port, timeout=0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server did not answer on port {self.port}:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after a bound) and wait for the process."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Kill it at once (SIGKILL): what a crash looks like to its clients."""
        self._end(signal.SIGKILL)

    def _end(self, sig: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT)


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    """A private ``redis-server`` on a free loopback port, stopped (and its directory removed) on exit.

    Skips or fails as ``require_binary`` says when ``redis-server`` is not installed.
    """
    binary = require_binary("redis-server", "redis-server")
    with tempfile.TemporaryDirectory(prefix="asgi-lifetime-redis-") as directory:
        server = RedisServer(binary, Path(directory))
        for attempt in range(3):  # the free port may be taken between choosing it and binding it
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                server.port = free_port()
        try:
            yield server
        finally:
            server.stop()
