"""The first parse end to end, over real sockets: refusal, charge, the loop kept free, safe bodies out.

The gateway runs under uvicorn on a loopback port in front of a recording upstream on
another. Covered here:

- a body whose parse would multiply it (a million empty messages) is forwarded unparsed when no
  preparer reads it, and is a 413 ``body_too_complex`` with nothing forwarded when one does; a
  parse is charged to admission before it runs;
- while a large parse runs (made to block, deterministically), other requests are served;
- bodies the standard library parses (lone surrogate escapes, ``NaN``, ``Infinity``, huge
  numbers) survive a refold after a context overflow, a role remap and a changing preparer:
  the client gets the upstream's answer, the upstream a body that says what the client sent;
- any unexpected exception in the gateway is an OpenAI-style JSON 500 that leaks nothing, and is logged.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from asgi_lifetime import _json
from asgi_lifetime._parse import THREAD_THRESHOLD, parse_cost
from asgi_lifetime._settings import LifetimeSettings, MiB
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._prepare import Draft, Preparer, without_parse
from asgi_lifetime.testing._serve import serve_in_thread
from benchmarks.bodies import make_body

from .._spy import spy_parse
from ..reliability.test_faults import FAST, PATH, assert_idle, error_code

pytestmark = pytest.mark.anyio

OVERFLOW = (
    b'{"error":{"message":"This model\'s maximum context length is 50 tokens.","code":"context_length_exceeded"}}'
)
ROLE = b'{"error":{"message":"Unsupported role: \'developer\'","type":"invalid_request_error"}}'
ANSWER = b'{"choices":[{"message":{"role":"assistant","content":"ok"}}]}'


class Recorder:
    """An upstream that records each request body and answers ``rejections`` first, then 200."""

    def __init__(self, rejections: Sequence[bytes] = ()) -> None:
        self.rejections = list(rejections)
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(b"".join(chunks))
        status, body = (400, self.rejections.pop(0)) if self.rejections else (200, ANSWER)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@contextmanager
def gateway(upstream: Recorder, *, preparers: Sequence[Preparer] = (), **changes: Any) -> Iterator[tuple[str, Any]]:
    with serve_in_thread(upstream) as upstream_url:
        settings = LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, **changes})
        app = create_app(settings, preparers=preparers)
        with serve_in_thread(app) as url:
            yield url, app


JSON = {"content-type": "application/json"}


# --- parse amplification ---------------------------------------------------------------------------


MILLION_EMPTY = b'{"model":"m","messages":[' + b",".join([b"{}"] * 1_000_000) + b"]}"  # 2.9 MiB, a 70 MiB parse


def reads_the_body(draft: Draft) -> None:
    """A preparer that needs the parse (it is not declared ``without_parse``)."""
    assert isinstance(draft.body, dict)


async def test_a_million_empty_messages_are_refused_before_parsing_when_a_preparer_reads_them() -> None:
    upstream = Recorder()
    with gateway(upstream, preparers=[reads_the_body]) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=MILLION_EMPTY, headers=JSON)
            assert response.status_code == 413 and error_code(response) == "body_too_complex"
            assert response.json()["error"]["type"] == "invalid_request_error"
            # An ordinary request still goes through.
            assert (await client.post(PATH, json={"messages": [{"role": "user", "content": "hi"}]})).status_code == 200
        assert len(upstream.bodies) == 1
        stats = await assert_idle(app, url)
        assert stats["too_large"] == 1


@without_parse
def policy(draft: Draft) -> None:
    """A preparer that adds a system message without reading the body."""
    if draft.conversation is not None:
        draft.conversation.prepend({"role": "system", "content": "policy"})


async def test_a_body_shaped_too_costly_does_not_slip_past_a_preparer_that_adds_a_message() -> None:
    """Nobody looked into the body, so whether it has a conversation is unknown: a ``@without_parse``
    preparer must not see "no conversation" and let the body through without its message."""
    upstream = Recorder()
    with gateway(upstream, preparers=[policy]) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=MILLION_EMPTY, headers=JSON)
            assert response.status_code == 413 and error_code(response) == "body_too_complex"
            small = {"messages": [{"role": "user", "content": "hi"}]}
            assert (await client.post(PATH, json=small)).status_code == 200
        (forwarded,) = upstream.bodies
        assert json.loads(forwarded)["messages"][0] == {"role": "system", "content": "policy"}
        await assert_idle(app, url)


async def test_a_body_too_costly_to_parse_is_forwarded_unparsed_when_nothing_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody needs the parse: the body goes on as received (the upstream judges it), nothing
    parses it, and it is charged its size only (the ticket gave back the estimate's charge)."""
    from asgi_lifetime import _middleware

    parses = spy_parse(monkeypatch, _middleware)
    upstream = Recorder()
    with gateway(upstream) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=MILLION_EMPTY, headers=JSON)
            assert response.status_code == 200, response.text
        assert upstream.bodies == [MILLION_EMPTY]
        assert parses == [MILLION_EMPTY]  # asked once, refused by the estimate before any parse
        stats = await assert_idle(app, url)
        assert stats["too_large"] == 0


@pytest.mark.parametrize("shape", ["turns", "huge_text", "image"])
async def test_realistic_large_bodies_are_accepted(shape: str) -> None:
    raw = make_body(shape, 4 * MiB)
    upstream = Recorder()
    with gateway(upstream) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=raw, headers=JSON)
        assert response.status_code == 200 and upstream.bodies == [raw]
        await assert_idle(app, url)


async def test_the_parse_is_charged_and_other_requests_are_served_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The large body's parse is made to block on an Event in its worker thread (no timing luck).
    # Blocked there it releases the GIL; a real msgspec decode holds it for the whole decode,
    # which is why the decode is bounded (refused past 8x) rather than merely moved.
    entered = threading.Event()
    release = threading.Event()
    real = _json.loads_fast

    def blocked(raw: bytes) -> Any:
        if len(raw) >= THREAD_THRESHOLD:  # only the large request's parse blocks, until the test releases it
            entered.set()
            if not release.wait(20):
                raise RuntimeError("the large parse was never released")
        return real(raw)

    monkeypatch.setattr(_json, "loads_fast", blocked)
    raw = make_body("turns", 2 * MiB)
    upstream = Recorder()
    # A preparer that reads the body: the gateway parses every JSON body at once (without one, a
    # conversation the lazy walk can judge is not parsed at all).
    with gateway(upstream, admission_timeout=10.0, preparers=[_route]) as (url, app):
        results: dict[str, int] = {}

        async def large() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                results["large"] = (await client.post(PATH, content=raw, headers=JSON)).status_code

        async with anyio.create_task_group() as tg:
            tg.start_soon(large)
            with anyio.fail_after(20):
                await anyio.to_thread.run_sync(entered.wait)
                # The large body's parse is blocked in a worker thread, charged before it started.
                stats = app.state.lifetime.stats()
                assert stats.inflight_bytes >= len(raw) + parse_cost(raw) - 64 * 1024
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    small = await client.post(PATH, json={"messages": [{"role": "user", "content": "hi"}]})
                    health = await client.get("/healthz")
                results["small"], results["health"] = small.status_code, health.status_code
                assert "large" not in results  # served while the large parse was still running
            release.set()
        assert results == {"small": 200, "health": 200, "large": 200}
        await assert_idle(app, url)


# --- bodies the standard library parses, on every path that writes a new body ----------------------

# (the raw JSON of a value, and what the upstream must see of it in a rewritten body)
ODD_VALUES = {
    "lone high surrogate": (b'"before \\ud800 after"', b"\\ud800"),
    "lone low surrogate": (b'"\\udfff"', b"\\udfff"),
    "surrogate in a key": (b'{"k\\ud83d": 1}', b"\\ud83d"),
    "NaN": (b"NaN", b"NaN"),
    "Infinity": (b"[Infinity, -Infinity]", b"[Infinity,-Infinity]"),
    "1e400": (b"1e400", b"Infinity"),
    "huge int": (b"1" + b"0" * 400, b"1" + b"0" * 400),
}


def _route(draft: Draft) -> None:
    draft.body["model"] = "routed"
    draft.mark_changed()


def _conversation(value: bytes) -> bytes:
    return (
        b'{"model":"m","messages":['
        b'{"role":"developer","content":"be brief"},'
        b'{"role":"user","content":"' + b"old question " * 20 + b'"},'
        b'{"role":"assistant","content":"old answer"},'
        b'{"role":"user","content":"now","extra":' + value + b"}]}"
    )


@dataclass
class Rewriting:
    """One upstream behind two gateways: as configured, and with a preparer that changes every body."""

    upstream: Recorder
    plain: tuple[str, Any]
    routed: tuple[str, Any]


@pytest.fixture(scope="module")
def rewriting() -> Iterator[Rewriting]:
    upstream = Recorder()
    with serve_in_thread(upstream) as upstream_url:
        settings = LifetimeSettings(upstream_url=(upstream_url,), **FAST)
        plain, routed = create_app(settings), create_app(settings, preparers=[_route])
        with serve_in_thread(plain) as plain_url, serve_in_thread(routed) as routed_url:
            yield Rewriting(upstream, (plain_url, plain), (routed_url, routed))


@pytest.mark.parametrize(("value", "expected"), list(ODD_VALUES.values()), ids=list(ODD_VALUES))
@pytest.mark.parametrize("path", ["refold", "remap", "preparer", "preparer+refold"])
async def test_bodies_only_the_standard_library_parses_survive_every_rewrite(
    rewriting: Rewriting, value: bytes, expected: bytes, path: str
) -> None:
    upstream = rewriting.upstream
    rejections = {"refold": [OVERFLOW], "remap": [ROLE], "preparer": [], "preparer+refold": [OVERFLOW]}[path]
    upstream.rejections, upstream.bodies = list(rejections), []
    url, app = rewriting.routed if path.startswith("preparer") else rewriting.plain
    raw = _conversation(value)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(PATH, content=raw, headers=JSON)
    assert response.status_code == 200, response.text
    assert response.content == ANSWER
    await assert_idle(app, url)
    assert len(upstream.bodies) == 1 + len(rejections)
    last = upstream.bodies[-1]
    assert expected in last
    sent = json.loads(last.decode("utf-8"))  # valid UTF-8, and JSON to the standard library
    assert sent["messages"][-1]["content"] == "now"
    if path != "preparer":
        assert last != raw
    if path == "remap":
        assert sent["messages"][0]["role"] == "system"
    if "refold" in path:
        assert [m["role"] for m in sent["messages"]] == ["developer", "user"]
    if path.startswith("preparer"):
        assert sent["model"] == "routed"


# --- the last resort -------------------------------------------------------------------------------


def _explode(draft: Draft) -> None:
    raise RuntimeError("secret detail sk-live-123")


async def test_an_unexpected_exception_is_a_json_500_that_leaks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    upstream = Recorder()
    with caplog.at_level(logging.ERROR, logger="asgi_lifetime.gateway"):
        with gateway(upstream, preparers=[_explode]) as (url, app):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post(PATH, json={"messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 500
            assert response.headers["content-type"] == "application/json"
            assert response.json() == {
                "error": {"type": "server_error", "code": "internal_error", "message": "internal error"}
            }
            assert b"secret" not in response.content and b"RuntimeError" not in response.content
            await assert_idle(app, url)
    assert upstream.bodies == []
    logged = [r for r in caplog.records if r.name == "asgi_lifetime.gateway" and r.exc_info]
    assert logged and "RuntimeError" in logged[0].getMessage()
    assert logged[0].exc_info is not None and "secret detail" in str(logged[0].exc_info[1])


# --- a conversation nobody needs parsed ---------------------------------------------------------


def _inject(draft: Draft) -> None:
    assert draft.conversation is not None
    draft.conversation.prepend({"role": "system", "content": "policy"})


@pytest.mark.parametrize("change", [False, True])
async def test_a_large_conversation_is_forwarded_without_its_parse(
    monkeypatch: pytest.MonkeyPatch, change: bool
) -> None:
    """No preparer, or one declared ``without_parse`` that adds a message: the body is judged by the
    lazy walk, never parsed whole, and the added message is spliced into the bytes as received."""
    from asgi_lifetime.gateway import without_parse

    whole: list[int] = []
    real = _json.loads_fast

    def counting(raw: Any) -> Any:
        if len(raw) >= MiB:
            whole.append(len(raw))
        return real(raw)

    monkeypatch.setattr(_json, "loads_fast", counting)
    raw = make_body("turns", 4 * MiB)
    upstream = Recorder()
    with gateway(upstream, preparers=[without_parse(_inject)] if change else []) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post(PATH, content=raw, headers=JSON)
        assert response.status_code == 200
        assert whole == []
        if change:
            sent = upstream.bodies[0]
            expected = json.loads(raw)
            expected["messages"].insert(0, {"role": "system", "content": "policy"})
            assert json.loads(sent) == expected
            at = raw.index(b"[") + 1
            assert sent[at + len(b'{"role":"system","content":"policy"},') :] == raw[at:]  # as received
        else:
            assert upstream.bodies == [raw]
        await assert_idle(app, url)
