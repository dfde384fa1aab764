"""Attack: the graceful drain, as an operator doing a rolling deploy sees it (SIGTERM, ``/healthz`` 503
for ``DRAIN_DELAY``, ``SHUTDOWN_GRACE``, uvicorn's backstop), over real servers and ``asgi-lifetime serve``
processes (1 and 2 workers), with a raw loopback upstream that records what it was sent and when the
gateway hung up on it.

What each client must get: a complete answer or an error in its API's shape, never a silently cut
200; the upstream sees every cut request closed; the process exits 0 within the documented bound; one
access-log line per request. Found: a request still waiting for the upstream's answer when the grace
ended (its headers, a retry's backoff) was not ended by the drain: uvicorn's backstop cut it 5 s later
with its own plain-text 500 and a traceback. It now gets the 503 ``shutting_down`` a relay gets.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from asgi_lifetime._cli._main import SHUTDOWN_BACKSTOP
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._shutdown import request_shutdown, reset_shutdown

from .._gateways import clean_env, eventually
from .._servers import free_port, served, threaded_server

ROOT = Path(__file__).resolve().parents[2]  # the checkout under test, also for the served processes
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@dataclass
class Upstream:
    """Answers by the request's ``model``: ``hold`` never answers, ``retry`` is a 503 asking for 30 s,
    ``stream`` is an endless OpenAI event stream, anything else a complete chat completion. One request
    per connection (a complete answer says ``connection: close``)."""

    url: str = ""
    seen: list[str] = field(default_factory=list)  # the model of each request, as it arrived
    closed: list[str] = field(default_factory=list)  # the model of each request the gateway hung up on
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, sock: socket.socket, n: int) -> None:
        with sock:
            sock.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                if not (chunk := sock.recv(65536)):
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(v)
                for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
            while len(body) < length:
                body += sock.recv(65536)
            model = body.split(b'"model":', 1)[1].split(b'"')[1].decode()
            with self.lock:
                self.seen.append(model)
            try:
                self.answer(sock, model, anthropic=head.startswith(b"POST /v1/messages"))
                while sock.recv(65536):  # until the gateway hangs up
                    pass
            except OSError:
                pass
            with self.lock:
                self.closed.append(model)

    def answer(self, sock: socket.socket, model: str, *, anthropic: bool) -> None:
        if model == "retry":
            body = b'{"error": {"message": "busy"}}'
            sock.sendall(
                b"HTTP/1.1 503 Busy\r\nconnection: close\r\ncontent-type: application/json\r\nretry-after: 30\r\n"
            )
            sock.sendall(b"content-length: %d\r\n\r\n%s" % (len(body), body))
        elif model == "stream":
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            event = (
                b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
            )
            if anthropic:
                start = (
                    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
                    b'"role":"assistant","model":"m","content":[],"stop_reason":null,"usage":{"input_tokens":1,'
                    b'"output_tokens":0}}}\n\nevent: content_block_start\ndata: {"type":"content_block_start",'
                    b'"index":0,"content_block":{"type":"text","text":""}}\n\n'
                )
                sock.sendall(b"%x\r\n%s\r\n" % (len(start), start))
                event = (
                    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                    b'"delta":{"type":"text_delta","text":"x"}}\n\n'
                )
            while True:
                sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                time.sleep(0.05)
        elif model != "hold":
            body = (
                b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
                b'{"role":"assistant","content":"done"},"finish_reason":"stop"}],'
                b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
            )
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )

    def count(self, model: str, of: str = "seen") -> int:
        with self.lock:
            return getattr(self, of).count(model)  # type: ignore[no-any-return]


@contextlib.contextmanager
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    with threaded_server(up.handle, name="drain-upstream") as url:
        up.url = url
        yield up


def ask(base: str, path: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=30)


class Calls:
    """Requests run in threads; each one's answer (or exception) and when it came."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[float, Any]] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call: Any) -> None:
        def run() -> None:
            try:
                result: Any = call()
            except Exception as exc:
                result = exc
            self.results[name] = (time.monotonic(), result)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self, seconds: float) -> None:
        for thread in self.threads:
            thread.join(seconds)
        assert not any(thread.is_alive() for thread in self.threads), self.results


def assert_shutting_down(response: Any, shape: str) -> None:
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1, response.text
    body = response.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["code"] == "shutting_down"
    else:
        assert body["error"]["code"] == "shutting_down"


# -- waiting for the upstream's answer when the grace ends ---------------------------------------------


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn-asyncio", "hypercorn-trio"])
def test_a_request_waiting_for_its_answer_gets_a_503_when_the_grace_ends(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Waiting for the upstream's headers (OpenAI and Anthropic paths) or in a retry's 30 s backoff when
    # SHUTDOWN_GRACE (0.5 s) ends: each gets the 503 shutting_down of its API at once, the upstream is hung
    # up on, one access line each. Before: nothing ended them; a server's backstop cut them (uvicorn: 500).
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    calls = Calls()
    with upstream() as up:
        settings = LifetimeSettings(
            upstream_url=(up.url,),
            shutdown_grace=0.5,
            retry_after_cap=60,
            retry_deadline=120,
            max_inflight=3,
            admission_target_delay=0,  # a plain queue: the fourth waits for a slot
            paths=("/v1/", "/v1beta/"),
        )
        app = create_app(settings)
        try:
            with served(app, server) as base:
                calls.start("openai", lambda: ask(base, "/v1/chat/completions", "hold"))
                calls.start("anthropic", lambda: ask(base, "/v1/messages", "hold", ANTHROPIC))
                calls.start("backoff", lambda: ask(base, "/v1/chat/completions", "retry"))
                eventually(lambda: len(up.seen) == 3 and up.count("retry", "closed"), seconds=10, what="three asked")
                gemini = f"{base}/v1beta/models/gemini-2.5-flash:generateContent"
                calls.start("queued", lambda: httpx.post(gemini, json={"contents": []}, timeout=30))
                eventually(lambda: app.state.lifetime.stats().queued_requests, seconds=10, what="one queued")
                signalled = time.monotonic()
                request_shutdown()
                calls.join(10)
                # Waiting for a slot: turned away when the drain begins, in Gemini's shape, never forwarded.
                refused_at, queued = calls.results["queued"]
                assert queued.status_code == 503 and "retry-after" in queued.headers
                assert queued.json()["error"]["status"] == "UNAVAILABLE" and refused_at - signalled < 0.4
                for name, shape in (("openai", "openai"), ("anthropic", "anthropic"), ("backoff", "openai")):
                    answered, response = calls.results[name]
                    assert_shutting_down(response, shape)
                    assert 0.4 < answered - signalled < 3, name
                eventually(lambda: up.count("hold", "closed") == 2, seconds=5, what="the upstream hung up on")
                assert up.seen.count("retry") == 1  # the backoff ended, not followed by an attempt
        finally:
            reset_shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "asgi_lifetime.access"]
    assert len(lines) == 4 and sum("status=503 outcome=shutdown code=shutting_down" in line for line in lines) == 3
    assert any("status=503 outcome=refused code=overloaded" in line for line in lines), lines


# -- a client mid-upload when the grace ends ---------------------------------------------------------------


def start_upload(port: int) -> socket.socket:
    """A 10 MB JSON body announced, 1 MB of it sent; the client then pauses (well within BODY_IDLE_TIMEOUT)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    sock.sendall(head + b"content-length: 10000000\r\n\r\n" + b'{"model": "upload", "x": "' + b"a" * 1_000_000)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def assert_refused_upload(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    head = head.lower()
    assert head.startswith(b"http/1.1 503 ") and b"\r\nconnection: close" in head and b"\r\nretry-after: " in head
    assert b'"code":"shutting_down"' in body.replace(b" ", b""), answer


@pytest.mark.parametrize("server", ["uvicorn-h11", "hypercorn-asyncio", "hypercorn-trio"])
def test_an_upload_still_arriving_when_the_grace_ends_gets_a_503(server: str, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the drain ended relays only; the upload held the request until the server's backstop
    # (uvicorn: a plain-text 500) or the client's own timeout.
    caplog.set_level(logging.INFO, logger="asgi_lifetime.access")
    with upstream() as up:
        app = create_app(LifetimeSettings(upstream_url=(up.url,), shutdown_grace=0.5, body_idle_timeout=60))
        try:
            with served(app, server) as base:
                sock = start_upload(int(base.rsplit(":", 1)[1]))
                with sock:
                    lifetime = app.state.lifetime
                    eventually(lambda: lifetime.stats().inflight_bytes >= 500_000, seconds=10, what="uploading")
                    signalled = time.monotonic()
                    request_shutdown()
                    assert_refused_upload(read_until_closed(sock))
                    assert 0.4 < time.monotonic() - signalled < 3
                eventually(lambda: lifetime.stats().idle, seconds=5, what="the gateway idle")
        finally:
            reset_shutdown()
    assert up.seen == []  # never forwarded
    lines = [r.getMessage() for r in caplog.records if r.name == "asgi_lifetime.access"]
    assert len(lines) == 1 and "status=503 outcome=refused code=shutting_down" in lines[0], lines


# -- asgi-lifetime serve, SIGTERM, 1 and 2 workers -------------------------------------------------------


@contextlib.contextmanager
def serve(up: Upstream, tmp_path: Path, *argv: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_port()
    log = tmp_path / "serve.log"
    env = clean_env({"PYTHONPATH": str(ROOT)})  # this checkout's package, not the one installed
    with log.open("wb") as handle:
        args = ["serve", "--port", str(port), "--upstream", up.url, "--log-level", "info", *argv]
        process = subprocess.Popen(
            [sys.executable, "-m", "asgi_lifetime", *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
        base = f"http://127.0.0.1:{port}"

        def up_now() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            eventually(up_now, seconds=60, what="the gateway up", every=0.1)
            yield process, base, log
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def raw_exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send ``request`` on a kept-alive connection; the whole answer (Content-Length framed)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        data.lower().split(b"content-length:")[1].split(b"\r\n")[0]
    ):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n"
CHAT = b'{"model": "quick", "messages": []}'
POST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
)


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_under_serve_answers_every_client_and_exits_0_in_time(tmp_path: Path, workers: int) -> None:
    drain, grace = 2.0, 1.0
    calls = Calls()
    with upstream() as up:
        argv = ("--workers", str(workers), "--drain-delay", str(drain), "--shutdown-grace", str(grace))
        with serve(up, tmp_path, *argv) as (process, base, log):
            idle = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=15)
            silent = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=15)
            assert b" 200 " in raw_exchange(idle, HEALTHZ).split(b"\r\n")[0]
            assert b" 200 " in raw_exchange(silent, HEALTHZ).split(b"\r\n")[0]

            def stream() -> tuple[int, str]:
                body = {"model": "stream", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
                    return response.status_code, response.read().decode()  # raises if the framing is cut

            calls.start("stream", stream)
            calls.start("waiting", lambda: ask(base, "/v1/messages", "hold", ANTHROPIC))
            uploading = start_upload(int(base.rsplit(":", 1)[1]))
            calls.start("upload", lambda: read_until_closed(uploading))
            eventually(lambda: len(up.seen) == 2, seconds=10, what="both forwarded")
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            # The kept-alive connection, during DRAIN_DELAY: /healthz says draining, then a request on it
            # gets 503 + Retry-After + connection: close and the connection ends cleanly (no reset).
            eventually(lambda: b" 503 " in raw_exchange(idle, HEALTHZ), seconds=drain / 2, what="healthz 503")
            refused = raw_exchange(idle, POST)
            head = refused.partition(b"\r\n\r\n")[0].lower()
            assert (
                head.startswith(b"http/1.1 503 ") and b"\r\nretry-after: " in head and b"\r\nconnection: close" in head
            )
            assert b'"code":"overloaded"' in refused.replace(b" ", b"")
            assert idle.recv(1) == b""  # closed by the gateway, not reset
            assert process.wait(drain + grace + SHUTDOWN_BACKSTOP) == 0  # the silent connection held nothing
            assert time.monotonic() - signalled < drain + grace + 2  # ended by the grace, not the backstop
            assert silent.recv(1) == b""
            calls.join(5)
            for sock in (idle, silent, uploading):
                sock.close()
    status, text = calls.results["stream"][1]
    assert status == 200 and text.rstrip().endswith("}") and "event: error" in text and "shutting_down" in text
    assert_shutting_down(calls.results["waiting"][1], "anthropic")
    assert_refused_upload(calls.results["upload"][1])
    assert up.seen.count("quick") == 0 and up.seen.count("upload") == 0  # refused before forwarding
    eventually(lambda: up.count("hold", "closed") == 1 and up.count("stream", "closed") == 1, seconds=5, what="hung up")
    output = log.read_text()
    assert "Traceback" not in output and "Cancel" not in output, output
    assert output.count("outcome=shutdown") == 2, output  # the stream and the request waiting for its answer
    assert output.count("outcome=refused code=overloaded") == 1, output  # asked during DRAIN_DELAY
    assert output.count("outcome=refused code=shutting_down") == 1, output  # the upload


# -- the official SDKs during a drain ----------------------------------------------------------------------


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_sdk_retries_during_a_drain_never_send_a_generation_twice(tmp_path: Path, sdk: str) -> None:
    # Four calls with the SDK's own retries (2): one answered before SIGTERM; one asked during
    # DRAIN_DELAY (503 + Retry-After each time: the SDK retries, then raises; the upstream never saw it);
    # one waiting upstream when the grace ends (503 shutting_down, retried against a server gone: raises);
    # one streaming when the grace ends (the in-band error: the SDK raises). The upstream sees the
    # answered one, the cut one and the stream once each.
    def call(base: str, model: str, stream: bool = False) -> Any:
        messages = [{"role": "user", "content": "hi"}]
        if sdk == "openai":
            client: Any = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=2, timeout=20)
            answer = client.chat.completions.create(model=model, messages=messages, stream=stream)
        else:
            client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=2, timeout=20)
            answer = client.messages.create(model=model, max_tokens=5, messages=messages, stream=stream)
        return [event for event in answer] if stream else answer  # a stream read to its end

    calls = Calls()
    with upstream() as up:
        argv = ("--drain-delay", "1.5", "--shutdown-grace", "1", "--admission-timeout", "1")
        with serve(up, tmp_path, *argv) as (process, base, _):
            with contextlib.suppress(Exception):  # the upstream answers OpenAI's shape: enough for openai
                call(base, "quick")
            calls.start("cut", lambda: call(base, "hold"))
            calls.start("streamed", lambda: call(base, "stream", stream=True))
            eventually(lambda: up.count("hold") == 1 and up.count("stream") == 1, seconds=10, what="forwarded")
            process.send_signal(signal.SIGTERM)
            eventually(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 503, seconds=1, what="draining")
            calls.start("during", lambda: call(base, "during"))
            calls.join(30)
            assert process.wait(10) == 0
    errors = (openai.APIError, anthropic.APIError)
    assert isinstance(calls.results["cut"][1], errors) and isinstance(calls.results["during"][1], errors)
    assert isinstance(calls.results["streamed"][1], errors)  # the in-band shutting_down, raised: not a whole answer
    assert "shutting down" in str(calls.results["streamed"][1])
    assert sorted(up.seen) == ["hold", "quick", "stream"]


# -- other servers: the drain is theirs (docs/operators.md says what a client gets) -------------------------


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn-asyncio", "hypercorn-trio"])
def test_under_another_server_what_outlives_its_timeout_is_cut_never_a_complete_200(
    tmp_path: Path, server: str
) -> None:
    # Plain uvicorn --factory / hypercorn call the gateway's lifespan shutdown only after their own wait:
    # SHUTDOWN_GRACE (0.5 s) does not apply. At the server's timeout (2 s) the stream is cut (its chunked
    # body incomplete: a client raises, never reads a complete answer) and the upstream hung up on.
    port = free_port()
    timeout = 2
    with upstream() as up:
        env = clean_env(
            {"PYTHONPATH": str(ROOT), "ASGI_LIFETIME_UPSTREAM_URL": up.url, "ASGI_LIFETIME_SHUTDOWN_GRACE": "0.5"}
        )
        if server == "uvicorn":
            factory = ["uvicorn", "--factory", "asgi_lifetime.gateway:create_app", "--port", str(port)]
            command = [*factory, "--timeout-graceful-shutdown", str(timeout)]
        else:
            worker = server.removeprefix("hypercorn-")
            bind = ["--worker-class", worker, "--graceful-timeout", str(timeout), "-b", f"127.0.0.1:{port}"]
            command = ["hypercorn", *bind, "asgi_lifetime.gateway:create_app()"]
        log = tmp_path / "server.log"
        with log.open("wb") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", *command], stdout=handle, stderr=subprocess.STDOUT, cwd=tmp_path, env=env
            )
            try:
                base = f"http://127.0.0.1:{port}"

                def ready() -> bool:
                    assert process.poll() is None, log.read_text()
                    with contextlib.suppress(httpx.TransportError):
                        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
                    return False

                eventually(ready, seconds=60, what="the server up", every=0.1)
                body = {"model": "stream", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
                    chunks = response.iter_bytes()
                    assert b"data: " in next(chunks)
                    signalled = time.monotonic()
                    process.send_signal(signal.SIGTERM)
                    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                        for _ in chunks:
                            pass
                    cut_after = time.monotonic() - signalled
                assert timeout - 0.5 < cut_after < timeout + 3  # the server's timeout, not SHUTDOWN_GRACE
                # uvicorn re-raises SIGTERM once it has shut down: the status a shell shows as 143
                assert process.wait(10) == (-signal.SIGTERM if server == "uvicorn" else 0)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
    eventually(lambda: up.count("stream", "closed") == 1, seconds=5, what="the upstream hung up on")


def test_sigint_during_the_grace_force_quits_and_cuts_the_stream_visibly(tmp_path: Path) -> None:
    # Ctrl-C after SIGTERM (uvicorn's "CTRL+C to force quit"): no grace is waited for, the stream is cut
    # with its chunked body incomplete (never a complete 200), the upstream hung up on, and the status is 0.
    with upstream() as up:
        with serve(up, tmp_path, "--drain-delay", "0", "--shutdown-grace", "30") as (process, base, log):
            body = {"model": "stream", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
                chunks = response.iter_bytes()
                assert b"data: " in next(chunks)
                process.send_signal(signal.SIGTERM)
                eventually(lambda: "Waiting for connections to close" in log.read_text(), seconds=5, what="draining")
                signalled = time.monotonic()
                process.send_signal(signal.SIGINT)
                with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                    for _ in chunks:
                        pass
                assert time.monotonic() - signalled < 5
            assert process.wait(10) == 0
    eventually(lambda: up.count("stream", "closed") == 1, seconds=5, what="the upstream hung up on")


def test_a_sigint_to_the_parent_of_workers_reaches_them_as_sigterm(tmp_path: Path) -> None:
    # uvicorn's supervisor stops its workers with SIGTERM whatever it got: `kill -INT` of the parent does
    # not skip DRAIN_DELAY there (docs/operators.md says so); the workers drain, then all exit 0.
    with upstream() as up:
        with serve(up, tmp_path, "--workers", "2", "--drain-delay", "2") as (process, base, _):
            signalled = time.monotonic()
            process.send_signal(signal.SIGINT)
            eventually(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 503, seconds=2, what="draining")
            assert process.wait(15) == 0
            assert time.monotonic() - signalled > 2
