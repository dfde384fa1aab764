"""The fleet, for real, on loopback: nginx -> two gateway replicas (2 workers each) -> two upstreams.

nginx runs ``examples/deploy/nginx.conf`` (addresses replaced by loopback ones, plus an
``X-Upstream-Addr`` response header so the client sees which replica answered); each replica is
``asgi-lifetime serve --workers 2``; the upstreams are demo upstreams in this process, tagged so
the client sees which one answered.

1. 200 sessions x 5 turns (and one identical re-send of turn 3 each), 16 in flight: every
   session's turns reach one replica (nginx's consistent hash) and one upstream (the gateway's
   rendezvous hash), and each replica's ``/lifetime/stats`` totals, over its workers, count
   exactly the requests the client saw it answer.
2. Long streams are held open on both replicas; sessions re-send their last turn; one replica is
   killed (SIGKILL to its supervisor and workers). Only requests in flight on the killed replica
   fail (its held streams, and requests that reached it before its port closed); every request
   sent after that succeeds; its sessions move to the other replica and keep their upstream.
3. The sessions go on (the failed turn re-sent, then new turns), all on the survivor.
4. ``on_change`` across the fleet: the sum of ``session_changes`` over the replicas against the
   real changes (each session's bodies in turn order, each differing from the one before; identical
   re-sends are not changes). With ``SESSION_STORE=redis://...`` (a shared ``redis-server``, each
   change claimed at admission) it runs exactly once per real change, on the replica that admitted
   it, except the changes claimed by requests in flight on the killed replica when it died: its held
   streams (a new turn each), claimed there and never recorded; their re-sends on the survivor find
   the change claimed and do not run it. Exactly: after phase 1, each replica counts 5 changes per
   session it served; at the end, the sum is the real changes minus the killed replica's held streams.
   With each worker's own memory it runs again wherever a session's known body lands on a book that
   has not seen it (a moved session's re-send), which the memory run shows.

Bounded: every request has a timeout, every phase a deadline; loopback only.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_lifetime._settings import SETTINGS
from asgi_lifetime.gateway._metrics import MULTIPROC_DIR_ENV
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream
from tests._gateways import Gateway, eventually, gateway_process
from tests._nginx import EXAMPLE, loopback_site, nginx_server
from tests._servers import free_port

pytestmark = pytest.mark.slow

SESSIONS = 200
TURNS = 5
REPEATED_TURN = 3  # re-sent once, identical: a client's retry, not a change
CONCURRENCY = 16
HELD_PER_REPLICA = 4
HELD = {"max_tokens": 150, "behaviour": "delay=0.1"}  # 15 s unless cut
PHASE_TIMEOUT = 180.0
REQUEST_TIMEOUT = 60.0
ADDR_HEADER = "x-upstream-addr"
TAG_HEADER = "x-test-upstream"
# Test config only: the replica that answered, as nginx saw it ("A, B" when it moved on from A).
HTTP_EXTRA = f"    add_header {ADDR_HEADER} $upstream_addr always;"


def tagged(app: ASGIApp, tag: str) -> ASGIApp:
    """The demo upstream, adding ``x-test-upstream: TAG`` to its responses (the gateway relays it)."""

    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def tagging(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (TAG_HEADER.encode(), tag.encode())]}
            await send(message)

        await app(scope, receive, tagging)

    return wrapper


def two_workers(gateway: Gateway) -> bool:
    stats = gateway.stats()
    return stats["scope"] == "workers" and len(stats["workers"]) == 2


@dataclass
class Fleet:
    nginx: str
    replicas: list[Gateway]
    upstreams: list[str]

    def replica(self, address: str) -> int:
        return [f"127.0.0.1:{r.port}" for r in self.replicas].index(address)


@contextlib.contextmanager
def fleet(tmp_path: Path, env: dict[str, str]) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        upstreams = [
            # Idle connections kept longer than the test: the gateway never races the upstream's
            # keep-alive close (a failed reuse would be retried on the other upstream).
            stack.enter_context(
                serve_in_thread(tagged(create_demo_upstream(tokens_per_second=1000), f"u{i}"), timeout_keep_alive=600)
            )
            for i in range(2)
        ]
        replicas = []
        for i in range(2):
            shared = tmp_path / f"replica-{i}" / "shared"
            shared.mkdir(parents=True)
            argv = ["--upstream", upstreams[0], "--upstream", upstreams[1], "--workers", "2"]
            argv += ["--timeout-keep-alive", "60"]  # above nginx's upstream keepalive_timeout, as in compose.yaml
            replicas.append(
                stack.enter_context(
                    gateway_process(
                        argv,
                        tmp_path / f"replica-{i}" / "serve.log",
                        env={MULTIPROC_DIR_ENV: str(shared), **env},
                        ready=two_workers,
                    )
                )
            )
        port = free_port()
        site = loopback_site(EXAMPLE.read_text(), listen=port, gateways=[r.port for r in replicas])
        proxy = stack.enter_context(nginx_server(tmp_path / "nginx", site, port=port, http_extra=HTTP_EXTRA))
        yield Fleet(proxy.base, replicas, upstreams)


# --- the client ---------------------------------------------------------------------------------


@dataclass
class Turn:
    session: int
    turn: int
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    addresses: list[str] = field(default_factory=list)
    upstream: str = ""

    @property
    def replica_address(self) -> str:
        return self.addresses[-1] if self.addresses else ""


def body(session: int, turn: int) -> dict[str, Any]:
    """Turn ``turn`` of a session's conversation: every turn's body differs (a real change)."""
    messages: list[dict[str, str]] = []
    for n in range(1, turn + 1):
        messages.append({"role": "user", "content": f"session {session}, turn {n}: tell me more"})
        if n < turn:
            messages.append({"role": "assistant", "content": f"answer {n}"})
    max_tokens = HELD["max_tokens"] if turn == TURNS + 1 else 5  # turn 6 is the long one
    return {"model": "demo", "stream": True, "max_tokens": max_tokens, "messages": messages}


class Client:
    def __init__(self, base: str) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        self.http = httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT, limits=limits)
        self.turns: list[Turn] = []
        self._lock = threading.Lock()

    def send(
        self, session: int, turn: int, *, held: bool = False, on_first_byte: Callable[[], None] | None = None
    ) -> Turn:
        headers = {"x-session-id": f"session-{session}"}
        if held:
            headers["x-demo-behaviour"] = str(HELD["behaviour"])
        record = Turn(session, turn, time.time())
        try:
            with self.http.stream(
                "POST", "/v1/chat/completions", json=body(session, turn), headers=headers
            ) as response:
                record.addresses = [a.strip() for a in response.headers.get(ADDR_HEADER, "").split(",") if a.strip()]
                record.upstream = response.headers.get(TAG_HEADER, "")
                chunks = response.iter_raw()
                text = next(chunks, b"")
                if on_first_byte is not None:
                    on_first_byte()
                text += b"".join(chunks)
                record.ok = response.status_code == 200 and b"data: [DONE]" in text
                if not record.ok:
                    record.error = f"{response.status_code}: {text[-300:]!r}"
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.ended = time.time()
        with self._lock:
            self.turns.append(record)
        return record

    def complete(self, session: int, turn: int) -> None:
        """Send a turn until it is answered, as a client would (each attempt is recorded)."""
        for _ in range(3):
            if self.send(session, turn).ok:
                return

    def close(self) -> None:
        self.http.close()


def run_all(jobs: list[Callable[[], None]], threads: int = CONCURRENCY) -> None:
    with ThreadPoolExecutor(threads) as pool:
        futures: list[Future[None]] = [pool.submit(job) for job in jobs]
        done, pending = wait(futures, timeout=PHASE_TIMEOUT)
        assert not pending, f"{len(pending)} sessions not done within {PHASE_TIMEOUT}s"
        for future in done:
            future.result()


def store_fallbacks(gateway: Gateway) -> float:
    """``session_store_fallbacks`` summed over the replica's workers (``/metrics``)."""
    text = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    found = re.search(r"^asgi_lifetime_session_store_fallbacks_total (\S+)$", text, re.MULTILINE)
    assert found, "no session_store_fallbacks metric"
    return float(found.group(1))


def settled(gateway: Gateway, completed: int) -> dict[str, Any]:
    """The replica's totals once they count ``completed`` finished requests and nothing is in flight,
    read from two successive reports of every worker, each written after the previous read, that
    agree on ``session_changes`` (a shared store decides a change after a round trip)."""

    def counted() -> bool:
        stats = gateway.stats()
        return bool(stats["completed"] >= completed and stats["inflight_requests"] == 0)

    eventually(counted, seconds=30, what=f"replica {gateway.port} counting {completed} requests")

    def fresh_after(moment: float) -> dict[str, Any] | None:
        asked = time.time()
        stats = gateway.stats()
        return stats if all(asked - w["age"] > moment for w in stats["workers"]) else None

    def read() -> dict[str, Any]:
        moment = time.time()
        result: dict[str, Any] = eventually(lambda: fresh_after(moment), seconds=10, what="fresh worker reports")
        return result

    previous = read()
    for _ in range(20):
        current = read()
        if current["session_changes"] == previous["session_changes"]:
            return current
        previous = current
    raise AssertionError(f"session_changes of replica {gateway.port} still moving: {current['session_changes']}")


# --- the scenario -------------------------------------------------------------------------------


STORES = [
    pytest.param("memory", id="memory"),
    pytest.param(
        "redis",
        id="redis",
        marks=pytest.mark.xfail("session_store" not in SETTINGS, strict=True, reason="needs SESSION_STORE (h/redis)"),
    ),
]


@contextlib.contextmanager
def store(kind: str) -> Iterator[dict[str, str]]:
    if kind == "memory":
        yield {}
        return
    servers = importlib.import_module("tests._servers")  # h/redis: redis_server() and its require_binary rule
    with servers.redis_server() as redis:
        # Exactly once holds while the store answers: past SESSION_STORE_TIMEOUT a replica decides
        # alone (and says so in session_store_fallbacks). The default 0.25 s was exceeded on a
        # loaded 2-core machine; this test is about the fleet, not that bound.
        yield {"ASGI_LIFETIME_SESSION_STORE": redis.url, "ASGI_LIFETIME_SESSION_STORE_TIMEOUT": "2"}


@pytest.mark.parametrize("kind", STORES)
def test_fleet_routes_sessions_survives_a_replica_kill_and_counts_changes(tmp_path: Path, kind: str) -> None:
    with store(kind) as env, fleet(tmp_path, env) as f:
        client = Client(f.nginx)
        try:
            scenario(f, client, exact_changes=kind != "memory")
        finally:
            client.close()


def scenario(f: Fleet, client: Client, *, exact_changes: bool) -> None:
    # 1. Sessions, each turn after the previous one, 16 requests in flight.
    def conversation(session: int) -> Callable[[], None]:
        def run() -> None:
            for turn in range(1, TURNS + 1):
                client.send(session, turn)
                if turn == REPEATED_TURN:
                    client.send(session, turn)

        return run

    run_all([conversation(s) for s in range(SESSIONS)])
    first = list(client.turns)
    assert len(first) == SESSIONS * (TURNS + 1)
    assert [t for t in first if not t.ok] == []
    home: dict[int, str] = {}  # session -> the replica address it lives on
    upstream: dict[int, str] = {}
    for session in range(SESSIONS):
        turns = [t for t in first if t.session == session]
        assert {tuple(t.addresses) for t in turns} == {(turns[0].replica_address,)}, "one replica, no retry"
        assert len({t.upstream for t in turns}) == 1, "one upstream"
        home[session], upstream[session] = turns[0].replica_address, turns[0].upstream
    assert set(upstream.values()) == {"u0", "u1"}
    per_replica = [sum(1 for t in first if t.replica_address == f"127.0.0.1:{r.port}") for r in f.replicas]
    assert all(per_replica), per_replica  # both replicas serve sessions
    before = [settled(r, n) for r, n in zip(f.replicas, per_replica, strict=True)]
    # /lifetime/stats, summed over each replica's workers, counts what the client saw each replica answer.
    assert [s["admitted"] for s in before] == per_replica
    assert [s["completed"] for s in before] == per_replica
    sessions_on = [[s for s in range(SESSIONS) if home[s] == f"127.0.0.1:{r.port}"] for r in f.replicas]
    if exact_changes:  # once per new body, on the replica that admitted it; never for the identical re-send
        assert [store_fallbacks(r) for r in f.replicas] == [0, 0], "the store stopped answering in time"
        assert [s["session_changes"] for s in before] == [TURNS * len(on) for on in sessions_on]

    # 2. Long streams held open on both replicas; then replica 0 is killed while traffic flows.
    victim, survivor = f.replicas
    victim_address, survivor_address = (f"127.0.0.1:{r.port}" for r in f.replicas)
    held = sessions_on[0][:HELD_PER_REPLICA] + sessions_on[1][:HELD_PER_REPLICA]
    streaming = threading.Semaphore(0)
    held_results: dict[int, Turn] = {}
    kill_started = kill_done = 0.0
    killed = threading.Event()

    def hold(session: int) -> Callable[[], None]:
        def run() -> None:
            held_results[session] = client.send(session, TURNS + 1, held=True, on_first_byte=streaming.release)
            if not held_results[session].ok:  # cut with its replica: the client sends it again
                client.complete(session, TURNS + 1)
            client.complete(session, TURNS + 2)

        return run

    def carry_on(session: int) -> Callable[[], None]:
        def run() -> None:
            client.complete(session, TURNS)  # the last turn again, identical: maybe across the kill
            assert killed.wait(PHASE_TIMEOUT)
            client.complete(session, TURNS + 1)
            client.complete(session, TURNS + 2)

        return run

    with ThreadPoolExecutor(len(held)) as holders:
        holding = [holders.submit(hold(s)) for s in held]
        for _ in held:
            assert streaming.acquire(timeout=30), "a held stream did not start"
        eventually(
            lambda: [r.stats()["inflight_requests"] for r in f.replicas] == [HELD_PER_REPLICA, HELD_PER_REPLICA],
            seconds=10,
            what="the held streams counted on their replicas",
        )
        others = [s for s in range(SESSIONS) if s not in held]
        count_before_load = len(client.turns)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            carrying = [pool.submit(carry_on(s)) for s in others]
            # Requests are flowing (some answered) when the replica dies.
            eventually(lambda: len(client.turns) >= count_before_load + CONCURRENCY, seconds=30, what="traffic")
            kill_started = time.time()
            victim.kill()  # SIGKILL to its supervisor and workers; returns once its port refuses
            kill_done = time.time()
            killed.set()
            done, pending = wait([*carrying, *holding], timeout=PHASE_TIMEOUT)
            assert not pending, f"{len(pending)} sessions not done within {PHASE_TIMEOUT}s"
            for future in done:
                future.result()

    later = client.turns[count_before_load:]  # the held streams ended after that point: they are in it
    failed = [t for t in later if not t.ok]
    # Only what was in flight on the killed replica fails: its held streams, and requests to its
    # sessions sent before its port closed (answered by it, or caught in its dying listen queue).
    in_flight_on_victim = [
        t for t in later if home[t.session] == victim_address and t.started < kill_done and t.ended >= kill_started
    ]
    assert all(t in in_flight_on_victim for t in failed), [(t.session, t.turn, t.error) for t in failed]
    assert len(failed) <= len(in_flight_on_victim)
    assert {s for s, r in held_results.items() if not r.ok} == set(sessions_on[0][:HELD_PER_REPLICA])
    assert all(held_results[s].ok for s in sessions_on[1][:HELD_PER_REPLICA])
    after_kill = [t for t in later if t.started > kill_done]
    assert after_kill and all(t.ok for t in after_kill)
    # Its sessions moved to the survivor; every session kept its upstream.
    assert {t.replica_address for t in after_kill} == {survivor_address}
    moved = [(t.session, t.turn, t.upstream) for t in later if t.ok and t.upstream != upstream[t.session]]
    assert not moved, (moved[:10], len(moved), survivor.stats())
    assert any(home[t.session] == victim_address for t in after_kill)

    # 3. Every session has its 7 turns answered.
    answered = {(t.session, t.turn) for t in client.turns if t.ok}
    assert answered == {(s, n) for s in range(SESSIONS) for n in range(1, TURNS + 3)}

    # 4. on_change across the fleet: the victim's count when it died (nothing of the traffic
    # around the kill was a change: identical re-sends) plus the survivor's now.
    ok_on_survivor = sum(1 for t in client.turns if t.ok and t.replica_address == survivor_address)
    final = settled(survivor, ok_on_survivor)
    assert final["inflight_requests"] == 0 and final["pinned_sessions"] == 0
    changes = before[0]["session_changes"] + final["session_changes"]
    real = SESSIONS * (TURNS + 2)  # distinct bodies per session
    if exact_changes:
        assert store_fallbacks(survivor) == 0, "the store stopped answering in time"
        # Lost: the changes the killed replica claimed at admission and died before recording (its held
        # streams: turn 6 of its held sessions). Nothing else it had in flight was a change (re-sends of
        # turn 5); new turns of its sessions were sent after its port closed.
        lost = [s for s, r in held_results.items() if not r.ok]
        assert len(lost) == HELD_PER_REPLICA
        assert changes == real - len(lost), (changes, real, lost)
    else:
        # Each worker's own book: a moved session's re-sent last turn is new to the survivor.
        assert changes > real
