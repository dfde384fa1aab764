"""Round 4: a real user's view of the day's fixes, looking for what they cut that worked (false positives).

- Idle rule (``_cli/_idle.py``) under h11: an answer sent before the request's body was read (a 413 for a
  declared length over ``MAX_BODY_BYTES``) leaves the connection kept alive while the client sends the rest.
  The first byte of that rest cancelled the rule's timer (h11's client state was not IDLE), as uvicorn's own
  timer is cancelled by any byte: a client that then sent nothing more, or finished its body and went silent,
  was held open for ever. httptools kept the timer (its parser reports no new head). And under both, a body
  sent on after the early answer for longer than the rule's time was cut: httpx sends the whole body before
  it reads the answer, and read a reset instead of the 404 (uvicorn alone drained the body). Each piece of
  that body now gives the rule's time again, up to ``LINGER_SECONDS`` after the answer.
- Session store probe (``_PROBE``): it wrote with SET and DEL, which the book itself never calls. A Redis ACL
  granting the book exactly the commands it runs (hashes, sorted sets, scripts, on ``asgi_lifetime:*``) took
  every claim but refused the probe (-NOPERM), so the book never came up: sessions were per process.
- Held, kept as guards: a client waiting for ``100 Continue`` then slow to send its body, HTTP/1.0 with
  keep-alive, the openai SDK's pool idle past the rule (its next request goes on a new connection, no retry
  needed), a WebSocket upgrade attempt (a 403, then closed), and legitimate paths with dots, colons, ``;``,
  ``%2F``, ``%3F``, ``%25`` and UTF-8, forwarded as written in process and over uvicorn (h11, httptools) and
  hypercorn (asyncio, trio).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from asgi_lifetime._cli import _idle
from asgi_lifetime._cli._main import H11_PROTOCOL, HTTPTOOLS_PROTOCOL
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import _session_store, create_app
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import create_demo_upstream

from .._servers import RedisServer, redis_server, served
from ..gateway._raw_upstream import raw_upstream
from ..gateway.test_session_store import ASYNCIO, Changes, book, fp, redis_client, started, until
from .test_attack_conns import IDLE, MARGIN, closed_within
from .test_attack_paths import SERVERS, _post, exchange
from .test_faults import CHAT, FAST, Stack, request_bytes

pytestmark = pytest.mark.anyio

PROTOCOLS = {"serve-h11": H11_PROTOCOL, "serve-httptools": HTTPTOOLS_PROTOCOL}
MAX_BODY = 1024


@pytest.fixture(scope="module", params=list(PROTOCOLS))
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    demo = create_demo_upstream(tokens_per_second=20, default_tokens=8)
    with serve_in_thread(demo) as upstream_url:
        settings = LifetimeSettings(
            upstream_url=(upstream_url,), max_body_bytes=MAX_BODY, **{**FAST, "body_idle_timeout": 5.0}
        )
        app = create_app(settings)
        with serve_in_thread(app, http=PROTOCOLS[request.param], timeout_keep_alive=IDLE) as url:
            yield Stack(app=app, url=url, upstream_url=upstream_url, upstream=demo)


async def read_head(stream: anyio.abc.SocketStream) -> bytes:
    received = b""
    with anyio.fail_after(IDLE + MARGIN):
        while b"\r\n\r\n" not in received:
            received += await stream.receive()
    return received


EARLY = {
    "413": ("POST", "/v1/chat/completions"),
    "404": ("POST", "/elsewhere"),
    "405": ("PUT", "/healthz"),
    "options": ("OPTIONS", "/v1/models"),
}


@pytest.mark.parametrize("early", list(EARLY))
@pytest.mark.parametrize("rest", ["a part", "all of it"])
async def test_an_early_answer_then_a_silent_client_is_still_closed(stack: Stack, rest: str, early: str) -> None:
    body = json.dumps({**CHAT, "pad": "x" * (2 * MAX_BODY)}).encode()
    method, path = EARLY[early]
    async with await anyio.connect_tcp("127.0.0.1", stack.port) as stream:
        await stream.send(request_bytes(body[:10], method=method, path=path, content_length=len(body)))
        assert (await read_head(stream)).startswith(b"HTTP/1.1 4")  # answered before the body was read
        await stream.send(body[10:20] if rest == "a part" else body[10:])
        await closed_within(stream, IDLE + MARGIN)


async def test_an_upload_answered_early_and_sent_on_for_longer_than_the_rule_gets_its_answer(stack: Stack) -> None:
    """httpx (and the SDKs on it) sends the whole body before it reads the answer. A 404 for a wrong path, then a
    body sent on for longer than ``--timeout-keep-alive``: the rule closed the connection under the upload, and
    the client read a reset instead of the 404 (uvicorn alone read the body to its end)."""

    async def slow_body() -> AsyncIterator[bytes]:
        for _ in range(int(2.5 * IDLE / 0.1)):
            yield b"x" * 4096
            await anyio.sleep(0.1)  # the client's pace, past the rule's time in all: not a sync

    async with httpx.AsyncClient() as client:
        response = await client.post(stack.url + "/elsewhere", content=slow_body())
    assert response.status_code == 404


async def test_a_body_trickled_after_an_early_answer_is_closed_at_the_linger_bound(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece of an answered body gives the connection the rule's time again, but not past LINGER_SECONDS
    after the answer: a client that trickles a declared gigabyte is still closed."""
    monkeypatch.setattr(_idle, "LINGER_SECONDS", 2 * IDLE)
    async with await anyio.connect_tcp("127.0.0.1", stack.port) as stream, anyio.create_task_group() as tg:
        await stream.send(request_bytes(b"x", method="POST", path="/elsewhere", content_length=2**30))
        assert (await read_head(stream)).startswith(b"HTTP/1.1 404")

        async def trickle() -> None:  # each byte well within IDLE: only the linger bound ends it
            with contextlib.suppress(anyio.BrokenResourceError, ConnectionError):
                while True:
                    await stream.send(b"x")
                    await anyio.sleep(IDLE / 4)

        tg.start_soon(trickle)
        await closed_within(stream, 2 * IDLE + MARGIN)
        tg.cancel_scope.cancel()


async def test_a_client_waiting_for_100_continue_then_slow_to_send_is_served(stack: Stack) -> None:
    """The head is complete when the client waits: neither the wait for ``100 Continue`` nor a body sent
    later than ``--timeout-keep-alive`` after it is the idle rule's to cut (``BODY_IDLE_TIMEOUT`` is)."""
    body = json.dumps({**CHAT, "max_tokens": 2}).encode()
    async with await anyio.connect_tcp("127.0.0.1", stack.port) as stream:
        await stream.send(request_bytes(b"", headers=[("expect", "100-continue")], content_length=len(body)))
        assert (await read_head(stream)).startswith(b"HTTP/1.1 100")
        await anyio.sleep(IDLE * 1.5)  # the client's own pace, past the idle rule's time: not a sync
        await stream.send(body)
        assert (await read_head(stream)).startswith(b"HTTP/1.1 200")


async def test_http_1_0_with_keep_alive_is_served_then_closed_when_idle(stack: Stack) -> None:
    body = json.dumps({**CHAT, "max_tokens": 2}).encode()
    one = request_bytes(body, headers=[("connection", "keep-alive")]).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    async with await anyio.connect_tcp("127.0.0.1", stack.port) as stream:
        await stream.send(one)
        first = await read_head(stream)
        assert first.startswith(b"HTTP/1.1 200"), first
        rest = await closed_within(stream, IDLE + MARGIN)  # answered, then closed: by uvicorn or by the rule
        assert b"HTTP/1.1" not in rest


async def test_an_sdk_pool_idle_past_the_rule_sends_its_next_request_on_a_new_connection(stack: Stack) -> None:
    """The openai SDK's httpx pool keeps a connection the rule then closes: the pool sees the close and
    connects again, without the SDK's own retries (a request is not lost to the rule)."""
    openai = pytest.importorskip("openai")
    async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0) as client:
        for _ in range(2):
            answer = await client.chat.completions.create(model="demo", messages=CHAT["messages"], max_tokens=2)
            assert answer.choices
            await anyio.sleep(IDLE * 1.5)  # the client idles past the rule: the scenario, not a sync


UPGRADE = (
    b"GET /v1/realtime HTTP/1.1\r\nhost: gateway.test\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
)


@pytest.mark.parametrize("after_an_answer", [False, True])
async def test_a_websocket_upgrade_attempt_is_answered_then_closed(stack: Stack, after_an_answer: bool) -> None:
    """uvicorn hands an upgrade to its WebSocket protocol; the gateway has no WebSocket route: a 403, on a
    fresh connection or a kept-alive one, and the connection ends (not held, not cut before its answer)."""
    async with await anyio.connect_tcp("127.0.0.1", stack.port) as stream:
        if after_an_answer:
            await stream.send(request_bytes(json.dumps({**CHAT, "max_tokens": 1}).encode()))
            answer = await read_head(stream)
            assert answer.startswith(b"HTTP/1.1 200")
            length = int(re.search(rb"content-length: (\d+)", answer, re.IGNORECASE)[1])  # type: ignore[index]
            with anyio.fail_after(IDLE + MARGIN):  # the rest of that answer
                while len(answer.partition(b"\r\n\r\n")[2]) < length:
                    answer += await stream.receive()
        await stream.send(UPGRADE)
        rest = await closed_within(stream, IDLE + MARGIN)
        assert b"HTTP/1.1 403" in rest, rest


@pytest.mark.parametrize("server", SERVERS)
def test_over_real_servers_a_legitimate_path_reaches_the_upstream_as_written(server: str) -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    with raw_upstream(lambda request: [ok]) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url + "/base",), paths=PATHS, max_attempts=1)
        with served(create_app(settings), server) as url:
            port = int(url.rsplit(":", 1)[1])
            for _, target in LEGIT_PATHS:
                before = len(upstream.requests)
                answer = _post(port, target)
                assert answer.startswith(b"HTTP/1.1 200"), (target, answer[:300])
                assert [r.target for r in upstream.requests[before:]] == ["/base" + target], target


# --- the session store's probe under a least-privilege ACL -----------------------------------------------------


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as running_server:
        yield running_server


# What the book runs, and no more: its scripts (hashes, sorted sets, expiries, the server's clock), HGETALL and
# ZREM beside them, on its own keys. A user an operator writes from the commands the book is seen to send.
BOOK_CATEGORIES = ["-@all", "+@connection", "+@scripting", "+@hash", "+@sortedset"]


@ASYNCIO
async def test_a_least_privilege_acl_user_keeps_sessions_in_redis(server: RedisServer) -> None:
    """The book needs no right to come up that its own writes do not: a write probe with commands of its own."""
    async with redis_client(server.url) as admin:
        await admin.acl_setuser(
            "book",
            enabled=True,
            passwords=["+book-pass"],
            keys=["asgi_lifetime:*"],
            categories=BOOK_CATEGORIES,
            commands=["+pexpire", "+pexpireat", "+time"],
        )
        url = f"redis://book:book-pass@127.0.0.1:{server.port}/0"
        subject = book(url, Changes().of("a"), lease=2.0, timeout=1.0)
        async with started(subject):
            await until(lambda: subject.up)
            claim = await subject.claim("s1", fp("a"), time.monotonic())
            assert claim not in ("unsure", "local") and subject.up and subject.fallbacks == 0
        assert await admin.exists(f"{_session_store.KEY_PREFIX}:probe") == 0  # the probe leaves nothing behind


# --- legitimate paths with dots, colons, ';' and encodings: forwarded as the client wrote them ---------------

# (method, target): what SDKs and users send under PATHS; the upstream must get the path exactly as written.
LEGIT_PATHS = [
    ("GET", "/v1/models/gpt-4.1"),
    ("GET", "/v1/models/gpt-4.1-mini-2025-04-14"),
    ("POST", "/v1beta/models/gemini-1.5-pro:generateContent"),
    ("POST", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"),
    ("GET", "/v1beta/tunedModels/my-model%2Fv2"),
    ("GET", "/v1/files/file-abc..def/content"),
    ("GET", "/v1/files/a."),
    ("GET", "/v1/files/a.."),
    ("GET", "/v1/files/..a"),
    ("GET", "/v1/files/..."),
    ("GET", "/v1/.well-known/ai-plugin.json"),
    ("GET", "/v1/models/ft:gpt-4o-mini:org:custom:id"),
    ("GET", "/v1/models/x;version=2"),
    ("GET", "/v1/files/%E2%9C%93.txt"),
    ("GET", "/v1/files/caf%C3%A9"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-1/events?after=../x&limit=2"),
    ("DELETE", "/v1/vector_stores/vs_1/files/file-1"),
    ("POST", "/v1/messages/batches/msgbatch_01/cancel"),
    ("GET", "/v1/files/a%20b"),
    ("GET", "/v1/files/a+b"),
    ("GET", "/v1/files/a%2Bb"),
    ("GET", "/v1/files/name%3Fx"),
    ("GET", "/v1/files/100%25"),
    ("HEAD", "/v1/models/gpt-4.1"),
    ("PATCH", "/v1/files/x.y.z"),
]
PATHS = ("/v1/", "/v1beta/")


@pytest.mark.parametrize(("method", "target"), LEGIT_PATHS)
async def test_a_legitimate_path_reaches_the_upstream_as_written(method: str, target: str) -> None:
    app = create_app(LifetimeSettings(upstream_url=("http://upstream.test/base",), paths=PATHS, max_attempts=1))
    body: dict[str, Any] = {"json": {"contents": []}} if method in ("POST", "PATCH") else {}
    response, calls = await exchange(app, method, target, **body)
    assert response.status_code == 200, response.text
    assert [call.url.raw_path.decode() for call in calls] == ["/base" + target]
