"""The gateway end to end over real sockets: uvicorn in front of the demo upstream under uvicorn, on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing._serve import serve_in_thread
from asgi_lifetime.testing._upstream import DemoStats, create_demo_upstream

PATH = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me something"}]
TIMEOUT = 15


@dataclass
class Stack:
    gateway_url: str
    gateway: Any
    upstream_url: str
    upstream: Any

    @property
    def upstream_stats(self) -> DemoStats:
        stats: DemoStats = self.upstream.state.stats
        return stats


@contextlib.contextmanager
def serve_stack(*, tokens: int = 20, tokens_per_second: float = 400.0, **settings: Any) -> Iterator[Stack]:
    upstream = create_demo_upstream(tokens_per_second=tokens_per_second, default_tokens=tokens)
    with serve_in_thread(upstream) as upstream_url:
        options: dict[str, Any] = {
            "upstream_url": (upstream_url,),
            "backoff_base": 0.01,
            "backoff_max": 0.02,
            "connect_timeout": 5.0,
            "headers_timeout": 5.0,
            "stall_timeout": 5.0,
            **settings,
        }
        gateway = create_app(LifetimeSettings(**options))
        with serve_in_thread(gateway) as gateway_url:
            yield Stack(gateway_url, gateway, upstream_url, upstream)


@contextlib.asynccontextmanager
async def stack(**settings: Any) -> AsyncIterator[tuple[Stack, httpx.AsyncClient]]:
    with serve_stack(**settings) as served:
        async with httpx.AsyncClient(base_url=served.gateway_url, timeout=TIMEOUT) as client:
            with anyio.fail_after(TIMEOUT):
                yield served, client


def chat(*, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": MESSAGES, "stream": stream, **extra}


def behaviour(value: str) -> dict[str, str]:
    return {"x-demo-behaviour": value}


async def read_lines(response: httpx.Response) -> list[tuple[float, str]]:
    """Every line of the response with the time it arrived (read to the end)."""
    return [(time.monotonic(), line) async for line in response.aiter_lines()]


def payloads(lines: list[tuple[float, str]]) -> list[str]:
    return [line[len("data: ") :] for _, line in lines if line.startswith("data: ")]


def text_of(lines: list[tuple[float, str]]) -> str:
    text = []
    for data in payloads(lines):
        if data == "[DONE]":
            continue
        document = json.loads(data)
        for choice in document.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def error_event(lines: list[tuple[float, str]]) -> dict[str, Any]:
    texts = [line for _, line in lines]
    index = texts.index("event: error")
    assert texts[index + 1].startswith("data: ")
    error: dict[str, Any] = json.loads(texts[index + 1][len("data: ") :])["error"]
    return error


async def eventually(predicate: Any, *, within: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {within}s")
        await anyio.sleep(0.02)


async def assert_gateway_idle(client: httpx.AsyncClient) -> dict[str, Any]:
    """Poll /lifetime/stats until every gauge is zero (the request settles just after its last byte)."""
    stats: dict[str, Any] = {}
    gauges = ("inflight_requests", "inflight_bytes", "retained_input_bytes", "live_resources", "pinned_sessions")
    deadline = time.monotonic() + 5
    while True:
        stats = (await client.get("/lifetime/stats")).json()
        if not any(stats[gauge] for gauge in gauges) and all(u["inflight"] == 0 for u in stats["upstreams"]):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway not idle: {stats}")
        await anyio.sleep(0.02)


# --- streaming --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stream_is_relayed_incrementally() -> None:
    async with stack(tokens=24) as (served, client):
        expected = (await client.post(PATH, json=chat(stream=False))).json()["choices"][0]["message"]["content"]
        started = time.monotonic()
        headers = {**behaviour("delay=0.05"), "x-session-id": "e2e"}
        async with client.stream("POST", PATH, json=chat(), headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = await read_lines(response)
        stats = await assert_gateway_idle(client)
    first_content = next(
        at
        for at, line in lines
        if line.startswith("data: ") and '"content":"' in line[6:] and '"content":""' not in line
    )
    finished = lines[-1][0]
    # ~12-24 chunks at 50 ms each: the first arrived long before the upstream finished.
    assert finished - started > 0.5
    assert first_content - started < finished - started - 0.3
    assert payloads(lines)[-1] == "[DONE]"
    assert text_of(lines) == expected and expected
    assert served.upstream_stats.requests == 2 and served.upstream_stats.completed == 2
    assert stats["completed"] == 2


@pytest.mark.anyio
async def test_client_disconnect_mid_stream_closes_the_upstream() -> None:
    async with stack(tokens=200) as (served, client):
        got_content = False
        async with client.stream("POST", PATH, json=chat(), headers=behaviour("delay=0.05")) as response:
            assert response.status_code == 200
            # Hang up while a read is pending: no generator is left half-iterated.
            with anyio.CancelScope() as scope:
                async for line in response.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        got_content = True
                        scope.cancel()
        assert got_content
        hung_up = time.monotonic()
        await eventually(lambda: served.upstream_stats.disconnects == 1, what="upstream disconnect")
        assert time.monotonic() - hung_up < 2.0
        assert served.upstream_stats.active_streams == 0
        assert served.upstream_stats.completed == 0
        await assert_gateway_idle(client)


# --- stall and keep-alives --------------------------------------------------------------------


@pytest.mark.anyio
async def test_stalled_upstream_ends_with_an_inband_error_and_is_closed() -> None:
    async with stack(stall_timeout=0.5) as (served, client):
        started = time.monotonic()
        async with client.stream("POST", PATH, json=chat(), headers=behaviour("stall=0")) as response:
            assert response.status_code == 200
            lines = await read_lines(response)
        elapsed = time.monotonic() - started
        error = error_event(lines)
        assert error["code"] == "upstream_stalled"
        assert 0.4 < elapsed < 3.0
        await eventually(lambda: served.upstream_stats.disconnects == 1, what="upstream disconnect")
        stats = await assert_gateway_idle(client)
    assert stats["stalled"] == 1
    assert payloads(lines)[0].startswith("{")  # the role delta came through before the stall
    assert "[DONE]" not in payloads(lines)


@pytest.mark.anyio
async def test_keepalives_arrive_during_a_silence_shorter_than_the_stall_timeout() -> None:
    async with stack(stall_timeout=3.0, keepalive_interval=0.2) as (served, client):
        async with client.stream("POST", PATH, json=chat(), headers=behaviour("stall=1.0")) as response:
            assert response.status_code == 200
            lines = await read_lines(response)
        stats = await assert_gateway_idle(client)
    keepalives = [at for at, line in lines if line == ": keep-alive"]
    assert len(keepalives) >= 2
    assert "event: error" not in [line for _, line in lines]
    assert payloads(lines)[-1] == "[DONE]"
    assert text_of(lines)
    assert stats["stalled"] == 0
    assert served.upstream_stats.completed == 1 and served.upstream_stats.disconnects == 0


# --- starvation and retries -------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("retain", [True, False])
async def test_starved_stream(retain: bool) -> None:
    # The demo's starved stream sends its role event first: once an upstream event reached the
    # client, a second answer cannot follow, so it is not re-issued even with the body retained.
    requests = 1
    async with stack(retain_outbound=retain) as (served, client):
        async with client.stream("POST", PATH, json=chat(), headers=behaviour("starve")) as response:
            assert response.status_code == 200
            lines = await read_lines(response)
        stats = await assert_gateway_idle(client)
    error = error_event(lines)
    assert error["code"] == "upstream_starved"
    assert error["message"] == "the upstream produced no output"
    assert served.upstream_stats.requests == requests
    assert stats["retried"] == requests - 1
    assert stats["starved"] == requests
    assert "[DONE]" not in payloads(lines)


@pytest.mark.anyio
async def test_503s_then_success_streams() -> None:
    async with stack() as (served, client):
        async with client.stream("POST", PATH, json=chat(), headers=behaviour("fail=2")) as response:
            assert response.status_code == 200
            lines = await read_lines(response)
        stats = await assert_gateway_idle(client)
    assert payloads(lines)[-1] == "[DONE]" and text_of(lines)
    assert served.upstream_stats.requests == 3
    assert stats["retried"] == 2


@pytest.mark.anyio
async def test_upstream_error_status_is_relayed() -> None:
    async with stack(max_attempts=2) as (served, client):
        response = await client.post(PATH, json=chat(), headers=behaviour("status=429"))
        stats = await assert_gateway_idle(client)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert served.upstream_stats.requests == 2 and stats["retried"] == 1


# --- uvicorn --factory, configured by the environment only ------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_uvicorn_factory_configured_by_environment(tmp_path: Any) -> None:
    upstream = create_demo_upstream(tokens_per_second=1000, default_tokens=8)
    with serve_in_thread(upstream) as upstream_url:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASGI_LIFETIME_")}
        env["ASGI_LIFETIME_UPSTREAM_URL"] = upstream_url
        env["ASGI_LIFETIME_STALL_TIMEOUT"] = "5"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "uvicorn", "--factory", "asgi_lifetime.gateway:create_app"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        # cwd: an empty directory, so no .env file is picked up.
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 15
            with httpx.Client(base_url=url, timeout=5) as client:
                while True:
                    assert process.poll() is None, process.communicate()[0].decode(errors="replace")
                    try:
                        if client.get("/healthz").json() == {"status": "ok"}:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "the gateway did not come up"
                    time.sleep(0.05)
                response = client.post(PATH, json=chat(stream=False))
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["message"]["content"]
                with client.stream("POST", PATH, json=chat()) as streamed:
                    lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                stats = client.get("/lifetime/stats").json()
            assert stats["admitted"] == 2 and stats["upstreams"][0]["url"] == upstream_url
            assert upstream.state.stats.requests == 2
        finally:
            process.terminate()
            try:
                process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate(timeout=5)
        assert process.returncode is not None
