"""The retained outbound body, off the heap (``RETAIN_OUTBOUND=disk``).

Once retries settle, a retained body larger than ``RETAIN_SPILL_BYTES`` is copied to a
``tempfile.TemporaryFile`` in ``RETAIN_DIR`` and the in-memory copy is released: the
``Prepared`` holder keeps a ``SpilledBody`` instead, and a blind re-issue streams the body
back from the file in the slices the first send used. On Linux the file is opened with
``O_TMPFILE``, so it never has a name (elsewhere ``tempfile`` unlinks it right after creating
it): it is gone when it is closed, or when the process dies. Every file operation runs in a
worker thread, one slice at a time, so a cancelled request waits for one slice at most::

    held = resources.retain(len(prepared.body))
    await spill(prepared, held=held, resources=resources, directory=settings.retain_dir, ...)

The file's close is registered with the request's ``RequestResources`` as soon as the file is
open: that is its one release point, reached on every settlement path
(``Prepared.release_body()`` reaches it earlier at the end of a relay). A file that cannot be
opened or written (disk full, I/O error, a directory that is missing or read-only) leaves the
body in memory for that request: ``spill_failures`` is counted, a warning is logged (at most
one a minute), and the request goes on.

The body's pages then sit in the kernel's page cache, not in the process: no ``fdatasync``,
no ``posix_fadvise``. Measured (docs/operators.md): ``POSIX_FADV_DONTNEED`` right after the
write drops nothing (the pages are dirty) and starts writing them to the disk; without it, a
file closed before the kernel's writeback (``vm.dirty_expire_centisecs``, 30 s) never reaches
the disk at all, and under a container's memory limit the kernel writes back and reclaims
those pages itself.
"""

from __future__ import annotations

import io
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, TypeVar

import anyio
import anyio.to_thread

from .._resources import RequestResources, Resource
from .._stats import Counters
from ._memory import trim_after_large_request

if TYPE_CHECKING:
    from ._prepare import Prepared

__all__ = ["SLICE", "SpillClosed", "SpillFile", "SpilledBody", "spill"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

SLICE: Final = 1024 * 1024
"""Bytes per write, per read back, per piece sent upstream: the one slice size of the outbound body."""

_WARN_EVERY: Final = 60.0
"""Seconds between two warnings about failed spills (a full disk fails every request: one line a minute)."""


class SpillClosed(Exception):
    """The temporary file was closed (its request settled) before a read or write could start."""


class SpillFile:
    """An unlinked temporary file, read and written in worker threads and closed from the event loop.

    ``close()`` never closes the descriptor under a read or write that a worker thread is
    running: closed there, the number could be reused by another open in between and the
    pending call would then land in that other file (or socket). The running call closes it
    when it returns instead. The lock is held only to flip these flags, never across I/O, so
    ``close()`` never waits for a disk.
    """

    __slots__ = ("_file", "_lock", "_busy", "_closing")

    def __init__(self, file: io.FileIO) -> None:
        self._file = file
        self._lock = threading.Lock()
        self._busy = False
        self._closing = False

    @classmethod
    def open(cls, directory: str | None) -> SpillFile:
        """A new unlinked file in ``directory`` (None: the system temp dir); blocking, for a worker thread."""
        # Unbuffered: every write and read goes straight to the kernel, no second copy in a buffer.
        return cls(tempfile.TemporaryFile(dir=directory, buffering=0))

    @property
    def closed(self) -> bool:
        return self._closing

    def write(self, piece: memoryview) -> None:
        """Write all of ``piece`` at the end (worker thread); ``SpillClosed`` if the file was closed."""
        self._run(lambda file: _write_all(file, piece))

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (worker thread); ``SpillClosed`` if the file was closed."""
        return self._run(lambda file: _read_at(file, offset, size))

    def close(self) -> None:
        """Close now, or as soon as the running read or write returns. Idempotent; never blocks on I/O."""
        with self._lock:
            self._closing = True
            if not self._busy:
                self._file.close()

    def _run(self, operation: Callable[[io.FileIO], _T]) -> _T:
        with self._lock:
            if self._closing:
                raise SpillClosed
            self._busy = True
        try:
            return operation(self._file)
        finally:
            with self._lock:
                self._busy = False
                if self._closing:
                    self._file.close()


class SpilledBody:
    """A retained outbound body on disk, read back a slice at a time."""

    __slots__ = ("size", "_file", "_held")

    def __init__(self, file: SpillFile, size: int, held: tuple[Resource, ...]) -> None:
        self.size = size
        self._file = file
        self._held = held  # the file's close and its retained_disk_bytes: released together

    async def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer only at the end), read in a worker thread.

        Raises ``OSError`` if the file cannot be read, was closed, or ends before the body does.
        """
        end = min(self.size, offset + size)
        try:
            data = await anyio.to_thread.run_sync(self._file.read, offset, end - offset)
        except SpillClosed:
            raise OSError("the retained body's file is closed") from None
        if len(data) != end - offset:
            raise OSError(f"the retained body's file ended at {offset + len(data)} of {self.size} bytes")
        return data

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Close the file (its data is gone) and end its accounting. Idempotent."""
        for resource in self._held:
            resource.release_now()

    def __repr__(self) -> str:
        return f"<SpilledBody {self.size} bytes{' closed' if self.closed else ''}>"


def _write_all(file: io.FileIO, piece: memoryview) -> None:
    while piece:
        written = file.write(piece)
        if not written:  # a raw file reports a write it could not do as None or 0
            raise OSError("the retained body's file took no bytes")
        piece = piece[written:]


def _read_at(file: io.FileIO, offset: int, size: int) -> bytes:
    file.seek(offset)
    parts: list[bytes] = []
    while size > 0:
        part = file.read(size)
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def spill(
    prepared: Prepared,
    *,
    held: Resource,
    resources: RequestResources,
    directory: str | None,
    counters: Counters,
    malloc_trim: bool,
) -> bool:
    """Move ``prepared.body`` to an unlinked temporary file in ``directory`` (None: the system temp dir).

    ``held`` is the body's ``retained_input_bytes`` accounting: released once the body is on
    disk, where ``retained_disk_bytes`` counts it instead. Returns whether the body moved. A
    file that fails leaves the body in memory (see the module docstring); so does a request
    that settles (its resources are released) or is cancelled meanwhile, and its file is
    closed. Never raises but for cancellation.
    """
    body = prepared.body
    if body is None:
        return False
    try:
        # Shielded: a file opened in a thread that a cancellation then forgot would stay open.
        with anyio.CancelScope(shield=True):
            file = await anyio.to_thread.run_sync(SpillFile.open, directory)
    except Exception as exc:
        _failed(counters, directory, exc)
        return False
    try:
        closing = resources.add(file.close)  # the one release point of the file, on every settlement path
    except RuntimeError:  # the request settled while the file was being opened: nothing to keep
        file.close()
        return False
    size = len(body)
    try:
        written = await _write(file, (body,) if isinstance(body, bytes) else body.parts, counters, directory)
    except BaseException:
        closing.release_now()  # cancelled: the request is ending, its half-written file goes now
        raise
    if not written:
        closing.release_now()
        return False
    try:
        on_disk = resources.retain_on_disk(size)
    except RuntimeError:  # settled during the last write: the file is closed already
        return False
    prepared.spill_to(SpilledBody(file, size, (closing, on_disk)))
    held.release_now()
    counters.spilled += 1
    del body  # the holder was the other reference: the body is freed here
    # Below 32 MiB glibc may have put the body on the heap (its mmap threshold grows): give it back.
    trim_after_large_request(size, enabled=malloc_trim)
    return True


async def _write(
    file: SpillFile, parts: Sequence[bytes | memoryview], counters: Counters, directory: str | None
) -> bool:
    """Write ``parts`` (the body, or a spliced body's parts) to ``file`` a slice at a time, each in a
    worker thread; whether all of it was written."""
    for part in parts:
        view = memoryview(part)
        try:
            for offset in range(0, len(view), SLICE):
                await anyio.to_thread.run_sync(file.write, view[offset : offset + SLICE])
        except SpillClosed:  # the request settled meanwhile
            return False
        except Exception as exc:
            _failed(counters, directory, exc)
            return False
        finally:
            view.release()  # no export of ours left on the body, so the holder's release frees it
    return True


class _Warner:
    """Rate-limits the failed-spill warning, process wide (a full disk fails every request alike)."""

    __slots__ = ("last", "suppressed")

    def __init__(self) -> None:
        self.last: float | None = None
        self.suppressed = 0


_warner: Final = _Warner()


def _failed(counters: Counters, directory: str | None, exc: Exception) -> None:
    counters.spill_failures += 1
    now = time.monotonic()
    if _warner.last is not None and now - _warner.last < _WARN_EVERY:
        _warner.suppressed += 1
        return
    suppressed, _warner.suppressed, _warner.last = _warner.suppressed, 0, now
    logger.warning(
        "could not keep a retained outbound body on disk in %s (%s); it stays in memory for this request "
        "(RETAIN_OUTBOUND=disk; %d more failures since the last warning)",
        directory or tempfile.gettempdir(),
        (exc.strerror if isinstance(exc, OSError) else None) or exc,
        suppressed,
    )
