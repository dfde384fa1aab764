"""Attacks on the request head as the gateway and the middleware read it (``gateway._head.RequestHead``,
``_asgi.normalize_headers``), by a hostile client and by a Starlette/FastAPI user of the middleware alone.

- Order: a stranger gets the 401 whatever its head; a member with a head that cannot be forwarded gets
  the 400 before a 413, 415, a conflicting ``Content-Type`` or admission's 503, each one refusal line
  and one ``refused_total`` count; a path the gateway does not forward is not judged by ``RequestHead``.
- A session id the gateway would refuse (two different ones, one over ``MAX_SESSION_ID_BYTES``) is
  judged from the head too: before, the whole body was admitted, read and charged for it.
- The connection after the 400 (real servers): a request hidden in the unread body is never parsed
  nor forwarded; ``Expect: 100-continue`` gets the 400 instead of a 100 (the body is never sent).
- ``normalize_headers``: cookie fields joined as RFC 9113 8.2.3 says, a single field byte for byte,
  other fields in their order; names already lower-case (letters or not) leave the scope's list as it
  is; a list an outer layer recorded is never changed; a Starlette app reads the cookies it expects.
- The middleware alone under FastAPI: capitalised ``Content-Encoding`` and ``Content-Length`` are the
  fields they name; the app's scope differs from the server's only where the middleware says so.
"""

from __future__ import annotations

import gzip
import json
import logging
import socket
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from starlette.types import Receive, Scope, Send

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings, MiB
from asgi_lifetime._asgi import normalize_headers
from asgi_lifetime.gateway._access_log import ACCESS_LOGGER
from asgi_lifetime.testing import assert_idle

from .._asgi import Recorder, body_receive, http_scope
from ..gateway.test_request_head import BODY, PATHS, Client, access_lines, call, gateway, start_headers
from .test_attack_headers import post_http2, served

KEY = [(b"authorization", b"Bearer gw-key")]
KEYED = {"gateway_keys": ("gw-key",), "upstream_api_key": "sk-upstream"}
BAD = (b"x-trace", b"a\x00b")  # a value HTTP/1.1 cannot carry: RequestHead's 400 invalid_header
DECLARED = 8 * MiB


async def metrics_text(app: Any) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test") as client:
        return (await client.get("/metrics", headers={"authorization": "Bearer gw-key"})).text


def refused_count(metrics: str, reason: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("asgi_lifetime_refused_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# Each of these is refused by the middleware on its own (control), and by RequestHead first with BAD.
OTHER_REFUSALS = {
    "too_large": ([(b"content-length", str(64 * MiB + 1).encode())], 413, "request_too_large"),
    "unsupported_encoding": ([(b"content-encoding", b"x-unknown")], 415, "unsupported_encoding"),
    "conflicting_content_type": (
        [(b"content-type", b"application/json"), (b"content-type", b"text/plain")],
        400,
        "conflicting_content_type",
    ),
    "overloaded": ([], 503, "overloaded"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", OTHER_REFUSALS)
@pytest.mark.parametrize("hostile", [False, True], ids=["alone", "with-bad-header"])
async def test_the_heads_400_comes_before_every_other_refusal(
    case: str, hostile: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fields, status, code = OTHER_REFUSALS[case]
    if hostile:
        status, code = 400, "invalid_header"
    length = [] if case == "too_large" else [(b"content-length", str(DECLARED).encode())]
    client = Client(DECLARED)
    recorder = Recorder()
    async with gateway(**KEYED) as (upstream, app):
        if case == "overloaded":
            app.state.lifetime.admission.close("draining for the test")
        headers = [*KEY, *length, *fields, *([BAD] if hostile else [])]
        with anyio.fail_after(10):
            await app(http_scope(PATHS["openai"], headers), client.receive, recorder)
        metrics = await metrics_text(app)
        await assert_idle(app)
    # Admission watches a queued client by taking its first body message (_acquire_watching); the head's
    # refusal takes none.
    assert (recorder.status, client.taken) == (status, 1 if case == "overloaded" and not hostile else 0)
    assert (b"connection", b"close") in start_headers(recorder)
    assert upstream.requests == []
    [line] = access_lines(caplog)
    assert (line["status"], line["outcome"], line["code"]) == (status, "refused", code)
    assert refused_count(metrics, code) == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("field", [BAD, (b"x(trace)", b"1"), None], ids=["value", "name", "dot-path"])
async def test_a_stranger_gets_the_401_whatever_its_head(
    field: tuple[bytes, bytes] | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    path = "/v1/./chat/completions" if field is None else PATHS["openai"]
    head = [(b"content-length", str(DECLARED).encode()), *([field] if field else [])]
    answers = []
    async with gateway(**KEYED) as (upstream, app):
        for credential in ([], [(b"authorization", b"Bearer wrong")], KEY):
            client, recorder = Client(DECLARED), Recorder()
            with anyio.fail_after(10):
                await app(http_scope(path, [*credential, *head]), client.receive, recorder)
            answers.append((recorder.status, client.taken))
        metrics = await metrics_text(app)
        await assert_idle(app)
    assert answers == [(401, 0), (401, 0), (400, 0)]
    assert upstream.requests == []
    code = "invalid_path" if field is None else "invalid_header"
    assert [(line["status"], line["code"]) for line in access_lines(caplog)] == [
        (401, "invalid_api_key"),
        (401, "invalid_api_key"),
        (400, code),
    ]
    assert (refused_count(metrics, "invalid_api_key"), refused_count(metrics, code)) == (2.0, 1.0)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "status"), [("/healthz", 200), ("/metrics", 200), ("/lifetime/stats", 200), ("/v2/nothing", 404)]
)
async def test_a_path_the_gateway_does_not_forward_is_not_judged_by_its_head(
    path: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with gateway(**KEYED) as (_, app):
        scope = http_scope(path, [*KEY, BAD, (b"X-Odd\xff", b"1")], method="GET")
        recorder = Recorder()
        with anyio.fail_after(10):
            await app(scope, body_receive(b""), recorder)
        metrics = await metrics_text(app)
    assert recorder.status == status
    assert access_lines(caplog) == []  # the access log is for forwarded paths
    assert refused_count(metrics, "invalid_header") == 0.0


SESSION_REFUSALS = [
    ([(b"x-session-id", b"sess-1"), (b"x-session-id", b"sess-2")], "conflicting_session_id"),
    ([(b"X-Session-Id", b"sess-1"), (b"x-session-id", b"sess-2")], "conflicting_session_id"),
    ([(b"x-session-id", b"s" * 257)], "session_id_too_long"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("keyed", [True, False], ids=["gateway-keys", "no-keys"])
@pytest.mark.parametrize(("fields", "code"), SESSION_REFUSALS, ids=["conflict", "conflict-case", "too-long"])
async def test_a_session_id_the_gateway_refuses_is_refused_before_the_body_is_read(
    keyed: bool, fields: list[tuple[bytes, bytes]], code: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: judged by the forwarder, after the middleware had admitted, read and charged the whole
    # body (up to MAX_BODY_BYTES) for an answer the head decided. Without gateway keys GatewayAuth does
    # not read the headers: RequestHead lower-cases the names itself.
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    declared = 64 * MiB
    headers = [(b"content-type", b"application/json"), (b"content-length", str(declared).encode()), *fields]
    answers = []
    async with gateway(**(KEYED if keyed else {})) as (upstream, app):
        for credential in ([], KEY) if keyed else ([],):  # a stranger still gets the 401 first
            client, recorder = Client(declared), Recorder()
            with anyio.fail_after(10):
                await app(http_scope(PATHS["anthropic"], [*credential, *headers]), client.receive, recorder)
            answers.append((recorder.status, client.taken))
        metrics = await metrics_text(app)
        await assert_idle(app)
    assert answers == ([(401, 0)] if keyed else []) + [(400, 0)]
    assert upstream.requests == []
    assert (b"connection", b"close") in start_headers(recorder)
    document = json.loads(recorder.body)
    assert document["type"] == "error" and document["error"]["code"] == code  # the client's shape
    assert b"sess-" not in recorder.body
    assert [(line["status"], line["outcome"], line["code"]) for line in access_lines(caplog)][-1] == (
        400,
        "refused",
        code,
    )
    assert refused_count(metrics, code) == 1.0


# A target httpx cannot make a URL of: before, the forwarder raised httpx.InvalidURL after the body was
# read, a 500 with a traceback logged as an error.
CONTROL_TARGETS = [
    ("/v1/chat/completions", b"a=\x01"),
    ("/v1/chat/completions", b"a=\x0bb"),
    ("/v1/chat/completions", b"x\x7f"),
    ("/v1/chat\x1bcompletions", b""),
    ("/v1/chat/completions\t", b""),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "query"), CONTROL_TARGETS, ids=repr)
async def test_a_target_with_a_control_character_is_the_clients_400_before_the_body(
    path: str, query: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client, recorder = Client(DECLARED), Recorder()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(DECLARED).encode())]
    async with gateway() as (upstream, app):
        with anyio.fail_after(10):
            await app(http_scope(path, headers, query_string=query), client.receive, recorder)
        await assert_idle(app)
    assert (recorder.status, client.taken) == (400, 0)
    assert json.loads(recorder.body)["error"]["code"] == "invalid_path"
    assert upstream.requests == []
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


@pytest.mark.anyio
async def test_the_longest_target_an_upstream_url_can_take_is_forwarded_and_one_more_is_refused() -> None:
    async with gateway() as (upstream, app):
        room = 65536 - len(upstream.url)  # httpx refuses a longer URL
        path = PATHS["openai"]
        query = b"q=" + b"x" * (room - len(path) - 3)
        scope_headers = [(b"content-type", b"application/json")]
        fits = await call_query(app, path, scope_headers, query)
        over = await call_query(app, path, scope_headers, query + b"x")
    assert fits.status == 200 and len(upstream.requests[0].target) == room
    assert over.status == 400 and json.loads(over.body)["error"]["code"] == "invalid_path"
    assert b"xxxx" not in over.body  # the query is never quoted: it may carry a key
    assert len(upstream.requests) == 1


async def call_query(app: Any, path: str, headers: list[tuple[bytes, bytes]], query: bytes) -> Recorder:
    recorder = Recorder()
    scope = http_scope(path, [(b"content-length", str(len(BODY)).encode()), *headers], query_string=query)
    with anyio.fail_after(10):
        await app(scope, body_receive(BODY), recorder)
    return recorder


@pytest.mark.parametrize("server", ["hypercorn-asyncio", "hypercorn-trio"])
def test_a_control_character_in_an_http2_target_is_the_clients_400(server: str) -> None:
    # h2 refuses only NUL, CR and LF in ``:path``.
    with served(server, "httpcore") as (upstream, _, port):
        status, body = post_http2(port, [], path=PATHS["openai"] + "?a=\x0b")
        again = post_http2(port, [])
    assert (status, json.loads(body)["error"]["code"]) == (400, "invalid_path")
    assert again == (200, b"{}") and len(upstream.requests) == 1


def test_a_query_too_long_for_a_url_under_uvicorn_h11_is_the_clients_400() -> None:
    # h11 takes a whole request line of any size when it comes in one read.
    target = PATHS["openai"].encode() + b"?q=" + b"x" * 70_000
    request = b"POST " + target + b" HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
    request += b"content-length: %d\r\n\r\n" % len(BODY) + BODY
    with served("h11", "httpcore") as (upstream, _, port):
        answer = exchange(port, request)
    assert status_and_close(answer) == (400, True) and b'"invalid_path"' in answer
    assert upstream.requests == []


# --- the connection after the 400, through real servers --------------------------------------------

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway.test\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)
DOTTED_HEAD = b"POST /v1/./chat/completions HTTP/1.1\r\nhost: gateway.test\r\ncontent-type: application/json\r\n"


def exchange(port: int, first: bytes, then: bytes = b"") -> bytes:
    """Send ``first``, read one whole answer, send ``then`` (if the server still takes it), and read until
    the server closes (a reset once the answer is in counts as closed): every byte the server sent."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(first)
        try:
            while not _whole(answer) and (data := sock.recv(65536)):
                answer += data
            if then:
                sock.sendall(then)
            while data := sock.recv(65536):
                answer += data
        except (ConnectionResetError, BrokenPipeError):
            pass
    return answer


def _whole(answer: bytes) -> bool:
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    lengths = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return len(body) >= int(lengths[0]) if lengths else True


def status_and_close(answer: bytes) -> tuple[int, bool]:
    head = answer.partition(b"\r\n\r\n")[0].split(b"\r\n")
    return int(head[0].split()[1]), b"connection: close" in [line.lower() for line in head[1:]]


SERVERS = ["h11", "httptools", "hypercorn-asyncio", "hypercorn-trio"]


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_hidden_in_the_unread_body_is_never_parsed(server: str, framing: str) -> None:
    # The 400 leaves the body unread: the server must take what follows as body bytes (its framing says
    # so) and close, never as the next request.
    if framing == "chunked":
        first = DOTTED_HEAD + b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n"
        then = b"0\r\n\r\n"
    else:
        first = DOTTED_HEAD + b"content-length: %d\r\n\r\n" % (len(SMUGGLED) + 100) + SMUGGLED
        then = b" " * 100
    with served(server, "httpcore") as (upstream, _, port):
        answer = exchange(port, first, then)
        assert status_and_close(answer) == (400, True)
        assert b'"invalid_path"' in answer and answer.count(b"HTTP/1.1 ") == 1
        assert upstream.requests == []
        again = exchange(port, SMUGGLED.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nconnection: close\r\n", 1))
    assert status_and_close(again)[0] == 200 and len(upstream.requests) == 1  # served on, as it came


@pytest.mark.parametrize("server", SERVERS)
def test_a_request_pipelined_after_a_refused_one_is_not_served(server: str) -> None:
    with served(server, "httpcore") as (upstream, _, port):
        answer = exchange(port, DOTTED_HEAD + b"content-length: 2\r\n\r\n{}" + SMUGGLED)
    assert upstream.requests == []
    if server != "hypercorn-trio":  # it may lose the 400 itself (docs/reliability.md, known limits)
        assert status_and_close(answer) == (400, True) and answer.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("server", ["h11", "httptools"])
def test_expect_100_continue_gets_the_400_and_never_a_100(server: str) -> None:
    # uvicorn sends "100 Continue" when the app first reads the body: RequestHead never does, so the
    # client learns of the 400 without sending a byte of its body.
    head = DOTTED_HEAD + b"content-length: 1000000\r\nexpect: 100-continue\r\n\r\n"
    with served(server, "httpcore") as (upstream, _, port):
        answer = exchange(port, head)
    assert status_and_close(answer) == (400, True)
    assert b"100 Continue" not in answer and upstream.requests == []


# --- normalize_headers: cookies, case, and the scope seen by others --------------------------------


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        # empty and blank lines add nothing, not an empty pair
        ([(b"cookie", b"a=1"), (b"cookie", b""), (b"cookie", b" \t"), (b"cookie", b"b=2")], [(b"cookie", b"a=1; b=2")]),
        ([(b"cookie", b""), (b"cookie", b" ")], [(b"cookie", b"")]),
        # OWS around each line is not part of it; inside a line everything stays
        ([(b"cookie", b" a=1;  b=2 \t"), (b"cookie", b'\tc="x y" ')], [(b"cookie", b'a=1;  b=2; c="x y"')]),
        # mixed-case names are joined too, where the first cookie line was; other fields keep their order
        (
            [(b"x-r", b"1"), (b"COOKIE", b"a=1"), (b"X-R", b"2"), (b"cOoKiE", b"b=2"), (b"x-r", b"3")],
            [(b"x-r", b"1"), (b"cookie", b"a=1; b=2"), (b"x-r", b"2"), (b"x-r", b"3")],
        ),
        # values that are not UTF-8 go as they came
        ([(b"cookie", b"a=\xff"), (b"cookie", b"b=\xe9")], [(b"cookie", b"a=\xff; b=\xe9")]),
    ],
)
def test_cookie_fields_are_joined_as_http2_says(
    given: list[tuple[bytes, bytes]], normal: list[tuple[bytes, bytes]]
) -> None:
    scope = {"headers": list(given)}
    normalize_headers(scope)
    assert scope["headers"] == normal


@pytest.mark.parametrize(
    "headers",
    [
        [(b"cookie", b" a=1;  b=2 \t")],  # one cookie line: byte for byte, padding and all
        [(b"x-1", b"1"), (b"-", b"2"), (b"_", b"3"), (b"1", b"4"), (b"x_y", b"5"), (b"cookie", b"a=1")],
        [(b"x-\xc0\xff", b"1"), (b"\xe9", b"2")],  # not tokens, but nothing to lower-case
        [],
    ],
    ids=["one-cookie", "no-letters", "high-bytes", "empty"],
)
def test_names_already_lower_case_leave_the_scope_alone(headers: list[tuple[bytes, bytes]]) -> None:
    # Before: a name with no letter at all (``-``, ``_``, ``1``) made a new list on every request.
    given = list(headers)
    scope = {"headers": given}
    normalize_headers(scope)
    assert scope["headers"] is given and given == headers


async def _cookies(request: FastAPIRequest) -> dict[str, Any]:
    return {"cookies": request.cookies, "lines": request.headers.getlist("cookie"), "names": list(request.headers)}


def fastapi_app(**changes: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(upstream_url=("http://127.0.0.1:1",), **changes))

    @app.post("/v1/echo")
    async def echo(request: FastAPIRequest) -> dict[str, Any]:
        body = await request.body()
        return {**await _cookies(request), "size": len(body), "body": body.decode()}

    return app


class Outer:
    """A layer outside the middleware that recorded the server's headers list before calling it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.recorded: list[tuple[bytes, bytes]] = []
        self.copy: list[tuple[bytes, bytes]] = []
        self.after: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.recorded = scope["headers"]
        self.copy = list(self.recorded)
        await self.app(scope, receive, send)
        self.after = scope["headers"]


async def serve_once(app: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int | None, Any]:
    recorder = Recorder()
    scope = http_scope("/v1/echo", [(b"content-length", str(len(body)).encode()), *headers])
    with anyio.fail_after(10):
        await app(scope, body_receive(body), recorder)
    return recorder.status, json.loads(recorder.body) if recorder.body else None


@pytest.mark.anyio
async def test_a_starlette_app_reads_every_cookie_and_outer_layers_keep_their_list() -> None:
    # HTTP/2 (or a client) sent each cookie in a field of its own: Starlette's request.cookies reads one
    # field only, so the app saw the first cookie alone. An outer layer's recorded list is never changed;
    # the scope it passed in carries the joined one afterwards (what the app saw: one truth for both).
    outer = Outer(fastapi_app())
    headers = [(b"Cookie", b"a=1"), (b"x-r", b"1"), (b"cookie", b"b=2; c=3"), (b"X-R", b"2")]
    status, seen = await serve_once(outer, headers, b"{}")
    assert status == 200
    assert seen["cookies"] == {"a": "1", "b": "2", "c": "3"}
    assert seen["lines"] == ["a=1; b=2; c=3"]
    assert seen["names"] == ["content-length", "cookie", "x-r", "x-r"]
    assert outer.recorded == outer.copy  # not mutated in place
    assert (b"cookie", b"a=1; b=2; c=3") in outer.after and outer.after is not outer.recorded


@pytest.mark.anyio
async def test_the_middleware_alone_reads_capitalised_framing_fields_and_changes_nothing_else() -> None:
    app = fastapi_app(max_body_bytes=1024)
    packed = gzip.compress(b'{"a": "' + b"x" * 500 + b'"}')
    status, seen = await serve_once(
        app, [(b"Content-Encoding", b"gzip"), (b"Content-Type", b"application/json")], packed
    )
    assert status == 200 and seen["size"] == 509 and seen["body"].startswith('{"a": "xxx')
    # A declared length over the limit is refused before a body message is taken.
    client, recorder = Client(2048), Recorder()
    with anyio.fail_after(10):
        await app(http_scope("/v1/echo", [(b"Content-Length", b"2048")]), client.receive, recorder)
    assert (recorder.status, client.taken) == (413, 0)


@pytest.mark.anyio
async def test_the_apps_scope_differs_from_the_servers_only_in_state_and_header_names() -> None:
    seen: list[Scope] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(dict(scope))
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = LifetimeMiddleware(inner, settings=LifetimeSettings(upstream_url=("http://127.0.0.1:1",)))
    headers = [(b"Content-Type", b"application/json"), (b"X-Trace", b" Mixed Case "), (b"content-length", b"2")]
    scope = http_scope("/v1/echo", headers, extensions={"http.response.trailers": {}})
    given = {key: value for key, value in scope.items() if key != "headers"}
    recorder = Recorder()
    with anyio.fail_after(10):
        await app(scope, body_receive(b"{}"), recorder)
    assert recorder.status == 204
    [inner_scope] = seen
    assert inner_scope["headers"] == [
        (b"content-type", b"application/json"),
        (b"x-trace", b" Mixed Case "),
        (b"content-length", b"2"),
    ]  # values as they came
    assert {key: value for key, value in inner_scope.items() if key not in ("headers", "state")} == given
    assert set(inner_scope["state"]) == {"lifetime"}


@pytest.mark.anyio
async def test_a_name_that_is_no_token_is_the_gateways_400_and_the_apps_field() -> None:
    # The gateway cannot forward it (h11 would refuse it upstream); an app behind the middleware alone
    # gets it with its ASCII letters lower-cased and its other bytes as they came.
    field = (b"X-Caf\xe9", b"1")
    async with gateway() as (upstream, app):
        refused = await call(app, PATHS["openai"], [field])
    assert refused.status == 400 and json.loads(refused.body)["error"]["code"] == "invalid_header"
    assert upstream.requests == []
    status, seen = await serve_once(fastapi_app(), [field], b"{}")
    assert status == 200 and "x-caf\xe9" in seen["names"]
