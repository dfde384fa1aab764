"""A hostile or slow upstream against the time bound on a buffered error body (``read_error_body``).

The gateway (``create_app``) runs under uvicorn or hypercorn (asyncio, trio) on loopback, in front of a
raw-socket upstream (``tests/gateway/_raw_upstream.py``) answering scripted bytes, through either upstream
transport (``UPSTREAM_TRANSPORT``). An error body (4xx/5xx) is buffered before the client gets any of it,
so it must arrive whole within ``STALL_TIMEOUT``: one dripped a byte at a time under that, on every path
that reads one (the final relay, a retryable status on a last and a non-last attempt, the refold and
role matchers), ends there with the upstream's status and ``upstream_error_incomplete``. One sent at once
is never cut, however small ``STALL_TIMEOUT``. Checked each time: what the client got, how long it took,
how many requests the upstream saw (never one billed twice), and that nothing is held after.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from ..gateway._raw_upstream import HOLD, RawRequest, Script, chunked, raw_upstream, response
from .test_attack_sse_fast_path import SERVERS, gateway
from .test_attack_upstream import chunk
from .test_faults import CHAT, PATH, assert_idle

pytestmark = pytest.mark.anyio

TRANSPORTS = ("httpcore", "aiohttp")
PACE = 0.1  # the upstream's own pace between two pieces: far under STALL_TIMEOUT
STALL = 0.6
# Every retry within the deadline; the backoff short.
SETTINGS: dict[str, Any] = {"stall_timeout": STALL, "max_attempts": 2, "retry_deadline": 10.0, "headers_timeout": 5.0}
OK = response(200, b'{"ok": true}', headers=(("content-type", "application/json"),))


def head(status: int, *fields: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "content-type: application/json", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def dripped(status: int, start: bytes, *fields: str, pieces: int = 200) -> Script:
    """A chunked error body: ``start`` at once, then a space every ``PACE`` seconds (20 s in all)."""

    def piece() -> bytes:
        time.sleep(PACE)  # the upstream's pace, in its own thread
        return chunk(b" ")

    return [head(status, "transfer-encoding: chunked", *fields) + chunk(start), *[piece] * pieces]


async def post(url: str, body: dict[str, Any] | None = None, **headers: str) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = time.monotonic()
        answer = await client.post(PATH, json=body or CHAT, headers=headers)
        return answer, time.monotonic() - started


def incomplete(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.content[:300]
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == "upstream_error_incomplete", error
    return error


OVERFLOW = (
    b'{"error": {"message": "This model\'s maximum context length is 8192 tokens.", "code": "context_length_exceeded"'
)
ROLE = b'{"error": {"message": "Unsupported role: developer"'
TWO_TURNS: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "old " * 50},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "hello"},
    ],
}


# (status, first bytes, header fields, request body, upstream requests): each path that reads an error body.
PATHS = {
    "400 relayed": (400, b'{"error": {"message": "bad"', (), None, 1),
    "401 relayed": (401, b'{"error": {"message": "no key"', (), None, 1),
    "404 relayed": (404, b'{"error": {"message": "none"', (), None, 1),
    "422 relayed": (422, b'{"detail": [', (), None, 1),
    # Read for a RetryInfo wait on the first attempt (by RETRY_DEADLINE too), relayed on the last.
    "429 retried then last": (429, b'{"error": {"code": 429, "details": [', (), None, 2),
    "502 retried then last": (502, b'{"error": {"message": "boom"', (), None, 2),
    "503 retried then last": (503, b'{"error": {"message": "busy"', (), None, 2),
    "529 retried then last": (529, b'{"type": "error", "error": {"type": "overloaded_error"', (), None, 2),
    # The wait in a header: the first body is never read (closed), the last one is relayed.
    "429 retry-after retried then last": (429, b'{"error": {"message": "slow down"', ("retry-after: 0",), None, 2),
    # The upstream says not to retry: its answer stands at once, read as a relayed error.
    "529 x-should-retry false": (529, b'{"type": "error"', ("x-should-retry: false",), None, 1),
    # The matchers decide on what came (the start names the overflow or the role): one reshaped attempt.
    "400 overflow refolded": (400, OVERFLOW, (), TWO_TURNS, 2),
    "400 role renamed": (400, ROLE, (), TWO_TURNS, 2),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("status", "start", "fields", "body", "requests"), list(PATHS.values()), ids=list(PATHS))
async def test_a_dripped_error_body_ends_at_the_stall_timeout_on_every_path(
    transport: str, status: int, start: bytes, fields: tuple[str, ...], body: dict[str, Any] | None, requests: int
) -> None:
    with (
        raw_upstream(lambda request: dripped(status, start, *fields)) as upstream,
        gateway(upstream.url, "uvicorn", upstream_transport=transport, **SETTINGS) as (url, app),
    ):
        answer, waited = await post(url, body)
        error = incomplete(answer, status)
        assert f"within {STALL:g} seconds" in error["message"], error
        assert error["upstream_body"].startswith(start.decode()), error
        assert len(upstream.requests) == requests
        # Each attempt's body within STALL_TIMEOUT (and its backoff): never the 20 s it would take.
        assert waited < requests * STALL + 3.0, waited
        if requests == 2 and status in (429, 502, 503, 529):
            assert answer.headers["x-should-retry"] == "false"  # the gateway retried: the SDK must not
        await assert_idle(app, url)


@pytest.mark.parametrize(
    ("server", "transport"),
    # aiohttp runs on asyncio only: the gateway refuses it on trio at startup.
    [(s, t) for s in SERVERS for t in TRANSPORTS if not (t == "aiohttp" and s == "hypercorn-trio")],
)
@pytest.mark.parametrize("framing", ["content-length", "chunked", "chunked with trailers", "close-delimited"])
async def test_a_whole_error_body_sent_at_once_is_never_cut(server: str, transport: str, framing: str) -> None:
    """``ERROR_BODY_LIMIT`` bytes exactly, sent with the headers, ``STALL_TIMEOUT`` 50 ms: relayed byte
    for byte; the pooled connection (where it is kept) then carries the next request's own answer."""
    limit = 64 * 1024
    text = json.dumps({"error": {"message": "x" * limit}}).encode()
    body = text[: limit - 3] + b'"}}'
    assert len(body) == limit and json.loads(body)
    if framing == "content-length":
        first = response(400, body, headers=(("content-type", "application/json"),))
    elif framing == "chunked":
        first = head(400, "transfer-encoding: chunked") + chunked(body, size=4096)
    elif framing == "chunked with trailers":
        first = head(400, "transfer-encoding: chunked", "trailer: x-t") + chunked(body, size=4096)[:-2]
        first += b"x-t: 1\r\n\r\n"
    else:
        first = head(400, "connection: close") + body

    seen: list[RawRequest] = []

    def answer(request: RawRequest) -> Script:
        seen.append(request)
        if len(seen) % 2:
            return [first, "close"] if framing == "close-delimited" else [first]
        return [OK]

    with (
        raw_upstream(answer) as upstream,
        gateway(upstream.url, server, upstream_transport=transport, error_body_limit=limit, stall_timeout=0.05) as (
            url,
            app,
        ),
    ):
        for _ in range(3):
            got, _ = await post(url)
            assert (got.status_code, got.content) == (400, body)
            again, _ = await post(url)
            assert (again.status_code, again.json()) == (200, {"ok": True})
        assert len(upstream.requests) == 6
        await assert_idle(app, url)


async def test_a_dripped_gzip_error_body_ends_with_its_decoded_start() -> None:
    """gzip dripped a compressed byte at a time: cut at ``STALL_TIMEOUT``, the client gets what was
    decoded so far (never the compressed bytes, never a ``content-encoding``)."""
    plain = json.dumps({"error": {"message": "slow " * 2000}}).encode()
    packed = gzip.compress(plain, mtime=0)

    def piece_of(data: bytes) -> Callable[[], bytes]:
        def piece() -> bytes:
            time.sleep(PACE / 5)
            return chunk(data)

        return piece

    def answer(request: RawRequest) -> Script:
        pieces = [piece_of(packed[i : i + 1]) for i in range(20, len(packed))]
        return [head(400, "transfer-encoding: chunked", "content-encoding: gzip") + chunk(packed[:20]), *pieces]

    with (
        raw_upstream(answer) as upstream,
        gateway(upstream.url, "uvicorn", **SETTINGS) as (url, app),
    ):
        got, waited = await post(url)
        error = incomplete(got, 400)
        assert "content-encoding" not in got.headers
        assert plain.decode().startswith(error["upstream_body"]) and error["upstream_body"].startswith('{"error"')
        assert waited < STALL + 3.0 and len(upstream.requests) == 1
        await assert_idle(app, url)


async def test_concurrent_dripped_error_bodies_are_each_bounded_on_their_own_time() -> None:
    """Twelve requests, each answered with a body dripped for 20 s: each ends at its own
    ``STALL_TIMEOUT``, together within about one (never one after another)."""
    with (
        raw_upstream(lambda request: dripped(400, b'{"error": ')) as upstream,
        gateway(upstream.url, "uvicorn", **SETTINGS) as (url, app),
    ):
        answers: list[tuple[httpx.Response, float]] = []

        async def one() -> None:
            answers.append(await post(url))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(one)
        elapsed = time.monotonic() - started
        assert len(answers) == 12 and len(upstream.requests) == 12
        for got, _ in answers:
            incomplete(got, 400)
        assert elapsed < STALL + 4.0, elapsed
        await assert_idle(app, url)


async def test_the_client_leaving_while_an_error_body_drips_releases_the_upstream() -> None:
    with (
        raw_upstream(lambda request: dripped(400, b'{"error": ')) as upstream,
        gateway(upstream.url, "uvicorn", **{**SETTINGS, "stall_timeout": 30.0}) as (url, app),
    ):
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(PATH, json=CHAT)
        await assert_idle(app, url)
        assert len(upstream.requests) == 1


# vLLM's overflow, cut (by STALL_TIMEOUT: the upstream holds after it) inside its window "4096".
VLLM_CUT = (
    b'{"object": "error", "message": "The decoder prompt (length 5000) is longer than the maximum model length of 40'
)
# A role the ladder renames, cut inside a longer name it does not know.
ROLE_CUT = b'{"error": {"message": "Unsupported role: developer'


@pytest.mark.parametrize("start", [VLLM_CUT, ROLE_CUT], ids=["window cut", "role cut"])
async def test_the_matchers_never_act_on_a_word_the_cut_may_have_shortened(start: bytes) -> None:
    """A cut body's last word or number may be the start of a longer one: "of 40" of "of 4096" would
    refold the conversation to 36 tokens (dropping every old turn, billed), "developer" of "developer_v2"
    rename a role the upstream never rejected. Neither is read: the client gets the incomplete 400."""
    with (
        raw_upstream(lambda request: [head(400, "transfer-encoding: chunked") + chunk(start), HOLD]) as upstream,
        gateway(upstream.url, "uvicorn", **SETTINGS) as (url, app),
    ):
        got, waited = await post(url, TWO_TURNS)
        error = incomplete(got, 400)
        assert error["upstream_body"] == start.decode()
        assert len(upstream.requests) == 1, [r.body[:200] for r in upstream.requests]
        assert waited < STALL + 3.0
        await assert_idle(app, url)


async def openai_call(url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=2, timeout=30) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def anthropic_call(url: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=2, timeout=30) as client:
        await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("call", "status", "start", "raised"),
    [
        (openai_call, 503, b'{"error": {"message": "busy"', openai.InternalServerError),
        (anthropic_call, 529, b'{"type": "error", "error": {"type"', anthropic.OverloadedError),
    ],
    ids=["openai 503", "anthropic 529"],
)
async def test_the_sdks_take_an_incomplete_retryable_error_without_retrying_it(
    call: Callable[[str], Awaitable[None]], status: int, start: bytes, raised: type[Exception]
) -> None:
    """Each SDK with ``max_retries=2``: the gateway's two attempts end with ``x-should-retry: false``,
    so the SDK raises its class for the status after them, and makes no request more."""
    with (
        raw_upstream(lambda request: dripped(status, start)) as upstream,
        gateway(upstream.url, "uvicorn", **SETTINGS) as (url, app),
    ):
        started = time.monotonic()
        with pytest.raises(raised) as caught:
            await call(url)
        waited = time.monotonic() - started
        assert getattr(caught.value, "status_code", None) == status
        assert "error body is incomplete" in str(caught.value), caught.value  # the message the SDK shows
        assert len(upstream.requests) == 2 and waited < 2 * STALL + 3.0, waited
        await assert_idle(app, url)
