"""Security of the standalone gateway as a reverse proxy, over real sockets.

- Hop-by-hop headers (RFC 9110 7.6.1), the headers ``Connection`` names, and ``Host`` are
  not forwarded, in either direction; end-to-end headers are, byte for byte.
- No header the upstream receives carries CR, LF or NUL, whatever the client sent or however
  it reached the gateway.
- The ASGI server's own ``Date`` and ``Server`` are the only ones the client gets.
- Request bodies never reach a log record, at any level, on any path.
- What the gateway reads of an upstream error body is bounded.
- A request under ``PATHS`` cannot reach another path of the upstream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from asgi_lifetime._cli._main import HTTPTOOLS_PROTOCOL
from asgi_lifetime._settings import KiB, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing._upstream import create_demo_upstream

from .test_faults import (
    CHAT,
    HTTP_PARSERS,
    PATH,
    Firehose,
    Stack,
    assert_idle,
    raw_client,
    request_bytes,
    running,
)

pytestmark = pytest.mark.anyio

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}


@dataclass
class Seen:
    method: str
    path: str
    raw_path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]


@dataclass
class Capture:
    """An upstream that records each request and answers with a fixed response."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: [(b"content-type", b"application/json")])
    body: bytes = json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
    ).encode()
    seen: list[Seen] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.seen.append(Seen(scope["method"], scope["path"], scope["raw_path"], list(scope["headers"]), body))
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


@pytest.fixture(scope="module", params=HTTP_PARSERS)
def capture(request: pytest.FixtureRequest) -> Iterator[tuple[Capture, Stack]]:
    upstream = Capture(
        headers=[
            (b"content-type", b"application/json"),
            (b"connection", b"x-upstream-hop, keep-alive"),
            (b"x-upstream-hop", b"secret"),
            (b"keep-alive", b"timeout=5"),
            (b"proxy-authenticate", b"Basic realm=upstream"),
            (b"trailer", b"x-checksum"),
            (b"server", b"secret-upstream/1.2.3"),
            (b"date", b"Mon, 01 Jan 1990 00:00:00 GMT"),
            (b"x-request-id", b"req-1"),
            (b"set-cookie", b"a=1"),
        ]
    )
    with running(upstream=upstream, serve={"http": request.param}) as stack:
        yield upstream, stack


async def exchange(stack: Stack, request: bytes) -> tuple[int, list[tuple[str, str]]]:
    """Send raw request bytes; the response status and its header list (repeats kept)."""
    async with raw_client(stack.url) as client:
        await client.send(request)
        with anyio.fail_after(5):
            while True:
                event = await client.next_event()
                if hasattr(event, "status_code") and event.status_code >= 200:
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
                    await client.response()
                    return int(event.status_code), headers


async def test_request_hop_by_hop_and_host_are_not_forwarded(capture: tuple[Capture, Stack]) -> None:
    upstream, stack = capture
    sent = [
        ("host", "evil.example"),
        ("connection", "keep-alive, x-client-hop, Upgrade"),
        ("x-client-hop", "secret"),
        ("keep-alive", "timeout=5"),
        ("te", "trailers"),
        ("trailer", "x-checksum"),
        ("upgrade", "h2c"),
        ("proxy-authorization", "Basic cHJveHk6c2VjcmV0"),
        ("proxy-connection", "keep-alive"),
        ("expect", "100-continue"),
        ("authorization", "Bearer client-key"),
        ("accept-encoding", "gzip, br"),
        ("x-custom", "kept"),
        ("x-custom", "twice"),
    ]
    if stack.http == "httptools":  # see test_a_request_asking_for_an_upgrade_is_served
        sent = [(name, value.replace(", Upgrade", "")) for name, value in sent if name != "upgrade"]
    body = json.dumps(CHAT).encode()
    raw = request_bytes(body, headers=sent).replace(b"host: gateway.test\r\n", b"")
    status, _ = await exchange(stack, raw)
    assert status == 200
    seen = upstream.seen[-1]
    names = {name.decode() for name, _ in seen.headers}
    assert not names & (HOP_BY_HOP - {"connection"}) and seen.header(b"connection") in ([], [b"keep-alive"])
    assert not names & {"x-client-hop", "expect"}
    # Nothing the client did not send (no Accept or User-Agent naming httpx), and Accept-Encoding
    # identity whatever the client accepts: an encoded stream would escape the guards and the scrubber.
    assert not names & {"accept", "user-agent"}
    assert seen.header(b"accept-encoding") == [b"identity"]
    assert seen.header(b"host") == [stack.upstream_url.removeprefix("http://").encode()]
    assert seen.header(b"authorization") == [b"Bearer client-key"]
    assert seen.header(b"x-custom") == [b"kept", b"twice"]
    assert seen.header(b"content-length") == [str(len(body)).encode()] and seen.body == body
    await assert_idle(stack.app, stack.url)


async def test_a_request_asking_for_an_upgrade_is_served(
    capture: tuple[Capture, Stack], request: pytest.FixtureRequest
) -> None:
    """``Connection: Upgrade`` / ``Upgrade: h2c`` (curl's cleartext HTTP/2 offer) on a POST: h11 serves it
    as HTTP/1.1 (the upgrade is not taken, and not forwarded)."""
    upstream, stack = capture
    if stack.http == "httptools":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=HTTPTOOLS_UPGRADE))
    body = json.dumps(CHAT).encode()
    raw = request_bytes(body, headers=[("connection", "Upgrade, HTTP2-Settings"), ("upgrade", "h2c")])
    before = len(upstream.seen)
    status, _ = await exchange(stack, raw)
    assert status == 200 and len(upstream.seen) == before + 1 and upstream.seen[-1].body == body
    assert upstream.seen[-1].header(b"upgrade") == []
    await assert_idle(stack.app, stack.url)


HTTPTOOLS_UPGRADE = (
    "known limit: under httptools uvicorn stops parsing at an Upgrade it does not take (anything but a "
    "WebSocket): the body never arrives and the request fails (an error answer, nothing forwarded); "
    "use --http h11 for clients that offer h2c"
)


async def test_response_hop_by_hop_date_and_server_are_not_relayed(capture: tuple[Capture, Stack]) -> None:
    upstream, stack = capture
    status, headers = await exchange(stack, request_bytes(json.dumps(CHAT).encode()))
    assert status == 200
    names = [name for name, _ in headers]
    assert not set(names) & (HOP_BY_HOP - {"connection"}) and "x-upstream-hop" not in names
    assert [value for name, value in headers if name == "connection"] in ([], ["close"], ["keep-alive"])
    assert names.count("date") == 1 and "1990" not in dict(headers)["date"]  # the server's own Date, once
    assert names.count("server") <= 1 and "secret-upstream" not in dict(headers).get("server", "")
    assert dict(headers)["x-request-id"] == "req-1" and dict(headers)["set-cookie"] == "a=1"
    await assert_idle(stack.app, stack.url)


async def test_no_forwarded_header_carries_cr_lf_or_nul(capture: tuple[Capture, Stack]) -> None:
    """h11 ends a header line at a bare LF and unfolds obsolete line folding: whatever reaches
    the upstream is separate, clean header fields. httptools refuses both (its plain 400)."""
    upstream, stack = capture
    body = json.dumps(CHAT).encode()
    for line in (b"x-a: 1\nx-b: 2\r\n", b"x-folded: first\r\n  second\r\n", b"x-session-id: s1\r\n\tcontinued\r\n"):
        raw = request_bytes(body).replace(b"\r\n\r\n", b"\r\n" + line + b"\r\n", 1)
        before = len(upstream.seen)
        status, _ = await exchange(stack, raw)
        if stack.http == "httptools":
            assert status == 400 and len(upstream.seen) == before
            continue
        assert status == 200
        for name, value in upstream.seen[-1].headers:
            assert not {b"\r", b"\n", b"\0"} & {bytes([c]) for c in name + value}, (name, value)
    if stack.http != "httptools":
        assert upstream.seen[-3].header(b"x-a") == [b"1"] and upstream.seen[-3].header(b"x-b") == [b"2"]
    await assert_idle(stack.app, stack.url)


TRAILERS = (b"x-injected: 1", b"authorization: Bearer trailer-key", b"x-session-id: other", b"content-type: text/plain")


@pytest.mark.parametrize("http", [*HTTP_PARSERS, HTTPTOOLS_PROTOCOL], ids=[*HTTP_PARSERS, "serve-httptools"])
async def test_trailer_fields_of_a_chunked_body_are_not_forwarded(http: str, request: pytest.FixtureRequest) -> None:
    """Trailer fields after a chunked body are dropped (h11 drops them; so does ``asgi-lifetime serve``'s
    httptools protocol). uvicorn's own httptools protocol appends them to the request's header list, often
    before the app looks at it: the gateway would forward fields it never judged (a second Authorization
    or session id), so plain uvicorn with httptools is a known limit."""
    if http == "httptools":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=HTTPTOOLS_TRAILERS))
    upstream = Capture()
    body = json.dumps(CHAT).encode()
    with running(upstream=upstream, serve={"http": http}) as stack:
        for trailer in TRAILERS:
            chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n" + trailer + b"\r\n\r\n"
            raw = request_bytes(chunked, content_length=None, headers=[("transfer-encoding", "chunked")])
            status, _ = await exchange(stack, raw.replace(b"\r\n\r\n", b"\r\nx-session-id: s1\r\n\r\n", 1))
            assert status == 200, trailer
            seen = upstream.seen[-1]
            assert b"x-injected" not in {key for key, _ in seen.headers}
            assert seen.header(b"authorization") == []
            assert seen.header(b"x-session-id") == [b"s1"]
            assert seen.header(b"content-type") == [b"application/json"]
            assert seen.body == body
        await assert_idle(stack.app, stack.url)


HTTPTOOLS_TRAILERS = (
    "known limit of plain uvicorn with httptools: trailer fields join the request's headers and are forwarded; "
    "asgi-lifetime serve runs httptools without them (--http httptools), or run uvicorn with --http h11"
)


@pytest.mark.parametrize("hosts", [(), ("a.test", "b.test")], ids=["none", "two"])
async def test_an_http11_request_without_exactly_one_host_is_refused(
    capture: tuple[Capture, Stack], hosts: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    """RFC 9112 3.2: a server must answer 400 to an HTTP/1.1 request with no Host or several."""
    upstream, stack = capture
    if stack.http == "httptools":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=HTTPTOOLS_HOST))
    raw = request_bytes(json.dumps(CHAT).encode(), headers=[("host", host) for host in hosts])
    before = len(upstream.seen)
    status, _ = await exchange(stack, raw.replace(b"host: gateway.test\r\n", b""))
    assert status == 400 and len(upstream.seen) == before
    await assert_idle(stack.app, stack.url)


HTTPTOOLS_HOST = (
    "known limit: uvicorn's httptools parser serves an HTTP/1.1 request with no Host or several; the gateway "
    "never forwards the client's Host (the upstream gets its own), so nothing downstream routes by it"
)


async def test_non_ascii_header_values_are_forwarded_byte_for_byte(capture: tuple[Capture, Stack]) -> None:
    """obs-text (bytes 0x80-0xFF) is legal in a field value; it used to crash the request with a 500
    (the gateway decoded the value as latin-1 and httpx encoded it back as ASCII)."""
    upstream, stack = capture
    value = "caf\xe9 \xff".encode("latin-1")
    raw = request_bytes(json.dumps(CHAT).encode()).replace(
        b"\r\n\r\n", b"\r\nx-note: " + value + b"\r\nx-session-id: s\xe9ssion\r\n\r\n", 1
    )
    status, headers = await exchange(stack, raw)
    assert status == 200
    assert upstream.seen[-1].header(b"x-note") == [value]
    assert upstream.seen[-1].header(b"x-session-id") == [b"s\xe9ssion"]
    assert not any("ssion" in v for _, v in headers)  # the session id is not echoed into the response
    await assert_idle(stack.app, stack.url)


async def test_header_injection_through_asgi_never_reaches_the_upstream() -> None:
    """A scope no HTTP parser checked (the gateway mounted in another ASGI app, a test client):
    a CR/LF in a header value, the session id included, is never written to the upstream: the client's
    400 (before: h11 refused it on every attempt, and the client got 502 upstream_unreachable)."""
    upstream = create_demo_upstream(tokens_per_second=20_000, default_tokens=8)
    with running(upstream=upstream) as stack:
        app = create_app(stack.app.state.lifetime.settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
                for name in ("x-custom", "x-session-id"):
                    response = await client.post(PATH, json=CHAT, headers={name: "a\r\nx-injected: 1"})
                    assert response.status_code == 400
                    assert response.json()["error"]["code"] == "invalid_header"
            assert app.state.lifetime.stats().idle
        assert stack.demo.requests == 0


MARKER = "zq-BODY-MARKER-7f3a"


async def test_request_bodies_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    conversation = {
        "model": "demo",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": f"system {MARKER}"}]
        + [{"role": "user", "content": f"turn {i} {MARKER} " + "filler " * 40} for i in range(12)],
    }
    with running(serve={"log_level": "trace"}) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            requests: list[tuple[dict[str, Any], dict[str, str]]] = [
                (conversation, {}),
                ({**conversation, "stream": True}, {}),
                (conversation, {"x-demo-behaviour": "overflow=2000"}),  # context overflow: refolded
                (conversation, {"x-demo-behaviour": "reject_role=system"}),  # role remapped
                (conversation, {"x-demo-behaviour": "fail=9"}),  # retried, then passed on
                ({**conversation, "stream": True}, {"x-demo-behaviour": "starve"}),  # re-issued
                ({**conversation, "stream": True}, {"x-demo-behaviour": "stall"}),
                ({**conversation, "stream": True}, {"x-demo-behaviour": "reset"}),
            ]
            for payload, headers in requests:
                await client.post(PATH, json=payload, headers={**headers, "x-session-id": "logged-session"})
            await client.post(
                PATH, content=f'{{"messages": "{MARKER}'.encode(), headers={"content-type": "application/json"}
            )
            await client.post(PATH, content=f"{MARKER}".encode(), headers={"content-encoding": "gzip"})
        await assert_idle(stack.app, stack.url, upstream=stack.upstream)
        assert stack.stats()["refolded"] >= 1
    assert len(caplog.records) > 20  # DEBUG and uvicorn's TRACE did log
    for record in caplog.records:
        assert MARKER not in record.getMessage(), record.name
        assert MARKER not in (record.exc_text or "")
    assert MARKER not in caplog.text


async def test_error_body_read_for_a_retry_decision_is_bounded() -> None:
    """A 400 on a conversation is read to see whether it is a context overflow: at most
    ERROR_BODY_LIMIT bytes of it, whatever the upstream sends, and the client gets those."""
    firehose = Firehose(total=256 * MiB, event_size=64 * KiB, status=400, sse=False)
    with running(upstream=firehose, error_body_limit=64 * KiB) as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post(PATH, json=CHAT)
        assert response.status_code == 400 and len(response.content) == 64 * KiB
        assert firehose.sent < 64 * MiB  # the gateway stopped reading; the rest was never sent
        await assert_idle(stack.app, stack.url)


async def test_dot_segments_cannot_leave_the_forwarded_prefix(capture: tuple[Capture, Stack]) -> None:
    upstream, stack = capture
    before = len(upstream.seen)
    body = json.dumps(CHAT).encode()
    for path in ("/v1/../admin", "/v1/%2e%2e/admin", "/v1/./../admin", "/v1/chat/../../admin"):
        status, _ = await exchange(stack, request_bytes(body, path=path))
        assert 400 <= status < 500
    escaped = [seen.path for seen in upstream.seen[before:]]
    assert escaped == []
    await assert_idle(stack.app, stack.url)
