"""Attacks on hashing a large body beside the look (``_middleware._hash_and_look``, 782e34e).

From ``THREAD_THRESHOLD`` (256 KiB) on, the middleware hashes the body in a worker thread while the
lazy look (itself in a worker thread) or the full parse judges it. What must still hold:

- the wire hash is blake3 of the body as decoded, the verdict the full parse's, at and around both
  thresholds (the look's 64 KiB, the thread's 256 KiB), on the wire size and on the decoded size;
- an error of the look (413 ``body_too_complex``) or of the hash is raised as itself: an error
  response, or the error to the server, never an ``ExceptionGroup``; nothing reaches the app;
- on every path the body is unreachable once the request has settled: not even a reference cycle
  keeps it (the collector is off while that is checked: a cycle would hold a 64 MiB body until
  the next full collection), and the slot and bytes are back;
- a request cancelled while both threads run ends cancelled, with everything released;
- many large requests at once (more threads than anyio's 40 default) neither deadlock nor keep a
  small request waiting; under a real server too.
"""

from __future__ import annotations

import gc
import gzip
import json
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread
import httpx
import pytest
from blake3 import blake3
from starlette.types import Message, Receive, Scope, Send

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings, _lazy, _middleware, _parse, fingerprint
from asgi_lifetime._parse import THREAD_THRESHOLD
from asgi_lifetime.testing import serve_in_thread

from .._asgi import Recorder, http_scope, receiving
from .test_faults import eventually

pytestmark = pytest.mark.anyio

KiB = 1024
Handoff = bool | Literal["on_demand"]
HANDOFFS: list[Handoff] = [False, "on_demand", True]


def settings(**changes: Any) -> LifetimeSettings:
    return LifetimeSettings(paths=("/v1/",), admission_timeout=5.0, body_idle_timeout=10.0).replace(**changes)


def chat(size: int) -> bytes:
    """A text conversation of exactly ``size`` bytes."""
    empty = len(json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}).encode())
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (size - empty)}]}).encode()
    assert len(raw) == size
    return raw


def request(raw: bytes, encoding: str | None = None, chunk: int = 64 * KiB) -> tuple[Scope, Receive]:
    """The scope and the client of a JSON POST of ``raw`` (compressed with ``encoding`` on the wire)."""
    wire = gzip.compress(raw) if encoding else raw
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(wire)).encode())]
    if encoding:
        headers.append((b"content-encoding", encoding.encode()))
    messages: list[Message] = [
        {"type": "http.request", "body": wire[i : i + chunk], "more_body": True} for i in range(0, len(wire), chunk)
    ]
    messages[-1]["more_body"] = False
    return http_scope(headers=headers), receiving(messages)


class Replayed:
    """What the app was replayed: the body's digest and size."""

    def __init__(self, body: bytes) -> None:
        self.digest, self.size = blake3(body).hexdigest(), len(body)

    def __eq__(self, raw: object) -> bool:
        return isinstance(raw, bytes) and (self.digest, self.size) == (blake3(raw).hexdigest(), len(raw))

    __hash__ = None  # type: ignore[assignment]


def recording_app(seen: list[Any]) -> Callable[[Scope, Receive, Send], Any]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["state"]["lifetime"].fingerprint)
        seen.append(Replayed((await receive())["body"]))  # not the body: the test checks nothing holds it
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


@contextmanager
def collector_off() -> Iterator[Callable[[], int]]:
    """tracemalloc on and the cyclic collector off; yields the bytes allocated since and still held."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield lambda: tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
        gc.enable()


async def released(held: Callable[[], int], size: int) -> None:
    """Wait (bounded: it only matters on failure) until less than half of a ``size``-byte body is held.

    A worker thread drops its reference to the job it ran just after handing back the result, so
    the first reading may still see it; a reference cycle holds the body for good (the collector is off).
    """
    try:
        await eventually(lambda: held() < size // 2, seconds=5)
    except AssertionError:
        raise AssertionError(f"{held()} bytes still held after a {size}-byte body settled") from None


# 1. The hash and the verdict around both thresholds, on the wire size and on the decoded size.

SIZES = [64 * KiB - 1, 64 * KiB, 64 * KiB + 1, THREAD_THRESHOLD - 1, THREAD_THRESHOLD, THREAD_THRESHOLD + 1]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("encoding", [None, "gzip"])
@pytest.mark.parametrize("handoff", HANDOFFS)
async def test_around_the_thresholds_the_hash_is_of_the_decoded_body_and_the_verdict_the_parse(
    size: int, encoding: str | None, handoff: Handoff
) -> None:
    """gzip: the wire body is a few hundred bytes, the decoded one crosses the threshold."""
    raw = chat(size)
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=handoff)
    out = Recorder()
    with anyio.fail_after(30):
        await middleware(*request(raw, encoding), out)
    assert out.status == 204
    fp, body = seen
    assert body == raw
    assert fp == fingerprint(raw)
    assert fp.wire_hash == blake3(raw).hexdigest() and fp.size == size
    stats = middleware.stats()
    assert stats.idle and stats.completed == 1 and stats.admitted == 1


# 2. Bodies the look refuses, or only the full parse (in a thread) can judge, above the threshold.

PAD = b"x" * (300 * KiB)
MILLION_EMPTY = b"[" + b"{}," * 200_000 + b"{}]"  # valid JSON whose parse costs ~24x the body
HOSTILE = {
    "too complex": MILLION_EMPTY,
    "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800' + PAD + b'"}]}',
    "invalid utf-8": b'{"messages": [{"role": "user", "content": "' + PAD + b'\xff"}]}',
    "truncated": b'{"messages": [{"role": "user", "content": "' + PAD + b'"}], ',
    "huge digit run": b'{"messages": [], "n": ' + b"7" * (300 * KiB) + b"}",
    "deep nesting": b"[" * (150 * KiB) + b"]" * (150 * KiB),
    "NaN": b'{"messages": [{"role": "user", "content": "' + PAD + b'"}], "t": NaN}',
}
# Refused with 413 body_too_complex when the app wants the parse (True); the rest are forwarded, not comparable.
REFUSED = {("too complex", True), ("lone surrogate", True)}


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("handoff", HANDOFFS)
async def test_a_hostile_large_body_gets_its_answer_and_leaves_nothing_behind(kind: str, handoff: Handoff) -> None:
    """Before the fix, a 413 from the look kept the body in a reference cycle (the error, held in a local
    of the frame its traceback holds), and so did any error raised in a worker thread (anyio's future,
    trio's outcome closures: invalid UTF-8, truncated JSON), until the collector ran."""
    raw = HOSTILE[kind]
    assert len(raw) >= THREAD_THRESHOLD
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=handoff)
    out = Recorder()
    with collector_off() as held:
        with anyio.fail_after(30):
            await middleware(*request(raw), out)
        await released(held, len(raw))
    if (kind, handoff) in REFUSED:
        assert out.status == 413 and seen == []
        error = json.loads(out.body)["error"]
        assert error["code"] == "body_too_complex" and error["type"] == "invalid_request_error"
        assert (b"connection", b"close") in out.messages[0]["headers"]
    else:
        assert out.status == 204
        fp, body = seen
        assert body == raw and fp.wire_hash == blake3(raw).hexdigest() and fp.size == len(raw)
        # As before 782e34e: only the NaN conversation is comparable. The lone surrogate's parse (the
        # standard library's) would cost too much: judged without it, not comparable, as documented.
        assert fp.text_comparable is (kind == "NaN")
    assert middleware.stats().idle


@pytest.mark.parametrize("handoff", HANDOFFS)
async def test_a_valid_large_body_leaves_nothing_behind_either(handoff: Handoff) -> None:
    raw = chat(1024 * KiB)
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=handoff)
    with collector_off() as held:
        with anyio.fail_after(30):
            await middleware(*request(raw, chunk=256 * KiB), Recorder())
        await released(held, len(raw))
    assert middleware.stats().idle


# 3. The look fails while the hash thread still runs; the hash fails; the request is cancelled.


async def test_the_look_fails_while_the_hash_thread_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash thread waits until the look has raised: the 413 waits for it, then goes out as itself."""
    look_failed = threading.Event()
    hash_waited: list[bool] = []
    first_look = _middleware._first_look
    real = blake3

    async def failing_look(*args: Any) -> Any:
        try:
            return await first_look(*args)
        except Exception:
            look_failed.set()
            raise

    def slow_blake3(data: bytes) -> Any:
        hash_waited.append(look_failed.wait(10))
        return real(data)

    monkeypatch.setattr(_middleware, "_first_look", failing_look)
    monkeypatch.setattr(_middleware, "blake3", slow_blake3)
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=True)
    out = Recorder()
    with collector_off() as held:
        with anyio.fail_after(30):
            await middleware(*request(MILLION_EMPTY), out)
        await released(held, len(MILLION_EMPTY))
    assert hash_waited == [True]  # the hash was still running when the look failed, and it ended
    assert out.status == 413 and json.loads(out.body)["error"]["code"] == "body_too_complex" and seen == []
    assert middleware.stats().idle


@pytest.mark.parametrize("handoff", HANDOFFS)
@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
async def test_a_hash_failure_is_raised_as_itself_not_in_an_exception_group(
    monkeypatch: pytest.MonkeyPatch, handoff: Handoff, error: type[Exception]
) -> None:
    """Before the fix: ``ExceptionGroup([MemoryError()])``, which no ``except MemoryError`` or exception
    handler keyed on the type catches (before 782e34e the hasher raised its error as it is)."""

    def failing_blake3(data: bytes) -> Any:
        raise error("the hasher failed")

    monkeypatch.setattr(_middleware, "blake3", failing_blake3)
    raw = chat(512 * KiB)
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=handoff)
    with collector_off() as held:
        with anyio.fail_after(30), pytest.raises(error, match="the hasher failed"):
            await middleware(*request(raw), Recorder())
        await released(held, len(raw))
    assert seen == [] and middleware.stats().idle


@pytest.mark.parametrize("handoff", [False, True])
async def test_cancelled_while_the_hash_and_the_look_both_run(
    monkeypatch: pytest.MonkeyPatch, handoff: Handoff, anyio_backend: str
) -> None:
    """Server shutdown (or a client the server saw leave) cancels the request while both worker threads
    run: the request ends cancelled once they end, nothing wrapped, everything released."""
    hashing, looking, go = threading.Event(), threading.Event(), threading.Event()
    real_blake3, real_shape, real_parse = blake3, _lazy.shape, _parse.parse_body

    def held_blake3(data: bytes) -> Any:
        hashing.set()
        go.wait(10)
        return real_blake3(data)

    def held_shape(raw: bytes) -> Any:
        looking.set()
        go.wait(10)
        return real_shape(raw)

    async def held_parse(raw: bytes, **kwargs: Any) -> Any:
        looking.set()
        await anyio.to_thread.run_sync(go.wait, 10)
        return await real_parse(raw, **kwargs)

    monkeypatch.setattr(_middleware, "blake3", held_blake3)
    monkeypatch.setattr(_lazy, "shape", held_shape)
    monkeypatch.setattr(_middleware, "parse_body", held_parse)
    raw = chat(512 * KiB)
    seen: list[Any] = []
    middleware = LifetimeMiddleware(recording_app(seen), settings=settings(), handoff_parsed=handoff)
    outcome: list[str] = []

    async def checkpointing_send(message: Message) -> None:
        await anyio.lowlevel.checkpoint()  # as a server's send does

    with collector_off() as held:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    with anyio.CancelScope() as scope:
                        tg.start_soon(watch, scope)
                        await middleware(*request(raw), checkpointing_send)
                        outcome.append("returned")
                    outcome.append("cancelled" if scope.cancelled_caught else "not cancelled")

                async def watch(scope: anyio.CancelScope) -> None:
                    assert await anyio.to_thread.run_sync(hashing.wait, 10)
                    assert await anyio.to_thread.run_sync(looking.wait, 10)
                    scope.cancel()  # while both threads wait
                    go.set()

                tg.start_soon(run)
        await released(held, len(raw))
    # On asyncio the request ends as the threads do; trio ignores the cancellation of a thread it may
    # not abandon and delivers it at the next checkpoint: after the look, or the app's first send.
    assert outcome == ["cancelled"]
    assert len(seen) in ((0,) if anyio_backend == "asyncio" else (0, 2))
    assert middleware.stats().idle


# 4. More large requests than worker threads; a small one among them.


async def test_more_large_requests_than_worker_threads_neither_deadlock_nor_starve_a_small_one() -> None:
    """Each large request takes two worker threads at once (hash and look). With the limiter at one
    token, every request still finishes (the hash never waits for the look), and a small request,
    which takes no thread, is answered while the large ones queue for the token."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens = limiter.total_tokens
    limiter.total_tokens = 1
    try:
        raws = [chat(THREAD_THRESHOLD + 4096 * i) for i in range(12)]
        seen: list[Any] = []
        middleware = LifetimeMiddleware(
            recording_app(seen), settings=settings(max_inflight=64), handoff_parsed="on_demand"
        )
        outs = [Recorder() for _ in raws]
        small = Recorder()
        small_seen: list[Any] = []
        small_middleware = LifetimeMiddleware(recording_app(small_seen), settings=settings())
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for raw, out in zip(raws, outs, strict=True):
                    tg.start_soon(middleware, *request(raw), out)
                await anyio.lowlevel.checkpoint()  # the large ones have started
                await small_middleware(*request(chat(1000)), small)
                assert small.status == 204  # while the large ones run or wait for the thread
        assert [out.status for out in outs] == [204] * len(raws)
        hashes = {fp.wire_hash for fp in seen[0::2]}
        assert hashes == {blake3(raw).hexdigest() for raw in raws}
        assert middleware.stats().idle and middleware.stats().completed == len(raws)
    finally:
        limiter.total_tokens = tokens


async def echo_hash(scope: Scope, receive: Receive, send: Send) -> None:
    fp = scope["state"]["lifetime"].fingerprint
    body = (await receive())["body"]
    answer = json.dumps({"wire_hash": fp.wire_hash, "comparable": fp.text_comparable, "size": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


async def test_under_uvicorn_many_large_requests_at_once_and_a_refused_one() -> None:
    """48 large requests at once (anyio's default limiter has 40 tokens; each takes two), gzip among
    them, beside one the look refuses (413, connection closed) and a small one: all answered right."""
    middleware = LifetimeMiddleware(echo_hash, settings=settings(max_inflight=64), handoff_parsed=True)
    raws = [chat(THREAD_THRESHOLD - 8 + 4 * i) for i in range(48)]
    results: dict[int, httpx.Response] = {}
    with serve_in_thread(middleware) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=64)) as client:

            async def post(i: int, raw: bytes, gzipped: bool) -> None:
                headers = {"content-type": "application/json"}
                content = raw
                if gzipped:
                    content, headers["content-encoding"] = gzip.compress(raw), "gzip"
                results[i] = await client.post("/v1/x", content=content, headers=headers)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i, raw in enumerate(raws):
                        tg.start_soon(post, i, raw, i % 3 == 0)
                    tg.start_soon(post, -1, MILLION_EMPTY, False)
                    tg.start_soon(post, -2, chat(2000), False)
        for i, raw in enumerate(raws):
            assert results[i].status_code == 200
            assert results[i].json() == {"wire_hash": blake3(raw).hexdigest(), "comparable": True, "size": len(raw)}
        refused = results[-1]
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_complex"
        assert refused.headers["connection"] == "close"
        assert results[-2].status_code == 200
        await eventually(lambda: middleware.stats().idle, seconds=10)  # the server thread settles the last one
    assert middleware.stats().completed == len(raws) + 1
