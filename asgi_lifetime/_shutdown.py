"""Process-wide shutdown signal, from the server's signal handler to the gateway apps.

uvicorn only tells an app about shutdown through lifespan, and that comes *after* open
connections have finished or been cut. To drain gracefully (stop admitting, let streams
finish up to ``SHUTDOWN_GRACE``, then end them with an in-band error) the gateway must
know the moment the signal arrives. The CLI's server calls ``request_shutdown()`` from
its signal handling; every gateway app in the process watches ``shutdown_requested()``.
Signals are process-wide, so this flag is too (and a ``threading.Event`` because signal
handlers and event loops may run in different threads).
"""

from __future__ import annotations

import threading

__all__ = ["request_shutdown", "reset_shutdown", "shutdown_requested"]

_requested = threading.Event()


def request_shutdown() -> None:
    """Ask every gateway in this process to start draining. Safe from signal handlers."""
    _requested.set()


def shutdown_requested() -> bool:
    return _requested.is_set()


def reset_shutdown() -> None:
    """Clear the flag (tests, or an embedding that restarts a server in-process)."""
    _requested.clear()
