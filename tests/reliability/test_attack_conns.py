"""Hostile and merely bad connections against the gateway as ``asgi-lifetime serve`` runs it (uvicorn with the
protocols ``serve`` picks, ``H11_PROTOCOL`` and ``HTTPTOOLS_PROTOCOL``), over real loopback sockets.

- Idle rule (``_cli/_idle.py``): a connection that never sends a byte, one that sends its head a byte at a time
  (slowloris), and a kept-alive one that starts its next head and stops, are each closed ``--timeout-keep-alive``
  seconds after they were accepted or their last answer ended. Before, uvicorn held each of them open for ever
  (its keep-alive timer starts only after an answer, and the next byte cancels it for good): a few thousand
  cost nothing to send and took every file descriptor. Many at once do not keep a real client waiting. With
  ``--timeout-keep-alive 0`` (keep-alive off) a new connection still gets ``MIN_HEAD_SECONDS`` for its head.
- What the rule must not cut: a head sent in pieces within the time, a body uploaded for longer than it (its
  bounds are ``BODY_IDLE_TIMEOUT`` and ``BODY_TIMEOUT``), an answer streamed for longer than it, and a
  request pipelined behind a streamed one.
- A client that closes its sending side after the request (half-close) gets its whole answer or none: uvicorn
  closes the connection on the FIN unless it has paused reading, as nginx takes a FIN for an abort by default
  (``proxy_ignore_client_abort off``): a FIN cannot be told from a full close, and a gone client must free its
  upstream. Nothing stays held either way.
- File descriptors: the gateway alone in a process with ``RLIMIT_NOFILE`` 128, 400 silent connections that
  never close: a client trying again is served once the rule has closed them (before: never).
- Known limit, pinned: a client with a key that trickles its body holds its admission slot until the body
  ends (up to ``BODY_TIMEOUT``); with ``MAX_INFLIGHT=1`` the next client gets admission's 503.
- A client that never reads a long streamed answer, under each upstream transport: the gateway's memory does
  not grow with the answer, and the upstream is pushed back, then freed when the client leaves.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import pytest

from asgi_lifetime._cli._idle import MIN_HEAD_SECONDS
from asgi_lifetime._cli._main import H11_PROTOCOL, HTTPTOOLS_PROTOCOL
from asgi_lifetime._settings import LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

from .test_faults import (
    CHAT,
    FAST,
    STREAM,
    Firehose,
    RawResponse,
    Stack,
    assert_idle,
    eventually,
    never_reading,
    raw_client,
    request_bytes,
    rss,
)

pytestmark = pytest.mark.anyio

IDLE = 1.0  # --timeout-keep-alive in these tests
# How long a closed-by-the-rule connection may take to see its EOF beyond IDLE (loaded CI machines).
MARGIN = 4.0
ROOT = Path(__file__).resolve().parents[2]  # the worktree's package, not an installed one, in the subprocess
PROTOCOLS = {"serve-h11": H11_PROTOCOL, "serve-httptools": HTTPTOOLS_PROTOCOL}


@pytest.fixture(scope="module", params=list(PROTOCOLS))
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The demo upstream (slow enough that a streamed answer outlasts IDLE) and the gateway in front of it,
    served with one of serve's protocols and ``timeout_keep_alive=IDLE``."""
    demo = create_demo_upstream(tokens_per_second=20, default_tokens=8)
    with serve_in_thread(demo) as upstream_url:
        settings = LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, "body_idle_timeout": 5.0})
        app = create_app(settings)
        with serve_in_thread(app, http=PROTOCOLS[request.param], timeout_keep_alive=IDLE) as url:
            yield Stack(app=app, url=url, upstream_url=upstream_url, upstream=demo)


async def connect(stack: Stack) -> anyio.abc.SocketStream:
    return await anyio.connect_tcp("127.0.0.1", stack.port)


async def closed_within(stream: anyio.abc.SocketStream, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open after ``seconds``."""
    received = b""
    with anyio.fail_after(seconds):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                return received


CHAT_REQUEST = request_bytes(json.dumps({**CHAT, "max_tokens": 2}).encode())


# --- the idle rule ---------------------------------------------------------------------------------


async def test_a_connection_that_never_sends_a_byte_is_closed(stack: Stack) -> None:
    async with await connect(stack) as stream:
        started = anyio.current_time()
        assert await closed_within(stream, IDLE + MARGIN) == b""
    assert anyio.current_time() - started >= IDLE * 0.9


async def test_a_head_sent_a_byte_at_a_time_is_closed(stack: Stack) -> None:
    async with await connect(stack) as stream, anyio.create_task_group() as tg:

        async def trickle() -> None:  # each byte well within IDLE: only a rule on the whole head ends it
            for byte in CHAT_REQUEST:
                await stream.send(bytes([byte]))
                await anyio.sleep(0.1)

        tg.start_soon(trickle)
        received = await closed_within(stream, IDLE + MARGIN)
        tg.cancel_scope.cancel()
    assert received == b""
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)


async def test_a_kept_alive_connection_that_starts_a_head_and_stops_is_closed(stack: Stack) -> None:
    async with raw_client(stack.url) as client:
        await client.send(CHAT_REQUEST)
        assert (await client.response()).status == 200
        await client.send(CHAT_REQUEST[:20])  # cancelled uvicorn's keep-alive timer for good
        with anyio.fail_after(IDLE + MARGIN):
            assert (await client.response()).status == 0  # closed, nothing answered


async def test_many_silent_connections_do_not_keep_a_real_client_waiting(stack: Stack) -> None:
    silent = [await connect(stack) for _ in range(200)]
    try:
        async with raw_client(stack.url) as client:
            await client.send(CHAT_REQUEST)
            assert (await client.response(seconds=IDLE)).status == 200
        with anyio.fail_after(IDLE + MARGIN):
            for stream in silent:
                assert await closed_within(stream, IDLE + MARGIN) == b""
    finally:
        for stream in silent:
            await stream.aclose()


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_with_keep_alive_off_a_new_connection_still_has_a_second_for_its_head(protocol: str) -> None:
    demo = create_demo_upstream(tokens_per_second=1000, default_tokens=2)
    with serve_in_thread(demo) as upstream_url:
        app = create_app(LifetimeSettings(upstream_url=(upstream_url,), **FAST))
        with serve_in_thread(app, http=PROTOCOLS[protocol], timeout_keep_alive=0) as url:
            async with raw_client(url) as client:
                await anyio.sleep(0.2)  # the head comes a moment after the connection, as over a real network
                await client.send(CHAT_REQUEST)
                assert (await client.response()).status == 200
            async with await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1])) as silent:
                assert await closed_within(silent, MIN_HEAD_SECONDS + MARGIN) == b""


# --- what the idle rule must not cut ---------------------------------------------------------------


async def test_a_head_sent_in_pieces_within_the_time_is_served(stack: Stack) -> None:
    async with raw_client(stack.url) as client:
        for start in range(0, len(CHAT_REQUEST), 40):
            await client.send(CHAT_REQUEST[start : start + 40])
            await anyio.sleep(IDLE / 20)
        assert (await client.response()).status == 200


async def test_a_body_uploaded_for_longer_than_the_idle_time_is_served(stack: Stack) -> None:
    body = json.dumps({**CHAT, "max_tokens": 2}).encode()
    async with raw_client(stack.url) as client:
        await client.send(request_bytes(body)[: -len(body)])
        for start in range(0, len(body), 10):  # about 3 s in all, each gap far below BODY_IDLE_TIMEOUT
            await client.send(body[start : start + 10])
            await anyio.sleep(3 * IDLE / (len(body) / 10))
        assert (await client.response()).status == 200


async def test_a_long_stream_and_the_request_pipelined_behind_it_are_served(stack: Stack) -> None:
    stream_body = json.dumps({**STREAM, "max_tokens": 40}).encode()  # 2 s at 20 tokens a second: beyond IDLE
    async with raw_client(stack.url) as client:
        await client.send(request_bytes(stream_body) + CHAT_REQUEST)
        first = await client.response(seconds=10)
        assert first.status == 200 and first.complete and b"[DONE]" in first.body
        second = await client.response()
        assert second.status == 200 and second.complete
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)


# --- half-close ------------------------------------------------------------------------------------


async def test_a_client_that_half_closes_gets_a_whole_answer_or_none(stack: Stack) -> None:
    async with raw_client(stack.url) as client:
        await client.send(CHAT_REQUEST)
        await client.stream.send_eof()
        response = await client.response(seconds=MARGIN)
    # uvicorn closes on the FIN unless it has paused reading: which one wins is a race, both are fine.
    assert response.status in (0, 200) and response.complete == (response.status == 200)
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)


# --- a client that never reads ---------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["httpcore", "aiohttp"])
async def test_a_client_that_never_reads_costs_no_memory_under_either_transport(
    transport: str, anyio_backend: str
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("the servers run in their own threads: one backend is enough")
    firehose = Firehose(total=256 * MiB)
    with serve_in_thread(firehose) as upstream_url:
        settings = LifetimeSettings(upstream_url=(upstream_url,), upstream_transport=transport, **FAST)
        app = create_app(settings)
        with serve_in_thread(app, http=HTTPTOOLS_PROTOCOL, timeout_keep_alive=IDLE) as url:
            before = rss()
            async with never_reading(int(url.rsplit(":", 1)[1]), firehose):
                assert not firehose.finished
                assert firehose.sent < 64 * MiB, f"the upstream got {firehose.sent / MiB:.1f} MiB out"
                assert rss() - before < 64 * MiB, f"RSS grew {(rss() - before) / MiB:.1f} MiB"
            await eventually(lambda: firehose.disconnected, seconds=5)
            await assert_idle(app, url)


# --- known limit: a slow uploader holds its admission slot -----------------------------------------


async def test_a_slow_uploader_holds_its_admission_slot_until_its_body_ends() -> None:
    """Pinned as documented (docs/reliability.md, known limits): admission comes before the body, so a
    client with a key that trickles its body within ``BODY_IDLE_TIMEOUT`` holds a slot up to ``BODY_TIMEOUT``."""
    demo = create_demo_upstream(tokens_per_second=1000, default_tokens=2)
    with serve_in_thread(demo) as upstream_url:
        settings = LifetimeSettings(
            upstream_url=(upstream_url,), **{**FAST, "max_inflight": 1, "body_idle_timeout": 5.0}
        )
        app = create_app(settings)
        with serve_in_thread(app, http=HTTPTOOLS_PROTOCOL, timeout_keep_alive=IDLE) as url:
            body = json.dumps({**CHAT, "max_tokens": 2}).encode()
            async with raw_client(url) as slow, raw_client(url) as other:
                await slow.send(request_bytes(body)[: -len(body)] + body[:1])  # admitted, body unfinished
                await eventually(lambda: app.state.lifetime.stats().as_dict()["inflight_requests"] == 1)
                await other.send(CHAT_REQUEST)
                refused = await other.response()
                assert refused.status == 503 and refused.json()["error"]["code"] == "overloaded"
                await slow.send(body[1:])
                assert (await slow.response()).status == 200
            await assert_idle(app, url)


# --- file descriptors ------------------------------------------------------------------------------

GATEWAY_WITH_FEW_FDS = """
import resource, sys
from asgi_lifetime._cli._main import HTTPTOOLS_PROTOCOL
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing._serve import serve_in_thread

resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
app = create_app(LifetimeSettings(upstream_url=(sys.argv[1],)))
with serve_in_thread(app, http=HTTPTOOLS_PROTOCOL, timeout_keep_alive=1) as url:
    print(url, flush=True)
    sys.stdin.read()
"""


async def request_once(url: str) -> RawResponse:
    try:
        async with raw_client(url) as client:
            await client.send(CHAT_REQUEST)
            return await client.response(seconds=15)
    except OSError:  # refused or reset before the request was out
        return RawResponse(0, {}, b"", False)


async def test_silent_connections_past_the_fd_limit_free_the_process_by_themselves(anyio_backend: str) -> None:
    """The gateway alone in a process with 128 file descriptors; 400 connections that never send a byte, and
    never close. A real client behind them is served once the idle rule has closed them: before, never."""
    if anyio_backend != "asyncio":
        pytest.skip("the gateway runs in its own process: one backend is enough")
    demo = create_demo_upstream(tokens_per_second=1000, default_tokens=2)
    with serve_in_thread(demo) as upstream_url:
        process = await anyio.open_process(
            [sys.executable, "-c", GATEWAY_WITH_FEW_FDS, upstream_url, "128"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        async with process:
            try:
                assert process.stdout is not None
                with anyio.fail_after(20):
                    url = (await process.stdout.receive()).decode().strip()
                port = int(url.rsplit(":", 1)[1])
                silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]
                try:
                    # While the descriptors are gone, a new connection is accepted and closed at once (uvloop,
                    # libuv's EMFILE trick) or left in the backlog (asyncio): the client tries again, as one would.
                    for _ in range(75):  # 15 s at a client's pace of 5 tries a second
                        response = await request_once(url)
                        if response.status:
                            break
                        await anyio.sleep(0.2)
                    assert response.status == 200 and response.complete
                finally:
                    for sock in silent:
                        sock.close()
            finally:
                process.terminate()


# --- resets ----------------------------------------------------------------------------------------


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends an RST
    sock.close()


STREAM_REQUEST = request_bytes(json.dumps({**STREAM, "max_tokens": 40}).encode())  # 2 s of answer


@pytest.mark.parametrize(
    ("sent", "before_reset"),
    [
        (CHAT_REQUEST[:30], b""),  # mid-head
        (CHAT_REQUEST[:-5], b""),  # mid-body
        (STREAM_REQUEST, b"data:"),  # mid-answer, once the first event is in
    ],
    ids=["mid-head", "mid-body", "mid-answer"],
)
async def test_a_reset_leaves_nothing_held_and_the_next_client_is_served(
    stack: Stack, sent: bytes, before_reset: bytes
) -> None:
    sock = socket.create_connection(("127.0.0.1", stack.port))
    try:
        sock.sendall(sent)
        received = b""
        sock.settimeout(5)
        while before_reset not in received:
            received += await anyio.to_thread.run_sync(sock.recv, 65536)
        if not before_reset:  # the gateway has the bytes: wait until it holds the request (or the head is partial)
            await eventually(lambda: b"\r\n\r\n" not in sent or stack.stats()["inflight_requests"] == 1)
    finally:
        reset(sock)
    await assert_idle(stack.app, stack.url, upstream=stack.upstream)
    async with raw_client(stack.url) as client:
        await client.send(CHAT_REQUEST)
        assert (await client.response()).status == 200
