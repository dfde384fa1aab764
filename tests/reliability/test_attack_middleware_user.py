"""``LifetimeMiddleware`` tried as a FastAPI/Starlette user would, following README.md's "Drop-in
middleware" and docs/testing.md, then attacked by a hostile client under real servers on loopback
(uvicorn h11 and httptools, hypercorn asyncio and trio).

Found here:

- settings a lifespan handler put in ``app.state.lifetime_settings`` (where an app loads its
  configuration at startup) were silently ignored: the middleware resolved its settings at the start
  of the lifespan, before the handler ran, from the environment. A body over the app's 100-byte
  limit was served (200) under the default 64 MiB one.
- README's drop-in handler (``await request.json()``) holds the raw body and its parse for as long
  as a streamed response lasts (Starlette caches both on the ``Request``): the middleware's replay
  keeps nothing, Starlette does. README now says so and shows the handler that lets go; the probe
  tests below pin both.
- an endpoint that does not read the body (it ignores it, or takes only the parse with
  ``handoff_parsed=True``) and streams its answer: Starlette's disconnect listener received the whole
  replayed body and kept it for the whole stream (4 MiB under the probe; without the middleware, one
  network chunk). Emptying the message at the listener's next ``receive()`` gave an empty body to
  receivers that read it later (tests/reliability/test_attack_replay.py): such an endpoint drops the
  replay itself (docs/testing.md), pinned below.
- README did not say that the default ``PATHS`` (``/v1/``) reads multipart uploads (``/v1/files``)
  whole into memory and refuses them over ``MAX_BODY_BYTES``.
- ``asgi_lifetime.testing``, and so the pytest plugin, could not be imported without httpx and
  uvicorn (``[cli]``), though the probe needs the core only (tests/test_package.py).

Held up (kept as tests): a declared or sent body over ``max_body_bytes``, one byte over and exactly
at it, a gzip bomb, stacked and unknown encodings, truncated gzip, chunked bodies with extensions,
zero-padded sizes and trailers, a body that stops (408), ``Expect: 100-continue`` over the limit,
a GET with a body, paths outside ``paths=``: each a JSON error in the OpenAI shape or the app's
answer, and nothing left held afterwards.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings
from asgi_lifetime.testing import LifetimeProbe, plugin, probe_retention, serve_in_thread, wait_idle
from tests._servers import served

pytestmark = pytest.mark.anyio
lifetime_probe = plugin.lifetime_probe  # the fixture, as a user's conftest enables it

LIMIT = 4096
SERVERS = ["uvicorn-h11", "uvicorn-httptools", "hypercorn-asyncio", "hypercorn-trio"]


def user_app(settings: LifetimeSettings | None = None, **state: Any) -> FastAPI:
    """A FastAPI app as README shows it: the middleware added, ordinary handlers behind it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name, value in state.items():  # configuration loaded at startup, as apps do
            setattr(app.state, name, value)
        yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(LifetimeMiddleware, settings=settings)

    @app.post("/v1/body")
    async def body(request: Request) -> dict[str, int]:
        return {"len": len(await request.body())}

    @app.api_route("/v1/get", methods=["GET"])
    async def get(request: Request) -> dict[str, int]:
        return {"len": len(await request.body())}

    @app.post("/other")
    async def other(request: Request) -> dict[str, int]:
        return {"len": len(await request.body())}

    return app


# --- settings loaded by the app's lifespan -------------------------------------------------------


@pytest.mark.parametrize("server", SERVERS)
async def test_settings_set_in_the_lifespan_are_the_ones_used(server: str) -> None:
    app = user_app(lifetime_settings={"max_body_bytes": 100})
    with served(app, server) as url:
        if server.startswith("uvicorn-"):  # serve_in_thread returns once the startup has run
            assert app.state.lifetime.stats().admitted == 0  # published then, before any request
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            over = await client.post("/v1/body", content=b"x" * 101)
            at = await client.post("/v1/body", content=b"x" * 100)
    assert over.status_code == 413, over.text
    assert over.json()["error"]["code"] == "request_too_large"
    assert "100 bytes" in over.json()["error"]["message"]
    assert at.status_code == 200 and at.json() == {"len": 100}


def test_an_invalid_setting_from_the_lifespan_fails_the_startup() -> None:
    app = user_app(lifetime_settings={"max_body_bytes": "lots"})
    with pytest.raises(RuntimeError), serve_in_thread(app, startup_timeout=10):
        pass


# --- a hostile client, raw bytes on the socket --------------------------------------------------


def _post(path: str, body: bytes, *headers: str, method: str = "POST") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: testserver", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _sized(path: str, body: bytes, *headers: str, method: str = "POST") -> bytes:
    return _post(path, body, f"Content-Length: {len(body)}", *headers, method=method)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


_JSON = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
_BOMB = gzip.compress(b"0" * (8 * 1024 * 1024))

# (name, request bytes, expected status, expected error code or the app's JSON answer)
ATTACKS: list[tuple[str, bytes, int, str | dict[str, int]]] = [
    ("declared over the limit", _post("/v1/body", b"", f"Content-Length: {LIMIT + 1}"), 413, "request_too_large"),
    ("one byte over", _sized("/v1/body", b"x" * (LIMIT + 1)), 413, "request_too_large"),
    ("exactly at the limit", _sized("/v1/body", b"x" * LIMIT), 200, {"len": LIMIT}),
    ("gzip bomb", _sized("/v1/body", _BOMB, "Content-Encoding: gzip"), 413, "request_too_large"),
    ("gzip within", _sized("/v1/body", gzip.compress(_JSON), "Content-Encoding: gzip"), 200, {"len": len(_JSON)}),
    (
        "raw deflate",
        _sized("/v1/body", zlib.compress(_JSON)[2:-4], "Content-Encoding: deflate"),
        200,
        {"len": len(_JSON)},
    ),
    (
        "stacked gzip, gzip",
        _sized("/v1/body", gzip.compress(gzip.compress(_JSON)), "Content-Encoding: gzip, gzip"),
        415,
        "unsupported_encoding",
    ),
    (
        "two Content-Encoding lines",
        _sized("/v1/body", gzip.compress(_JSON), "Content-Encoding: gzip", "Content-Encoding: deflate"),
        415,
        "unsupported_encoding",
    ),
    ("br", _sized("/v1/body", _JSON, "Content-Encoding: br"), 415, "unsupported_encoding"),
    (
        "truncated gzip",
        _sized("/v1/body", gzip.compress(_JSON)[:-6], "Content-Encoding: gzip"),
        400,
        "malformed_encoding",
    ),
    (
        "gzip then junk",
        _sized("/v1/body", gzip.compress(_JSON) + b"junk", "Content-Encoding: gzip"),
        400,
        "malformed_encoding",
    ),
    (
        "chunked: extensions, zero-padded sizes, trailers",
        _post(
            "/v1/body",
            b"5;ext=1\r\nhello\r\n0005\r\nworld\r\nA\r\n0123456789\r\n0\r\nX-Trailer: y\r\n\r\n",
            "Transfer-Encoding: chunked",
        ),
        200,
        {"len": 20},
    ),
    (
        "chunked: 2000 one-byte chunks",
        _post("/v1/body", _chunked(*[b"x"] * 2000), "Transfer-Encoding: chunked"),
        200,
        {"len": 2000},
    ),
    (
        "chunked over the limit",
        _post("/v1/body", _chunked(*[b"x" * 1024] * 5), "Transfer-Encoding: chunked"),
        413,
        "request_too_large",
    ),
    (
        "Expect: 100-continue over the limit",
        _post("/v1/body", b"", f"Content-Length: {LIMIT * 100}", "Expect: 100-continue"),
        413,
        "request_too_large",
    ),
    ("GET with a body over the limit", _sized("/v1/get", b"x" * (LIMIT + 1), method="GET"), 413, "request_too_large"),
    ("outside paths=: untouched", _sized("/other", b"x" * (LIMIT * 4)), 200, {"len": LIMIT * 4}),
]


async def _exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` whole, read until the server closes; the final status and body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        with contextlib.suppress(anyio.BrokenResourceError):  # a server may answer before reading all
            await stream.send(request)
        received = bytearray()
        with anyio.fail_after(10), contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                received += await stream.receive()
    # hypercorn answers Expect: 100-continue itself before the app reads: skip interim responses
    while received.startswith(b"HTTP/1.1 100"):
        received = received.partition(b"\r\n\r\n")[2]
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("server", SERVERS)
async def test_hostile_requests(server: str) -> None:
    settings = LifetimeSettings(paths=("/v1/",), max_body_bytes=LIMIT, body_idle_timeout=0.5)
    app = user_app(settings)
    with served(app, server) as url:
        port = int(url.rsplit(":", 1)[1])
        seen = []
        for name, request, _, _ in ATTACKS:
            got, body = await _exchange(port, request)
            answer = json.loads(body)
            shape = answer["error"]["code"] if "error" in answer else answer
            seen.append((name, got, shape))
        # A body that stops: the idle timeout answers, the connection is not held.
        got, body = await _exchange(port, _post("/v1/body", b"abc", "Content-Length: 100"))
        seen.append(("stops after 3 of 100 bytes", got, json.loads(body)["error"]["code"]))
        await wait_idle(app)
    expected_all = [(name, status, expected) for name, _, status, expected in ATTACKS]
    assert seen == [*expected_all, ("stops after 3 of 100 bytes", 408, "request_timeout")]


# --- the retention probe on README's drop-in app ------------------------------------------------


def _sse(count: int) -> StreamingResponse:
    async def tokens() -> AsyncIterator[str]:
        for i in range(3):
            yield f"data: {i} of {count}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(tokens(), media_type="text/event-stream")


async def _read_json(request: Request) -> Any:
    # What README shows for a streamed answer: the body read without Starlette's cache
    return json.loads(b"".join([chunk async for chunk in request.stream()]))


def _drop_in(handler: Callable[..., Any]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(paths=("/v1/",)))
    app.post("/v1/chat/completions")(handler)
    return app


async def _cached(request: Request) -> Response:
    body = await request.json()  # README's non-streaming example, used for a streamed answer
    count = len(body["messages"])
    del body
    return _sse(count)


async def _uncached(request: Request) -> Response:
    body = await _read_json(request)
    count = len(body["messages"])
    del body
    return _sse(count)


async def _count(request: Request) -> int:
    return len((await _read_json(request))["messages"])


async def _dependency(count: int = Depends(_count)) -> Response:
    return _sse(count)


async def test_readme_streaming_handler_lets_go(lifetime_probe: LifetimeProbe) -> None:
    await lifetime_probe(_drop_in(_uncached))


async def test_readme_streaming_dependency_lets_go(lifetime_probe: LifetimeProbe) -> None:
    await lifetime_probe(_drop_in(_dependency))


async def test_request_json_is_held_by_starlette_while_the_answer_streams() -> None:
    report = await probe_retention(_drop_in(_cached))
    paths = sorted(holder.path for holder in report.holders)
    assert len(paths) == 2 and all("local 'request' → Request._" in path for path in paths), paths
    assert any("Request._body" in path for path in paths) and any("Request._json" in path for path in paths)


async def test_a_plain_starlette_app_with_the_middleware(lifetime_probe: LifetimeProbe) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    async def endpoint(request: Request) -> Response:
        size = len(await _read_json(request))
        return _sse(size) if request.query_params.get("stream") else JSONResponse({"size": size})

    app = Starlette(
        routes=[Route("/v1/chat/completions", endpoint, methods=["POST"])],
        middleware=[Middleware(LifetimeMiddleware, settings=LifetimeSettings(paths=("/v1/",)))],
    )
    await lifetime_probe(app, path="/v1/chat/completions?stream=1")


# --- the replay when the app answers without reading the body -----------------------------------


async def _drop_the_replay(request: Request) -> None:
    message = await request.receive()  # docs/testing.md: the replayed body, taken and let go
    del message


def _ignores_the_body(*, drop: bool) -> FastAPI:
    async def endpoint(request: Request) -> Response:  # its input is the query, say: a body sent anyway is not read
        if drop:
            await _drop_the_replay(request)
        return _sse(0)

    return _drop_in(endpoint)


def _takes_the_parse(*, drop: bool) -> FastAPI:
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(paths=("/v1/",)), handoff_parsed=True)

    @app.post("/v1/chat/completions")
    async def endpoint(request: Request) -> Response:
        body = request.state.lifetime.take_parsed()  # docstring's way to the parse, no second one
        count = len(body["messages"])
        del body
        if drop:
            await _drop_the_replay(request)
        return _sse(count)

    return app


@pytest.mark.parametrize("build", [_ignores_the_body, _takes_the_parse])
async def test_a_body_the_app_did_not_read_waits_in_the_disconnect_listener(
    anyio_backend: str, build: Callable[..., FastAPI]
) -> None:
    # Starlette's disconnect listener is the first to receive() once the response has started:
    # it gets the whole replayed body (4 MiB here, up to MAX_BODY_BYTES) and keeps it for the whole
    # stream, where without the middleware it would keep one network chunk. The replay cannot take
    # it back: the same message may be on its way to a receiver that reads it later.
    report = await probe_retention(build(drop=False))
    assert not report.ok
    assert "StreamingResponse.listen_for_disconnect local 'message'['body']" in str(report)


@pytest.mark.parametrize("build", [_ignores_the_body, _takes_the_parse])
async def test_a_body_the_app_dropped_is_not_held_while_it_streams(
    lifetime_probe: LifetimeProbe, build: Callable[..., FastAPI]
) -> None:
    await lifetime_probe(build(drop=True))
