"""Attacks on the context-overflow refold of a large body, through the real app.

The real app under uvicorn on loopback, in front of a raw loopback upstream that rejects a conversation
with a context overflow (OpenAI, Anthropic or Gemini wording) while it still holds its oldest turn, and
streams an answer naming the conversation once it was refolded. A custom ``refold_factory`` whose refold
waits on a ``threading.Event`` the test holds makes "while the refold runs" a moment the test chooses:
the client leaves, the server drains, the refold raises. Each request must settle (admission back, the
gateway idle) and leave its refold closure, and through it the conversation, unreachable with the
collector off.

The refold runs on the gateway's event loop (docs/design.md says why), so the held refold blocks the
gateway's loop (uvicorn's thread) while it waits, never the test's. Written against 563aba6, which ran it
in a worker thread from ``THREAD_THRESHOLD`` on (reverted in 35d2303); the tests hold for both.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import anyio
import anyio.to_thread
import httpx
import openai
import pytest
import respx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_lifetime import Lifetime, LifetimeSettings
from asgi_lifetime._parse import THREAD_THRESHOLD
from asgi_lifetime._settings import RetainOutbound
from asgi_lifetime.gateway import create_app
from asgi_lifetime.gateway._refold import Conversation, Refold, default_refold
from asgi_lifetime.gateway._shutdown import request_shutdown, reset_shutdown
from asgi_lifetime.testing._serve import serve_in_thread

from ..gateway._raw_upstream import RawRequest, Script, raw_upstream, response
from ..gateway.sdk_upstream import ANTHROPIC_PATH, TEXT, anthropic_events, chat_chunks, sse_frame
from ..gateway.test_relay_first_error import CHAT_ERROR_EVENT
from ..gateway.test_upstream import BASE, DEVELOPER_REJECTED, OK, OVERFLOW, Recorder, chat, make_settings, make_upstream
from ..gateway.test_upstream import conversation as unit_conversation
from .test_attack_upstream import SSE_HEAD, chunk
from .test_faults import FAST, PATH, assert_idle

pytestmark = pytest.mark.anyio

KiB = 1024
WAIT = 10.0  # bound on every cross-thread wait (only reached on failure)
OLDEST = "turn-0 "
OVERFLOWS: dict[str, dict[str, Any]] = {
    "openai": {
        "error": {
            "message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
    },
    "anthropic": {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 250000 tokens > 100000 maximum"},
    },
    "gemini": {
        "error": {
            "code": 400,
            "message": "The input token count (250000) exceeds the maximum number of tokens allowed (100000).",
            "status": "INVALID_ARGUMENT",
        }
    },
}


def conversation(tag: str, size: int) -> dict[str, Any]:
    """A chat of about ``size`` bytes whose last user turn names it (``ask <tag>``)."""
    turns = max(4, size // (8 * KiB))
    filler = "z" * (size // (2 * turns))
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"turn-{n} {tag} {filler}"})
        messages.append({"role": "assistant", "content": f"reply-{n} {filler}"})
    messages.append({"role": "user", "content": f"ask {tag}"})
    return {"model": "m", "stream": True, "messages": messages}


def sse_answer(text: str) -> bytes:
    event = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]}
    done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    return SSE_HEAD + chunk(b"data: " + json.dumps(event).encode() + b"\n\n") + chunk(done) + b"0\r\n\r\n"


def asked(body: bytes) -> str:
    """What the upstream answers a conversation: its last turn's text."""
    messages = json.loads(body)["messages"]
    content = messages[-1]["content"]
    return content if isinstance(content, str) else json.dumps(content)


def overflowing(shape: str = "openai") -> Callable[[RawRequest], Script]:
    """Rejects a conversation that still holds its oldest turn; streams ``answer: <last turn>`` otherwise."""
    error = json.dumps(OVERFLOWS[shape]).encode()

    def answer(request: RawRequest) -> Script:
        if OLDEST.encode() in request.body:
            return [response(400, error, headers=(("content-type", "application/json"),))]
        return [sse_answer(f"answer: {asked(request.body)}")]

    return answer


def answer_text(body: bytes) -> str:
    """The content of the first SSE event of a relayed answer."""
    line = next(part for part in body.split(b"\n\n") if part.startswith(b"data: {"))
    text: str = json.loads(line[6:])["choices"][0]["delta"]["content"]
    return text


class Gated:
    """A ``refold_factory`` whose refold waits for the test's ``gate`` (in the gateway's thread), then runs
    the default refold, or raises ``raises()`` (a new exception each time: a kept one keeps its
    traceback). Weak references to every refold closure it made."""

    def __init__(self, *, raises: Callable[[], Exception] | None = None) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.raises = raises
        self.closures: list[weakref.ref[Any]] = []
        self.calls = 0

    def __call__(self, conversation: Conversation) -> Refold:
        inner = default_refold(conversation)
        started, gate, raises = self.started, self.gate, self.raises

        def refold(window: int | None) -> bytes | None:
            self.calls += 1
            started.set()
            assert gate.wait(WAIT)
            if raises is not None:
                raise raises()
            return inner(window)

        self.closures.append(weakref.ref(refold))
        self.closures.append(weakref.ref(inner))
        return refold

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.closures)


def noticing_disconnect(app: ASGIApp, left: threading.Event) -> ASGIApp:
    """``app`` with its ``receive`` wrapped: ``left`` is set as the server hands it ``http.disconnect``."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                left.set()
            return message

        await app(scope, watched, send)

    return wrapped


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic collector off: what is still reachable afterwards is held, not awaiting a collection."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def wait_for(event: threading.Event) -> None:
    assert await anyio.to_thread.run_sync(event.wait, WAIT)


def gateway(upstream_url: str, refold_factory: Any = default_refold, **changes: Any) -> Any:
    settings = LifetimeSettings(upstream_url=(upstream_url,), **{**FAST, "stall_timeout": 5.0, **changes})
    return create_app(settings, refold_factory=refold_factory)


async def post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(PATH, json=body)


def test_the_bodies_here_are_large() -> None:
    # From THREAD_THRESHOLD on: the size from which 563aba6 refolded in a worker thread.
    assert len(json.dumps(conversation("x", 512 * KiB))) >= THREAD_THRESHOLD


# -- each overflow wording, through the real app --------------------------------------------------


@pytest.mark.parametrize("shape", list(OVERFLOWS))
async def test_a_large_overflowing_conversation_gets_the_refolded_answer(shape: str) -> None:
    gated = Gated()
    gated.gate.set()
    with raw_upstream(overflowing(shape)) as upstream:
        app = gateway(upstream.url, gated)
        with serve_in_thread(app) as url:
            answer = await post(url, conversation("solo", 512 * KiB))
            stats = await assert_idle(app, url)
    assert answer.status_code == 200 and answer_text(answer.content) == "answer: ask solo"
    assert len(upstream.requests) == 2 and OLDEST.encode() not in upstream.requests[1].body
    assert gated.calls == 1 and stats["refolded"] == 1


# -- the client leaves while the refold runs -------------------------------------------------------


async def test_a_client_leaving_during_the_refold_settles_the_request() -> None:
    # The refold holds the gateway's loop: the disconnect is seen once it returned. The refolded body may
    # be on its way by then (or sent whole): it is cut, the request settles, nothing is kept.
    gated = Gated()
    left = threading.Event()
    with raw_upstream(overflowing()) as upstream:
        app = gateway(upstream.url, gated)
        with serve_in_thread(noticing_disconnect(app, left)) as url, collector_off():
            async with anyio.create_task_group() as tg:
                tg.start_soon(post, url, conversation("gone", 512 * KiB))
                await wait_for(gated.started)
                tg.cancel_scope.cancel()  # the client hangs up while the refold runs
            gated.gate.set()
            await wait_for(left)
            await assert_idle(app, url)
            assert gated.alive() == 0  # the refold, and the conversation it held, are gone
    assert gated.calls == 1 and 1 <= len(upstream.requests) <= 2
    assert all(OLDEST.encode() not in r.body for r in upstream.requests[1:])


# -- the refold raises in its thread ----------------------------------------------------------------


async def test_a_refold_that_raises_in_its_thread_answers_as_on_the_loop_and_keeps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same at 563aba6 (the refold raised in a worker thread) as on the loop: the gateway's 500, the
    # upstream not asked again, and nothing (no traceback's frames) keeps the refold's parse.
    gated = Gated(raises=lambda: RuntimeError("the custom refold broke"))
    gated.gate.set()
    # pytest keeps each log record, with its exc_info (the traceback's frames): no record, no such holder.
    for name in ("asgi_lifetime.gateway", "uvicorn.error"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)
    with raw_upstream(overflowing()) as upstream:
        app = gateway(upstream.url, gated)
        with serve_in_thread(app) as url, collector_off():
            answer = await post(url, conversation("broken", 512 * KiB))
            await assert_idle(app, url)
            assert gated.alive() == 0
    assert gated.calls == 1 and len(upstream.requests) == 1
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"


# -- the retry policy around a refold ----------------------------------------------------------------


class Clock:
    """The upstream client's clock, moved by the refold: "the refold took this long", without a wait."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("rename", [False, True], ids=["refold", "role-rename"])
async def test_the_reshaped_body_is_not_sent_once_the_retry_deadline_passed_while_it_was_built(rename: bool) -> None:
    # RETRY_DEADLINE is "seconds all attempts of one request may take": it was checked before the refold
    # (or role rename) only, and one that ran past it (a large body's) still sent the new body. Now the
    # client gets the upstream's error, as when the deadline passed before the refold.
    prepared = await chat(unit_conversation(240, system_role="developer" if rename else "system"))
    attribute = "remap_role" if rename else "refold"
    reshape = getattr(prepared, attribute)
    reject = DEVELOPER_REJECTED if rename else OVERFLOW
    clock = Clock()
    settings = make_settings(retry_deadline=5.0)

    def slow(*args: Any) -> bytes | None:
        clock.now += settings.retry_deadline + 1
        return reshape(*args)  # type: ignore[no-any-return]

    setattr(prepared, attribute, slow)
    recorder, lifetime = Recorder(), Lifetime(settings)
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.post(PATH).mock(side_effect=[httpx.Response(400, json=reject), httpx.Response(200, json=OK)])
        async with make_upstream(recorder, settings, lifetime=lifetime) as upstream:
            upstream._clock = clock
            answer = await upstream.forward(prepared, on_retries_settled=lambda: None)
            assert answer.status_code == 400 and json.loads(await answer.aread()) == reject
            await answer.aclose()
    assert route.call_count == 1
    # Not counted nor reported as made: the refold (or rename) nobody sent.
    assert lifetime.counters.refolded == 0
    assert [event.kind for event in recorder.events] == ["settled"]


@pytest.mark.parametrize("max_attempts", [1, 2])
async def test_no_refold_runs_on_the_last_attempt(max_attempts: int) -> None:
    # An upstream that rejects every body: with one attempt nothing is refolded; with two, one refold,
    # and the second rejection goes to the client without a refold nobody would send.
    error = json.dumps(OVERFLOWS["openai"]).encode()
    gated = Gated()
    gated.gate.set()
    with raw_upstream(lambda _: [response(400, error, headers=(("content-type", "application/json"),))]) as upstream:
        app = gateway(upstream.url, gated, max_attempts=max_attempts)
        with serve_in_thread(app) as url:
            answer = await post(url, conversation("last", 512 * KiB))
            await assert_idle(app, url)
    assert answer.status_code == 400 and answer.json() == OVERFLOWS["openai"]
    assert len(upstream.requests) == max_attempts
    assert gated.calls == max_attempts - 1


# -- graceful shutdown while the refold runs ---------------------------------------------------------


async def test_a_shutdown_during_the_refold_ends_the_request_and_leaves_the_gateway_idle() -> None:
    # Draining with no grace left, asked while the refold holds the loop: the request ends with its
    # answer or, if the drain ends the relay first, a 503 before any byte; either way it settles.
    gated = Gated()
    answers: list[httpx.Response] = []

    async def client(url: str) -> None:
        answers.append(await post(url, conversation("stop", 512 * KiB)))

    try:
        with raw_upstream(overflowing()) as upstream:
            app = gateway(upstream.url, gated, shutdown_grace=0.0, drain_delay=0.0)
            with serve_in_thread(app) as url, collector_off():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client, url)
                    await wait_for(gated.started)
                    request_shutdown()
                    gated.gate.set()
                await assert_idle(app, url)
                assert gated.alive() == 0
    finally:
        reset_shutdown()
    [answer] = answers
    if answer.status_code == 503:
        assert answer.json()["error"]["code"] == "shutting_down"
    else:
        assert answer.status_code == 200 and answer_text(answer.content) == "answer: ask stop"


# -- many large refolds at once, beside small streams -------------------------------------------------


async def test_concurrent_large_refolds_each_answer_their_own_client_while_small_streams_go_on() -> None:
    sizes = [KiB * KiB * (1 + n % 4) for n in range(12)]
    with raw_upstream(overflowing()) as upstream:
        app = gateway(upstream.url, max_attempts=3)
        with serve_in_thread(app) as url:
            large: dict[str, str] = {}
            small: list[str] = []
            done = anyio.Event()

            async def one(tag: str, size: int) -> None:
                answer = await post(url, conversation(tag, size))
                assert answer.status_code == 200, answer.content[:200]
                large[tag] = answer_text(answer.content)

            async def smalls() -> None:
                n = 0
                while not done.is_set():
                    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"small {n}"}]}
                    answer = await post(url, body)
                    small.append(answer_text(answer.content))
                    n += 1

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(smalls)
                    async with anyio.create_task_group() as bigs:
                        for n, size in enumerate(sizes):
                            bigs.start_soon(one, f"big-{n}", size)
                    done.set()
            stats = await assert_idle(app, url)
    assert large == {f"big-{n}": f"answer: ask big-{n}" for n in range(len(sizes))}
    assert small and small == [f"answer: small {n}" for n in range(len(small))]
    refolded = [r.body for r in upstream.requests if b"big-" in r.body and OLDEST.encode() not in r.body]
    # Each refolded body went out once, and holds one conversation only (its own tag, no other's).
    tags = sorted(asked(body) for body in refolded)
    assert tags == sorted(f"ask big-{n}" for n in range(len(sizes)))
    for body in refolded:
        tag = asked(body).removeprefix("ask ")
        assert body.count(b"big-") == body.count(tag.encode())
    assert stats["refolded"] == len(sizes)


# -- a refold, then the re-issue of a stream whose first event is the transient error -----------------


@pytest.mark.parametrize("retain", ["off", "memory", "disk"])
async def test_the_reissue_after_a_refold_sends_the_refolded_body(retain: RetainOutbound) -> None:
    error = json.dumps(OVERFLOWS["anthropic"]).encode()
    transient = SSE_HEAD + chunk(CHAT_ERROR_EVENT) + b"0\r\n\r\n"

    def answer(request: RawRequest) -> Script:
        if OLDEST.encode() in request.body:
            return [response(400, error, headers=(("content-type", "application/json"),))]
        if len(upstream.requests) == 2:  # the refolded body's first answer: the error in band
            return [transient]
        return [sse_answer(f"answer: {asked(request.body)}")]

    with raw_upstream(answer) as upstream:
        app = gateway(upstream.url, retain_outbound=retain, retain_spill_bytes=0, max_attempts=3)
        with serve_in_thread(app) as url:
            got = await post(url, conversation("again", 512 * KiB))
            await assert_idle(app, url)
    bodies = [r.body for r in upstream.requests]
    assert OLDEST.encode() in bodies[0] and OLDEST.encode() not in bodies[1]
    if retain == "off":
        assert len(bodies) == 2 and CHAT_ERROR_EVENT in got.content
    else:
        assert len(bodies) == 3 and bodies[2] == bodies[1]  # the refolded body, from memory or the file
        assert answer_text(got.content) == "answer: ask again"


# -- the SDKs, with a large conversation the upstream first finds too long ----------------------------


def sdk_upstream(path_events: dict[str, bytes], shape: str) -> Callable[[RawRequest], Script]:
    error = json.dumps(OVERFLOWS[shape]).encode()

    def answer(request: RawRequest) -> Script:
        if OLDEST.encode() in request.body:
            return [response(400, error, headers=(("content-type", "application/json"),))]
        return [SSE_HEAD + chunk(path_events[request.target]) + b"0\r\n\r\n"]

    return answer


def openai_text(url: str) -> str:
    # The synchronous client, in a thread: under trio the async one leaves its stream's async generators
    # to the garbage collector (ResourceWarning), whatever closes it.
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client:
        big = conversation("sdk", 512 * KiB)
        with client.chat.completions.create(model="m", messages=big["messages"], stream=True) as stream:
            return "".join(part.choices[0].delta.content or "" for part in stream if part.choices)


def anthropic_text(url: str) -> str:
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as client:
        messages = conversation("sdk", 512 * KiB)["messages"][1:]  # Anthropic: no system turn in them
        with client.messages.stream(model="claude", max_tokens=16, system="be brief", messages=messages) as stream:
            return stream.get_final_text()


SDKS: dict[str, tuple[str, Callable[[], list[tuple[str | None, Any]]], Callable[[str], str]]] = {
    # name: (the path it posts to, the upstream's events, the SDK call giving the answer's text)
    "openai": (PATH, lambda: chat_chunks("m"), openai_text),
    "anthropic": (ANTHROPIC_PATH, lambda: anthropic_events("claude"), anthropic_text),
}


@pytest.mark.parametrize("sdk", SDKS)
async def test_an_sdk_gets_the_answer_of_a_refolded_conversation(sdk: str) -> None:
    path, events_of, ask = SDKS[sdk]
    events = b"".join(sse_frame(name, data) for name, data in events_of())
    with raw_upstream(sdk_upstream({path: events}, sdk)) as upstream:
        app = gateway(upstream.url)
        with serve_in_thread(app) as url:
            text = await anyio.to_thread.run_sync(ask, url)
            await assert_idle(app, url)
    assert text.strip() == TEXT
    assert len(upstream.requests) == 2 and OLDEST.encode() not in upstream.requests[1].body
