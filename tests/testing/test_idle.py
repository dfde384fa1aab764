"""``held`` / ``wait_idle`` / ``assert_idle``: what a gateway or a middleware app still holds.

A served gateway streams from the demo upstream, which stalls after its first chunk: while the
client reads, the gateway holds a request, its bytes and an upstream request, and says so; once
the client leaves, it holds nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import anyio.abc
import httpx
import pytest
from starlette.applications import Starlette

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings, LifetimeStats
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import assert_idle, create_demo_upstream, held, serve_in_thread, wait_idle
from asgi_lifetime.testing._idle import GAUGES

from . import apps

pytestmark = pytest.mark.anyio
STREAM = {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hello"}]}


@dataclass
class Served:
    gateway: Starlette
    url: str
    upstream_url: str


@pytest.fixture
def served() -> Iterator[Served]:
    with serve_in_thread(create_demo_upstream(tokens_per_second=2000)) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,)))
        with serve_in_thread(gateway) as url:
            yield Served(gateway, url, upstream_url)


@pytest.fixture
async def streaming(served: Served) -> AsyncIterator[anyio.abc.ByteStream]:
    """A streamed answer in progress: its first event read, the upstream silent after it (a raw
    socket: the client stays until the test closes it)."""
    host, port = httpx.URL(served.url).host, httpx.URL(served.url).port
    body = json.dumps(STREAM).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"x-demo-behaviour: stall=0\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    async with await anyio.connect_tcp(host, port or 80) as stream:
        await stream.send(head.encode() + body)
        received = b""
        with anyio.fail_after(10):
            while b"data: " not in received:
                received += await stream.receive()
        assert received.startswith(b"HTTP/1.1 200 ")
        yield stream


def test_the_gauges_are_those_lifetime_stats_idle_reads() -> None:
    for field in dataclasses.fields(LifetimeStats):
        assert LifetimeStats(**{field.name: 1}).idle is (field.name not in GAUGES), field.name


async def test_a_held_stream_is_listed_then_released(
    anyio_backend: str, served: Served, streaming: anyio.abc.ByteStream
) -> None:
    busy = held(served.gateway)
    assert "inflight_requests=1" in busy
    assert f"upstream {served.upstream_url} inflight=1" in busy
    with pytest.raises(AssertionError, match=r"not idle after 0.2 s: inflight_requests=1, .*upstream http://"):
        await wait_idle(served.gateway, within=0.2)
    with pytest.raises(AssertionError, match=r"not idle: inflight_requests=1, .*upstream http://"):
        await assert_idle(served.url)
    await streaming.aclose()  # the client leaves: the gateway lets go of everything
    stats = await wait_idle(served.url)
    assert stats["admitted"] == 1 and stats["inflight_requests"] == 0
    assert stats["upstreams"][0]["inflight"] == 0
    assert held(served.gateway) == []
    assert (await assert_idle(served.gateway))["inflight_bytes"] == 0


async def test_after_a_complete_response_the_gateway_is_idle_at_once(anyio_backend: str, served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json={**STREAM, "stream": False})
        assert response.status_code == 200
        stats = await assert_idle(served.url, client=client)
    assert stats["completed"] == 1
    # The URL's payload has the app object's counters, and says whose they are (scope, process).
    counters = {k: v for k, v in (await assert_idle(served.gateway)).items() if k != "upstreams"}
    assert {k: stats[k] for k in counters} == counters and stats["scope"] == "process"


async def test_extra_is_waited_for_and_listed(anyio_backend: str, served: Served) -> None:
    pool = ["connection 1 busy", "connection 2 busy"]

    def busy_connections() -> list[str]:
        return pool[:1] and [pool.pop()]  # busy on the first two looks, then idle

    await wait_idle(served.gateway, extra=busy_connections)
    assert pool == []
    with pytest.raises(AssertionError, match="not idle after 0.1 s: my pool: 1 busy"):
        await wait_idle(served.url, within=0.1, extra=lambda: ["my pool: 1 busy"])
    with pytest.raises(AssertionError, match="not idle: my pool: 1 busy"):
        await assert_idle(served.gateway, extra=lambda: ["my pool: 1 busy"])


async def test_a_middleware_app_a_middleware_and_a_lifetime_are_targets(anyio_backend: str) -> None:
    app = apps.lifetime_app()
    with pytest.raises(TypeError, match="no asgi_lifetime state on"):
        held(app)  # the middleware publishes app.state.lifetime with its first request
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://testserver") as client:
        response = await client.post(apps.PATH, json=STREAM)
    assert response.status_code == 200
    assert held(app) == []
    assert (await assert_idle(app))["completed"] == 1
    lifetime = app.state.lifetime
    assert held(lifetime) == []
    middleware = LifetimeMiddleware(app, lifetime=lifetime)
    assert (await wait_idle(middleware))["completed"] == 1


@pytest.mark.parametrize("target", [object(), Starlette(), None], ids=["object", "plain-starlette", "none"])
async def test_something_else_is_refused(anyio_backend: str, target: object) -> None:
    with pytest.raises(TypeError, match="pass an app from asgi_lifetime.gateway.create_app"):
        await wait_idle(target)


async def test_a_url_without_lifetime_stats_is_an_assertion(anyio_backend: str) -> None:
    with serve_in_thread(Starlette()) as url:
        with pytest.raises(AssertionError, match="/lifetime/stats answered 404"):
            await assert_idle(url)


async def test_within_must_be_positive(anyio_backend: str) -> None:
    with pytest.raises(ValueError, match="^within=0 is invalid: must be greater than 0$"):
        await wait_idle(apps.lifetime_app(), within=0)
