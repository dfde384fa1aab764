from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from asgi_lifetime.testing._serve import serve_in_thread


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    """A raw ASGI app without lifespan support (lifespan="auto" must tolerate it)."""
    if scope["type"] != "http":
        raise RuntimeError("no lifespan here")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def never_finishes(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        raise RuntimeError("no lifespan here")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"first", "more_body": True})
    await anyio.sleep_forever()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def serving_threads(port: int) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"asgi-lifetime-serve-{port}"]


def assert_port_free(port: int) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # fails while anything still listens there
        probe.listen()


def test_serves_on_a_loopback_url() -> None:
    with serve_in_thread(hello) as url:
        assert url.startswith("http://127.0.0.1:") and port_of(url) > 0
        response = httpx.get(url, timeout=5)
    assert response.status_code == 200 and response.text == "hello"


def test_exit_stops_the_thread_and_frees_the_port() -> None:
    with serve_in_thread(hello) as url:
        port = port_of(url)
        assert len(serving_threads(port)) == 1
    assert serving_threads(port) == []
    assert_port_free(port)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5)


def test_error_in_body_propagates_and_server_stops() -> None:
    with pytest.raises(KeyError, match="boom"), serve_in_thread(hello) as url:
        raise KeyError("boom")
    assert serving_threads(port_of(url)) == []


def test_failed_lifespan_startup_raises() -> None:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise ValueError("database unavailable")
        yield

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start"), serve_in_thread(Starlette(lifespan=lifespan)):
        pytest.fail("entered despite a failed startup")
    assert time.monotonic() - started < 5


def test_slow_startup_times_out() -> None:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await anyio.sleep(0.5)
        yield

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start within"):
        with serve_in_thread(Starlette(lifespan=lifespan), startup_timeout=0.1):
            pytest.fail("entered before startup finished")
    assert time.monotonic() - started < 5


def test_exit_with_a_response_in_flight_is_bounded() -> None:
    with httpx.Client(timeout=5) as client:
        with serve_in_thread(never_finishes) as url:
            response = client.send(client.build_request("GET", url), stream=True)
            chunks = response.iter_raw()
            assert next(chunks) == b"first"
            started = time.monotonic()
        assert time.monotonic() - started < 5  # graceful shutdown gives up on the stalled response
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            list(chunks)
        response.close()
    assert serving_threads(port_of(url)) == []


@pytest.mark.parametrize("setting", ["startup_timeout", "shutdown_timeout"])
def test_rejects_non_positive_timeouts(setting: str) -> None:
    options: dict[str, Any] = {setting: 0}
    with pytest.raises(ValueError, match=setting), serve_in_thread(hello, **options):
        pass


@pytest.mark.anyio
async def test_usable_from_async_clients() -> None:
    with serve_in_thread(hello) as url:
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(url)
    assert response.text == "hello"
