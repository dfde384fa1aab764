"""Attacks on the forwarded request headers (``gateway._head.RequestHead`` and the OWS strip).

Legitimate headers must reach the upstream as the client sent them (spaces and tabs around a value
dropped, names lower-case), whatever the server (uvicorn's h11 and httptools, hypercorn over HTTP/1.1
and over HTTP/2 with prior knowledge) and the upstream transport (httpcore, aiohttp): checked on the
bytes a raw-socket upstream reads. Hostile ones (a control byte HTTP/1.1 cannot carry, a name that is
not a token) are the client's 400 ``invalid_header`` in its error shape: nothing forwarded, the value
never echoed, a refused access-log line with its code (the body is not read first:
tests/gateway/test_request_head.py), nothing left held. Over HTTP/1.1 the servers refuse
them first; HTTP/2 passes ``\\x0b``, ``\\x0c`` and non-token names (h2 checks only NUL, CR, LF and some
name bytes), and a raw ASGI scope anything.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._access_log import ACCESS_LOGGER, session_hash
from asgi_lifetime.testing import assert_idle, wait_idle
from asgi_lifetime.testing._serve import serve_in_thread

from .._servers import hypercorn_in_thread
from ..gateway._raw_upstream import RawUpstream, raw_upstream, response
from ..gateway.test_upstream_transport import TRANSPORTS, runs_here
from .test_faults import eventually

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
SECRET = b"sk-SECRETVALUE"
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
GEMINI = "/v1/models/gemini-2.0-flash:generateContent"

# What the official SDKs send (openai-python, anthropic-sdk-python), and what a proxy or a browser adds.
SDK = [
    (b"User-Agent", b"OpenAI/Python 1.54.3"),  # a name in capitals: servers give it lower-case
    (b"X-Stainless-Lang", b"python"),
    (b"x-stainless-package-version", b"1.54.3"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"),
    (b"x-stainless-runtime-version", b"3.12.3"),
    (b"x-stainless-async", b"async:asyncio"),
    (b"x-stainless-retry-count", b"0"),
    (b"x-stainless-read-timeout", b"600"),
    (b"anthropic-version", b"2023-06-01"),
    (b"anthropic-beta", b"prompt-caching-2024-07-31,token-efficient-tools-2025-02-19"),
    (b"openai-project", b"proj_abc"),
    (b"idempotency-key", b"stainless-python-retry-0f0c6f5e-7a54-4b6e-9a7b-5b6b8f1c2d3e"),
]
ODD = [
    (b"x-obs-text", b"caf\xe9 \xff\x80 end"),  # obs-text (latin-1), not UTF-8
    (b"x-utf8", "café ☃ 日本".encode()),
    (b"x-empty", b""),
    (b"x-inner-tabs", b"a\tb \t c"),
    (b"x-long", b"z" * 8000),  # a large cookie or JWT
    (b"x-repeated", b"1"),
    (b"x-repeated", b"2"),
    *((f"x-many-{n}".encode(), str(n).encode()) for n in range(60)),
]
PADDED = [(b"x-padded", b" \t a b \t ")]  # HTTP/1.1 servers strip it; HTTP/2 refuses it
CONTROL = [(b"x-control", b"a\x01b\x7fc")]  # h11 and h2 pass it, as does h11 on the way out; llhttp refuses it


def expected_lines(fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [name.lower() + b": " + value.strip(b" \t") for name, value in fields]


def our_lines(upstream: RawUpstream, fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The header lines of the one request the upstream saw that carry one of ``fields``' names, in order."""
    [request] = upstream.requests
    names = {name.lower() for name, _ in fields}
    return [line for line in request.raw_head.split(b"\r\n")[1:] if line.partition(b":")[0] in names]


def post_http11(port: int, fields: list[tuple[bytes, bytes]], path: str = PATHS["openai"]) -> tuple[int, bytes]:
    """One POST on a raw socket (the header bytes as given); the status and body of the answer."""
    head = [f"POST {path} HTTP/1.1".encode(), b"host: gateway.test", b"content-type: application/json"]
    head += [f"content-length: {len(BODY)}".encode(), b"connection: close"]
    head += [name + b": " + value for name, value in fields]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + BODY)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def post_http2(port: int, fields: list[tuple[bytes, bytes]], path: str = PATHS["openai"]) -> tuple[int, bytes]:
    """One POST over cleartext HTTP/2 with prior knowledge; our side does not check the fields."""
    config = h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False, header_encoding=None
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    head = [(b":method", b"POST"), (b":path", path.encode()), (b":scheme", b"http"), (b":authority", b"gateway.test")]
    head += [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    conn.send_headers(1, head + fields)
    conn.send_data(1, BODY, end_stream=True)
    status, body = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return status, body
            sock.sendall(conn.data_to_send())
    raise AssertionError("the connection closed before the stream ended")


@contextlib.contextmanager
def served(server: str, transport: str) -> Iterator[tuple[RawUpstream, Any, int]]:
    """A raw upstream answering 200 and the gateway in front of it under ``server``: upstream, app, port."""
    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url,), upstream_transport=transport, max_attempts=2)
        app = create_app(settings)
        if server.startswith("hypercorn"):
            with hypercorn_in_thread(app, server.partition("-")[2]) as port:
                yield upstream, app, port
        else:
            with serve_in_thread(app, http=server) as url:
                yield upstream, app, int(url.rsplit(":", 1)[1])


# uvicorn runs on asyncio; hypercorn on either (aiohttp needs asyncio).
HTTP11 = [
    ("h11", "httpcore"),
    ("h11", "aiohttp"),
    ("httptools", "httpcore"),
    ("httptools", "aiohttp"),
    ("hypercorn-asyncio", "httpcore"),
    ("hypercorn-asyncio", "aiohttp"),
    ("hypercorn-trio", "httpcore"),
]
HTTP2 = [("hypercorn-asyncio", "httpcore"), ("hypercorn-asyncio", "aiohttp"), ("hypercorn-trio", "httpcore")]


@pytest.mark.parametrize(("server", "transport"), HTTP11)
def test_legitimate_headers_reach_the_upstream_as_sent_over_http11(server: str, transport: str) -> None:
    fields = SDK + ODD + PADDED + ([] if server == "httptools" else CONTROL)
    with served(server, transport) as (upstream, _, port):
        status, body = post_http11(port, fields)
    assert (status, body) == (200, b"{}")
    assert our_lines(upstream, fields) == expected_lines(fields)


@pytest.mark.parametrize(("server", "transport"), HTTP2)
def test_legitimate_headers_reach_the_upstream_as_sent_over_http2(server: str, transport: str) -> None:
    fields = [(name.lower(), value) for name, value in SDK + ODD + CONTROL]  # h2 wants lower-case names
    with served(server, transport) as (upstream, _, port):
        status, body = post_http2(port, fields)
    assert (status, body) == (200, b"{}")
    assert our_lines(upstream, fields) == expected_lines(fields)


HOSTILE_HTTP2 = [
    (b"x-trace", SECRET + b"\x0bx"),
    (b"x-trace", SECRET + b"\x0c"),
    (b"x-trace", b"\x0b" + SECRET),  # not SP or HTAB: h2 lets it open a value
    (b"x-session-id", SECRET + b"\x0b"),  # the session id is read before the forwarder's check
    (b"x(trace)", b"1"),
    (b"x@trace", b"1"),
    (b"x,trace", b"1"),
    (b'x"trace', b"1"),
]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [record.__dict__["asgi_lifetime"] for record in caplog.records if record.name == ACCESS_LOGGER]


def assert_invalid_header(status: int, body: bytes, shape: str, caplog: pytest.LogCaptureFixture) -> None:
    assert status == 400
    assert SECRET not in body  # a value is never quoted: it may be a credential
    document = httpx.Response(status, content=body).json()
    error = document["error"]
    if shape == "gemini":
        assert error["status"] == "INVALID_ARGUMENT" and error["details"][0]["reason"] == "invalid_header"
    else:
        assert error["code"] == "invalid_header"
    if shape == "anthropic":
        assert document["type"] == "error" and error["type"] == "invalid_request_error"
    elif shape == "openai":
        assert error["type"] == "invalid_request_error"
    [line] = access_lines(caplog)
    # Refused before the forwarder (and the body): the short line, no attempt made or upstream named.
    assert (line["status"], line["outcome"], line["code"]) == (400, "refused", "invalid_header")
    assert "attempts" not in line and "upstream" not in line
    assert not any(SECRET.decode() in record.getMessage() for record in caplog.records)


@pytest.mark.anyio
@pytest.mark.parametrize(("server", "transport"), HTTP2)
@pytest.mark.parametrize("shape", PATHS)
@pytest.mark.parametrize("field", HOSTILE_HTTP2, ids=repr)
async def test_a_header_http11_cannot_carry_over_http2_is_the_clients_400(
    server: str, transport: str, shape: str, field: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with served(server, transport) as (upstream, app, port):
        status, body = post_http2(port, [field], PATHS[shape])
        await wait_idle(app)  # the request body and everything admitted is released
        await eventually(lambda: bool(access_lines(caplog)))  # written in the server's thread, after the answer
        assert upstream.requests == []
        assert_invalid_header(status, body, shape, caplog)
        again = post_http2(port, [(b"x-trace", b"fine")], PATHS[shape])  # the gateway serves on
    assert again == (200, b"{}") and len(upstream.requests) == 1


@contextlib.asynccontextmanager
async def in_process(
    preparers: tuple[Any, ...] = (), **changes: Any
) -> AsyncIterator[tuple[RawUpstream, Any, httpx.AsyncClient]]:
    """The gateway with its lifespan, reached through ``ASGITransport``: a scope no HTTP parser checked
    (the gateway mounted in another ASGI app, a test client), header bytes as given."""
    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **changes), preparers=preparers)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
                yield upstream, app, client


HOSTILE_SCOPE = [
    (b"x-trace", SECRET + b"\x00x"),
    (b"x-trace", SECRET + b"\rx"),
    (b"x-trace", SECRET + b"\nx"),
    (b"x-trace", SECRET + b"\r\nx-injected: 1"),
    (b"x-trace", SECRET + b"\x0bx"),
    (b"x-trace", SECRET + b"\x0cx"),
    (b"x-trace", b" " + SECRET + b"\r\n"),  # stripped of spaces, not of line breaks
    (b"x-session-id", SECRET + b"\nx"),
    (b"x:trace", b"1"),
    (b"x trace", b"1"),
    (b"", b"1"),
    (b"x\x7ftrace", b"1"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("shape", [*PATHS, "gemini"])
@pytest.mark.parametrize("field", HOSTILE_SCOPE, ids=repr)
async def test_a_header_http11_cannot_carry_in_a_raw_scope_is_the_clients_400(
    shape: str, field: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with in_process() as (upstream, app, client):
        path = GEMINI if shape == "gemini" else PATHS[shape]
        answer = await client.post(path, content=BODY, headers=[(b"content-type", b"application/json"), field])
        await assert_idle(app)
    assert upstream.requests == []
    assert_invalid_header(answer.status_code, answer.content, shape, caplog)


@pytest.mark.anyio
async def test_session_ids_that_differ_only_by_padding_are_one_session(caplog: pytest.LogCaptureFixture) -> None:
    # The gateway keys by the stripped value (single_field) and now forwards the stripped lines:
    # both lines say the same id, and the session is that id.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with in_process() as (upstream, _, client):
        headers = [
            (b"x-session-id", b"sess-1"),
            (b"x-session-id", b" \tsess-1 "),
            (b"content-type", b"application/json"),
        ]
        answer = await client.post(PATHS["openai"], content=BODY, headers=headers)
        conflicting = [(b"x-session-id", b"sess-1"), (b"x-session-id", b" sess-2")]
        refused = await client.post(PATHS["openai"], content=BODY, headers=conflicting)
    assert answer.status_code == 200
    [request] = upstream.requests
    assert [line for line in request.raw_head.split(b"\r\n") if line.startswith(b"x-session-id:")] == [
        b"x-session-id: sess-1",
        b"x-session-id: sess-1",
    ]
    assert access_lines(caplog)[0]["session"] == session_hash("sess-1")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "conflicting_session_id"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "credential",
    [(b"authorization", b"Bearer  gw-key \t"), (b"x-api-key", b" gw-key\t"), (b"authorization", b"Bearer gw-key")],
)
async def test_a_padded_gateway_key_is_the_key_and_the_upstream_sees_only_ours(credential: tuple[bytes, bytes]) -> None:
    async with in_process(gateway_keys=("gw-key",), upstream_api_key="sk-upstream") as (upstream, _, client):
        answer = await client.post(PATHS["openai"], content=BODY, headers=[credential])
        wrong = await client.post(PATHS["openai"], content=BODY, headers=[(credential[0], credential[1] + b"x")])
    assert answer.status_code == 200 and wrong.status_code == 401
    [request] = upstream.requests
    lines = request.raw_head.lower().split(b"\r\n")
    assert [line for line in lines if line.startswith((b"authorization:", b"x-api-key:"))] == [
        b"authorization: bearer sk-upstream"
    ]
    assert b"gw-key" not in request.raw_head


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("value", [" a b ", "a b\t", "\t a b"])
async def test_a_preparers_padded_header_goes_out_the_same_on_both_transports(
    transport: str, value: str, anyio_backend: str
) -> None:
    # Only the client's values were stripped: a preparer's " a b " was a 502 request_unsendable through
    # httpcore (h11 refuses the padding) and went out padded through aiohttp. Now every outgoing value is.
    if not runs_here(transport, anyio_backend):
        return

    def route(draft: Any) -> None:
        draft.headers["x-routed"] = value

    async with in_process(preparers=(route,), upstream_transport=transport) as (upstream, _, client):
        answer = await client.post(PATHS["openai"], content=BODY, headers=[(b"content-type", b"application/json")])
    assert answer.status_code == 200
    [request] = upstream.requests
    assert b"\r\nx-routed: a b\r\n" in request.raw_head
