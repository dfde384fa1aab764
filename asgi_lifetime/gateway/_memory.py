"""Give the heap back to the OS after a large request settles (glibc only).

A parsed request is many small blocks (strings of a few KiB, dicts, lists) below glibc's
mmap threshold, so they come from the heap. Freeing them makes the memory reusable but
glibc returns it to the OS only from the top of the heap, and only past its trim
threshold: a 64 MiB conversation, freed, stays in RSS (about 2-3x the body, see
docs/benchmarks.md). ``malloc_trim(0)`` releases the free pages anywhere in the heap; it
takes milliseconds, so it runs only once ``TRIM_THRESHOLD`` bytes of requests have settled
since the last trim (one large request, or several smaller ones: 16 agents re-posting 4 MiB
conversations otherwise never trimmed, and the heap kept what their overlapping parses needed),
and only if the ``MALLOC_TRIM`` setting is on (every caller passes it)::

    held.release()                                                    # the parse and the raw body are gone
    trim_after_large_request(len(raw), enabled=settings.malloc_trim)  # and their pages go back to the OS

The gateway calls it at the settle point (``_gateway._Input.release``) and again at the end
of a request whose retained outbound body it released: below 32 MiB, glibc's mmap threshold
(which rises to the size of any mmapped block freed) may have put that body on the heap.
``prepare()`` calls it every ``TRIM_THRESHOLD`` bytes while it serializes a large changed body.

Elsewhere (macOS, musl, Windows) ``trim_after_large_request`` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import Final

__all__ = ["TRIM_THRESHOLD", "trim_after_large_request"]

logger = logging.getLogger(__name__)

TRIM_THRESHOLD: Final = 8 * 1024 * 1024
"""Bytes of settled requests worth one trim: below it their blocks are reused by the next ones."""

# Bytes settled since the last trim, in this process (the heap is the process's).
_settled = 0


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # glibc answers "glibc 2.36"; musl has no such name
            return None
        function = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, ValueError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    trim: Callable[[int], int] = function
    return trim


_malloc_trim: Final = _load_malloc_trim()


def trim_after_large_request(nbytes: int, *, enabled: bool) -> bool:
    """After a request of ``nbytes`` released its input: return free heap pages to the OS once
    ``TRIM_THRESHOLD`` bytes have settled since the last trim.

    Does nothing (and returns False) when not ``enabled`` (the ``MALLOC_TRIM`` setting: a
    required keyword, so no caller can trim past it), below the threshold or where glibc's
    ``malloc_trim`` is not available. Never raises.
    """
    global _settled
    if not enabled or _malloc_trim is None:
        return False
    _settled += nbytes
    if _settled < TRIM_THRESHOLD:
        return False
    _settled = 0
    try:
        _malloc_trim(0)
    except Exception:  # a foreign call: never let it break a request's settlement
        logger.debug("malloc_trim failed", exc_info=True)
        return False
    return True
