"""The request head as the gateway reads it, through ``create_app`` on a raw ASGI scope (the test is the server).

- A head the gateway cannot forward (a header field HTTP/1.1 cannot carry, a ``.``/``..`` path segment)
  is refused (400) before admission and before one body message is taken from the server: a hostile
  client no longer makes the gateway read up to ``MAX_BODY_BYTES`` first. A stranger still gets the
  401 first (it learns nothing of what the gateway would forward).
- Several ``cookie`` fields (HTTP/2 sends one per cookie, RFC 9113 8.2.3) go upstream as one, joined
  with ``"; "``, as HTTP/1.1 requires; any other repeated field goes as it came.
- Header names in capitals (a server that does not lowercase them, a raw scope) are the same fields as
  in lower case: credentials are replaced, hop-by-hop and framing fields are not forwarded, a gateway
  key authenticates, ``Content-Encoding`` and ``Content-Type`` describe the body, the session id is read.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Message

from asgi_lifetime import LifetimeSettings, MiB
from asgi_lifetime._asgi import FIELD_NAME, OWS
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._access_log import ACCESS_LOGGER, session_hash
from asgi_lifetime.gateway._head import _unforwardable
from asgi_lifetime.testing import assert_idle

from .._asgi import Recorder, http_scope
from ..reliability.test_attack_headers import post_http2, served
from ._raw_upstream import RawUpstream, raw_upstream, response
from .test_upstream_transport import TRANSPORTS, runs_here

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
SECRET = b"client-SECRET"
PATHS = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "gemini": "/v1/models/gemini-2.0-flash:generateContent",
}
# Each with a dot segment, in the same shape.
DOTTED = {
    "openai": "/v1/./chat/completions",
    "anthropic": "/v1/messages/../messages",
    "gemini": "/v1/./models/gemini-2.0-flash:generateContent",
}


@contextlib.asynccontextmanager
async def gateway(**changes: Any) -> AsyncIterator[tuple[RawUpstream, Any]]:
    """The gateway with its lifespan, in front of a raw loopback upstream answering 200 ``{}``."""
    with raw_upstream(lambda request: [response(200, b"{}")]) as upstream:
        app = create_app(LifetimeSettings(upstream_url=(upstream.url,), **changes))
        async with app.router.lifespan_context(app):
            yield upstream, app


class Client:
    """A client that declared ``declared`` bytes and sends them in 1 MiB messages, counting those taken."""

    def __init__(self, declared: int) -> None:
        self.left = declared
        self.taken = 0

    async def receive(self) -> Message:
        if self.left <= 0:
            await anyio.sleep_forever()
        self.taken += 1
        part = _CHUNK[: min(self.left, MiB)]
        self.left -= len(part)
        return {"type": "http.request", "body": part, "more_body": self.left > 0}


_CHUNK = b" " * MiB


async def call(app: Any, path: str, headers: list[tuple[bytes, bytes]], body: bytes = BODY) -> Recorder:
    """One request as a server that passes ``headers`` as given would make it; the answer recorded."""
    scope = http_scope(path, [(b"content-length", str(len(body)).encode()), *headers])
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if sent:
            return sent.pop()
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    recorder = Recorder()
    with anyio.fail_after(10):
        await app(scope, receive, recorder)
    return recorder


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [record.__dict__["asgi_lifetime"] for record in caplog.records if record.name == ACCESS_LOGGER]


def start_headers(recorder: Recorder) -> list[tuple[bytes, bytes]]:
    [start] = [m for m in recorder.messages if m["type"] == "http.response.start"]
    return list(start["headers"])


HOSTILE = [
    ((b"x-trace", SECRET + b"\x00x"), "invalid_header"),
    ((b"x-trace", SECRET + b"\r\nx-injected: 1"), "invalid_header"),
    ((b"x-trace", SECRET + b"\x0b"), "invalid_header"),
    ((b"X-Trace", b"\n" + SECRET), "invalid_header"),
    ((b"x(trace)", b"1"), "invalid_header"),
    ((b"", b"1"), "invalid_header"),
    ((b"x-session-id", SECRET + b"\nx"), "invalid_header"),
    (None, "invalid_path"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("shape", PATHS)
@pytest.mark.parametrize(("field", "code"), HOSTILE, ids=repr)
async def test_a_head_that_cannot_be_forwarded_is_refused_before_the_body_is_read(
    shape: str, field: tuple[bytes, bytes] | None, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    declared = 64 * MiB  # MAX_BODY_BYTES: before, all of it was read (and charged) before the 400
    path = PATHS[shape] if field is not None else DOTTED[shape]
    headers = [(b"content-type", b"application/json"), (b"content-length", str(declared).encode())]
    client = Client(declared)
    recorder = Recorder()
    async with gateway() as (upstream, app):
        with anyio.fail_after(10):
            await app(http_scope(path, [*headers, *([field] if field else [])]), client.receive, recorder)
        await assert_idle(app)
    assert client.taken == 0
    assert upstream.requests == []
    assert recorder.status == 400
    assert (b"connection", b"close") in start_headers(recorder)  # the body is unread: not another request
    assert SECRET not in recorder.body  # a value is never quoted: it may be a credential
    document = httpx.Response(400, content=recorder.body).json()
    if shape == "gemini":
        assert document["error"]["details"][0]["reason"] == code
    elif shape == "anthropic":
        assert document["type"] == "error" and document["error"]["code"] == code
    else:
        assert document["error"]["code"] == code
    [line] = access_lines(caplog)
    assert (line["status"], line["outcome"], line["code"]) == (400, "refused", code)


# The rule as the forwarder applied it to each forwarded line before (h11's, on the stripped value).
_BEFORE_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")


def _before(name: bytes, value: bytes) -> bool:
    return FIELD_NAME.fullmatch(name) is not None and _BEFORE_VALUE.fullmatch(value.strip(OWS)) is not None


@pytest.mark.parametrize("byte", range(256))
def test_the_check_judges_each_byte_as_the_forwarders_did(byte: int) -> None:
    # Judged at once over every line now: the same verdict for each byte, in a name or a value, anywhere.
    one = bytes([byte])
    cases = [
        (b"x" + one, b"v"),
        (one, b"v"),
        (b"x", one),
        (b"x", b"a" + one + b"b"),
        (b"x", one + b"a"),
        (b"x", b"a" + one),
    ]
    for name, value in cases:
        scope = {"path": "/v1/x", "headers": [(b"host", b"h"), (name, value), (b"accept", b"*/*")]}
        assert (_unforwardable(scope) is None) == _before(name, value), (name, value)


@pytest.mark.anyio
async def test_the_refusal_is_counted_by_its_code() -> None:
    async with gateway() as (_, app):
        await call(app, PATHS["openai"], [(b"x-trace", b"a\x00b")])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test") as client:
            metrics = (await client.get("/metrics")).text
    assert 'asgi_lifetime_refused_total{reason="invalid_header",status="400"} 1.0' in metrics


@pytest.mark.anyio
async def test_a_stranger_gets_the_401_first_and_a_member_the_400_both_before_the_body() -> None:
    bad = (b"x-trace", b"a\x00b")
    declared = [(b"content-length", str(8 * MiB).encode())]
    async with gateway(gateway_keys=("gw-key",), upstream_api_key="sk-upstream") as (upstream, app):
        answers = []
        for credential in ([], [(b"authorization", b"Bearer gw-key")]):
            client, recorder = Client(8 * MiB), Recorder()
            with anyio.fail_after(10):
                await app(http_scope(PATHS["openai"], [*declared, *credential, bad]), client.receive, recorder)
            answers.append((recorder.status, client.taken))
        await assert_idle(app)
    assert answers == [(401, 0), (400, 0)]
    assert upstream.requests == []


def lines_named(upstream: RawUpstream, *names: bytes) -> list[bytes]:
    [request] = upstream.requests
    return [line for line in request.raw_head.split(b"\r\n")[1:] if line.partition(b":")[0].lower() in names]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_several_cookie_fields_go_upstream_as_one(transport: str, anyio_backend: str) -> None:
    if not runs_here(transport, anyio_backend):
        return
    headers = [
        (b"content-type", b"application/json"),
        (b"cookie", b"a=1"),
        (b"x-repeated", b"1"),
        (b"cookie", b"b=2; c=3"),
        (b"x-repeated", b"2"),
        (b"Cookie", b" d=4\t"),
    ]
    async with gateway(upstream_transport=transport) as (upstream, app):
        answer = await call(app, PATHS["openai"], headers)
    assert answer.status == 200
    assert lines_named(upstream, b"cookie", b"x-repeated") == [
        b"cookie: a=1; b=2; c=3; d=4",
        b"x-repeated: 1",
        b"x-repeated: 2",
    ]


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_cookie_fields_over_http2_go_upstream_as_one(worker: str) -> None:
    fields = [(b"cookie", b"a=1"), (b"x-repeated", b"1"), (b"cookie", b"b=2"), (b"x-repeated", b"2")]
    with served(f"hypercorn-{worker}", "httpcore") as (upstream, _, port):
        assert post_http2(port, fields) == (200, b"{}")
    # h2 joins them itself (at the end of the list) before hypercorn builds the scope: this stays so.
    assert lines_named(upstream, b"cookie") == [b"cookie: a=1; b=2"]
    assert lines_named(upstream, b"x-repeated") == [b"x-repeated: 1", b"x-repeated: 2"]


CAPITALISED_CREDENTIALS = [
    (b"Authorization", b"Bearer " + SECRET),
    (b"X-Api-Key", SECRET),
    (b"X-Goog-Api-Key", SECRET),
    (b"API-KEY", SECRET),
]


@pytest.mark.anyio
@pytest.mark.parametrize("credential", CAPITALISED_CREDENTIALS, ids=repr)
async def test_a_capitalised_client_credential_never_reaches_the_upstream(credential: tuple[bytes, bytes]) -> None:
    # No gateway keys: a loopback client is served, and the upstream must see only the gateway's key.
    async with gateway(upstream_api_key="sk-upstream") as (upstream, app):
        answer = await call(app, PATHS["openai"], [(b"content-type", b"application/json"), credential])
    assert answer.status == 200
    assert SECRET not in upstream.requests[0].raw_head
    assert lines_named(upstream, b"authorization", b"x-api-key", b"x-goog-api-key", b"api-key") == [
        b"authorization: Bearer sk-upstream"
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("credential", [(b"Authorization", b"Bearer gw-key"), (b"X-API-Key", b"gw-key")], ids=repr)
async def test_a_gateway_key_under_a_capitalised_name_authenticates(credential: tuple[bytes, bytes]) -> None:
    async with gateway(gateway_keys=("gw-key",), upstream_api_key="sk-upstream") as (upstream, app):
        answer = await call(app, PATHS["openai"], [credential])
        stranger = await call(app, PATHS["openai"], [(credential[0], credential[1] + b"x")])
    assert (answer.status, stranger.status) == (200, 401)
    assert b"gw-key" not in upstream.requests[0].raw_head
    assert lines_named(upstream, b"authorization", b"x-api-key") == [b"authorization: Bearer sk-upstream"]


@pytest.mark.anyio
async def test_capitalised_hop_by_hop_and_framing_fields_are_not_forwarded() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"TE", b"trailers"),
        (b"Upgrade", b"h2c"),
        (b"Host", b"evil.test"),
        (b"Expect", b"100-continue"),
        (b"X-Kept", b"1"),
    ]
    async with gateway() as (upstream, app):
        answer = await call(app, PATHS["openai"], headers)
        chunked = await call(app, PATHS["openai"], [(b"Transfer-Encoding", b"chunked")])
    assert (answer.status, chunked.status) == (200, 400)  # Content-Length beside Transfer-Encoding: ambiguous
    [request] = upstream.requests
    names = [line.partition(b":")[0].lower() for line in request.raw_head.split(b"\r\n")[1:]]
    for name in (b"x-hop", b"keep-alive", b"te", b"upgrade", b"expect", b"transfer-encoding"):
        assert name not in names
    # The one Connection line is the upstream client's own.
    assert (
        lines_named(upstream, b"connection") == [b"connection: keep-alive"] and b"x-hop" not in request.raw_head.lower()
    )
    assert names.count(b"host") == 1 and b"evil.test" not in request.raw_head
    assert names.count(b"content-length") == 1 and b"x-kept: 1" in request.raw_head


@pytest.mark.anyio
async def test_a_capitalised_content_encoding_is_decoded_before_forwarding() -> None:
    # Before: the middleware did not see it (the body went on gzip-coded) and the forwarder dropped the
    # lower-cased field: the upstream got gzip bytes described as plain JSON.
    headers = [(b"Content-Type", b"application/json"), (b"Content-Encoding", b"gzip")]
    async with gateway() as (upstream, app):
        answer = await call(app, PATHS["openai"], headers, body=gzip.compress(BODY))
    assert answer.status == 200
    [request] = upstream.requests
    assert request.body == BODY and "content-encoding" not in request.headers


@pytest.mark.anyio
async def test_a_capitalised_content_type_says_the_body_is_not_json() -> None:
    async with gateway() as (upstream, app):
        answer = await call(app, "/v1/files", [(b"Content-Type", b"text/plain")], body=b"plain text")
    assert answer.status == 200
    assert upstream.requests[0].body == b"plain text"


@pytest.mark.anyio
async def test_a_capitalised_session_header_names_the_session(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with gateway() as (_, app):
        answer = await call(app, PATHS["openai"], [(b"X-Session-Id", b"sess-1")])
        conflict = await call(app, PATHS["openai"], [(b"X-Session-Id", b"sess-1"), (b"x-session-id", b"sess-2")])
    assert (answer.status, conflict.status) == (200, 400)
    assert access_lines(caplog)[0]["session"] == session_hash("sess-1")
