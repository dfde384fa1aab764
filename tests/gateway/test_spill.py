"""RETAIN_OUTBOUND=disk: the retained outbound body moves to an unlinked temporary file once retries settle.

Issue 12, part 1. Before, every in-flight stream held its whole outbound body in RAM for one
blind re-issue. Now a body above RETAIN_SPILL_BYTES is written to a file in RETAIN_DIR that
never has a name, the in-memory copy is released, and a re-issue streams it back from the file.
Checked here:

- ``spill()`` and ``SpillFile`` on their own: the body is read back byte for byte, accounting
  moves from ``retained_input_bytes`` to ``retained_disk_bytes``, and the file is closed by the
  request's resources; a file that cannot be opened or written (missing or read-only directory,
  a full disk, an I/O error) leaves the body in memory, counted and warned about (rate-limited);
  cancellation and settlement during the write close the file, and a close never lands under a
  read or write running in a worker thread;
- the gateway in process, on asyncio and trio: a starved stream is re-issued from disk with the
  identical bytes (the upstream records both attempts' bodies), no file name ever appears in
  RETAIN_DIR, and every spill file is closed on success, upstream error, client disconnect and
  cancellation; below the threshold, with ``memory`` and with ``off`` nothing goes to disk;
- the gateway under uvicorn on real sockets: the same re-issue from disk, for an unchanged body, a
  changed (re-serialized) one and one with a message spliced in (written part by part, not joined);
  a RETAIN_DIR that does not exist degrades to memory; a file that fails while the
  re-issue reads it back ends the stream with ``upstream_starved``, never a crash.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from anyio.abc import TaskGroup
from starlette.types import Scope

from asgi_lifetime import LifetimeSettings, MiB
from asgi_lifetime._resources import RequestResources
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway import _spill, create_app
from asgi_lifetime.gateway._prepare import Draft, Prepared, Preparer, without_parse
from asgi_lifetime.gateway._spill import SLICE, SpillClosed, SpilledBody, SpillFile, spill
from asgi_lifetime.testing._serve import serve_in_thread

from .._asgi import Connection, json_scope
from ..reliability.test_faults import Stack, assert_idle, eventually
from ._raw_upstream import RawRequest, RawUpstream, chunked, raw_upstream
from .test_relay_events import STREAMS, render

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
ANSWER = render(STREAMS["chat"][0])  # a whole chat completion stream, [DONE] included
SSE = {"content-type": "text/event-stream"}
WAIT = 20.0  # generous bound on every wait for the gateway (a shared, busy machine)


def conversation(size: int) -> bytes:
    """A chat request of about ``size`` bytes, in turns of 16 KiB."""
    turn = "x" * (16 * 1024)
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": f"{n} {turn}"} for n in range(size // 16400)]
    return json.dumps({"model": "m", "stream": True, "messages": messages}).encode()


BODY = conversation(int(2.5 * MiB))  # three slices on disk


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[SpillFile]:
    """Every spill file opened during the test (checked closed at the end of each one)."""
    files: list[SpillFile] = []
    real = SpillFile.open.__func__  # type: ignore[attr-defined]

    def recording(cls: type[SpillFile], directory: str | None) -> SpillFile:
        file: SpillFile = real(cls, directory)
        files.append(file)
        return file

    monkeypatch.setattr(SpillFile, "open", classmethod(recording))
    return files


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no failed-spill warning logged yet (the limiter is process wide)."""
    monkeypatch.setattr(_spill, "_warner", _spill._Warner())


def settled(body: bytes) -> Prepared:
    prepared = Prepared(method="POST", path=PATH, headers=[], body=body)
    prepared.settle(retain_outbound=True)
    return prepared


async def read_back(spilled: SpilledBody) -> bytes:
    pieces = []
    for offset in range(0, spilled.size, SLICE):
        pieces.append(await spilled.read(offset, SLICE))
    return b"".join(pieces)


# --- spill() and SpillFile on their own --------------------------------------------------------------------


async def test_spill_moves_the_body_to_an_unnamed_file_and_reads_it_back(
    tmp_path: Path, opened: list[SpillFile]
) -> None:
    counters = Counters()
    body = os.urandom(SLICE * 2 + 12345)
    prepared = settled(body)
    async with RequestResources(counters) as resources:
        held = resources.retain(len(body))
        moved = await spill(
            prepared, held=held, resources=resources, directory=str(tmp_path), counters=counters, malloc_trim=True
        )
        assert moved and prepared.body is None and prepared.spilled is not None
        assert prepared.has_body and prepared.body_size == len(body)
        assert os.listdir(tmp_path) == []  # the file never has a name
        status = os.fstat(opened[0]._file.fileno())
        assert status.st_nlink == 0 and status.st_mode & 0o777 == 0o600  # no link to it; the process's own
        assert (counters.retained_input_bytes, counters.retained_disk_bytes) == (0, len(body))
        assert (counters.spilled, counters.spill_failures) == (1, 0)
        assert await read_back(prepared.spilled) == body
        assert await prepared.spilled.read(len(body) - 5, SLICE) == body[-5:]  # the last slice is short
        spilled = prepared.spilled
    assert spilled.closed  # closed by the request's resources: its one release point
    assert counters.snapshot().idle


async def test_release_body_closes_the_file_early(tmp_path: Path) -> None:
    counters = Counters()
    prepared = settled(b"y" * 1000)
    async with RequestResources(counters) as resources:
        await spill(
            prepared,
            held=resources.retain(1000),
            resources=resources,
            directory=str(tmp_path),
            counters=counters,
            malloc_trim=False,
        )
        spilled = prepared.spilled
        assert spilled is not None and "on disk" in repr(prepared)
        prepared.release_body()
        assert spilled.closed and not prepared.has_body and prepared.body_size == 0
        assert counters.retained_disk_bytes == 0 and counters.live_resources == 0
        prepared.release_body()  # idempotent
        with pytest.raises(OSError, match="closed"):
            await spilled.read(0, 10)


async def test_only_a_settled_body_moves_to_disk(tmp_path: Path) -> None:
    prepared = Prepared(method="POST", path=PATH, headers=[], body=b"x")
    file = SpillFile.open(str(tmp_path))
    with pytest.raises(RuntimeError, match="settled"):
        prepared.spill_to(SpilledBody(file, 1, ()))
    file.close()
    assert prepared.body == b"x" and prepared.spilled is None


def _enospc_on_slice(number: int) -> Callable[[io.FileIO, memoryview], None]:
    calls = []
    real = _spill._write_all

    def write(file: io.FileIO, piece: memoryview) -> None:
        calls.append(len(piece))
        if len(calls) == number:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(file, piece)

    return write


def _eio(file: io.FileIO, piece: memoryview) -> None:
    raise OSError(errno.EIO, "Input/output error")


def _read_only(cls: type[SpillFile], directory: str | None) -> SpillFile:
    raise OSError(errno.EROFS, "Read-only file system")


@pytest.mark.parametrize(
    "failure", ["missing-dir", "not-a-dir", "read-only", "full-on-first-slice", "full-on-last-slice", "io-error"]
)
async def test_a_failing_disk_keeps_the_body_in_memory(
    failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile], caplog: Any
) -> None:
    directory = str(tmp_path)
    if failure == "missing-dir":
        directory = str(tmp_path / "gone")
    elif failure == "not-a-dir":
        (tmp_path / "file").write_bytes(b"")
        directory = str(tmp_path / "file")
    elif failure == "read-only":
        monkeypatch.setattr(SpillFile, "open", classmethod(_read_only))
    elif failure == "full-on-first-slice":
        monkeypatch.setattr(_spill, "_write_all", _enospc_on_slice(1))
    elif failure == "full-on-last-slice":
        monkeypatch.setattr(_spill, "_write_all", _enospc_on_slice(3))
    else:
        monkeypatch.setattr(_spill, "_write_all", _eio)
    counters = Counters()
    body = b"z" * (2 * SLICE + 1)
    prepared = settled(body)
    caplog.set_level(logging.WARNING, logger=_spill.__name__)
    async with RequestResources(counters) as resources:
        moved = await spill(
            prepared,
            held=resources.retain(len(body)),
            resources=resources,
            directory=directory,
            counters=counters,
            malloc_trim=True,
        )
        assert not moved and prepared.body is body and prepared.spilled is None
        assert (counters.retained_input_bytes, counters.retained_disk_bytes) == (len(body), 0)
        assert (counters.spilled, counters.spill_failures) == (0, 1)
        assert all(file.closed for file in opened)  # a half-written file is closed at once
    assert counters.snapshot().idle
    assert os.listdir(tmp_path) in ([], ["file"])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stays in memory" in warnings[0].getMessage()
    assert "z" * 20 not in caplog.text  # never a body in the log


async def test_failure_warnings_are_rate_limited(tmp_path: Path, caplog: Any) -> None:
    counters = Counters()
    caplog.set_level(logging.WARNING, logger=_spill.__name__)
    async with RequestResources(counters) as resources:
        for _ in range(5):
            await spill(
                settled(b"b" * 10),
                held=resources.retain(10),
                resources=resources,
                directory=str(tmp_path / "gone"),
                counters=counters,
                malloc_trim=False,
            )
    assert counters.spill_failures == 5
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


class _Blocking:
    """A write that blocks its worker thread on the second slice until ``go`` is set."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self.real = _spill._write_all

    def __call__(self, file: io.FileIO, piece: memoryview) -> None:
        self.calls += 1
        if self.calls == 2:
            self.started.set()
            if not self.go.wait(WAIT):
                raise AssertionError("the test never released the write")
            assert not file.closed, "the descriptor was closed under a running write"
        self.real(file, piece)


async def test_cancelled_during_the_write_closes_the_file_and_keeps_the_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile]
) -> None:
    blocking = _Blocking()
    monkeypatch.setattr(_spill, "_write_all", blocking)
    counters = Counters()
    body = b"c" * (3 * SLICE)
    prepared = settled(body)
    async with RequestResources(counters) as resources:
        held = resources.retain(len(body))
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: spill(
                    prepared, held=held, resources=resources, directory=str(tmp_path), counters=counters,
                    malloc_trim=False,
                )
            )  # fmt: skip
            assert await anyio.to_thread.run_sync(blocking.started.wait, WAIT)
            tg.cancel_scope.cancel()
            blocking.go.set()  # the slice in the worker thread finishes; then the cancellation lands
        assert len(opened) == 1 and opened[0].closed
        assert prepared.body is body and prepared.spilled is None
        assert (counters.spilled, counters.spill_failures, counters.retained_disk_bytes) == (0, 0, 0)
    assert counters.snapshot().idle


async def test_settling_during_the_write_closes_the_file_after_the_running_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile]
) -> None:
    blocking = _Blocking()
    monkeypatch.setattr(_spill, "_write_all", blocking)
    counters = Counters()
    prepared = settled(b"s" * (3 * SLICE))
    resources = RequestResources(counters)
    result: list[bool] = []

    async def run() -> None:
        held = resources.retain(3 * SLICE)
        result.append(
            await spill(
                prepared, held=held, resources=resources, directory=str(tmp_path), counters=counters,
                malloc_trim=False,
            )
        )  # fmt: skip

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        assert await anyio.to_thread.run_sync(blocking.started.wait, WAIT)
        await resources.aclose()  # the request settles while a worker thread writes
        assert opened[0].closed  # closed as far as anyone can see; the descriptor waits for the write
        blocking.go.set()
    assert result == [False] and prepared.spilled is None
    assert opened[0]._file.closed  # and the running write closed it when it returned
    assert counters.snapshot().idle and counters.spill_failures == 0


def test_a_close_never_lands_under_a_running_read(tmp_path: Path) -> None:
    file = SpillFile.open(str(tmp_path))
    file.write(memoryview(b"abc"))
    inside, go = threading.Event(), threading.Event()
    seen: list[bool] = []

    def slow_read(raw: io.FileIO) -> bytes:
        inside.set()
        go.wait(WAIT)
        seen.append(raw.closed)  # the descriptor is still this file's while the call runs
        return b"read"

    reader = threading.Thread(target=lambda: seen.append(file._run(slow_read) == b"read"))
    reader.start()
    assert inside.wait(WAIT)
    file.close()  # returns at once: the descriptor stays open for the running read
    assert file.closed and not file._file.closed
    go.set()
    reader.join(WAIT)
    assert seen == [False, True] and file._file.closed
    with pytest.raises(SpillClosed):
        file.read(0, 1)
    file.close()  # idempotent


async def test_a_file_shorter_than_the_body_is_an_oserror(tmp_path: Path) -> None:
    file = SpillFile.open(str(tmp_path))
    file.write(memoryview(b"short"))
    spilled = SpilledBody(file, 100, ())
    with pytest.raises(OSError, match="ended at 5 of 100"):
        await spilled.read(0, 100)
    file.close()


# --- the gateway in process (asyncio and trio) ----------------------------------------------------------


class Answer(httpx.AsyncByteStream):
    """An upstream answer: waits for ``gate``, then ``tail`` (bytes, or an exception to raise)."""

    def __init__(self, gate: anyio.Event | None, tail: bytes | Exception) -> None:
        self.gate = gate
        self.tail: bytes | Exception | None = tail
        self.closed = False
        self.pulled = False  # the relay is reading it: retries are settled, the relay has begun

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> bytes:
        self.pulled = True
        if self.gate is not None:
            await self.gate.wait()
            self.gate = None
        tail, self.tail = self.tail, None
        if isinstance(tail, Exception):
            raise tail
        if not tail:
            raise StopAsyncIteration
        return tail

    async def aclose(self) -> None:
        self.closed = True


class Recording(httpx.AsyncBaseTransport):
    """An upstream that reads each request body as a network transport does and records it."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        body = bytearray()
        async for chunk in request.stream:
            body += chunk
        self.bodies.append(bytes(body))
        return httpx.Response(200, headers=SSE, stream=self.answers[len(self.bodies) - 1])


def scope_for(body: bytes) -> Scope:
    return json_scope(body, PATH, state={})


def rename_model(draft: Draft) -> None:
    draft.body["model"] = "routed"
    draft.mark_changed()


@without_parse
def insert_system(draft: Draft) -> None:
    assert draft.conversation is not None
    draft.conversation.prepend({"role": "system", "content": "spliced"})


# The outbound body: as received, re-serialized from the parse, or a ``Spliced`` body (views of the received bytes).
PREPARERS: dict[str, list[Preparer]] = {"unchanged": [], "changed": [rename_model], "spliced": [insert_system]}


def assert_sent_as(change: str, body: bytes) -> None:
    """``body`` is what the upstream should get for ``BODY`` after the ``change`` preparer."""
    doc = json.loads(BODY)
    if change == "changed":
        doc["model"] = "routed"
    elif change == "spliced":
        doc["messages"].insert(0, {"role": "system", "content": "spliced"})
    assert json.loads(body) == doc
    assert (body == BODY) == (change == "unchanged")


async def until(condition: Callable[[], bool]) -> None:
    await eventually(condition, seconds=WAIT)


@contextlib.asynccontextmanager
async def in_process(
    upstream: httpx.AsyncBaseTransport, tmp_path: Path, *, change: str = "unchanged", **changes: Any
) -> Any:
    settings = LifetimeSettings(
        upstream_url=("http://upstream.test",),
        retain_dir=str(tmp_path),
        stall_timeout=WAIT,
        keepalive_interval=WAIT,
        **changes,
    )
    app = create_app(settings, transport=upstream, preparers=PREPARERS[change])
    try:
        yield app
    finally:
        await app.state.upstream.aclose()


@contextlib.asynccontextmanager
async def requesting(app: Any, client: Connection) -> AsyncIterator[TaskGroup]:
    """``client``'s request in flight to ``app``, run in the task group yielded; all of it within WAIT."""
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, scope_for(client.body), client.receive, client.send)
            yield tg


@pytest.mark.parametrize("change", list(PREPARERS))
async def test_a_starved_stream_is_reissued_from_disk_with_the_identical_bytes(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile]
) -> None:
    reads: list[int] = []
    real_read = SpilledBody.read

    async def counting_read(self: SpilledBody, offset: int, size: int) -> bytes:
        reads.append(offset)
        return await real_read(self, offset, size)

    monkeypatch.setattr(SpilledBody, "read", counting_read)
    gate = anyio.Event()
    upstream = Recording([Answer(gate, b""), Answer(None, ANSWER)])  # the first stream ends with no event
    client = Connection(BODY)
    async with in_process(upstream, tmp_path, change=change) as app:
        lifetime = app.state.lifetime
        async with requesting(app, client):
            await until(lambda: lifetime.stats().spilled == 1)
            # Streaming (the first answer is held open): the body is on disk, under no name.
            stats = lifetime.stats()
            outbound = len(upstream.bodies[0])
            assert (stats.retained_input_bytes, stats.retained_disk_bytes) == (0, outbound)
            assert os.listdir(tmp_path) == []
            gate.set()  # the first stream ends without an event: starved, re-issued
            await client.ended.wait()
            client.hang_up.set()
    assert len(upstream.bodies) == 2 and upstream.bodies[1] == upstream.bodies[0]
    assert_sent_as(change, upstream.bodies[0])
    assert reads == list(range(0, outbound, SLICE))  # streamed back from the file, one slice at a time
    assert client.status == 200 and bytes(client.received) == ANSWER
    stats = lifetime.stats()
    assert stats.idle and stats.retried == 1 and stats.starved == 1
    assert len(opened) == 1 and opened[0].closed


@pytest.mark.parametrize("ending", ["complete", "upstream_error", "client_disconnect", "cancelled"])
async def test_the_file_is_closed_on_every_settlement_path(
    ending: str, tmp_path: Path, opened: list[SpillFile]
) -> None:
    gate = anyio.Event()
    tail: bytes | Exception = httpx.ReadError("reset by peer") if ending == "upstream_error" else ANSWER
    answer = Answer(gate, tail)
    upstream = Recording([answer, Answer(None, ANSWER)])
    client = Connection(BODY)
    async with in_process(upstream, tmp_path) as app:
        lifetime = app.state.lifetime
        async with requesting(app, client) as tg:
            await until(lambda: lifetime.stats().spilled == 1)
            assert len(opened) == 1 and not opened[0].closed and os.listdir(tmp_path) == []
            if ending == "client_disconnect":
                client.hang_up.set()
            elif ending == "cancelled":
                tg.cancel_scope.cancel()
            else:
                gate.set()
                await client.ended.wait()
                client.hang_up.set()
        await until(lambda: lifetime.stats().idle)
    assert opened[0].closed and opened[0]._file.closed
    assert answer.closed
    assert len(upstream.bodies) == 1  # none of these endings is a re-issue
    if ending == "complete":
        assert bytes(client.received) == ANSWER
    elif ending == "upstream_error":  # nothing was sent yet: the error is the whole response
        assert client.status == 502 and b'"code":"bad_gateway"' in client.received


@pytest.mark.parametrize(
    ("changes", "retained_in_memory"),
    [
        pytest.param({"retain_spill_bytes": 4 * MiB}, True, id="below-RETAIN_SPILL_BYTES"),
        pytest.param({"retain_outbound": "memory"}, True, id="memory"),
        pytest.param({"retain_outbound": "off"}, False, id="off"),
    ],
)
async def test_nothing_goes_to_disk_below_the_threshold_or_without_disk(
    changes: dict[str, Any], retained_in_memory: bool, tmp_path: Path, opened: list[SpillFile]
) -> None:
    gate = anyio.Event()
    first = Answer(gate, b"")
    upstream = Recording([first, Answer(None, ANSWER)])
    client = Connection(BODY)
    async with in_process(upstream, tmp_path, **changes) as app:
        lifetime = app.state.lifetime
        async with requesting(app, client):
            await until(lambda: first.pulled)
            stats = lifetime.stats()  # streaming: the relay waits for the first answer
            assert stats.retained_input_bytes == (len(BODY) if retained_in_memory else 0)
            assert (stats.retained_disk_bytes, stats.spilled) == (0, 0)
            gate.set()
            await client.ended.wait()
            client.hang_up.set()
    assert opened == []
    # Kept (in memory): re-issued with the same bytes. Off: the starved stream ends with an error event.
    assert upstream.bodies == ([BODY, BODY] if retained_in_memory else [BODY])
    assert (bytes(client.received) == ANSWER) is retained_in_memory
    assert lifetime.stats().idle


async def test_a_full_disk_reissues_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile], caplog: Any
) -> None:
    monkeypatch.setattr(_spill, "_write_all", _enospc_on_slice(2))
    caplog.set_level(logging.WARNING, logger=_spill.__name__)
    gate = anyio.Event()
    upstream = Recording([Answer(gate, b""), Answer(None, ANSWER)])
    client = Connection(BODY)
    async with in_process(upstream, tmp_path) as app:
        lifetime = app.state.lifetime
        async with requesting(app, client):
            await until(lambda: lifetime.stats().spill_failures == 1)
            stats = lifetime.stats()
            assert (stats.retained_input_bytes, stats.retained_disk_bytes) == (len(BODY), 0)
            assert opened[0].closed
            gate.set()
            await client.ended.wait()
            client.hang_up.set()
    assert upstream.bodies == [BODY, BODY] and bytes(client.received) == ANSWER
    assert lifetime.stats().idle
    assert "No space left on device" in caplog.text


# --- the gateway under uvicorn, real sockets ------------------------------------------------------------


@contextlib.contextmanager
def gated_upstream() -> Iterator[tuple[RawUpstream, threading.Event]]:
    """A raw socket upstream: the first request's stream opens, waits for the gate, then ends with no
    event (starved); every later request gets a whole chat stream. Records every request's body."""
    gate = threading.Event()

    def answer(request: RawRequest) -> Any:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        if request.method == "POST" and len(upstream.requests) == 1:
            yield head  # steps are produced as they are sent: the stream is open while the gate is shut
            gate.wait(WAIT)
            yield b"0\r\n\r\n"
        else:
            yield head + chunked(ANSWER, size=4096)

    with raw_upstream(answer) as upstream:
        yield upstream, gate


@contextlib.contextmanager
def served(upstream_url: str, retain_dir: str, *, change: str = "unchanged") -> Iterator[Stack]:
    settings = LifetimeSettings(
        upstream_url=(upstream_url,), retain_dir=retain_dir, stall_timeout=WAIT, keepalive_interval=WAIT
    )
    app = create_app(settings, preparers=PREPARERS[change])
    with serve_in_thread(app) as url:
        yield Stack(app=app, url=url, upstream_url=upstream_url)


async def post_and_release(stack: Stack, gate: threading.Event, condition: Callable[[], bool]) -> httpx.Response:
    """POST the conversation; once ``condition`` holds (the first answer is open, nothing sent to the
    client yet), let the first answer end; return the response, read."""

    async def release() -> None:
        await eventually(condition, seconds=WAIT)
        gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release)
        async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT) as client:
            response = await client.post(PATH, content=BODY, headers={"content-type": "application/json"})
    return response


@pytest.mark.parametrize("change", list(PREPARERS))
async def test_socket_reissue_from_disk_sends_the_identical_bytes(
    change: str, tmp_path: Path, opened: list[SpillFile]
) -> None:
    with gated_upstream() as (upstream, gate), served(upstream.url, str(tmp_path), change=change) as stack:

        def on_disk() -> bool:
            stats = stack.stats()
            return stats["spilled"] == 1 and stats["retained_disk_bytes"] > 0 and os.listdir(tmp_path) == []

        response = await post_and_release(stack, gate, on_disk)
        stats = await assert_idle(stack.app, stack.url)
    assert response.status_code == 200 and response.content == ANSWER
    first, second = (request.body for request in upstream.requests)
    assert first == second
    assert_sent_as(change, first)
    assert stats["retried"] == 1 and stats["retained_disk_bytes"] == 0
    assert len(opened) == 1 and opened[0].closed


async def test_socket_missing_retain_dir_degrades_to_memory(
    tmp_path: Path, opened: list[SpillFile], caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger=_spill.__name__)
    with gated_upstream() as (upstream, gate), served(upstream.url, str(tmp_path / "gone")) as stack:
        response = await post_and_release(stack, gate, lambda: stack.stats()["spill_failures"] == 1)
        stats = await assert_idle(stack.app, stack.url)
    assert response.status_code == 200 and response.content == ANSWER  # never failed: re-issued from memory
    assert [request.body for request in upstream.requests] == [BODY, BODY]
    assert (stats["spilled"], stats["spill_failures"]) == (0, 1)
    assert opened == [] and "stays in memory" in caplog.text


async def test_socket_a_file_failing_during_the_reissue_ends_with_upstream_starved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opened: list[SpillFile]
) -> None:
    async def failing_read(self: SpilledBody, offset: int, size: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(SpilledBody, "read", failing_read)
    with gated_upstream() as (upstream, gate), served(upstream.url, str(tmp_path)) as stack:
        response = await post_and_release(stack, gate, lambda: stack.stats()["spilled"] == 1)
        stats = await assert_idle(stack.app, stack.url)
    # Nothing had reached the client: the error is the whole response, in the OpenAI shape.
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_starved"
    assert [request.body for request in upstream.requests] == [BODY]  # the re-issue never got its body out
    assert stats["starved"] == 1 and len(opened) == 1 and opened[0].closed
