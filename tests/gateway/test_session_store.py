"""The session book shared through Redis (``SESSION_STORE=redis://...``), against a real ``redis-server``.

Each test starts its own ``redis-server`` on a free loopback port (``tests/_servers.py``): under
``CI=true`` a missing binary fails, elsewhere these tests skip saying how to install it.

redis-py's asyncio client runs on asyncio only, so the tests that talk to Redis run on asyncio;
the trio cases check the book's documented fallback (one warning, the metric, the in-memory book).
Several books in one process stand for several replicas: each has its own connections and task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import httpx
import pytest
import respx
from redis.asyncio import Redis

from asgi_lifetime import Lifetime, LifetimeSettings
from asgi_lifetime._fingerprint import Fingerprint
from asgi_lifetime.gateway import RedisSessionBook, SessionBook, _session_store, create_app
from asgi_lifetime.gateway._bookkeeping import Outcome, StoreState, session_key
from asgi_lifetime.gateway._session_store import entry_key, leases_key, make_session_book

from .._servers import RedisServer, free_port, redis_server, require_binary
from ..reliability.test_faults import CHAT, PATH, assert_idle, running

pytestmark = pytest.mark.anyio

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout, for a replica in a child process

# redis-py's client needs asyncio: the tests that talk to Redis run there only (trio: see the fallback tests).
ASYNCIO = pytest.mark.parametrize("anyio_backend", ["asyncio"])
LOGGER = "asgi_lifetime.gateway._session_store"
WAIT = 10.0  # the bound on every wait for a condition; conditions are met long before it


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as running_server:
        yield running_server


def fp(tag: str) -> Fingerprint:
    return Fingerprint(wire_hash=(tag * 64)[:64], text_comparable=True, size=42)


def outcome(session_id: str | None, tag: str = "a", *, bytes_out: int = 7) -> Outcome:
    now = time.monotonic()
    return Outcome(
        fingerprint=fp(tag),
        session_id=session_id,
        path=PATH,
        status=200,
        bytes_out=bytes_out,
        attempts=1,
        upstream="http://upstream.test",
        started=now - 1,
        first_byte_at=now - 0.5,
        ended=now,
        outcome="complete",
    )


FENCE = "fence-"


async def settled(*books: RedisSessionBook) -> None:
    """Wait until every operation each book queued so far has been written and decided.

    Each book's task takes its queue in order and finishes deciding one record (``on_change``
    included) before it takes the next: once a record queued last is in Redis, the rest are done.
    """
    for each in books:
        fence = f"{FENCE}{uuid.uuid4().hex}"
        each.record(outcome(fence))
        await until(functools.partial(_requests_are, each, fence, 1))


class Changes:
    """Records ``on_change`` calls of several books, by book name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail: set[str] = set()

    def of(self, name: str) -> Callable[[str, Fingerprint], None]:
        def on_change(session_id: str, fingerprint: Fingerprint) -> None:
            if session_id.startswith(FENCE):
                return
            self.calls.append((name, session_id, fingerprint.wire_hash))
            if name in self.fail:
                self.fail.discard(name)
                raise RuntimeError("on_change failed")

        return on_change


def book(url: str, on_change: Callable[[str, Fingerprint], None] | None = None, **options: Any) -> RedisSessionBook:
    settings: dict[str, Any] = {"lease": 10.0, "timeout": 2.0, **options}
    return RedisSessionBook(url, max_sessions=100, on_change=on_change, **settings)


@contextlib.asynccontextmanager
async def started(*books: RedisSessionBook) -> AsyncIterator[None]:
    """Run each book's task as the app's lifespan would, and stop them on exit."""
    async with anyio.create_task_group() as tg:
        for each in books:
            await tg.start(each.run)
        yield
        tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def redis_client(url: str) -> AsyncIterator[Redis]:
    """A plain client of the tests' own, to look at what the books wrote."""
    client: Redis = Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


async def until(condition: Callable[[], Awaitable[bool] | bool], *, seconds: float = WAIT) -> None:
    """Wait for ``condition`` (sync or async), polling; fail after ``seconds``."""
    with anyio.fail_after(seconds):
        while True:
            result = condition()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await anyio.sleep(0.01)


async def requests_in_redis(observer: RedisSessionBook, session_id: str) -> int:
    entry = await observer.lookup(session_id)
    return 0 if entry is None else entry.requests


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# --- on_change: once in the fleet ---------------------------------------------------------------


@ASYNCIO
@pytest.mark.parametrize("replicas", [2, 3])
async def test_on_change_runs_once_in_the_fleet(server: RedisServer, replicas: int) -> None:
    changes = Changes()
    books = [book(server.url, changes.of(f"r{i}")) for i in range(replicas)]
    rounds = [("a", 1), ("a", 0), ("b", 1), ("b", 0), ("a", 1)]  # (wire hash, on_change runs expected)
    per_replica = 25
    expected_requests = 0
    async with started(*books):
        for tag, runs in rounds:
            before = len(changes.calls)
            for _ in range(per_replica):  # interleaved: every replica records the same change at once
                for each in books:
                    each.record(outcome("shared", tag))
            expected_requests += per_replica * replicas
            await settled(*books)
            assert await requests_in_redis(books[0], "shared") == expected_requests
            assert len(changes.calls) - before == runs, (tag, changes.calls)
            for each in books:  # every replica knows the fleet has synced it: a fallback would not run it again
                assert each.get("shared") is not None and each.get("shared").synced_hash == fp(tag).wire_hash  # type: ignore[union-attr]
        assert all(each.up for each in books)
    assert [(sid, h) for _, sid, h in changes.calls] == [("shared", fp("a").wire_hash), ("shared", fp("b").wire_hash),
                                                        ("shared", fp("a").wire_hash)]  # fmt: skip
    assert sum(each.recomputations for each in books) == 3 + len(rounds) * replicas  # and each fence once
    assert sum(each.local_records for each in books) == 0


async def _requests_are(observer: RedisSessionBook, session_id: str, expected: int) -> bool:
    return await requests_in_redis(observer, session_id) == expected


@ASYNCIO
async def test_a_failed_on_change_is_run_again_by_the_next_record_anywhere(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    changes = Changes()
    changes.fail.add("a")
    a, b = book(server.url, changes.of("a")), book(server.url, changes.of("b"))
    async with started(a, b):
        a.record(outcome("s", "x"))
        # Claimed by a, whose on_change raised: the claim is given back.
        await until(lambda: len(changes.calls) == 1)
        await until(lambda: _unclaimed(a, "s"))
        b.record(outcome("s", "x"))
        await until(lambda: len(changes.calls) == 2)
        a.record(outcome("s", "x"))
        b.record(outcome("s", "x"))
        await settled(a, b)
        assert await requests_in_redis(a, "s") == 4
    assert [name for name, _, _ in changes.calls] == ["a", "b"]
    assert "on_change failed" in caplog.text


# (wire hash tag, admission, end, book) in the order the records reach Redis; then the hashes on_change
# must run for, in order. Admissions and ends are seconds after a common origin.
_Delivery = list[tuple[str, float, float, str]]
LATE_DELIVERIES: dict[str, tuple[_Delivery, list[str]]] = {
    # Turns 1..5 and an identical re-send of turn 3 (at 4), alternating workers; the re-send's record
    # reaches Redis after turn 4's. Turn 3 ends after turn 4 does (recorded late): the end is no order.
    "a re-send arrives after the next turn": (
        [("1", 1, 1.5, "a"), ("2", 2, 2.5, "b"), ("3", 3, 5.9, "a"), ("4", 5, 5.5, "a"), ("3", 4, 4.5, "b"),
         ("5", 6, 6.5, "b")],
        ["1", "2", "3", "4", "5"],
    ),
    "back to an earlier hash, in order": (
        [("A", 1, 1.5, "a"), ("B", 2, 2.5, "b"), ("A", 3, 3.5, "a")],
        ["A", "B", "A"],
    ),
    "back to an earlier hash, then an older record of the other": (
        [("A", 1, 1.5, "a"), ("B", 2, 2.5, "b"), ("A", 3, 3.5, "a"), ("B", 2.5, 4, "b")],
        ["A", "B", "A"],
    ),
    "an older record of the first hash after the change": (
        [("A", 1, 1.5, "a"), ("B", 3, 3.5, "b"), ("A", 2, 2.5, "a")],
        ["A", "B"],
    ),
    "an older record of the same hash": (
        [("A", 1, 1.5, "a"), ("B", 3, 3.5, "b"), ("B", 2, 2.5, "a"), ("C", 4, 4.5, "a")],
        ["A", "B", "C"],
    ),
}  # fmt: skip


@ASYNCIO
@pytest.mark.parametrize("case", list(LATE_DELIVERIES))
async def test_a_record_reaching_redis_after_a_newer_one_claims_no_change(server: RedisServer, case: str) -> None:
    """Records reach Redis through per-process queues: the order is the requests' admission, not the arrival.

    A late, older record counts as a request but neither runs ``on_change`` nor moves the synced hash back;
    a real change back to an earlier hash still runs it.
    """
    deliveries, expected = LATE_DELIVERIES[case]
    changes = Changes()
    books = {name: book(server.url, changes.of(name)) for name in ("a", "b")}
    origin = time.monotonic() - 100
    known: dict[str, str] = {}  # book -> the fleet's synced hash as of that book's last record
    async with started(*books.values()):
        for count, (tag, admitted, ended, name) in enumerate(deliveries, start=1):
            record = dataclasses.replace(outcome("s", tag), started=origin + admitted, ended=origin + ended)
            books[name].record(record)
            # This record is in Redis before the next is sent: the arrival order is the test's.
            await until(functools.partial(_requests_are, books["a"], "s", count))
            newest = max(deliveries[:count], key=lambda d: d[1])[0]
            entry = await books["a"].lookup("s")
            assert entry is not None
            assert (entry.wire_hash, entry.synced_hash) == (fp(newest).wire_hash, fp(newest).wire_hash), (count, tag)
            known[name] = fp(newest).wire_hash
        await settled(*books.values())
        for name, synced in known.items():  # a replica's own view follows the fleet, not its own late record
            local = books[name].get("s")
            assert local is not None and local.synced_hash == synced, name
    assert [h for _, _, h in changes.calls] == [fp(tag).wire_hash for tag in expected]
    assert sum(each.local_records for each in books.values()) == 0


async def _unclaimed(observer: RedisSessionBook, session_id: str) -> bool:
    entry = await observer.lookup(session_id)
    return entry is not None and entry.synced_hash is None


# --- what Redis keeps -----------------------------------------------------------------------------


@ASYNCIO
async def test_redis_keeps_the_scalars_under_a_digest_with_a_ttl(server: RedisServer) -> None:
    session_id = f"secret-session-{uuid.uuid4()}"
    observer = book(server.url, ttl=600.0)
    async with started(observer), redis_client(server.url) as client:
        release = observer.pin(session_id)
        observer.record(outcome(session_id, "c", bytes_out=11))
        observer.record(outcome(session_id, "c", bytes_out=5))
        await until(lambda: _requests_are(observer, session_id, 2))
        digest = session_key(session_id).hex()
        keys = sorted(text(k) for k in await client.keys("*"))
        assert keys == sorted([entry_key(session_key(session_id)), leases_key(session_key(session_id))])
        assert all(digest in k and session_id not in k for k in keys)
        entry = await observer.lookup(session_id)
        assert entry is not None
        assert (entry.wire_hash, entry.text_comparable, entry.size) == (fp("c").wire_hash, True, 42)
        assert (entry.requests, entry.bytes_out, entry.last_status, entry.last_outcome) == (2, 16, 200, "complete")
        assert entry.synced_hash == fp("c").wire_hash
        assert abs(entry.last_seen - time.time()) < 60  # wall-clock time: comparable across hosts
        fields = {text(k) for k in await client.hkeys(entry_key(session_key(session_id)))}
        assert fields == {"wire_hash", "text_comparable", "size", "requests", "bytes_out", "last_status",
                          "last_outcome", "last_seen", "synced_hash", "started"}  # fmt: skip
        assert 0 < await client.pttl(entry_key(session_key(session_id))) <= 600_000
        assert await observer.live_leases(session_id) == 1
        release()
        release()  # idempotent
        await until(lambda: _leases_are(observer, session_id, 0))
        assert not await client.exists(leases_key(session_key(session_id)))
    assert observer.pinned == 0


async def _leases_are(observer: RedisSessionBook, session_id: str, expected: int) -> bool:
    return await observer.live_leases(session_id) == expected


# --- pins are leases ------------------------------------------------------------------------------


@ASYNCIO
async def test_a_held_pin_outlives_its_first_lease(server: RedisServer) -> None:
    lease = 0.9
    holder, observer = book(server.url, lease=lease, timeout=0.4), book(server.url)
    async with started(holder, observer), redis_client(server.url) as client:
        release = holder.pin("long-stream")
        await until(lambda: _leases_are(observer, "long-stream", 1))
        rows = await client.zrange(leases_key(session_key("long-stream")), 0, -1, withscores=True)
        [(_, first_expiry)] = cast(list[tuple[bytes, float]], rows)

        async def first_lease_over() -> bool:
            now: tuple[int, int] = await client.time()
            return now[0] * 1000 + now[1] // 1000 > first_expiry + 100

        await until(first_lease_over)  # the lease it took at admission has run out by Redis's clock...
        assert await observer.live_leases("long-stream") == 1  # ...and the pin is still there: renewed
        release()
        await until(lambda: _leases_are(observer, "long-stream", 0))


REPLICA = """
import sys
import anyio
from asgi_lifetime.gateway import RedisSessionBook

async def main():
    book = RedisSessionBook(sys.argv[1], max_sessions=10, lease=float(sys.argv[3]), timeout=0.2)
    async with anyio.create_task_group() as tg:
        await tg.start(book.run)
        book.pin(sys.argv[2])
        print("pinned", flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


@ASYNCIO
async def test_a_replica_that_dies_leaves_no_pin_past_the_lease(server: RedisServer) -> None:
    lease = 1.0
    observer = book(server.url)
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, "-c", textwrap.dedent(REPLICA), server.url, "doomed", str(lease)]
    async with await anyio.open_process(command, env=env, stderr=None) as replica:
        try:
            async with started(observer), redis_client(server.url) as client:
                assert replica.stdout is not None
                line = b""
                with anyio.fail_after(WAIT):
                    while not line.endswith(b"\n"):
                        line += await replica.stdout.receive()
                assert line == b"pinned\n"
                await until(lambda: _leases_are(observer, "doomed", 1))
                replica.kill()  # SIGKILL: no release, no goodbye
                await replica.wait()
                await until(lambda: _leases_are(observer, "doomed", 0), seconds=lease + WAIT)
                await until(lambda: _gone(client, leases_key(session_key("doomed"))), seconds=lease + WAIT)
        finally:
            if replica.returncode is None:
                replica.kill()
                await replica.wait()


async def _gone(client: Redis, key: str) -> bool:
    return not await client.exists(key)


# --- Redis down, killed, slow ----------------------------------------------------------------------


@ASYNCIO
async def test_redis_down_at_start_then_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    binary = require_binary("redis-server", "redis-server")
    later = RedisServer(binary, tmp_path)  # nothing listens on its port yet
    changes = Changes()
    subject = book(later.url, changes.of("a"), lease=1.5, timeout=0.5)
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        async with started(subject):
            assert not subject.up
            assert subject.store_state().fallbacks == 1
            [line] = transitions(caplog)
            assert "unusable" in line and later.url in line
            release = subject.pin("s")  # the request path works on the in-memory book
            subject.record(outcome("s", "a"))
            assert changes.calls == [("a", "s", fp("a").wire_hash)]  # decided here, at once
            assert subject.local_records == 1
            later.start()
            await until(lambda: subject.up)
            assert len(transitions(caplog)) == 2 and "answers again" in transitions(caplog)[1]
            assert await subject.live_leases("s") == 1  # the pin taken while down is now a lease
            subject.record(outcome("s", "b"))
            await settled(subject)
            assert await requests_in_redis(subject, "s") == 1
            assert [h for _, _, h in changes.calls] == [fp("a").wire_hash, fp("b").wire_hash]
            release()
            await until(lambda: _leases_are(subject, "s", 0))
        assert subject.store_state().fallbacks == 1
    finally:
        later.stop()


@ASYNCIO
async def test_redis_killed_mid_run_then_restarted(server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    changes = Changes()
    subject = book(server.url, changes.of("a"), lease=1.5, timeout=0.5)
    async with started(subject):
        assert subject.up and subject.store_state() == _state(up=True)
        release = subject.pin("s")
        subject.record(outcome("s", "a"))
        await until(lambda: len(changes.calls) == 1)
        server.kill()
        subject.record(outcome("s", "b"))  # taken by the task, refused by the dead server: decided here
        await until(lambda: not subject.up)
        await until(lambda: len(changes.calls) == 2)
        assert changes.calls[1][2] == fp("b").wire_hash
        subject.record(outcome("s", "b"))  # same hash, decided here: no second run
        subject.record(outcome("s", "c"))
        assert len(changes.calls) == 3
        state = subject.store_state()
        assert not state.up and state.fallbacks == 1 and state.local_records == 3
        [line] = transitions(caplog)
        assert "unusable" in line and "ConnectionError" in line
        server.start()  # the same port, an empty Redis
        await until(lambda: subject.up)
        lines = transitions(caplog)
        assert len(lines) == 2 and "answers again" in lines[1]
        assert await subject.live_leases("s") == 1  # written again on the way back
        subject.record(outcome("s", "c"))  # an empty Redis has not synced c: claimed, runs once more
        await settled(subject)
        assert await requests_in_redis(subject, "s") == 1
        assert len(changes.calls) == 4
        release()
    assert subject.store_state() == _state(up=False, fallbacks=1, local_records=3)


def _state(*, up: bool, fallbacks: int = 0, local_records: int = 0) -> StoreState:
    return StoreState(up=up, fallbacks=fallbacks, local_records=local_records)


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """A TCP server that accepts connections and never answers: a Redis that hangs."""

    async def hold(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, hold)
            yield f"redis://127.0.0.1:{port}/0"
            tg.cancel_scope.cancel()


@ASYNCIO
async def test_a_silent_redis_costs_the_request_nothing(caplog: pytest.LogCaptureFixture) -> None:
    changes = Changes()
    async with silent_server() as url:
        subject = book(url, changes.of("a"), lease=1.0, timeout=0.2)
        with anyio.fail_after(WAIT):
            async with started(subject):  # startup waits for one bounded ping, then goes on
                [line] = transitions(caplog)
                assert "no answer within 0.2s" in line  # the timeout path, not a refused connection
                assert not subject.up and subject.fallbacks == 1
                release = subject.pin("s")
                with anyio.fail_after(0.1):  # down since the start: the admission does not ask Redis
                    claim = await subject.claim("s", fp("a"), time.monotonic())
                assert claim == "local"
                subject.record(dataclasses.replace(outcome("s", "a"), claim=claim))  # decided in memory at once
                assert changes.calls == [("a", "s", fp("a").wire_hash)] and subject.local_records == 1
                release()
                assert subject.pinned == 0


@contextlib.asynccontextmanager
async def serving_on_loopback(handler: Callable[[anyio.abc.SocketStream], Awaitable[None]]) -> AsyncIterator[str]:
    """``handler`` serving each connection on a free loopback port, given as a ``redis://`` URL."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            yield f"redis://127.0.0.1:{port}/0"
            tg.cancel_scope.cancel()


class FreezingProxy:
    """A TCP proxy in front of Redis that can stop passing bytes (and start again)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.flowing = anyio.Event()
        self.flowing.set()

    def freeze(self) -> None:
        self.flowing = anyio.Event()

    def thaw(self) -> None:
        self.flowing.set()

    async def _pump(self, source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteSendStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for data in source:
                await self.flowing.wait()
                await sink.send(data)

    async def _serve(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.target_port) as upstream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream)
                await self._pump(upstream, client)
                tg.cancel_scope.cancel()

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        return serving_on_loopback(self._serve)


@ASYNCIO
async def test_a_redis_that_stops_answering_mid_run(server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    changes = Changes()
    proxy = FreezingProxy(server.port)
    async with proxy.serving() as url:
        subject = book(url, changes.of("a"), lease=1.5, timeout=0.3)
        async with started(subject):
            assert subject.up
            proxy.freeze()
            subject.record(outcome("s", "a"))  # returns at once; the task's call to Redis hangs...
            await until(lambda: not subject.up)  # ...until its bound: then the book falls back
            [line] = transitions(caplog)
            assert "no answer within 0.3s" in line
            await until(lambda: len(changes.calls) == 1)  # the record Redis did not take, decided here
            assert subject.local_records == 1
            proxy.thaw()
            await until(lambda: subject.up)
            assert len(transitions(caplog)) == 2 and "answers again" in transitions(caplog)[1]


@ASYNCIO
async def test_a_full_queue_settles_in_memory_without_waiting(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_session_store, "_QUEUE_SIZE", 1)
    changes = Changes()
    subject = book(server.url, changes.of("a"))
    async with started(subject):
        for i in range(5):  # no await in between: the task cannot take any of them
            subject.record(outcome(f"s{i}", "a"))
        assert subject.local_records == 4  # one queued, the rest decided here at once
        assert len(changes.calls) == 4
        await until(lambda: len(changes.calls) == 5)


@ASYNCIO
async def test_stopping_writes_what_is_queued_and_removes_its_leases(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    changes = Changes()
    subject, observer = book(server.url, changes.of("a")), book(server.url)
    async with started(observer):
        async with started(subject):
            release = subject.pin("s")
            await until(lambda: _leases_are(observer, "s", 1))
            for _ in range(3):
                subject.record(outcome("s", "a"))
            # No await since: the task has taken none of them when the lifespan ends.
        assert await requests_in_redis(observer, "s") == 3
        assert len(changes.calls) == 1
        assert await observer.live_leases("s") == 0  # a stopped process leaves no pin, even one still held
        release()  # the request settles after the lifespan: nothing to say about it
    assert transitions(caplog) == []
    assert subject.pinned == 0


# --- trio, no lifespan, the package without redis ------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_book_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    changes = Changes()
    subject = book(f"redis://127.0.0.1:{free_port()}/0", changes.of("a"))
    async with started(subject):
        [line] = transitions(caplog)
        assert "needs asyncio" in line
        assert not subject.up and subject.store_state() == _state(up=False, fallbacks=1)
        release = subject.pin("s")
        assert await subject.claim("s", fp("a"), time.monotonic()) == "local"  # decided here, at the record
        subject.record(dataclasses.replace(outcome("s", "a"), claim="local"))
        subject.record(outcome("s", "a"))
        assert len(changes.calls) == 1 and subject.local_records == 2
        release()
    assert len(transitions(caplog)) == 1


def test_without_its_task_the_book_warns_once_and_keeps_sessions_in_memory(caplog: pytest.LogCaptureFixture) -> None:
    changes = Changes()
    subject = book(f"redis://127.0.0.1:{free_port()}/0", changes.of("a"))
    for _ in range(3):
        subject.pin("s")()
        subject.record(outcome("s", "a"))
    [line] = transitions(caplog)
    assert "not running" in line
    assert len(changes.calls) == 1 and subject.local_records == 3 and subject.fallbacks == 1


@pytest.mark.parametrize(
    ("url", "problem"),
    [("http://127.0.0.1:6379", "redis://"), ("redis://", "with a host"), ("redis:///0", "with a host")],
)
def test_the_url_is_checked(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RedisSessionBook(url, max_sessions=10)


@pytest.mark.parametrize(
    ("options", "problem"), [({"ttl": 0}, "ttl"), ({"lease": -1.0}, "lease"), ({"timeout": 3.0, "lease": 5.0}, "half")]
)
def test_the_bounds_are_checked(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RedisSessionBook("redis://127.0.0.1:6379/0", max_sessions=10, **options)


def test_the_settings_choose_the_book() -> None:
    lifetime = Lifetime(LifetimeSettings())
    memory = make_session_book(LifetimeSettings(), lifetime=lifetime)
    assert type(memory) is SessionBook and memory.store_state().up
    settings = LifetimeSettings(
        session_store="rediss://user:hunter2@redis.internal:6380/2",
        session_ttl=60.0,
        session_lease=3.0,
        session_store_timeout=0.5,
    )
    shared = make_session_book(settings, lifetime=lifetime)
    assert isinstance(shared, RedisSessionBook)
    assert shared.url == "rediss://user:***@redis.internal:6380/2"
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.public_items())


# --- the gateway ----------------------------------------------------------------------------------

UPSTREAM = "http://upstream.test"
OK = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}


async def test_the_gateway_shares_sessions_on_asyncio_and_falls_back_on_trio(
    server: RedisServer, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    changes = Changes()
    settings = LifetimeSettings(upstream_url=(UPSTREAM,), session_store=server.url, session_store_timeout=1.0)
    app = create_app(settings, on_change=changes.of("gateway"))
    with respx.mock(base_url=UPSTREAM, assert_all_called=True) as router:
        router.post(PATH).respond(200, json=OK)
        async with app.router.lifespan_context(app):  # the lifespan, on this backend
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
                for _ in range(3):
                    response = await client.post(PATH, json=CHAT, headers={"x-session-id": "conv-1"})
                    assert response.status_code == 200
                metrics = (await client.get("/metrics")).text
                book_: RedisSessionBook = app.state.book
                if anyio_backend == "asyncio":
                    await settled(book_)
                    assert await requests_in_redis(book_, "conv-1") == 3
                    assert "asgi_lifetime_session_store_up 1.0" in metrics
                    assert "asgi_lifetime_session_store_fallbacks_total 0.0" in metrics
                    assert transitions(caplog) == []
                else:
                    assert "asgi_lifetime_session_store_up 0.0" in metrics
                    assert "asgi_lifetime_session_store_fallbacks_total 1.0" in metrics
                    assert "asgi_lifetime_session_store_local_records_total 3.0" in metrics
                    [line] = transitions(caplog)
                    assert "needs asyncio" in line
                assert len(changes.calls) == 1  # one body, one wire hash: one run
                assert app.state.lifetime.stats().idle


class Monitor:
    """Everything Redis executes, as its ``MONITOR`` command shows it, read on a plain socket in a thread."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.sock.sendall(b"MONITOR\r\n")
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while data := self.sock.recv(65536):
                with self.lock:
                    self.seen += data

    def text(self) -> bytes:
        with self.lock:
            return bytes(self.seen)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread (close() alone would not)
        self.thread.join(WAIT)
        self.sock.close()


@ASYNCIO
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_nothing_of_the_body_reaches_redis(server: RedisServer, stream: bool) -> None:
    """Real sockets: client -> gateway (uvicorn) -> demo upstream; Redis watched with MONITOR."""
    marker = f"BODYMARKER{uuid.uuid4().hex}"
    session_id = f"SESSIONMARKER{uuid.uuid4().hex}"
    monitor = Monitor(server.port)
    try:
        await until(lambda: monitor.text().startswith(b"+OK"))
        with running(session_store=server.url, session_store_timeout=1.0) as stack:
            body = {**CHAT, "stream": stream, "messages": [{"role": "user", "content": f"say {marker} please"}]}
            async with httpx.AsyncClient(base_url=stack.url, timeout=WAIT) as client:
                for _ in range(2):
                    response = await client.post(PATH, json=body, headers={"x-session-id": session_id})
                    assert response.status_code == 200
            book_: RedisSessionBook = stack.app.state.book
            assert book_.up
            digest = session_key(session_id).hex().encode()
            await until(lambda: monitor.text().count(digest) >= 4)  # pins, releases and records were seen
            await until(lambda: b"ZREM" in monitor.text() or b"zrem" in monitor.text())
            await assert_idle(stack.app, stack.url)
        seen = monitor.text()
        assert marker.encode() not in seen
        assert session_id.encode() not in seen
        assert b"say " not in seen and b"messages" not in seen
    finally:
        monitor.close()


# --- the change decided at admission ----------------------------------------------------------------


def turn(n: int) -> dict[str, Any]:
    """Turn ``n`` of one conversation: each turn's body differs from the previous one's (a real change)."""
    return {**CHAT, "messages": [{"role": "user", "content": f"turn {i}"} for i in range(1, n + 1)]}


@contextlib.asynccontextmanager
async def replica(
    store: str, upstream: str, changes: Changes, name: str, *, bound: float = 4.0
) -> AsyncIterator[tuple[httpx.AsyncClient, RedisSessionBook]]:
    """A gateway app with its lifespan (its book's task), and a client on it (httpx's ASGI transport)."""
    settings = LifetimeSettings(upstream_url=(upstream,), session_store=store, session_store_timeout=bound)
    app = create_app(settings, on_change=changes.of(name))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{name}.test") as client:
            yield client, app.state.book
            assert app.state.lifetime.stats().idle


def hashes(changes: Changes) -> list[str]:
    return sorted(h for _, _, h in changes.calls)


@ASYNCIO
async def test_a_turn_recorded_after_the_next_turn_still_runs_on_change(server: RedisServer) -> None:
    """Turn 1 is answered by replica a, turn 2 by replica b; a's record reaches Redis after b's (its
    connection stalls, within the bound). Decided at the record, turn 1's change was superseded and never
    ran ``on_change``; decided at admission, each turn's change runs it once, on the replica that claimed it.
    """
    changes = Changes()
    proxy = FreezingProxy(server.port)
    with respx.mock(assert_all_called=True) as router:

        def stall_a(request: httpx.Request) -> httpx.Response:
            proxy.freeze()  # a's claim is in; what a writes from now on waits
            return httpx.Response(200, json=OK)

        router.post(f"http://upstream-a.test{PATH}").mock(side_effect=stall_a)
        router.post(f"http://upstream-b.test{PATH}").respond(200, json=OK)
        async with (
            proxy.serving() as via_proxy,
            replica(via_proxy, "http://upstream-a.test", changes, "a") as (a, book_a),
            replica(server.url, "http://upstream-b.test", changes, "b") as (b, book_b),
        ):
            headers = {"x-session-id": "conv"}
            assert (await a.post(PATH, json=turn(1), headers=headers)).status_code == 200
            assert (await b.post(PATH, json=turn(2), headers=headers)).status_code == 200
            await settled(book_b)  # turn 2's record is in Redis; turn 1's still waits at the proxy
            assert await requests_in_redis(book_b, "conv") == 1
            proxy.thaw()
            await until(lambda: _requests_are(book_b, "conv", 2))
            await settled(book_a, book_b)
            assert book_a.up and book_b.up  # no fallback: the stall stayed within the bound
            entry = await book_b.lookup("conv")
            assert entry is not None and entry.requests == 2
    assert sorted(name for name, _, _ in changes.calls) == ["a", "b"]  # one run per turn, where it was claimed
    assert len(set(hashes(changes))) == 2
    assert book_a.local_records == book_b.local_records == 0


# (wire hash tag, admission, end, book), in the order the records reach Redis (as LATE_DELIVERIES), each
# request claimed at its admission, in admission order.
ADMITTED_DELIVERIES: dict[str, _Delivery] = {
    **{case: deliveries for case, (deliveries, _) in LATE_DELIVERIES.items()},
    "turn 2's record after turn 3's": [("1", 1, 1.5, "a"), ("3", 3, 3.5, "b"), ("2", 2, 2.5, "a")],
    "every record after the last turn's": [("4", 4, 4.5, "b"), ("1", 1, 1.5, "a"), ("2", 2, 2.5, "b"),
                                           ("3", 3, 3.5, "a")],
    "a re-send on the other replica, recorded first": [("2", 3, 3.5, "b"), ("1", 1, 1.5, "a"), ("2", 2, 2.5, "a")],
}  # fmt: skip


def _changes_in_admission_order(deliveries: _Delivery) -> list[tuple[str, str]]:
    """(book, tag) of every admission whose wire hash differs from the previous admission's."""
    result: list[tuple[str, str]] = []
    previous = None
    for tag, _, _, name in sorted(deliveries, key=lambda d: d[1]):
        if tag != previous:
            result.append((name, tag))
        previous = tag
    return result


@ASYNCIO
@pytest.mark.parametrize("case", list(ADMITTED_DELIVERIES))
async def test_claimed_at_admission_every_change_runs_once_whatever_the_record_order(
    server: RedisServer, case: str
) -> None:
    """Two replicas claim at admission (in the turns' order); the records then reach Redis in any order:
    each change between two successive admissions runs ``on_change`` exactly once, on the replica that
    admitted it, and an identical re-send runs nothing."""
    deliveries = ADMITTED_DELIVERIES[case]
    changes = Changes()
    books = {name: book(server.url, changes.of(name)) for name in ("a", "b")}
    origin = time.monotonic() - 100
    async with started(*books.values()):
        claims: dict[int, Any] = {}
        for index, (tag, admitted, _, name) in sorted(enumerate(deliveries), key=lambda d: d[1][1]):
            claims[index] = await books[name].claim("s", fp(tag), origin + admitted)
        for index, (tag, admitted, ended, name) in enumerate(deliveries):
            record = dataclasses.replace(
                outcome("s", tag), started=origin + admitted, ended=origin + ended, claim=claims[index]
            )
            books[name].record(record)
        await settled(*books.values())
        assert await requests_in_redis(books["a"], "s") == len(deliveries)
        entry = await books["a"].lookup("s")
        newest = max(deliveries, key=lambda d: d[1])[0]
        assert entry is not None and entry.synced_hash == entry.wire_hash == fp(newest).wire_hash
    expected = _changes_in_admission_order(deliveries)
    assert sorted(changes.calls) == sorted((name, "s", fp(tag).wire_hash) for name, tag in expected)
    assert sorted(claims.values()).count("claimed") == len(expected)
    assert set(claims.values()) <= {"claimed", "synced"}
    assert sum(each.local_records for each in books.values()) == 0


@ASYNCIO
async def test_concurrent_requests_of_one_session_claim_each_change_in_the_order_redis_runs_them(
    server: RedisServer,
) -> None:
    """Requests of one session admitted at the same moment on two replicas: Redis runs their claims one
    after the other, and each claim whose hash differs from the one before it is a change."""
    changes = Changes()
    a, b = book(server.url, changes.of("a")), book(server.url, changes.of("b"))
    async with started(a, b):
        now = time.monotonic()
        answers: dict[tuple[str, str], Any] = {}

        async def admit(each: RedisSessionBook, name: str, tag: str) -> None:
            answers[(name, tag)] = await each.claim("s", fp(tag), now)

        async with anyio.create_task_group() as tg:  # the same hash on both: one claim
            tg.start_soon(admit, a, "a", "x")
            tg.start_soon(admit, b, "b", "x")
        assert sorted(answers.values()) == ["claimed", "synced"]
        answers.clear()
        async with anyio.create_task_group() as tg:  # two hashes, each new: one claim each, whatever the order
            tg.start_soon(admit, a, "a", "y")
            tg.start_soon(admit, b, "b", "z")
        assert sorted(answers.values()) == ["claimed", "claimed"]
        entry = await a.lookup("s")
        assert entry is not None and entry.synced_hash in (fp("y").wire_hash, fp("z").wire_hash)
        assert await b.claim("s", fp("y"), now) == ("synced" if entry.synced_hash == fp("y").wire_hash else "claimed")


@ASYNCIO
async def test_a_failed_on_change_claimed_at_admission_is_claimed_again(server: RedisServer) -> None:
    changes = Changes()
    changes.fail.add("a")
    a, b = book(server.url, changes.of("a")), book(server.url, changes.of("b"))
    async with started(a, b):
        now = time.monotonic()
        claim = await a.claim("s", fp("x"), now)
        assert claim == "claimed"
        with pytest.raises(RuntimeError, match="on_change failed"):
            a.record(dataclasses.replace(outcome("s", "x"), claim=claim))
        await until(lambda: _unclaimed(a, "s"))  # given back through a's task
        again = await b.claim("s", fp("x"), now + 1)  # the same body again, on the other replica
        assert again == "claimed"
        b.record(dataclasses.replace(outcome("s", "x"), claim=again))
        assert await a.claim("s", fp("x"), now + 2) == "synced"
    assert [name for name, _, _ in changes.calls] == ["a", "b"]


@ASYNCIO
async def test_a_redis_that_stops_answering_at_admission_costs_the_request_one_bound(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis takes the connection and never answers: the admission waits for ``SESSION_STORE_TIMEOUT``
    and no longer, the book falls back (one line), the change is decided in this process."""
    changes = Changes()
    proxy = FreezingProxy(server.port)
    bound = 0.5
    with respx.mock(assert_all_called=True) as router:
        router.post(f"{UPSTREAM}{PATH}").respond(200, json=OK)
        async with proxy.serving() as url, replica(url, UPSTREAM, changes, "a", bound=bound) as (client, subject):
            assert subject.up
            proxy.freeze()
            begun = time.monotonic()
            response = await client.post(PATH, json=turn(1), headers={"x-session-id": "s"})
            took = time.monotonic() - begun
            assert response.status_code == 200
            assert bound * 0.9 <= took < bound + WAIT / 2, took  # it waited for the bound, then went on
            assert not subject.up and subject.fallbacks == 1
            [line] = transitions(caplog)
            assert f"no answer within {bound:g}s" in line
            assert len(changes.calls) == 1 and subject.local_records == 1
            response = await client.post(PATH, json=turn(1), headers={"x-session-id": "s"})  # down: not asked
            assert response.status_code == 200
            assert len(changes.calls) == 1 and subject.local_records == 2  # the same body: decided here, not again
            proxy.thaw()
            await until(lambda: subject.up)


def watch_claims(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """An event set as soon as a ``RedisSessionBook.claim`` starts (the claim itself still runs)."""
    asking = anyio.Event()
    claim = RedisSessionBook.claim

    async def watched(self: RedisSessionBook, session_id: str, fingerprint: Fingerprint, started: float) -> Any:
        asking.set()
        return await claim(self, session_id, fingerprint, started)

    monkeypatch.setattr(RedisSessionBook, "claim", watched)
    return asking


@ASYNCIO
async def test_a_request_cancelled_during_its_claim_releases_everything_and_runs_its_change_once(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim is shielded and bounded: a request cancelled while Redis decides still knows what it
    claimed; its record runs ``on_change`` (as a disconnected request's record always did), its pin and
    lease are released, and the same body elsewhere is not a change again."""
    changes = Changes()
    proxy = FreezingProxy(server.port)
    asking = watch_claims(monkeypatch)
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{UPSTREAM}{PATH}").respond(200, json=OK)  # called or not: respx never yields
        async with (
            proxy.serving() as url,
            replica(url, UPSTREAM, changes, "a") as (client, subject),
            replica(server.url, UPSTREAM, changes, "b") as (_, other),
        ):
            proxy.freeze()
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(client.post, PATH, json=turn(1), headers={"x-session-id": "s"}))
                    await asking.wait()
                    tg.cancel_scope.cancel()  # the request is cancelled while its claim waits on Redis...
                    proxy.thaw()  # ...which answers within the bound
            assert subject.up and subject.pinned == 0
            assert [name for name, _, _ in changes.calls] == ["a"]  # its record ran the change it claimed
            await settled(subject)  # what it queued (the lease, the record, the lease's release) is in Redis
            assert await other.live_leases("s") == 0
            assert await other.claim("s", fp("x"), time.monotonic()) == "claimed"  # another body: a change
            entry = await other.lookup("s")
            assert entry is not None and entry.requests == 1


async def test_the_in_memory_book_is_not_asked_at_admission(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never(*args: object) -> None:
        raise AssertionError("the in-memory book decides at the record")

    monkeypatch.setattr(SessionBook, "claim", never)
    changes = Changes()
    app = create_app(LifetimeSettings(upstream_url=(UPSTREAM,)), on_change=changes.of("memory"))
    assert not app.state.book.claims_at_admission
    with respx.mock(base_url=UPSTREAM, assert_all_called=True) as router:
        router.post(PATH).respond(200, json=OK)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
                for body in (turn(1), turn(1), turn(2)):
                    response = await client.post(PATH, json=body, headers={"x-session-id": "s"})
                    assert response.status_code == 200
    assert len(changes.calls) == 2
