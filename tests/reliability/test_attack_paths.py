"""Attacks on which requests the gateway forwards and what path reaches the upstream (``PATHS``,
``_asgi.under``, ``_asgi.upstream_path``, ``gateway._head``), by a hostile client and a careless operator.

- Invariant, over real servers (uvicorn h11 and httptools, hypercorn asyncio and trio) and a corpus of
  targets (encoded slashes and dots, dot segments, double slashes, no leading slash, absolute form,
  ``;`` parameters, backslashes, NUL, non-ASCII, case, ``#``, ``*``, 70 KB): a request is admitted by
  the middleware exactly when it is forwarded, and what the upstream decodes lies under the prefix,
  with no segment an upstream reads as ``.`` or ``..`` (``..;`` for a servlet container, ``\\..\\`` for
  Windows and WHATWG parsers: both were forwarded as they came).
- A mount the client spells encoded (``/%61pi`` for ``Mount("/api")``): the gateway forwarded the decoded
  path, which the upstream decoded again (``%252e%252e`` became ``..`` there, ``%3F`` began a query, ``%23``
  cut the path). Now the upstream decodes exactly the path the gateway judged.
- ``PATHS=/`` (it covers the gateway's own endpoints): a stranger's ``POST /healthz`` or ``/metrics`` was
  forwarded without a key (the open paths were open to every method), and a health check or a scrape
  was admitted like a request (queued, or refused 503, under load). The mount itself (route path ``""``)
  was admitted, then redirected by Starlette.
- ``X-Accel-Buffering: no`` on every event stream the gateway relays (plain, gzip'd, an error status,
  HEAD), never on the gateway's own JSON answers.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import anyio
import httpx
import pytest
import respx
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount

from asgi_lifetime import LifetimeSettings
from asgi_lifetime._asgi import upstream_path
from asgi_lifetime.gateway import create_app

from .._nginx import nginx_server
from .._servers import free_port, served
from ..gateway._raw_upstream import raw_upstream

BASE = "http://upstream.test/base"
KEYS = {"gateway_keys": ("gw-key",), "upstream_api_key": "sk-upstream"}


def climbs(path: str) -> bool:
    """Whether some upstream reads a segment of ``path`` as "." or "..": split at "/" or a backslash, a ";"
    parameter dropped."""
    return any(segment.partition(";")[0] in (".", "..") for segment in re.split(r"[/\\]", path))


SERVERS = ["uvicorn-h11", "uvicorn-httptools", "hypercorn-asyncio", "hypercorn-trio"]


def settings(**changes: Any) -> LifetimeSettings:
    return LifetimeSettings(**{"upstream_url": (BASE,), "max_attempts": 1, **changes})


async def exchange(app: Any, method: str, target: str, **kwargs: Any) -> tuple[httpx.Response, list[httpx.Request]]:
    """One request to ``app`` in process (``target`` sent as it is written); the requests the upstream got."""
    with respx.mock(assert_all_called=False) as mock:
        route = mock.route(url__startswith="http://upstream.test").respond(200, json={"ok": True})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw.test") as client:
            with anyio.fail_after(10):
                response = await client.request(method, httpx.URL("http://gw.test" + target), **kwargs)
        return response, [call.request for call in route.calls]


# -- over real servers ---------------------------------------------------------------------------------

# target: the status every server gives, or None when they differ (the server's own parser decides).
CORPUS: dict[str, int | None] = {
    "/v1/x": 200,
    "/v1%2F..%2Fadmin": 400,
    "/v1/%2e%2e/x": 400,
    "/v1/%2E/x": 400,
    "/v1/../secret": 400,
    "/v1/./x": 400,
    "/v1/..": 400,
    "/v1/..;/admin": 400,  # Tomcat drops the parameter: "..;" is ".."
    "/v1/x/.;a=b/y": 400,
    "/v1/a\\..\\..\\admin": 400,  # a backslash is a separator to IIS and to a WHATWG URL parser
    "/v1/a%5C..%5C..%5Cadmin": 400,
    "//v1/x": 404,
    "/v1//x": 200,
    "v1/x": None,  # httptools refuses it; the others route "v1/x" nowhere
    "http://evil.example/v1/x": None,  # httptools takes the path alone; the others route it nowhere
    "/v1;a=b/x": 404,
    "/V1/x": 404,
    "/v1beta/x": 404,
    "/v1/x%00": 200,
    "/v1/%C3%A9": 200,
    "/v1#/x": None,  # httptools cuts the fragment: /v1
    "/v1/#/../x": None,  # httptools cuts the fragment: /v1/
    "/v1/%252e%252e/admin": 200,  # one level decoded: "%2e%2e", not a dot segment
    "/v1/chat%3Fa=b": 200,
    "/v1/%2F/x": 200,
    "/v1/x?a=%2F..": 200,
    "/v1/...": 200,
    "/v1/x.json": 200,
    "*": 404,
    "/v1/" + "a" * 70_000: None,  # 400 from the gateway or httptools, 431 from hypercorn
}


def _post(port: int, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST " + target.encode("latin-1") + b" HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: 2\r\nconnection: close\r\n\r\n{}"
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


# Each server with the httpcore transport; the aiohttp transport (asyncio only) under two of them.
SERVED = [(server, "httpcore") for server in SERVERS] + [("uvicorn-h11", "aiohttp"), ("hypercorn-asyncio", "aiohttp")]


@pytest.mark.parametrize(("server", "transport"), SERVED)
def test_a_request_is_admitted_exactly_when_forwarded_and_the_upstream_reads_a_path_under_the_prefix(
    server: str, transport: str
) -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    with raw_upstream(lambda request: [ok]) as upstream:
        app = create_app(
            LifetimeSettings(
                upstream_url=(upstream.url + "/base",), paths=("/v1",), max_attempts=1, upstream_transport=transport
            )
        )
        with served(app, server) as url:
            port = int(url.rsplit(":", 1)[1])
            for target, expected in CORPUS.items():
                forwarded_before = len(upstream.requests)
                admitted_before = app.state.lifetime.stats().admitted
                answer = _post(port, target)
                status = int(answer.split(b" ", 2)[1])
                forwarded = upstream.requests[forwarded_before:]
                admitted = app.state.lifetime.stats().admitted - admitted_before
                assert expected is None or status == expected, (target, answer[:300])
                assert admitted == len(forwarded) == (status == 200), (target, status, admitted, forwarded)
                for request in forwarded:
                    read = unquote(request.target.partition("?")[0])  # what the upstream decodes
                    assert read == "/base/v1" or read.startswith("/base/v1/"), (target, request.target)
                    assert not climbs(read), (target, request.target)


# -- in process ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("target", "read"),
    [
        ("/%61pi/v1/%252e%252e/admin", "/v1/%2e%2e/admin"),  # was "/v1/../admin" upstream
        ("/%61pi/v1/chat%3Fx=1", "/v1/chat?x=1"),  # was the path /v1/chat and a query x=1
        ("/%61pi/v1/a%23b", "/v1/a#b"),  # was cut at the "#": /v1/a
        ("/%61pi/v1/%C3%A9", "/v1/\u00e9"),
        ("/api/v1/%252e%252e/admin", "/v1/%2e%2e/admin"),  # the mount as written: the raw path, as before
        ("/api/v1/models/org%2Fname", "/v1/models/org/name"),
    ],
)
async def test_under_a_mount_the_upstream_decodes_the_path_the_gateway_judged(target: str, read: str) -> None:
    gateway = create_app(settings(paths=("/v1",)))
    try:
        response, sent = await exchange(Starlette(routes=[Mount("/api", gateway)]), "POST", target, json={})
    finally:
        await gateway.state.upstream.aclose()
    assert response.status_code == 200
    [request] = sent
    assert unquote(request.url.raw_path.decode()) == "/base" + read
    assert request.url.query == b""


def test_upstream_path_without_raw_path_encodes_what_the_upstream_would_decode_again() -> None:
    # An ASGI server need not give raw_path: the decoded path is encoded once more, not sent as it is.
    scope = {"type": "http", "path": "/api/v1/a%2e%2e?b#c", "root_path": "/api", "query_string": b"k=v"}
    assert upstream_path(scope) == "/v1/a%252e%252e%3Fb%23c?k=v"
    assert unquote(upstream_path(scope).partition("?")[0]) == "/v1/a%2e%2e?b#c"


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/healthz", "/metrics"])
async def test_with_paths_slash_a_stranger_cannot_reach_the_upstream_through_an_open_path(
    method: str, path: str
) -> None:
    gateway = create_app(settings(paths=("/",), **KEYS))
    try:
        stranger, sent = await exchange(gateway, method, path, json={})
        member, sent_member = await exchange(gateway, method, path, json={}, headers={"authorization": "Bearer gw-key"})
        health, _ = await exchange(gateway, "GET", "/healthz")
    finally:
        await gateway.state.upstream.aclose()
    assert stranger.status_code == 401 and sent == []  # was forwarded, no key asked
    assert member.status_code == 200  # PATHS=/ covers it: a member's request is forwarded, with our key
    assert sent_member[0].headers["authorization"] == "Bearer sk-upstream"
    assert health.status_code == 200  # the gateway's own GET stays open


@pytest.mark.anyio
async def test_with_paths_slash_the_gateways_own_endpoints_are_not_admitted() -> None:
    gateway = create_app(settings(paths=("/",)))
    try:
        for path in ("/healthz", "/metrics", "/lifetime/stats"):
            response, sent = await exchange(gateway, "GET", path)
            assert response.status_code == 200 and sent == []
        assert gateway.state.lifetime.stats().admitted == 0  # each was admitted like a request (3)
        response, sent = await exchange(gateway, "POST", "/healthz", json={})
        assert response.status_code == 200 and len(sent) == 1  # another method there is forwarded, and admitted
        assert gateway.state.lifetime.stats().admitted == 1
    finally:
        await gateway.state.upstream.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["OPTIONS", "TRACE", "PROPFIND"])
async def test_a_method_the_router_does_not_forward_is_not_admitted(method: str) -> None:
    gateway = create_app(settings(paths=("/v1",)))
    try:
        response, sent = await exchange(gateway, method, "/v1/chat/completions", content=b"{}")
    finally:
        await gateway.state.upstream.aclose()
    assert response.status_code == 405 and sent == []
    assert gateway.state.lifetime.stats().admitted == 0  # was 1: admitted and its body read, then the 405


@pytest.mark.anyio
async def test_the_mount_itself_is_not_admitted_before_starlettes_redirect() -> None:
    # hypercorn's root_path leaves the path as the client sent it: "/api" is the mount itself, route path "".
    gateway = create_app(settings(paths=("/",)))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gateway, root_path="/api"), base_url="http://gw.test"
        ) as client:
            response = await client.post("/api", json={})
    finally:
        await gateway.state.upstream.aclose()
    assert response.status_code == 307
    assert gateway.state.lifetime.stats().admitted == 0  # was 1: admitted, its body read, then redirected


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("paths", "path", "forwarded"),
    [
        (("/v1", "/v1/chat"), "/v1/chatx", True),  # overlapping prefixes: the wider one covers it
        (("/v1/", "/v1beta/"), "/v1beta", True),
        (("/v1/", "/v1beta/"), "/v1b", False),
        (("/v1/chat/",), "/v1", False),
        (("/v1",), "/V1/x", False),
    ],
)
async def test_overlapping_and_sibling_prefixes(paths: tuple[str, ...], path: str, forwarded: bool) -> None:
    gateway = create_app(settings(paths=paths))
    try:
        response, sent = await exchange(gateway, "POST", path, json={})
    finally:
        await gateway.state.upstream.aclose()
    assert (response.status_code, len(sent)) == ((200, 1) if forwarded else (404, 0))
    assert gateway.state.lifetime.stats().admitted == len(sent)


# -- X-Accel-Buffering -----------------------------------------------------------------------------------

EVENTS = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("method", "status", "headers", "body"),
    [
        ("POST", 200, {"content-type": "text/event-stream"}, EVENTS),
        ("POST", 200, {"content-type": "Text/Event-Stream; charset=utf-8", "x-accel-buffering": "yes"}, EVENTS),
        ("POST", 200, {"content-type": "text/event-stream", "content-encoding": "gzip"}, gzip.compress(EVENTS)),
        ("POST", 400, {"content-type": "text/event-stream"}, b'event: error\ndata: {"error":"bad"}\n\n'),
        ("HEAD", 200, {"content-type": "text/event-stream"}, b""),
    ],
)
async def test_every_relayed_event_stream_carries_x_accel_buffering_no(
    method: str, status: int, headers: dict[str, str], body: bytes
) -> None:
    gateway = create_app(settings(paths=("/v1",)))
    try:
        with respx.mock(assert_all_called=True) as mock:
            route = mock.route(url__startswith="http://upstream.test").respond(status, headers=headers, content=body)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as client:
                kwargs: dict[str, Any] = {"json": {"stream": True}} if method == "POST" else {}
                response = await client.request(method, "/v1/chat/completions", **kwargs)
    finally:
        await gateway.state.upstream.aclose()
    assert response.status_code == status  # a HEAD was judged a starved stream: sent twice, then a 502
    assert route.call_count == 1
    assert response.headers.get_list("x-accel-buffering") == ["no"]


@pytest.mark.anyio
async def test_the_gateways_own_json_answers_carry_no_x_accel_buffering() -> None:
    gateway = create_app(settings(paths=("/v1",), **KEYS))
    member = {"authorization": "Bearer gw-key"}
    try:
        refused, _ = await exchange(gateway, "POST", "/v1/chat/completions", json={})
        missing, _ = await exchange(gateway, "POST", "/v2/x", json={}, headers=member)
        plain, _ = await exchange(gateway, "POST", "/v1/chat/completions", json={}, headers=member)
    finally:
        await gateway.state.upstream.aclose()
    assert (refused.status_code, missing.status_code, plain.status_code) == (401, 404, 200)
    assert all("x-accel-buffering" not in r.headers for r in (refused, missing, plain))


# -- the openai SDK with a base_url that has a path prefix ---------------------------------------------


@pytest.mark.parametrize("mount", ["fastapi-mount", "uvicorn-root-path"])
def test_the_openai_sdk_through_a_mounted_gateway(mount: str) -> None:
    openai = pytest.importorskip("openai")
    from asgi_lifetime.testing import create_demo_upstream, serve_in_thread

    with serve_in_thread(create_demo_upstream()) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), max_attempts=1))
        if mount == "fastapi-mount":  # as docs/operators.md says: the gateway's lifespan in the host's

            @contextlib.asynccontextmanager
            async def lifespan(app: FastAPI) -> AsyncIterator[None]:
                async with gateway.router.lifespan_context(gateway):
                    yield

            served_app: Any = FastAPI(lifespan=lifespan)
            served_app.mount("/api", gateway)
            options: dict[str, Any] = {}
            prefix = "/api"
        else:  # a proxy in front strips /api; uvicorn --root-path /api tells the app
            served_app, options, prefix = gateway, {"root_path": "/api"}, ""
        with serve_in_thread(served_app, **options) as url:
            client = openai.OpenAI(base_url=f"{url}{prefix}/v1", api_key="unused", max_retries=0, timeout=10)
            messages: Any = [{"role": "user", "content": "hello"}]
            whole = client.chat.completions.create(model="m", messages=messages)
            streamed = client.chat.completions.create(model="m", messages=messages, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
            with pytest.raises(openai.NotFoundError):  # outside PATHS: the gateway's 404, nothing forwarded
                client.with_options(base_url=f"{url}{prefix}/v1beta").chat.completions.create(
                    model="m", messages=messages
                )
    assert whole.choices[0].message.content
    assert text
    assert gateway.state.lifetime.stats().admitted == 2


# -- through real nginx ----------------------------------------------------------------------------------


def _mounted(gateway: Any) -> FastAPI:
    """``gateway`` under ``/api`` in a FastAPI app, its lifespan run by the host's (docs/operators.md)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with gateway.router.lifespan_context(gateway):
            yield

    app = FastAPI(lifespan=lifespan)
    app.mount("/api", gateway)
    return app


@pytest.mark.parametrize(
    ("target", "read"),
    [
        ("/%61pi/v1/%252e%252e/admin", "/v1/%2e%2e/admin"),  # was /admin at the upstream
        ("/api/v1/%252e%252e/admin", "/v1/%2e%2e/admin"),
        ("/%61pi/v1/a%253Fb", "/v1/a%3Fb"),
    ],
)
def test_an_upstream_behind_nginx_gets_no_path_outside_the_prefix(tmp_path: Path, target: str, read: str) -> None:
    """An upstream behind nginx (``proxy_pass`` with a URI: nginx decodes the path, resolves dot segments
    and encodes it again) is where a path decoded once too often climbs out: the gateway mounted at
    ``/api`` and a client spelling it ``/%61pi`` sent ``/v1/%2e%2e/admin``, which nginx made ``/admin``."""
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    with raw_upstream(lambda request: [ok]) as upstream:
        port = free_port()
        site = f"server {{ listen 127.0.0.1:{port};\n  location / {{ proxy_pass {upstream.url}/; }} }}\n"
        with nginx_server(tmp_path / "nginx", site, port=port) as nginx:
            gateway = create_app(LifetimeSettings(upstream_url=(nginx.base,), paths=("/v1",), max_attempts=1))
            with served(_mounted(gateway), "uvicorn-h11") as url:
                answer = _post(int(url.rsplit(":", 1)[1]), target)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    [request] = upstream.requests
    assert unquote(request.target) == read


# -- a careless operator's PATHS -------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["/v1/{model}", "/v1/{path:path}", "/v1/../admin", "/v1/./x", "/v1/.."])
def test_a_prefix_the_router_and_the_middleware_would_read_differently_is_refused(prefix: str) -> None:
    # "/v1/{model}": the router forwarded /v1/abc/x, which the middleware, reading text, had not admitted
    # (a 500, KeyError 'state'); a dot segment: nothing under it is ever forwarded (400 invalid_path).
    with pytest.raises(ValueError, match="ASGI_LIFETIME_PATHS"):
        LifetimeSettings(paths=("/v1/", prefix))


@pytest.mark.anyio
async def test_a_reissued_stream_carries_x_accel_buffering_no_once() -> None:
    starved = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"data: [DONE]\n\n")
    second = httpx.Response(
        200, headers={"content-type": "text/event-stream", "x-accel-buffering": "yes"}, content=EVENTS
    )
    gateway = create_app(settings(paths=("/v1",), max_attempts=2))
    try:
        with respx.mock(assert_all_called=True) as mock:
            route = mock.route(url__startswith="http://upstream.test").mock(side_effect=[starved, second])
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw") as client:
                response = await client.post("/v1/chat/completions", json={"stream": True})
    finally:
        await gateway.state.upstream.aclose()
    assert route.call_count == 2  # the first produced nothing: re-issued into the same answer
    assert response.status_code == 200 and b'"hi"' in response.content
    assert response.headers.get_list("x-accel-buffering") == ["no"]


def test_through_a_buffering_nginx_a_head_of_an_event_stream_is_answered_once(tmp_path: Path) -> None:
    # nginx with its defaults (proxy_buffering on) in front of the gateway. A HEAD was a 502 after two
    # upstream attempts; nginx acts on X-Accel-Buffering and does not pass it on.
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    stream = head + b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(EVENTS), EVENTS)

    def answer(request: Any) -> list[bytes | str | Any]:
        return [head + b"content-length: 0\r\n\r\n"] if request.method == "HEAD" else [stream]

    with raw_upstream(answer) as upstream:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream.url,), max_attempts=2))
        with served(gateway, "uvicorn-h11") as url:
            port = free_port()
            site = (
                f"server {{ listen 127.0.0.1:{port};\n  location / {{ proxy_pass {url}; proxy_http_version 1.1; }} }}\n"
            )
            with nginx_server(tmp_path / "nginx", site, port=port) as nginx, httpx.Client(timeout=10) as client:
                heads = client.head(nginx.base + "/v1/responses/resp_1")
                gets = client.get(nginx.base + "/v1/responses/resp_1")
    assert heads.status_code == 200 and heads.headers["content-type"] == "text/event-stream"
    assert gets.status_code == 200 and b'"hi"' in gets.content
    assert "x-accel-buffering" not in heads.headers and "x-accel-buffering" not in gets.headers
    assert [r.method for r in upstream.requests] == ["HEAD", "GET"]
