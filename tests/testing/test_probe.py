"""``probe_retention``: what holds a request's body while the response streams, named.

Each app streams its answer; the probe holds the first streamed chunk while it searches the heap.
Apps that keep the body (raw, parsed, on ``request.state``, in a global...) are reported with the
path that reaches it; apps that let go pass, and the probe's own machinery is never reported.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from asgi_lifetime import KiB, LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import (
    LifetimeProbe,
    ProbeError,
    RetentionReport,
    chat_completion_body,
    create_demo_upstream,
    probe_retention,
    serve_in_thread,
    wait_idle,
)

from . import apps

pytestmark = pytest.mark.anyio


def paths(report: RetentionReport) -> str:
    return "\n".join(holder.path for holder in report.holders)


@pytest.fixture
def cleared() -> Iterator[None]:
    yield
    apps.CACHE.clear()
    apps.Remembered.last = None


# --- apps that keep the body ------------------------------------------------------------------


async def test_a_body_kept_in_a_local_is_named(anyio_backend: str) -> None:
    report = await probe_retention(apps.keeps_body())
    assert not report.ok
    found = paths(report)
    # The stream's closure over ``body``, and Starlette's own cache of it on the Request.
    assert "async generator tests.testing.apps.keeps_body.<locals>.chat.<locals>.stream local 'body'" in found
    assert "local 'request' → Request._body" in found
    assert {holder.kind for holder in report.holders} == {"bytes"}
    assert report.held_bytes == report.body_size  # one bytes object, however many paths reach it
    assert "(a 4.0 MiB body in 64.0 KiB chunks)" in str(report) and "in 1 object(s), held by:" in str(report)


async def test_a_kept_parse_is_named_down_to_its_strings(anyio_backend: str) -> None:
    report = await probe_retention(apps.keeps_parsed())
    found = paths(report)
    assert "stream local 'data'['messages'][*]['content']" in found
    assert "local 'request' → Request._json['messages'][*]['content']" in found
    parsed = next(holder for holder in report.holders if "stream local 'data'" in holder.path)
    assert parsed.kind == "str" and parsed.count > 100  # every message's content, one line


async def test_a_body_on_request_state_is_named(anyio_backend: str) -> None:
    report = await probe_retention(apps.keeps_in_state())
    found = paths(report)
    assert "['state']['body']" in found or "State._state['body']" in found, found


async def test_a_body_in_a_module_level_cache_is_named(anyio_backend: str, cleared: None) -> None:
    report = await probe_retention(apps.keeps_in_cache())
    assert paths(report) == "module tests.testing.apps.CACHE['last']"
    assert report.holders[0].kind == "bytes"


async def test_a_body_in_a_class_attribute_is_named_even_in_a_bytesio(anyio_backend: str, cleared: None) -> None:
    report = await probe_retention(apps.keeps_in_class())
    assert paths(report) == "class tests.testing.apps.Remembered.last"
    assert report.holders[0].kind == "BytesIO"


async def test_a_memoryview_of_a_bytearray_is_named(anyio_backend: str) -> None:
    report = await probe_retention(apps.keeps_a_view())
    assert "stream local 'view' (a memoryview)" in paths(report)
    assert report.holders[0].kind == "bytearray"


async def test_a_frame_kept_by_a_traceback_is_named(anyio_backend: str) -> None:
    app = apps.keeps_a_traceback()
    report = await probe_retention(app)
    assert "frame tests.testing.apps.keeps_a_traceback.<locals>.chat" in paths(report)
    assert "local 'body'" in paths(report)
    del app.state.last_error


async def test_a_local_of_another_thread_is_named(anyio_backend: str) -> None:
    holding = apps.ThreadHolding()
    try:
        report = await probe_retention(holding.app)
    finally:
        holding.stop()
    found = paths(report)
    assert "thread 'holder' frame tests.testing.apps.ThreadHolding.chat.<locals>.hold local 'body'" in found
    assert "Thread._args[0]" in found  # threading.Thread keeps its arguments until the target returns


async def test_fastapi_with_a_pydantic_model_keeps_the_body_and_its_parse(anyio_backend: str) -> None:
    # FastAPI reads the body with request.json() (Starlette caches both on the Request) and keeps
    # the Request in its route handler while the response streams: the endpoint itself let go.
    report = await probe_retention(apps.fastapi_app())
    found = paths(report)
    assert "coroutine fastapi.routing.request_response.<locals>.app local 'request' → Request._body" in found
    assert "local 'request' → Request._json['messages'][*]['content']" in found
    assert "ChatRequest" not in found  # the model, which the endpoint dropped, is not held


async def test_a_kept_pydantic_model_is_named_through_its_fields(anyio_backend: str) -> None:
    report = await probe_retention(apps.fastapi_keeps_the_model())
    model = next(holder for holder in report.holders if "ChatRequest" in holder.path)
    assert model.path == (
        "async generator tests.testing.apps.fastapi_keeps_the_model.<locals>.chat.<locals>.stream "
        "local 'chat' → ChatRequest.messages[*] → Message.content"
    )
    assert model.count > 200 and model.kind == "str"  # every message: more holders than one scan takes


async def test_the_middleware_replay_waits_in_starlettes_disconnect_listener(anyio_backend: str) -> None:
    # With handoff_parsed=True an endpoint that only takes the parse leaves the replayed body for
    # the next receive(): Starlette's disconnect listener gets it and holds it in a local. The
    # replay cannot take it back (another receiver may read it later: test_attack_replay.py).
    report = await probe_retention(apps.lifetime_take_parsed(drain=False))
    assert (
        paths(report) == "coroutine starlette.responses.StreamingResponse.listen_for_disconnect local 'message'['body']"
    )


# --- apps that let go ---------------------------------------------------------------------------


async def test_a_well_behaved_app_passes(anyio_backend: str) -> None:
    report = await probe_retention(apps.well_behaved())
    assert report.ok, report
    assert report.status == 200 and report.body_size >= 4 * MiB
    assert "nothing held the body" in str(report)


async def test_the_middleware_with_the_request_lifetime_api_passes(anyio_backend: str) -> None:
    app = apps.lifetime_app()
    report = await probe_retention(app)
    assert report.ok, report
    await wait_idle(app)


async def test_taking_the_parse_and_the_replay_passes(anyio_backend: str) -> None:
    report = await probe_retention(apps.lifetime_take_parsed(drain=True))
    assert report.ok, report


@pytest.fixture
def upstream_url() -> Iterator[str]:
    with serve_in_thread(create_demo_upstream(tokens_per_second=2000, default_tokens=16)) as url:
        yield url


async def test_the_gateway_passes(anyio_backend: str, upstream_url: str) -> None:
    gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), retain_outbound=False))
    report = await probe_retention(gateway, lifespan=True)
    assert report.ok, report
    await wait_idle(gateway)


async def test_the_gateway_keeping_the_outbound_body_for_a_reissue_is_seen(
    anyio_backend: str, upstream_url: str
) -> None:
    # RETAIN_OUTBOUND=memory keeps the body sent upstream in RAM for one blind re-issue of a
    # starved stream, by design and accounted for: the probe sees it; allow= names it expected.
    gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), retain_outbound="memory"))
    report = await probe_retention(gateway, lifespan=True)
    assert "local 'prepared' → Prepared.body" in paths(report)
    again = create_app(LifetimeSettings(upstream_url=(upstream_url,), retain_outbound="memory"))  # a new lifespan
    allowed = await probe_retention(again, lifespan=True, allow=["Prepared.body"])
    assert allowed.ok and allowed.allowed
    assert "allowed" in str(allowed)


async def test_the_fixture_passes_a_well_behaved_app(anyio_backend: str, lifetime_probe: LifetimeProbe) -> None:
    report = await lifetime_probe(apps.well_behaved(), body_size=1 * MiB)
    assert report.ok


# --- the probe's own machinery is not the app's ----------------------------------------------


async def test_chunks_the_app_has_not_read_yet_are_the_probes(anyio_backend: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()  # one chunk read, the rest left with the probe while streaming
        del first
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    assert (await probe_retention(app)).ok


async def test_a_raw_asgi_app_holding_a_chunk_message_is_named(anyio_backend: str) -> None:
    async def stream_after_reading(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        while message.get("more_body"):
            message = await receive()  # the last chunk stays in ``message``
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    report = await probe_retention(stream_after_reading)
    assert paths(report) == f"coroutine {__name__}.{stream_after_reading.__qualname__} local 'message'['body']"
    assert report.held_bytes <= 64 * KiB


@pytest.mark.parametrize("size", [1, 1000, 70 * KiB, 1 * MiB])
async def test_small_and_odd_sizes_are_probed(anyio_backend: str, size: int) -> None:
    assert (await probe_retention(apps.well_behaved(), body_size=size)).ok
    assert not (await probe_retention(apps.keeps_body(), body_size=size)).ok


async def test_a_body_factory_and_headers_are_used(anyio_backend: str) -> None:
    seen: list[Any] = []

    async def chat(request: Request) -> Response:
        seen.append((request.headers["content-type"], request.headers["x-key"], request.url.query))
        parsed = await request.json()
        seen.append(sorted(parsed))
        return StreamingResponse(apps.answer("ok"))

    def factory(marker: str, size: int) -> bytes:
        return json.dumps({"input": [f"{marker} {'x' * 200}"] * (size // 200)}).encode()

    report = await probe_retention(
        apps.starlette_app(chat),
        path=f"{apps.PATH}?debug=1",
        headers={"x-key": "k", "content-type": "application/json; charset=utf-8"},
        body_factory=factory,
        body_size=64 * KiB,
    )
    assert seen == [("application/json; charset=utf-8", "k", "debug=1"), ["input"]]
    assert "Request._json['input'][*]" in paths(report)


async def test_a_body_without_the_marker_in_every_chunk_is_refused(anyio_backend: str) -> None:
    with pytest.raises(ValueError, match="no marker in bytes 65536-100022"):
        await probe_retention(apps.well_behaved(), body_factory=lambda marker, size: marker.encode() + b" " * 100_000)
    with pytest.raises(TypeError, match="must return bytes"):
        await probe_retention(apps.well_behaved(), body_factory=lambda marker, size: marker)  # type: ignore[arg-type,return-value]


def test_the_default_body_is_a_streaming_chat_completion_marked_in_every_kib() -> None:
    body = chat_completion_body("MARK", 100 * KiB)
    request = json.loads(body)
    assert request["stream"] is True and request["model"]
    assert [m["role"] for m in request["messages"][:3]] == ["system", "user", "assistant"]
    assert request["messages"][-1]["role"] == "user"
    assert 100 * KiB <= len(body) < 100 * KiB + 20 * KiB
    for start in range(0, len(body) - KiB, KiB):  # a marker in every 2 KiB (pieces of 1 KiB, JSON between)
        assert b"MARK" in body[start : start + 2 * KiB]
    assert all(len(m["content"]) > 64 for m in request["messages"])  # no short marked string (caches)


# --- when the probe cannot look ---------------------------------------------------------------


async def test_an_app_that_does_not_stream_is_a_probe_error(anyio_backend: str) -> None:
    async def chat(request: Request) -> Response:
        return JSONResponse({"ok": True})

    with pytest.raises(ProbeError, match="answered 200 without streaming"):
        await probe_retention(apps.starlette_app(chat))


async def test_an_app_that_raises_is_a_probe_error(anyio_backend: str) -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    with pytest.raises(ProbeError, match="raised RuntimeError: boom") as raised:
        await probe_retention(broken)
    assert isinstance(raised.value.__cause__, RuntimeError)


async def test_an_app_that_never_streams_times_out(anyio_backend: str) -> None:
    async def stuck(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep_forever()

    with pytest.raises(ProbeError, match="did not start a streamed response within 0.2 s"):
        await probe_retention(stuck, within=0.2)


async def test_a_stream_that_never_ends_times_out_after_the_check(anyio_backend: str) -> None:
    async def endless(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await anyio.sleep_forever()

    with pytest.raises(ProbeError, match="did not end within 0.2 s"):
        await probe_retention(endless, within=0.2)


async def test_the_lifespan_runs_around_the_request_and_its_state_reaches_it(anyio_backend: str) -> None:
    events: list[str] = []

    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        events.append("startup")
        yield {"greeting": "hello"}
        events.append("shutdown")

    async def chat(request: Request) -> Response:
        events.append(request.state.greeting)
        await apps.read(request)
        return StreamingResponse(apps.answer("ok"))

    app = apps.starlette_app(chat)
    app.router.lifespan_context = _as_context(lifespan)
    assert (await probe_retention(app, lifespan=True)).ok
    assert events == ["startup", "hello", "shutdown"]


async def test_a_failed_lifespan_startup_is_a_probe_error(anyio_backend: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message: Message = await receive()
        assert message["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    with pytest.raises(ProbeError, match="no database"):
        await probe_retention(app, lifespan=True)


@pytest.mark.parametrize(
    "options", [{"body_size": 0}, {"chunk_size": -1}, {"within": 0}], ids=["body_size", "chunk_size", "within"]
)
async def test_bad_options_are_refused(anyio_backend: str, options: dict[str, Any]) -> None:
    [(name, value)] = options.items()
    with pytest.raises(ValueError, match=f"^{name}={value} is invalid: must be greater than 0$"):
        await probe_retention(apps.well_behaved(), **options)


def _as_context(lifespan: Any) -> Any:
    import contextlib

    return contextlib.asynccontextmanager(lifespan)


@pytest.mark.parametrize("size", [1, 64 * KiB, 100 * KiB, 2 * MiB + 100])
async def test_every_chunk_the_app_receives_carries_the_marker(anyio_backend: str, size: int) -> None:
    chunks: list[tuple[int, bool]] = []  # (length, has a marker): nothing of the body itself

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        more = True
        while more:
            message = await receive()
            chunks.append((len(message["body"]), re.search(rb"lp[0-9a-f]{20}-[0-9]{7} ", message["body"]) is not None))
            more = message["more_body"]
            del message
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    report = await probe_retention(app, body_size=size)
    assert report.ok, report
    assert sum(length for length, _ in chunks) == report.body_size >= size
    assert all(marked for _, marked in chunks)
    assert all(length >= 64 * KiB for length, _ in chunks[:-1])


async def test_any_buffer_is_read_and_strange_objects_do_not_stop_the_search(anyio_backend: str) -> None:
    import array
    import weakref

    class Strange:
        """repr, __class__ and attribute access that raise: the search must not."""

        @property  # type: ignore[misc]
        def __class__(self) -> type:
            raise RuntimeError("no class")

        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    class Target:
        pass

    target = Target()
    kept: dict[Any, Any] = {}

    async def chat(request: Request) -> Response:
        kept[Strange()] = array.array("B", await apps.read(request))
        kept["proxy"] = weakref.proxy(target)
        return StreamingResponse(apps.answer("ok"))

    report = await probe_retention(apps.starlette_app(chat))
    assert paths(report) == f"function {__name__}.{chat.__qualname__} free variable 'kept'[<Strange>]"
    assert report.holders[0].kind == "array"


async def test_the_demo_upstream_holds_no_request_while_it_streams(anyio_backend: str) -> None:
    # It runs in the gateway's process (the demo, the tests' upstream thread): its reading loop
    # once left the last chunk in a local of the coroutine that streams the answer.
    report = await probe_retention(create_demo_upstream(tokens_per_second=2000, default_tokens=16))
    assert report.status == 200
    assert report.ok, report
