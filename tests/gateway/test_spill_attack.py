"""Attacks on RETAIN_OUTBOUND=disk tried after it landed; each held, and stays checked here.

- Real reachability, not only the counters: once the body is on disk no Python allocation of
  its size is alive any more (tracemalloc), for an unchanged, a changed and a spliced body; with
  RETAIN_OUTBOUND=memory the same probe finds the one retained body (the probe's control).
- Many requests spilling at once, ending by completion, client disconnect or an upstream error
  after the spill: every file closed, the process's descriptor count back where it was, idle.
"""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

import anyio
import httpx
import pytest

from asgi_lifetime import MiB
from asgi_lifetime.gateway._spill import SpillFile

from .._asgi import Connection
from .test_spill import ANSWER, BODY, SSE, WAIT, Answer, in_process, requesting, scope_for, until
from .test_spill import opened as opened  # a fixture: every spill file opened during the test

pytestmark = pytest.mark.anyio


class Digesting(httpx.AsyncBaseTransport):
    """An upstream that reads each request body as a network transport does and keeps only its digest."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.digests: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        digest = hashlib.sha256()
        async for chunk in request.stream:
            digest.update(chunk)
        self.digests.append(digest.hexdigest())
        index = int(request.headers.get("x-answer", len(self.digests) - 1))  # which answer, if the client says
        return httpx.Response(200, headers=SSE, stream=self.answers[index])


def large_blocks(threshold: int) -> list[int]:
    """Sizes of the Python allocations at least ``threshold`` bytes that are alive now."""
    snapshot = tracemalloc.take_snapshot()
    return sorted(trace.size for trace in snapshot.traces if trace.size >= threshold)


@pytest.mark.parametrize("change", ["unchanged", "changed", "spliced"])
@pytest.mark.parametrize("mode", ["disk", "memory"])
async def test_a_spilled_body_is_no_longer_in_the_process(mode: str, change: str, tmp_path: Path) -> None:
    # The accounting says retained_input_bytes 0 once the body is on disk: check the memory agrees,
    # i.e. no reference (the replay, the request's stream, a frame) keeps the body's bytes alive.
    # RETAIN_OUTBOUND=memory is the control: there the one retained body is what the probe finds.
    gate = anyio.Event()
    answer = Answer(gate, ANSWER)
    upstream = Digesting([answer])
    client = Connection(BODY)
    threshold = 2 * MiB  # the body is 2.5 MiB; every slice in flight (client, upstream, file) is 1 MiB at most
    tracemalloc.start()
    try:
        async with in_process(upstream, tmp_path, change=change, retain_outbound=mode) as app:
            lifetime = app.state.lifetime
            async with requesting(app, client):
                await until(lambda: answer.pulled and lifetime.stats().spilled == (mode == "disk"))
                stats = lifetime.stats()
                # The worker thread that wrote the last slice (disk), or that built the changed body
                # (memory), drops its reference just after handing back the result: the body it held goes
                # a moment later. What is still alive then stays until the stream ends (a retention would
                # time ``until`` out, and fail the test).
                await until(lambda: len(large_blocks(threshold)) == (0 if mode == "disk" else 1))
                alive = large_blocks(threshold)
                gate.set()
                await client.ended.wait()
                client.hang_up.set()
    finally:
        tracemalloc.stop()
    if mode == "disk":
        assert alive == []
        assert stats.retained_input_bytes == 0 and stats.retained_disk_bytes > len(BODY) // 2
    else:  # the probe sees the one retained body (its size plus the bytes object's header)
        # A spliced body's one large block is the received body it views (the message is a part of its own).
        size = len(BODY) if change == "spliced" else stats.retained_input_bytes
        assert len(alive) == 1 and 0 < alive[0] - size <= 64
    assert bytes(client.received) == ANSWER


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
async def test_many_concurrent_spills_leave_no_descriptor_behind(tmp_path: Path, opened: list[SpillFile]) -> None:
    # 12 requests spill at once; a third complete, a third lose their client mid-stream, a third
    # see the upstream fail after the spill. Afterwards: every file closed, no descriptor left, idle.
    count = 12
    gates = [anyio.Event() for _ in range(count)]
    answers = [Answer(gates[n], httpx.ReadError("reset by peer") if n % 3 == 2 else ANSWER) for n in range(count)]
    upstream = Digesting(answers)
    clients = [Connection(BODY) for _ in range(count)]
    async with in_process(upstream, tmp_path, max_inflight=count) as app:
        lifetime = app.state.lifetime
        before = open_descriptors()
        with anyio.fail_after(WAIT * 3):
            async with anyio.create_task_group() as tg:
                for n, client in enumerate(clients):
                    scope = scope_for(BODY)
                    scope["headers"].append((b"x-answer", str(n).encode()))
                    tg.start_soon(app, scope, client.receive, client.send)
                await until(lambda: lifetime.stats().spilled == count)
                assert len(opened) == count and not any(file.closed for file in opened)
                assert open_descriptors() >= before + count
                assert os.listdir(tmp_path) == []
                for n, client in enumerate(clients):
                    if n % 3 == 1:
                        client.hang_up.set()
                    else:
                        gates[n].set()
                for n, client in enumerate(clients):
                    if n % 3 != 1:
                        await client.ended.wait()
                        client.hang_up.set()
        await until(lambda: lifetime.stats().idle)
        assert all(file.closed and file._file.closed for file in opened)
        assert all(answer.closed for answer in answers)
        assert open_descriptors() == before
        stats = lifetime.stats()
        assert (stats.retained_input_bytes, stats.retained_disk_bytes) == (0, 0)
    assert [bytes(c.received) == ANSWER for n, c in enumerate(clients) if n % 3 == 0] == [True] * (count // 3)
