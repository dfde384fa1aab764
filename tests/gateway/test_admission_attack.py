"""Attacks on admission shedding over real sockets (the gateway under uvicorn), tried after it landed.

- The Anthropic SDK's path (``/v1/messages`` with ``anthropic-version``): a request shed at a
  standing queue is a 503 with ``Retry-After`` and Anthropic's error shape (``overloaded_error``),
  which the SDK retries after the advertised delay. Held.
- Clients that send their headers (and none, part or all of the body) and hang up while their
  requests wait for a slot: each dead request kept its place (and ``queued_requests``) until
  admitted or ``ADMISSION_TIMEOUT``, so cheap connections opened and closed kept the queue long
  (and standing, so live arrivals were shed). Fixed: a queued request watches its client
  (``_middleware._acquire_watching``), and the body it took meanwhile reaches the upstream intact.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..reliability.test_faults import assert_idle, eventually, raw_client, running
from .test_overload import INTERVAL, TARGET, chat, holding_upstream

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}

WAIT = 20.0


async def test_a_shed_anthropic_request_gets_retry_after_and_the_anthropic_shape() -> None:
    release = threading.Event()
    with running(
        upstream=holding_upstream(release),
        max_inflight=1,
        admission_timeout=7,
        admission_target_delay=TARGET,
        admission_interval=INTERVAL,
    ) as stack:
        counters = stack.app.state.lifetime.counters
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: client.post("/v1/chat/completions", json=chat("hold")))
                    await eventually(lambda: counters.inflight_requests == 1, seconds=WAIT)
                    tg.start_soon(lambda: client.post("/v1/chat/completions", json=chat("m")))
                    await eventually(lambda: counters.queued_requests == 1, seconds=WAIT)
                    # Only lets the queue delay grow (the held request frees nothing): the shed counter decides.
                    # (Admission.standing() reads the server loop's clock: not callable from this thread.)
                    await anyio.sleep(TARGET + INTERVAL + 0.05)
                    shed = await client.post(
                        "/v1/messages",
                        json={"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
                        headers={"anthropic-version": "2023-06-01"},
                    )
                    release.set()
        finally:
            release.set()
        assert (counters.shed_standing_queue, counters.shed_timeout) == (1, 0)
        assert shed.status_code == 503
        assert shed.headers["retry-after"] == "7"
        body = shed.json()
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
        assert "not draining" in body["error"]["message"]
        await assert_idle(stack.app, stack.url)


HANG_UPS = {
    "headers only": b"",
    "part of the body": b'{"model": "m", "mess',
    "the whole body": b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}',
}


@pytest.mark.parametrize("sent", HANG_UPS.values(), ids=HANG_UPS.keys())
async def test_a_client_that_hangs_up_while_queued_leaves_the_queue(sent: bytes) -> None:
    release = threading.Event()
    # The held request must keep its slot for the whole test: no timeout of FAST may end it.
    holding: dict[str, Any] = {"headers_timeout": 60, "stall_timeout": 60, "retry_deadline": 60, "max_attempts": 1}
    with running(upstream=holding_upstream(release), max_inflight=1, admission_timeout=60, **holding) as stack:
        counters = stack.app.state.lifetime.counters
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=90) as client:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: client.post("/v1/chat/completions", json=chat("hold")))
                    await eventually(lambda: counters.inflight_requests == 1, seconds=WAIT)
                    length = len(HANG_UPS["the whole body"])
                    for n in range(3):
                        async with raw_client(stack.url) as raw:
                            await raw.send(
                                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                b"content-length: %d\r\n\r\n%s" % (length, sent)
                            )
                            await eventually(lambda: counters.queued_requests == 1, seconds=WAIT)
                        # the client is gone: its request leaves the queue well before ADMISSION_TIMEOUT
                        await eventually(lambda: counters.queued_requests == 0, seconds=10)
                        # counted a step after it leaves the queue, in the server's thread
                        aborted = functools.partial(lambda expected: counters.aborted == expected, n + 1)
                        await eventually(aborted, seconds=WAIT)
                    assert counters.inflight_requests == 1  # the held request still holds its slot
                    assert counters.admitted == 1  # no dead request was ever admitted
                    release.set()
        finally:
            release.set()
        await assert_idle(stack.app, stack.url, seconds=WAIT)


def echo_upstream(release: threading.Event, seen: list[bytes]) -> Starlette:
    """Keeps the bytes of each request it gets; a request for model ``hold`` waits for ``release``."""

    async def chat(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(body)
        if b'"model":"hold"' in body:
            await anyio.to_thread.run_sync(release.wait, 30)
        return JSONResponse({"object": "chat.completion", "choices": []})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_queued_requests_reach_the_upstream_intact() -> None:
    # What a queued request's watch takes off the server (all of a small body, the first 64 KiB
    # of a large one, sent in many small messages) is read first once it is admitted.
    release = threading.Event()
    seen: list[bytes] = []
    bodies = [
        json.dumps({"model": "small", "messages": [{"role": "user", "content": "é" * 100}]}).encode(),
        json.dumps({"model": "large", "messages": [{"role": "user", "content": "x" * 300_000}]}).encode(),
    ]

    async def trickle(body: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    with running(upstream=echo_upstream(release, seen), max_inflight=1, admission_timeout=60) as stack:
        counters = stack.app.state.lifetime.counters
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            answers: list[httpx.Response] = []

            async def post(body: bytes) -> None:
                answers.append(await client.post("/v1/chat/completions", content=trickle(body), headers=JSON))

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(post, json.dumps({"model": "hold", "messages": []}, separators=(",", ":")).encode())
                    await eventually(lambda: counters.inflight_requests == 1, seconds=WAIT)
                    for n, body in enumerate(bodies):
                        tg.start_soon(post, body)
                        await eventually(lambda: counters.queued_requests == n + 1, seconds=WAIT)  # noqa: B023 - awaited here
                    release.set()
            finally:
                release.set()
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert sorted(seen[1:], key=len) == bodies
        await assert_idle(stack.app, stack.url, seconds=WAIT)
