"""Overload over real sockets: the gateway (uvicorn) sheds new requests at once at a standing queue."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..reliability.test_faults import assert_idle, eventually, running
from .test_gateway_ops import samples

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
TARGET = 0.05
INTERVAL = 0.2
BURST = 8


def holding_upstream(release: threading.Event) -> Starlette:
    """Answers at once, except a request for model ``hold``, which waits for ``release``."""

    async def chat(request: Request) -> JSONResponse:
        data = await request.json()
        if data.get("model") == "hold":
            await anyio.to_thread.run_sync(release.wait, 30)
        return JSONResponse(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            }
        )

    return Starlette(routes=[Route(PATH, chat, methods=["POST"])])


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


async def test_standing_queue_sheds_a_burst_at_once() -> None:
    """MAX_INFLIGHT=1, one request held upstream, one waiting for its slot: nothing drains, so once the
    waiting one has waited TARGET + INTERVAL the queue stands, and a burst of new requests is answered
    503 with Retry-After at once (not after ADMISSION_TIMEOUT). The waiting one keeps its place."""
    release = threading.Event()
    with running(
        upstream=holding_upstream(release),
        max_inflight=1,
        admission_timeout=10,
        admission_target_delay=TARGET,
        admission_interval=INTERVAL,
    ) as stack:
        counters = stack.app.state.lifetime.counters
        answers: dict[str, httpx.Response] = {}
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                async with anyio.create_task_group() as tg:

                    async def post(name: str, model: str) -> None:
                        answers[name] = await client.post(PATH, json=chat(model))

                    tg.start_soon(post, "held", "hold")
                    await eventually(lambda: counters.inflight_requests == 1)
                    tg.start_soon(post, "waiting", "m")
                    await eventually(lambda: counters.queued_requests == 1)
                    # Only lets the queue delay grow (the held request frees nothing): it decides nothing.
                    await anyio.sleep(TARGET + INTERVAL + 0.05)
                    started = anyio.current_time()
                    async with anyio.create_task_group() as burst:
                        for index in range(BURST):
                            burst.start_soon(post, f"burst-{index}", "m")
                    elapsed = anyio.current_time() - started
                    assert counters.queued_requests == 1  # the burst never joined the queue
                    release.set()
                text = (await client.get("/metrics")).text
        finally:
            release.set()
        assert answers["held"].status_code == 200
        assert answers["waiting"].status_code == 200
        for index in range(BURST):
            response = answers[f"burst-{index}"]
            assert response.status_code == 503
            assert response.headers["retry-after"] == "10"
            assert response.json()["error"]["code"] == "overloaded"
            assert "not draining" in response.json()["error"]["message"]
        assert elapsed < 5.0  # far below ADMISSION_TIMEOUT (10 s); the rule is asserted by the counters below
        shed = {labels["reason"]: value for labels, value in samples(text, "asgi_lifetime_admission_shed_total")}
        assert shed == {"standing_queue": BURST, "timeout": 0, "draining": 0, "budget_deadlock": 0}
        assert samples(text, "asgi_lifetime_admission_rejections_total") == [({}, BURST)]
        # Two admitted requests: the held one at once, the waiting one after at least TARGET + INTERVAL.
        assert samples(text, "asgi_lifetime_admission_queue_seconds_count") == [({}, 2)]
        [(_, waited)] = samples(text, "asgi_lifetime_admission_queue_seconds_sum")
        assert waited >= TARGET + INTERVAL
        stats = await assert_idle(stack.app, stack.url)
        assert (stats["shed_standing_queue"], stats["shed_timeout"], stats["queued_requests"]) == (BURST, 0, 0)
