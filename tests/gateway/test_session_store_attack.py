"""Attacks on the fleet's claim at admission (``SESSION_STORE=redis://``): Redis losing the claim's
answer, answering garbage, dying between claim and record; requests cancelled around the claim; the
fleet against the single-process book on the same sequence of requests.

Replicas are gateway apps in this process (each with its lifespan, so its book's task) sharing one
real ``redis-server`` (``tests/_servers.py``); hostile peers are raw TCP servers on 127.0.0.1. redis-py's
client runs on asyncio only: the Redis-backed cases run there (see ``test_session_store.py`` for trio).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal

import anyio
import anyio.abc
import httpx
import pytest
import respx

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._fingerprint import wire_hash
from asgi_lifetime.gateway import RedisSessionBook, _session_store, create_app

from .._servers import RedisServer, redis_server
from ..reliability.test_faults import PATH
from .test_session_store import (
    ASYNCIO,
    OK,
    UPSTREAM,
    WAIT,
    Changes,
    book,
    fp,
    outcome,
    redis_client,
    replica,
    serving_on_loopback,
    settled,
    started,
    turn,
    until,
    watch_claims,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as running_server:
        yield running_server


def hashes_of(changes: Changes) -> list[str]:
    """The wire hashes ``on_change`` ran for, in the order it ran."""
    return [h for _, _, h in changes.calls]


def body_hash(body: dict[str, Any]) -> str:
    """The wire hash the gateway takes of ``body`` as httpx sends it (``json=``)."""
    return wire_hash(httpx.Request("POST", "http://x", json=body).read())


# --- a proxy that loses what crosses it ------------------------------------------------------------

Mode = Literal["pass", "drop_replies", "drop_requests"]


class LossyProxy:
    """A TCP proxy in front of Redis that passes bytes, or drops what Redis answers (the command ran,
    its answer never arrives), or drops what the client sends (the command never reaches Redis)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode: Mode = "pass"

    async def _pump(self, source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteSendStream, drop: Mode) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for data in source:
                if self.mode != drop:
                    await sink.send(data)

    async def _serve(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.target_port) as upstream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, "drop_requests")
                await self._pump(upstream, client, "drop_replies")
                tg.cancel_scope.cancel()

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        return serving_on_loopback(self._serve)


# --- the claim's answer lost ------------------------------------------------------------------------

# What the proxy in front of replica a loses while a admits a session's change back to an earlier body,
# and whether Redis answers a again before that request's record.
LOST: dict[str, tuple[Mode, bool]] = {
    "answer lost, recorded while Redis is unusable": ("drop_replies", False),
    "answer lost, recorded once Redis answers again": ("drop_replies", True),
    "command lost, recorded once Redis answers again": ("drop_requests", True),
    "command lost, recorded while Redis is unusable": ("drop_requests", False),
}


@ASYNCIO
@pytest.mark.parametrize("case", list(LOST))
async def test_a_claim_whose_answer_is_lost_runs_its_change_once_in_the_fleet(server: RedisServer, case: str) -> None:
    """Turns X (on a), Y (on b), X again (on a: a real change back), while Redis loses a's claim or
    its answer; then a re-send of that X on b, and a change to Y on b. Each of the three changes of
    the conversation runs ``on_change`` once in the fleet, and the re-send none."""
    lost, back_before_record = LOST[case]
    changes = Changes()
    proxy = LossyProxy(server.port)
    x, y = turn(1), turn(2)
    replicas: dict[str, RedisSessionBook] = {}

    async def answer_a(request: httpx.Request) -> httpx.Response:
        if proxy.mode != "pass":  # the admission whose claim got lost: a fell back
            assert not replicas["a"].up
            if back_before_record:
                proxy.mode = "pass"
                await until(lambda: replicas["a"].up)
        return httpx.Response(200, json=OK)

    with respx.mock(assert_all_called=True) as router:
        router.post(f"http://upstream-a.test{PATH}").mock(side_effect=answer_a)
        router.post(f"http://upstream-b.test{PATH}").respond(200, json=OK)
        async with (
            proxy.serving() as via_proxy,
            replica(via_proxy, "http://upstream-a.test", changes, "a", bound=0.5) as (a, book_a),
            replica(server.url, "http://upstream-b.test", changes, "b") as (b, book_b),
        ):
            replicas["a"] = book_a
            headers = {"x-session-id": "conv"}
            assert (await a.post(PATH, json=x, headers=headers)).status_code == 200
            assert (await b.post(PATH, json=y, headers=headers)).status_code == 200
            proxy.mode = lost
            assert (await a.post(PATH, json=x, headers=headers)).status_code == 200
            assert book_a.fallbacks == 1
            proxy.mode = "pass"
            await until(lambda: book_a.up)
            await settled(book_a)
            assert (await b.post(PATH, json=x, headers=headers)).status_code == 200  # a re-send, elsewhere
            assert (await b.post(PATH, json=y, headers=headers)).status_code == 200
            await settled(book_a, book_b)
    assert hashes_of(changes) == [body_hash(x), body_hash(y), body_hash(x), body_hash(y)], changes.calls
    assert [name for name, _, _ in changes.calls] == ["a", "b", "a", "b"]


# --- a server that is not quite Redis -----------------------------------------------------------------


class FakeRedis:
    """Speaks just enough RESP for redis-py: ``+PONG`` to ``PING``, every script known to ``SCRIPT EXISTS``,
    ``reply`` to each call of the script ``script`` (what a proxy or a foreign server answering garbage
    sends), ``:1`` to the other scripts' calls and ``+OK`` to the rest."""

    def __init__(self, script: str, reply: bytes) -> None:
        self.sha = hashlib.sha1(script.encode()).hexdigest().encode()
        self.reply = reply
        self.script_calls = 0

    async def _commands(self, stream: anyio.abc.SocketStream) -> AsyncIterator[list[bytes]]:
        buffer = b""

        async def line() -> bytes:
            nonlocal buffer
            while b"\r\n" not in buffer:
                buffer += await stream.receive()
            head, _, buffer = buffer.partition(b"\r\n")
            return head

        async def exactly(n: int) -> bytes:
            nonlocal buffer
            while len(buffer) < n + 2:
                buffer += await stream.receive()
            data, buffer = buffer[:n], buffer[n + 2 :]
            return data

        while True:
            head = await line()
            assert head.startswith(b"*"), head
            parts = []
            for _ in range(int(head[1:])):
                size = await line()
                parts.append(await exactly(int(size[1:])))
            yield parts

    async def _serve(self, stream: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            async with stream:
                async for command in self._commands(stream):
                    name = command[0].upper()
                    if name == b"PING":
                        await stream.send(b"+PONG\r\n")
                    elif name == b"EVALSHA" and command[1] == self.sha:
                        self.script_calls += 1
                        await stream.send(self.reply)
                    elif name == b"EVALSHA":
                        await stream.send(b":1\r\n")
                    elif name == b"SCRIPT" and command[1].upper() == b"EXISTS":
                        await stream.send(b"*%d\r\n" % (len(command) - 2) + b":1\r\n" * (len(command) - 2))
                    else:
                        await stream.send(b"+OK\r\n")

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        return serving_on_loopback(self._serve)


# Answers a script call cannot have: a claim answers 0 or 1, a record {0 or 1, hash}.
GARBAGE = {
    "a string": b"$3\r\nabc\r\n",
    "nil": b"$-1\r\n",
    "an empty array": b"*0\r\n",
    "two": b":2\r\n",
    "a status": b"+OK\r\n",
    "an array of three": b"*3\r\n:1\r\n:1\r\n:1\r\n",
    "an array of a string and an integer": b"*2\r\n$1\r\n1\r\n:7\r\n",
}


@ASYNCIO
@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_a_claim_answered_with_garbage_is_no_answer(garbage: str) -> None:
    """The request is served within the bound, the book falls back, the change runs once (here)."""
    changes = Changes()
    fake = FakeRedis(_session_store._CLAIM, GARBAGE[garbage])
    with respx.mock(assert_all_called=True) as router:
        router.post(f"{UPSTREAM}{PATH}").respond(200, json=OK)
        async with fake.serving() as url, replica(url, UPSTREAM, changes, "a", bound=2.0) as (client, subject):
            assert subject.up
            with anyio.fail_after(WAIT):
                response = await client.post(PATH, json=turn(1), headers={"x-session-id": "s"})
            assert response.status_code == 200, response.text
            assert fake.script_calls == 1
            assert not subject.up and subject.fallbacks == 1
            assert hashes_of(changes) == [body_hash(turn(1))]


@ASYNCIO
@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_a_record_answered_with_garbage_is_decided_here_and_the_task_lives_on(garbage: str) -> None:
    """A record Redis decides (one not claimed at admission) answered with garbage: the book's task must
    not die of it (it writes every replica's operations); the record is decided in memory, once."""
    changes = Changes()
    fake = FakeRedis(_session_store._RECORD, GARBAGE[garbage])
    async with fake.serving() as url:
        subject = book(url, changes.of("a"), timeout=0.5, lease=1.5)
        with anyio.fail_after(WAIT):
            async with started(subject):
                assert subject.up
                subject.record(outcome("s", "x"))
                await until(lambda: not subject.up)
                await until(lambda: len(changes.calls) == 1)
                assert subject.local_records == 1
                await until(lambda: subject.up)  # the task is alive: it pinged, and the fake answered
                subject.record(dataclasses.replace(outcome("s", "x"), claim="local"))
                assert len(changes.calls) == 1


@ASYNCIO
async def test_changes_decided_here_during_an_outage_are_told_to_redis_when_it_is_back(server: RedisServer) -> None:
    """Redis dies; replica a serves two changes of a conversation alone (the first claim fails on the way,
    the second is not asked) and runs ``on_change`` for each; Redis comes back (empty: no persistence).
    a tells it what it ran: the last body re-sent to b is no change, the next body is one."""
    changes = Changes()
    x, y, z, w = turn(1), turn(2), turn(3), turn(4)
    with respx.mock(assert_all_called=True) as router:
        router.post(f"{UPSTREAM}{PATH}").respond(200, json=OK)
        async with (
            replica(server.url, UPSTREAM, changes, "a", bound=0.5) as (a, book_a),
            replica(server.url, UPSTREAM, changes, "b", bound=0.5) as (b, book_b),
        ):
            headers = {"x-session-id": "conv"}
            assert (await a.post(PATH, json=x, headers=headers)).status_code == 200
            await anyio.to_thread.run_sync(server.kill)  # the loop runs meanwhile: its connections see the end
            assert (await a.post(PATH, json=y, headers=headers)).status_code == 200  # its claim fails: unsure
            assert not book_a.up
            assert (await a.post(PATH, json=z, headers=headers)).status_code == 200  # down: not asked
            assert book_a.local_records == 2
            await anyio.to_thread.run_sync(server.start)  # the same port, an empty Redis
            await until(lambda: book_a.up)
            await settled(book_a)
            assert (await b.post(PATH, json=z, headers=headers)).status_code == 200  # a re-send, elsewhere
            assert (await b.post(PATH, json=w, headers=headers)).status_code == 200
            await settled(book_a, book_b)
            assert book_b.up and book_b.fallbacks == 0  # its pooled connections to the dead Redis were replaced
    assert [(name, h) for name, _, h in changes.calls] == [
        ("a", body_hash(x)),
        ("a", body_hash(y)),
        ("a", body_hash(z)),
        ("b", body_hash(w)),
    ]


@ASYNCIO
async def test_a_redis_restart_costs_the_next_claim_nothing(server: RedisServer) -> None:
    """The pool's connections to a Redis that restarted (or closed them: its idle ``timeout``) are replaced
    before use: the next claim is answered, and nothing falls back."""
    changes = Changes()
    subject = book(server.url, changes.of("a"), timeout=0.5, lease=1.5)
    async with started(subject):
        assert await subject.claim("s", fp("x"), time.monotonic()) == "claimed"
        await anyio.to_thread.run_sync(server.kill)  # the loop runs meanwhile: its connections see the end
        await anyio.to_thread.run_sync(server.start)  # the same port, an empty Redis
        assert await subject.claim("s", fp("x"), time.monotonic()) == "claimed"  # empty: a change again
        assert subject.up and subject.fallbacks == 0


# --- the fleet decides as one process would ---------------------------------------------------------

Upstream = Literal["ok", "500", "401", "unreachable", "slow"]

# (body, whether the request carries the session id, what the upstream does): one conversation's requests
# in order, whatever becomes of them. "big" is refused by the gateway itself (413) before it is forwarded.
SEQUENCE: list[tuple[str, bool, Upstream]] = [
    ("x", True, "ok"),
    ("x", True, "ok"),  # the same body again: no change
    ("y", True, "500"),  # a change, whatever the upstream answers (as the memory book records every outcome)
    ("y", True, "ok"),  # the client retries the same body: no change
    ("z", True, "unreachable"),
    ("x", True, "401"),  # back to an earlier body: a change
    ("big", True, "ok"),  # 413 from the gateway: never forwarded, never recorded
    ("w", False, "ok"),  # no session id: not a session's request
    ("z", True, "slow"),  # the upstream answers after the bound the client waits for: the client leaves
    ("z", True, "ok"),
    ("x", True, "ok"),
]


def body_of(tag: str) -> dict[str, Any]:
    if tag == "big":
        return {**turn(1), "padding": "p" * 4096}
    return {**turn(1), "messages": [{"role": "user", "content": f"body {tag}"}]}


@contextlib.asynccontextmanager
async def gateway(store: str, changes: Changes, name: str) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = LifetimeSettings(
        upstream_url=(UPSTREAM,),
        session_store=store,
        session_store_timeout=4.0,
        max_attempts=1,
        max_body_bytes=2048,
    )
    app = create_app(settings, on_change=changes.of(name))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{name}.test") as client:
            yield client, app
            await until(lambda: app.state.lifetime.stats().idle)


async def play(clients: list[httpx.AsyncClient]) -> list[int]:
    """Send ``SEQUENCE``, request i to ``clients[i % len(clients)]``; the statuses the client saw."""
    plan: list[Upstream] = []
    reached = anyio.Event()

    async def upstream(request: httpx.Request) -> httpx.Response:
        what = plan.pop(0)
        if what == "unreachable":
            raise httpx.ConnectError("refused", request=request)
        if what == "slow":
            reached.set()
            await anyio.sleep_forever()
        return httpx.Response({"500": 500, "401": 401}.get(what, 200), json=OK)

    statuses: list[int] = []
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{UPSTREAM}{PATH}").mock(side_effect=upstream)
        for index, (tag, with_id, what) in enumerate(SEQUENCE):
            client = clients[index % len(clients)]
            if tag != "big":
                plan.append(what)
            headers = {"x-session-id": "conv"} if with_id else {}
            if what == "slow":  # the client gives up while the upstream is answering
                with anyio.fail_after(WAIT):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(functools.partial(client.post, PATH, json=body_of(tag), headers=headers))
                        await reached.wait()
                        tg.cancel_scope.cancel()
                statuses.append(0)
                continue
            statuses.append((await client.post(PATH, json=body_of(tag), headers=headers)).status_code)
    return statuses


@ASYNCIO
async def test_the_fleet_runs_on_change_as_one_process_does(server: RedisServer) -> None:
    """One sequence of requests, whatever becomes of each (upstream errors, the gateway's own refusal,
    a client that leaves): the in-memory book of one process and two replicas sharing Redis run
    ``on_change`` for the same changes, in the same order."""
    alone, fleet = Changes(), Changes()
    async with gateway("memory", alone, "memory") as (client, _):
        alone_statuses = await play([client])
    async with gateway(server.url, fleet, "a") as (a, app_a), gateway(server.url, fleet, "b") as (b, app_b):
        fleet_statuses = await play([a, b])
        assert app_a.state.book.up and app_b.state.book.up
        assert app_a.state.book.local_records == app_b.state.book.local_records == 0
    assert alone_statuses == fleet_statuses
    assert 413 in alone_statuses and 500 in alone_statuses and 401 in alone_statuses
    assert hashes_of(fleet) == hashes_of(alone), (fleet.calls, alone.calls)
    expected = [body_of(tag) for tag in ("x", "y", "z", "x", "z", "x")]
    assert hashes_of(alone) == [body_hash(body) for body in expected]


# --- Redis forgets between the claim and the record -------------------------------------------------


async def flush(server: RedisServer) -> None:
    async with redis_client(server.url) as client:
        await client.flushall()


async def restart(server: RedisServer) -> None:
    await anyio.to_thread.run_sync(server.kill)  # the loop runs meanwhile: the pools' connections see the end
    await anyio.to_thread.run_sync(server.start)  # an empty Redis (no persistence)


FORGETTING: dict[str, Callable[[RedisServer], Awaitable[None]]] = {"FLUSHALL": flush, "a restart": restart}


@ASYNCIO
@pytest.mark.parametrize("forget", list(FORGETTING))
async def test_a_claim_redis_forgot_before_the_record_is_put_back(server: RedisServer, forget: str) -> None:
    """Redis loses a's claim while a's answer streams: a runs the change (it claimed it), and its record
    puts the claim back, so the same body re-sent to b is no change again; the next body is one."""
    changes = Changes()
    x, y = turn(1), turn(2)

    async def answer_a(request: httpx.Request) -> httpx.Response:
        await FORGETTING[forget](server)
        return httpx.Response(200, json=OK)

    with respx.mock(assert_all_called=True) as router:
        router.post(f"http://upstream-a.test{PATH}").mock(side_effect=answer_a)
        router.post(f"http://upstream-b.test{PATH}").respond(200, json=OK)
        async with (
            replica(server.url, "http://upstream-a.test", changes, "a", bound=0.5) as (a, book_a),
            replica(server.url, "http://upstream-b.test", changes, "b", bound=0.5) as (b, book_b),
        ):
            headers = {"x-session-id": "conv"}
            assert (await a.post(PATH, json=x, headers=headers)).status_code == 200
            # A restart may cut a call of a's in flight (its lease's, on a connection still opening): then a
            # falls back, runs the change it claimed, and tells Redis when it answers again.
            await until(lambda: book_a.up)
            await settled(book_a)
            assert (await b.post(PATH, json=x, headers=headers)).status_code == 200  # a re-send, elsewhere
            assert (await b.post(PATH, json=y, headers=headers)).status_code == 200
            await settled(book_a, book_b)
            assert book_b.fallbacks == 0
    assert [(name, h) for name, _, h in changes.calls] == [("a", body_hash(x)), ("b", body_hash(y))]


# --- concurrency, clocks, the book's own life --------------------------------------------------------


@ASYNCIO
async def test_one_body_sent_at_once_to_both_replicas_runs_on_change_once(server: RedisServer) -> None:
    """A double submit, an SDK retry that reaches the other replica while the first attempt is still being
    answered: one change, one run in the fleet; two different bodies at once: two changes, one run each."""
    changes = Changes()
    gate = anyio.Event()
    arrived = 0

    async def answer(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        await gate.wait()  # every request is in flight (claimed) before any is answered
        return httpx.Response(200, json=OK)

    with respx.mock(assert_all_called=True) as router:
        router.post(f"{UPSTREAM}{PATH}").mock(side_effect=answer)
        async with (
            replica(server.url, UPSTREAM, changes, "a") as (a, book_a),
            replica(server.url, UPSTREAM, changes, "b") as (b, book_b),
        ):
            headers = {"x-session-id": "conv"}
            for bodies in ([turn(1)] * 8, [turn(2), turn(3)]):
                gate, arrived, before = anyio.Event(), 0, len(changes.calls)
                statuses: list[int] = []

                async def send(client: httpx.AsyncClient, body: dict[str, Any], into: list[int]) -> None:
                    into.append((await client.post(PATH, json=body, headers=headers)).status_code)

                with anyio.fail_after(WAIT):
                    async with anyio.create_task_group() as tg:
                        for index, body in enumerate(bodies):
                            tg.start_soon(send, (a, b)[index % 2], body, statuses)
                        await until(lambda: arrived == len(bodies))  # noqa: B023 (waited on here)
                        gate.set()
                assert statuses == [200] * len(bodies)
                assert sorted(hashes_of(changes)[before:]) == sorted({body_hash(body) for body in bodies})
            assert book_a.local_records == book_b.local_records == 0


@ASYNCIO
async def test_replicas_minutes_apart_still_claim_each_change_once(server: RedisServer) -> None:
    """The claim compares hashes, not clocks: a replica whose clock is five minutes behind the other's
    claims each change of a conversation once, wherever its turns land."""
    changes = Changes()
    a, b = book(server.url, changes.of("a")), book(server.url, changes.of("b"))
    skew = {"a": -300.0, "b": 0.0}
    turns = [("a", "x"), ("b", "y"), ("a", "y"), ("a", "z"), ("b", "x"), ("b", "x"), ("a", "z")]
    async with started(a, b):
        for name, tag in turns:
            subject = a if name == "a" else b
            admitted = time.monotonic() + skew[name]
            claim = await subject.claim("s", fp(tag), admitted)
            subject.record(dataclasses.replace(outcome("s", tag), started=admitted, claim=claim))
        await settled(a, b)
        entry = await a.lookup("s")
        assert entry is not None and entry.requests == len(turns)
    assert [(name, h) for name, _, h in changes.calls] == [
        ("a", fp("x").wire_hash),
        ("b", fp("y").wire_hash),
        ("a", fp("z").wire_hash),
        ("b", fp("x").wire_hash),
        ("a", fp("z").wire_hash),
    ]


@ASYNCIO
async def test_a_claim_that_outlives_the_book_s_task_leaves_it_ready_to_start_again(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lifespan ends while a request's claim waits on Redis: the claim ends within its bound, and
    the book is stopped, not "down" (which a new ``run`` refused as already running)."""
    proxy = LossyProxy(server.port)
    asking = watch_claims(monkeypatch)
    async with proxy.serving() as url:
        subject = book(url, timeout=0.5, lease=1.5)
        answers: list[Any] = []
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as outer:
                async with started(subject):
                    proxy.mode = "drop_replies"

                    async def admit() -> None:
                        answers.append(await subject.claim("s", fp("x"), time.monotonic()))

                    outer.start_soon(admit)
                    await asking.wait()
                # the task has stopped; the claim is still waiting
            assert answers == ["unsure"]
            assert not subject.up
            proxy.mode = "pass"
            async with started(subject):
                assert subject.up
