"""Run an ASGI app under real uvicorn on a loopback port, in a background thread.

uvicorn only runs on asyncio, so the server gets its own thread and event loop; the caller may
be synchronous, asyncio or trio. Used by the demo command, the end-to-end tests, the fault
matrix and the benchmarks::

    with serve_in_thread(create_demo_upstream()) as base_url:
        httpx.get(f"{base_url}/healthz")
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from .._settings import check_argument, positive

__all__ = ["serve_in_thread"]

logger = logging.getLogger(__name__)

_POLL_INTERVAL = 0.005


@contextmanager
def serve_in_thread(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 10.0,
    **uvicorn_options: Any,
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a daemon thread; yield its base URL (``http://127.0.0.1:PORT``).

    The socket is bound here (``port=0`` picks a free port), so the URL is known before the
    server starts. Entering waits until uvicorn reports ``started`` (lifespan startup done);
    a failed startup, or none within ``startup_timeout`` seconds, raises ``RuntimeError``.
    Leaving asks uvicorn to exit (graceful, then forced) and waits up to ``shutdown_timeout``
    seconds for the thread; a server that does not stop raises ``RuntimeError``.

    ``uvicorn_options`` go to ``uvicorn.Config``. Defaults differ from uvicorn's in three ways:
    ``log_level="warning"``, ``log_config=None`` (the host's logging setup is left alone) and
    ``timeout_graceful_shutdown=1`` (in-flight responses get one second on exit).
    """
    check_argument("startup_timeout", startup_timeout, positive)
    check_argument("shutdown_timeout", shutdown_timeout, positive)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # accepted sockets inherit it. Without it Nagle holds back each small write until the peer's
    # delayed ACK (40 ms on Linux): every response took at least 40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        bound_port: int = sock.getsockname()[1]
        options: dict[str, Any] = {
            "log_level": "warning",
            "log_config": None,
            "lifespan": "auto",
            "timeout_graceful_shutdown": 1,
            **uvicorn_options,
        }
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=bound_port, **options))
        failure: list[BaseException] = []

        def run() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # SystemExit on startup failure; kept for the caller
                failure.append(exc)

        thread = threading.Thread(target=run, name=f"asgi-lifetime-serve-{bound_port}", daemon=True)
        thread.start()
        try:
            _wait_started(server, thread, failure, startup_timeout)
            url_host = f"[{host}]" if family == socket.AF_INET6 else host
            yield f"http://{url_host}:{bound_port}"
        except BaseException:
            _stop(server, thread, shutdown_timeout, strict=False)  # do not mask the original error
            raise
        _stop(server, thread, shutdown_timeout, strict=True)
    finally:
        sock.close()


def _wait_started(
    server: uvicorn.Server, thread: threading.Thread, failure: list[BaseException], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            cause = failure[0] if failure else None
            raise RuntimeError("uvicorn failed to start (see its log for the cause)") from cause
        if time.monotonic() >= deadline:
            raise RuntimeError(f"uvicorn did not start within {timeout} s")
        time.sleep(_POLL_INTERVAL)


def _stop(server: uvicorn.Server, thread: threading.Thread, timeout: float, *, strict: bool) -> None:
    server.should_exit = True
    thread.join(timeout / 2)
    if thread.is_alive():
        logger.warning("uvicorn did not exit within %s s; forcing exit", timeout / 2)
        server.force_exit = True
        thread.join(timeout / 2)
    if thread.is_alive():
        message = f"uvicorn thread {thread.name} did not stop within {timeout} s"
        if strict:
            raise RuntimeError(message)
        logger.warning("%s; leaving the daemon thread behind", message)
