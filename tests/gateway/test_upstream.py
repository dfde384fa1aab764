from __future__ import annotations

import email.utils
import gc
import json
import random
import time
import types
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import respx

from asgi_lifetime import Lifetime, _json
from asgi_lifetime._exceptions import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._resources import RequestResources
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway._prepare import Draft, Prepared, prepare
from asgi_lifetime.gateway._upstream import AttemptEvent, UpstreamClient

pytestmark = pytest.mark.anyio

BASE = "http://upstream.test"
PATH = "/v1/chat/completions"
FILLER = "lorem ipsum dolor sit amet " * 20

OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 1000 tokens. However, your messages resulted in "
        "1700 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
DEVELOPER_REJECTED = {"object": "error", "message": "Unexpected role 'developer'", "type": "BadRequestError"}
SYSTEM_REJECTED = {"object": "error", "message": "System role not supported", "type": "BadRequestError"}
OK = {"id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "hello"}}]}


def make_settings(**changes: Any) -> LifetimeSettings:
    base: dict[str, Any] = {"max_attempts": 4, "backoff_base": 0.01, "backoff_max": 0.05, "headers_timeout": 5.0}
    return LifetimeSettings(**{**base, **changes})


class Recorder:
    """Stands in for the sleep, the settle callback and the listener; keeps one ordered log."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.sleeps: list[float] = []
        self.settled = 0
        self.events: list[AttemptEvent] = []

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.log.append("sleep")
        await anyio.lowlevel.checkpoint()

    def on_settled(self) -> None:
        self.settled += 1
        self.log.append("settled")

    def listen(self, event: AttemptEvent) -> None:
        self.events.append(event)


def make_upstream(recorder: Recorder, settings: LifetimeSettings | None = None, **kwargs: Any) -> UpstreamClient:
    kwargs.setdefault("base_url", BASE)
    upstream = UpstreamClient(settings=settings or make_settings(), listener=recorder.listen, **kwargs)
    upstream._sleep = recorder.sleep
    return upstream


def simple(body: bytes = b'{"prompt": "hi"}') -> Prepared:
    return Prepared(method="POST", path=PATH, headers=[("content-type", "application/json")], body=body)


def conversation(turns: int = 4, *, system_role: str = "system") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": system_role, "content": "be brief"}]
    for n in range(1, turns + 1):
        messages.append({"role": "user", "content": f"turn {n} " + FILLER})
        if n == 2:
            call = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": "call_2", "content": "result " + FILLER})
        messages.append({"role": "assistant", "content": f"answer {n} " + FILLER})
    messages.append({"role": "user", "content": "last question"})
    return {"model": "m", "messages": messages}


async def chat(doc: dict[str, Any]) -> Prepared:
    raw = _json.dumps(doc)
    return await prepare(
        raw,
        _json.loads(raw),
        preparers=[],
        fingerprint=fingerprint(raw),
        session_id=None,
        method="POST",
        path=PATH,
        headers=[("content-type", "application/json")],
        resources=RequestResources(Counters()),
    )


class Tracked(httpx.AsyncByteStream):
    """A response body that records how much was pulled and when it was closed."""

    def __init__(self, chunks: list[bytes], log: list[str] | None = None, name: str = "") -> None:
        self.chunks = chunks
        self.pulled = 0
        self.closed = False
        self.log = log if log is not None else []
        self.name = name

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.closed:  # like a connection: nothing more arrives once it is closed
                raise httpx.ReadError("connection closed")
            self.pulled += 1
            yield chunk

    async def aclose(self) -> None:
        self.closed = True
        self.log.append(f"close {self.name}")


def mock(handler: Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def sent_messages(route: respx.Route, n: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = json.loads(route.calls[n].request.content)["messages"]
    return messages


# --- success and the retryable kinds -----------------------------------------------------------


async def test_success_settles_once_before_returning_an_open_response() -> None:
    recorder = Recorder()
    prepared = await chat(conversation())
    seen: list[tuple[object, object]] = []

    def on_settled() -> None:
        seen.append((prepared.refold, prepared.body))
        recorder.on_settled()

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).respond(200, json=OK)
        async with make_upstream(recorder, make_settings(retain_outbound=False)) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=on_settled)
            recorder.log.append("returned")
            assert not response.is_closed
            assert json.loads(await response.aread()) == OK
            await response.aclose()
    assert recorder.settled == 1
    assert recorder.log == ["settled", "returned"]
    assert seen == [(None, None)]  # settled (closures and body dropped) before the callback ran
    assert [e.kind for e in recorder.events] == ["settled"]
    assert recorder.events[0] == AttemptEvent("settled", 1, 200, "status 200")


@pytest.mark.parametrize("status", [429, 502, 503, 504, 529])
async def test_retryable_status_then_success(status: int) -> None:
    recorder = Recorder()
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=[httpx.Response(status), httpx.Response(200, json=OK)])
        async with make_upstream(recorder, lifetime=lifetime) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert response.status_code == 200
    assert route.call_count == 2
    assert counters.retried == 1
    assert len(recorder.sleeps) == 1 and 0 <= recorder.sleeps[0] <= 0.01
    assert [(e.kind, e.status) for e in recorder.events] == [("retry", status), ("settled", 200)]
    assert recorder.settled == 1


@pytest.mark.parametrize(
    "error",
    [httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteTimeout, httpx.RemoteProtocolError, httpx.ReadError],
)
async def test_transport_error_then_success(error: type[httpx.TransportError]) -> None:
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=[error("boom"), httpx.Response(200, json=OK)])
        async with make_upstream(recorder) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert response.status_code == 200 and route.call_count == 2
    assert recorder.events[0].kind == "retry" and recorder.events[0].reason == error.__name__
    assert recorder.settled == 1


@pytest.mark.parametrize(("method", "calls"), [("POST", 1), ("GET", 2)])
async def test_a_read_timeout_after_the_request_was_sent_is_not_retried(method: str, calls: int) -> None:
    """The upstream had the whole request and may be generating the answer (a non-streamed answer
    sends no headers until it is done): sending it again would bill it twice. GET is safe to repeat."""
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.route(method=method, path=PATH).mock(
            side_effect=[httpx.ReadTimeout("timed out"), httpx.Response(200, json=OK)]
        )
        async with make_upstream(recorder) as upstream:
            prepared = simple() if method == "POST" else Prepared(method="GET", path=PATH, headers=[], body=None)
            if calls == 1:
                with pytest.raises(UpstreamTimeout):
                    await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            else:
                response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
                await response.aclose()
    assert route.call_count == calls and recorder.settled == 1


@pytest.mark.parametrize(
    "headers",
    [{"x-should-retry": "false"}, {"retry-after": "100"}, {"retry-after-ms": "100000"}],
    ids=["should-retry-false", "retry-after-over-cap", "retry-after-ms-over-cap"],
)
async def test_the_upstreams_own_retry_advice_is_followed(headers: dict[str, str]) -> None:
    """``x-should-retry: false``, or a wait over RETRY_AFTER_CAP with nowhere else to go: the
    answer goes to the client as the upstream sent it (the SDKs honour both), after one attempt."""
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        route = router.post(PATH).mock(side_effect=[httpx.Response(429, headers=headers), httpx.Response(200)])
        async with make_upstream(recorder, make_settings(retry_after_cap=5.0)) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert response.status_code == 429 and route.call_count == 1 and recorder.sleeps == []
    assert all(response.headers[name] == value for name, value in headers.items())
    if "x-should-retry" not in headers:
        assert "x-should-retry" not in response.headers  # the client may wait and retry


async def test_retry_after_ms_is_read_before_retry_after() -> None:
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(
            side_effect=[
                httpx.Response(503, headers={"retry-after-ms": "1500", "retry-after": "1"}),
                httpx.Response(200),
            ]
        )
        async with make_upstream(recorder, make_settings(retry_after_cap=5.0)) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert recorder.sleeps == [1.5]


async def test_discarded_responses_are_closed_before_the_next_attempt() -> None:
    recorder = Recorder()
    streams: list[Tracked] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        n = len(streams) + 1
        recorder.log.append(f"send {n}")
        streams.append(Tracked([b"busy" if n < 3 else b"ok"], recorder.log, str(n)))
        return httpx.Response(503 if n < 3 else 200, stream=streams[-1])

    async with make_upstream(recorder, transport=mock(handler)) as upstream:
        response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
        assert await response.aread() == b"ok"
        await response.aclose()
    assert recorder.log == ["send 1", "close 1", "sleep", "send 2", "close 2", "sleep", "send 3", "settled", "close 3"]


async def test_retry_after_seconds_is_honoured_and_capped() -> None:
    recorder = Recorder()
    settings = make_settings(retry_after_cap=5.0)
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(
            side_effect=[
                httpx.Response(503, headers={"Retry-After": "3"}),
                httpx.Response(429, headers={"Retry-After": "5"}),
                httpx.Response(503, headers={"Retry-After": "soon"}),
                httpx.Response(200),
            ]
        )
        async with make_upstream(recorder, settings) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert recorder.sleeps[0] == 3.0
    assert recorder.sleeps[1] == 5.0  # at the cap (over it, the answer goes to the client)
    assert 0 <= recorder.sleeps[2] <= 0.04  # unparseable: jitter only (third backoff, ceiling 0.04)
    assert [e.delay for e in recorder.events if e.kind == "retry"] == recorder.sleeps


async def test_retry_after_http_date() -> None:
    recorder = Recorder()
    when = email.utils.formatdate(time.time() + 20, usegmt=True)
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(side_effect=[httpx.Response(503, headers={"Retry-After": when}), httpx.Response(200)])
        async with make_upstream(recorder) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert 17.0 <= recorder.sleeps[0] <= 20.0


class Highest:
    def uniform(self, low: float, high: float) -> float:
        return high


async def test_backoff_is_exponential_full_jitter_up_to_backoff_max() -> None:
    settings = make_settings(max_attempts=6, backoff_base=1.0, backoff_max=4.0)
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).respond(503)
        highest = Recorder()
        async with make_upstream(highest, settings) as upstream:
            upstream._random = Highest()  # type: ignore[assignment]
            await (await upstream.forward(simple(), on_retries_settled=highest.on_settled)).aclose()
        sampled = Recorder()
        async with make_upstream(sampled, settings.replace(max_attempts=40)) as upstream:
            upstream._random = random.Random(7)
            await (await upstream.forward(simple(), on_retries_settled=sampled.on_settled)).aclose()
    assert highest.sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(0 <= d <= min(4.0, 2.0**n) for n, d in enumerate(sampled.sleeps))
    assert len(set(sampled.sleeps)) == len(sampled.sleeps)  # jittered, not fixed


async def test_max_attempts_returns_the_last_status_response_open() -> None:
    recorder = Recorder()
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(
            side_effect=[httpx.Response(503, content=f"busy {n}".encode()) for n in range(1, 4)]
        )
        async with make_upstream(recorder, make_settings(max_attempts=3), lifetime=lifetime) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            assert not response.is_closed
            assert await response.aread() == b"busy 3"
            await response.aclose()
    assert route.call_count == 3 and counters.retried == 2 and len(recorder.sleeps) == 2
    assert recorder.settled == 1
    assert recorder.events[-1] == AttemptEvent("settled", 3, 503, "status 503")


async def test_deadline_stops_before_sleeping_past_it() -> None:
    now = [0.0]
    recorder = Recorder()

    async def sleep(delay: float) -> None:
        recorder.sleeps.append(delay)
        now[0] += delay

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(503, headers={"Retry-After": "4"})
        upstream = make_upstream(recorder, make_settings(max_attempts=10, retry_deadline=10.0))
        upstream._sleep, upstream._clock = sleep, lambda: now[0]
        async with upstream:
            response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            await response.aclose()
        # Attempts at t=0, 4 and 8; one more would have meant sleeping until t=12.
        assert recorder.sleeps == [4.0, 4.0] and route.call_count == 3
        assert response.status_code == 503 and recorder.settled == 1

        late = Recorder()
        async with make_upstream(late, make_settings(retry_deadline=3.0)) as upstream:
            response = await upstream.forward(simple(), on_retries_settled=late.on_settled)
            await response.aclose()
        assert late.sleeps == [] and route.call_count == 4  # Retry-After 4 > deadline 3: no retry at all


# --- exhausted transport errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "raised", "code"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused"), UpstreamUnreachable, 502),
        (httpx.RemoteProtocolError("Server disconnected without sending a response."), UpstreamUnreachable, 502),
        (httpx.ConnectTimeout("timed out"), UpstreamTimeout, 504),
        (httpx.WriteTimeout("timed out"), UpstreamTimeout, 504),
    ],
)
async def test_exhausted_transport_errors_raise(
    error: Exception, raised: type[UpstreamTimeout | UpstreamUnreachable], code: int
) -> None:
    recorder = Recorder()
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    body = b'{"prompt": "secret-body-text"}'
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=error)
        async with make_upstream(recorder, make_settings(max_attempts=3), lifetime=lifetime) as upstream:
            with pytest.raises(raised) as info:
                await upstream.forward(simple(body), on_retries_settled=recorder.on_settled)
    assert route.call_count == 3 and counters.retried == 2 and recorder.settled == 1
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert info.value.status_code == code
    assert type(error).__name__ in str(info.value) and "3 attempts" in str(info.value)
    assert "secret" not in str(info.value)


async def test_a_request_our_own_client_refuses_is_not_retried() -> None:
    """httpx raises LocalProtocolError for a request it will not send (h11's checks, before anything is
    sent): every attempt would fail the same way, and the upstream is not to blame. Before: retried
    MAX_ATTEMPTS times, then 502 "upstream unreachable (LocalProtocolError) after 4 attempts"."""
    recorder = Recorder()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=httpx.LocalProtocolError("Illegal header value b'a\\x00b'"))
        async with make_upstream(recorder) as upstream:
            with pytest.raises(UpstreamError) as info:
                await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
            [state] = upstream.describe()
    assert route.call_count == 1 and recorder.sleeps == [] and recorder.settled == 1
    assert not isinstance(info.value, UpstreamUnreachable | UpstreamTimeout)
    assert info.value.status_code == 502 and info.value.code == "request_unsendable"
    assert "unreachable" not in str(info.value) and "LocalProtocolError" in str(info.value)
    assert "Illegal header" not in str(info.value)  # h11's message quotes the value, which may be a key
    assert state["down_for"] is None  # the upstream is not put in cool-off for our own refusal


async def test_headers_timeout_is_enforced_per_attempt() -> None:
    recorder = Recorder()

    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(10)
        raise AssertionError("unreachable")

    settings = make_settings(max_attempts=2, headers_timeout=0.05)
    async with make_upstream(recorder, settings, transport=mock(handler)) as upstream:
        with anyio.fail_after(5):
            with pytest.raises(UpstreamTimeout, match="no response headers within 0.05s"):
                await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
    assert len(recorder.sleeps) == 1 and recorder.settled == 1


# --- refold ------------------------------------------------------------------------------------


async def test_overflow_refolds_and_sends_a_smaller_body() -> None:
    recorder = Recorder()
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    prepared = await chat(conversation())
    first = prepared.body
    assert first is not None
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(side_effect=[httpx.Response(400, json=OVERFLOW), httpx.Response(200, json=OK)])
        async with make_upstream(recorder, lifetime=lifetime) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert response.status_code == 200
    assert route.calls[0].request.content == first
    second = route.calls[1].request.content
    assert len(second) < len(first) and len(second) / 4 <= 1000 * 0.9
    messages = sent_messages(route, 1)
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[-1] == {"role": "user", "content": "last question"}
    assert "turn 1" not in second.decode()
    calls = [c["id"] for m in messages for c in m.get("tool_calls") or []]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert calls == results
    assert counters.refolded == 1 and counters.retried == 0 and recorder.sleeps == []
    assert [e.kind for e in recorder.events] == ["refold", "settled"]
    assert int(route.calls[1].request.headers["content-length"]) == len(second)


async def test_second_overflow_shrinks_further_on_413() -> None:
    recorder = Recorder()
    prepared = await chat(conversation(turns=6))
    too_large = {"type": "error", "error": {"type": "invalid_request_error", "message": "Prompt is too long"}}
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(
            side_effect=[httpx.Response(413, json=too_large), httpx.Response(413, json=too_large), httpx.Response(200)]
        )
        async with make_upstream(recorder) as upstream:
            await (await upstream.forward(prepared, on_retries_settled=recorder.on_settled)).aclose()
    sizes = [len(call.request.content) for call in route.calls]
    assert sizes[0] > sizes[1] > sizes[2]
    assert sizes[2] <= sizes[1] * 0.75 + 1


async def test_refold_gives_up_and_relays_the_original_error_byte_for_byte() -> None:
    recorder = Recorder()
    prepared = await chat({"model": "m", "messages": [{"role": "user", "content": "only " + FILLER}]})
    error = json.dumps(OVERFLOW, indent=2).encode()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(400, content=error, headers={"x-request-id": "req_1"})
        async with make_upstream(recorder) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            assert await response.aread() == error
            await response.aclose()
    assert route.call_count == 1
    assert response.status_code == 400
    assert response.headers["x-request-id"] == "req_1"
    assert response.headers["content-length"] == str(len(error))
    assert recorder.settled == 1


async def test_error_body_is_read_up_to_the_limit_only() -> None:
    recorder = Recorder()
    prepared = await chat(conversation())
    stream = Tracked([b"x" * 32] * 100)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, headers={"content-encoding": "identity"}, stream=stream)

    settings = make_settings(error_body_limit=80)
    async with make_upstream(recorder, settings, transport=mock(handler)) as upstream:
        response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
        error = json.loads(await response.aread())["error"]
    # Cut at the limit: not relayed as if complete, but as an honest error carrying what was read.
    assert error["code"] == "upstream_error_incomplete"
    assert set(error["upstream_body"]) <= {"x"}  # as much as fits the limit (here: none)
    assert stream.pulled == 3 and stream.closed
    assert "content-encoding" not in response.headers
    assert response.headers["content-type"] == "application/json"


# --- role compatibility ------------------------------------------------------------------------


async def test_role_ladder_developer_system_user() -> None:
    recorder = Recorder()
    prepared = await chat(conversation(turns=1, system_role="developer"))
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(
            side_effect=[
                httpx.Response(400, json=DEVELOPER_REJECTED),
                httpx.Response(400, json=SYSTEM_REJECTED),
                httpx.Response(200, json=OK),
            ]
        )
        async with make_upstream(recorder) as upstream:
            await (await upstream.forward(prepared, on_retries_settled=recorder.on_settled)).aclose()
    assert [sent_messages(route, n)[0]["role"] for n in range(3)] == ["developer", "system", "user"]
    assert [e.kind for e in recorder.events] == ["role", "role", "settled"]
    assert recorder.sleeps == []


async def test_rejected_system_role_goes_to_user_and_the_ladder_ends() -> None:
    recorder = Recorder()
    prepared = await chat(conversation(turns=1))
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(
            side_effect=[httpx.Response(400, json=SYSTEM_REJECTED), httpx.Response(400, json=SYSTEM_REJECTED)]
        )
        async with make_upstream(recorder) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            assert json.loads(await response.aread()) == SYSTEM_REJECTED
    assert [sent_messages(route, n)[0]["role"] for n in range(2)] == ["system", "user"]


async def test_attempts_of_every_kind_share_max_attempts() -> None:
    recorder = Recorder()
    prepared = await chat(conversation(system_role="developer"))
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).mock(
            side_effect=[
                httpx.Response(503),
                httpx.Response(400, json=DEVELOPER_REJECTED),
                httpx.Response(400, json=OVERFLOW),
            ]
        )
        async with make_upstream(recorder, make_settings(max_attempts=3)) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            assert json.loads(await response.aread()) == OVERFLOW  # no attempt left to refold
    assert route.call_count == 3
    assert [e.kind for e in recorder.events] == ["retry", "role", "settled"]


# --- final statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 400, 401, 404, 413, 422, 500, 501])
async def test_other_statuses_are_final(status: int) -> None:
    recorder = Recorder()
    prepared = await chat(conversation())
    body = json.dumps({"error": {"message": "Invalid value for 'temperature'", "status": status}}).encode()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        route = router.post(PATH).respond(status, content=body)
        async with make_upstream(recorder) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            assert await response.aread() == body
            await response.aclose()
    assert route.call_count == 1 and response.status_code == status
    assert recorder.sleeps == [] and recorder.settled == 1


async def test_a_400_without_refold_or_remap_is_returned_unread() -> None:
    recorder = Recorder()
    stream = Tracked([b'{"error": ', b'"bad"}'])

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, stream=stream)

    async with make_upstream(recorder, transport=mock(handler)) as upstream:
        response = await upstream.forward(simple(), on_retries_settled=recorder.on_settled)
        assert stream.pulled == 0
        assert await response.aread() == b'{"error": "bad"}'
        await response.aclose()


# --- settlement on every path ------------------------------------------------------------------


async def test_settles_once_when_the_transport_raises() -> None:
    recorder = Recorder()

    async def handler(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("transport bug")

    prepared = await chat(conversation())
    async with make_upstream(recorder, transport=mock(handler)) as upstream:
        with pytest.raises(RuntimeError, match="transport bug"):
            await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
    assert recorder.settled == 1
    assert prepared.settled and prepared.refold is None
    assert recorder.events[-1] == AttemptEvent("settled", 1, None, "no response")


async def test_settles_once_when_cancelled_during_backoff() -> None:
    settled: list[str] = []
    stream = Tracked([b"busy"])

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "10"}, stream=stream)

    prepared = await chat(conversation())
    async with UpstreamClient(settings=make_settings(), base_url=BASE, transport=mock(handler)) as upstream:
        with anyio.move_on_after(0.1) as scope:
            await upstream.forward(prepared, on_retries_settled=lambda: settled.append("settled"))
    assert scope.cancelled_caught
    assert settled == ["settled"]
    assert stream.closed
    assert prepared.refold is None and prepared.remap_role is None


async def test_forward_twice_is_refused() -> None:
    recorder = Recorder()
    prepared = simple()
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).respond(200)
        async with make_upstream(recorder) as upstream:
            await (await upstream.forward(prepared, on_retries_settled=recorder.on_settled)).aclose()
            with pytest.raises(RuntimeError, match="already forwarded"):
                await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
    assert recorder.settled == 1


async def test_a_failing_listener_does_not_break_forwarding() -> None:
    def listener(event: AttemptEvent) -> None:
        raise ValueError("listener bug")

    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(side_effect=[httpx.Response(503), httpx.Response(200)])
        upstream = UpstreamClient(settings=make_settings(), base_url=BASE, listener=listener)
        async with upstream:
            response = await upstream.forward(simple(), on_retries_settled=lambda: None)
            await response.aclose()
    assert response.status_code == 200


# --- release proof -----------------------------------------------------------------------------


class Message(dict[str, Any]):
    """A dict that can be weakly referenced."""


class StreamingTransport(httpx.AsyncBaseTransport):
    """Sends the body the way a real transport does: iterating request.stream, never Request.aread()."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        self.sent.append(len(b"".join([chunk async for chunk in request.stream])))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Tracked([b"data: 1\n\n"]))


def reaches(root: object, target: object) -> bool:
    """Whether ``target`` is reachable from ``root`` through object references (not module globals)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FrameType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ())
        else:
            stack.extend(gc.get_referents(obj))
    return False


def holders(target: object) -> list[object]:
    """What refers to ``target``, except the test itself (its frame, or its coroutine holding the frame)."""

    def is_the_test(r: object) -> bool:
        return isinstance(r, types.FrameType) or (
            isinstance(r, types.CoroutineType) and r.cr_code.co_name.startswith("test_")
        )

    return [r for r in gc.get_referrers(target) if not is_the_test(r)]


async def release_case(retain: bool) -> tuple[Prepared, httpx.Response, bytes, list[weakref.ref[Any]]]:
    graph: list[weakref.ref[Any]] = []

    def rewrite(draft: Draft) -> None:  # so the outbound body is a fresh object held by Prepared alone
        draft.body["model"] = "routed"
        draft.mark_changed()

    messages = [Message(role="system", content="s")]
    messages += [Message(role="user" if n % 2 == 0 else "assistant", content=f"{n} {FILLER}") for n in range(6)]
    graph += [weakref.ref(m) for m in messages]
    raw = _json.dumps({"model": "m", "messages": messages})
    prepared = await prepare(
        raw,
        {"model": "m", "messages": messages},
        preparers=[rewrite],
        fingerprint=fingerprint(raw),
        session_id=None,
        method="POST",
        path=PATH,
        headers=[],
        resources=RequestResources(Counters()),
    )
    del messages, raw  # the caller drops its own references
    assert prepared.refold is not None
    graph.append(weakref.ref(prepared.refold))
    body = prepared.body
    assert isinstance(body, bytes)  # re-serialized: a small parse, not a splice
    transport = StreamingTransport()
    upstream = UpstreamClient(settings=make_settings(retain_outbound=retain), base_url=BASE, transport=transport)
    response = await upstream.forward(prepared, on_retries_settled=lambda: None)
    assert transport.sent == [len(body)]
    return prepared, response, body, graph


async def test_nothing_of_the_input_is_reachable_after_settling_without_retain() -> None:
    prepared, response, body, graph = await release_case(retain=False)
    assert not response.is_closed
    assert [ref() for ref in graph] == [None] * len(graph)  # parsed graph and refold closure are gone
    assert prepared.body is None
    assert not reaches(response, body)  # response.request.stream reads from the (emptied) holder
    assert not reaches(prepared, body)
    assert holders(body) == []
    assert await response.aread() == b"data: 1\n\n"
    await response.aclose()


async def test_with_retain_the_body_is_reachable_through_prepared_only() -> None:
    prepared, response, body, graph = await release_case(retain=True)
    assert [ref() for ref in graph] == [None] * len(graph)
    assert prepared.body is body
    assert holders(body) == [prepared]
    assert reaches(response, body)  # via request.stream -> Prepared
    prepared.release_body()
    assert holders(body) == [] and not reaches(response, body)
    await response.aclose()


# --- client, URLs and headers ------------------------------------------------------------------


async def test_request_headers_and_url() -> None:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    client = httpx.AsyncClient(transport=mock(handler), headers={"authorization": "Bearer k", "x-env": "a"})
    prepared = Prepared(
        method="POST",
        path="/v1/chat/completions?stream=true",
        headers=[
            ("x-env", "b"),
            ("Content-Length", "999"),
            ("Host", "elsewhere"),
            ("content-type", "application/json"),
        ],
        body=b'{"a": 1}',
    )
    async with UpstreamClient(settings=make_settings(), base_url="http://up.test:8080/", client=client) as upstream:
        await (await upstream.forward(prepared, on_retries_settled=lambda: None)).aclose()
    assert not client.is_closed  # a client passed in is left open
    await client.aclose()
    request = seen[0]
    assert str(request.url) == "http://up.test:8080/v1/chat/completions?stream=true"
    assert request.headers["host"] == "up.test:8080"
    assert request.headers["content-length"] == "8"
    assert request.headers.get_list("x-env") == ["b"]
    assert request.headers["authorization"] == "Bearer k"
    assert request.content == b'{"a": 1}'


async def test_failed_base_url_is_skipped_on_the_next_attempt() -> None:
    hosts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if request.url.host == "a.test":
            raise httpx.ConnectError("refused")
        return httpx.Response(200)

    recorder = Recorder()
    upstream = make_upstream(recorder, base_url=["http://a.test", "http://b.test"], transport=mock(handler))
    async with upstream:
        await (await upstream.forward(simple(), on_retries_settled=recorder.on_settled)).aclose()
    assert hosts == ["a.test", "b.test"]
    # a refused the connect: it cools off, so sessions and sessionless requests go to b meanwhile.
    assert upstream._pool.is_down("http://a.test")
    assert upstream._choose(None, frozenset()) == "http://b.test"
    assert {upstream._choose(f"session-{i}", frozenset()) for i in range(20)} == {"http://b.test"}
    assert [s["inflight"] for s in upstream.describe()] == [0, 0]  # every attempt gave its slot back


async def test_owned_client_is_closed_with_the_upstream() -> None:
    upstream = UpstreamClient(settings=make_settings(upstream_url=("http://x.test",)))
    assert upstream._client.timeout.read is None
    assert upstream._client.timeout.connect == make_settings().connect_timeout
    await upstream.aclose()
    assert upstream._client.is_closed


def test_configuration_errors() -> None:
    settings = make_settings()
    with pytest.raises(ValueError, match="no upstream"):
        UpstreamClient(settings=settings)
    with pytest.raises(ValueError, match="either client= or transport="):
        UpstreamClient(settings=settings, base_url=BASE, client=httpx.AsyncClient(), transport=mock(None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_url='ftp://x'"):
        UpstreamClient(settings=settings, base_url="ftp://x")


async def test_over_a_real_loopback_connection() -> None:
    """httpcore accepts the holder-backed request (Host, Content-Length) and keeps no copy of the body."""
    received: list[bytes] = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
            while len(rest) < int(length[15:]):
                rest += await stream.receive()
            received.append(head + b"\r\n\r\n" + rest)
            await stream.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello")

    prepared = await chat(conversation())
    prepared.body = bytes(bytearray(bytes(prepared.body or b"")))  # a fresh object only the holder refers to
    body = prepared.body
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.start_soon(listener.serve, handle)
        settings = make_settings(retain_outbound=False)
        async with UpstreamClient(settings=settings, base_url=f"http://127.0.0.1:{port}") as upstream:
            response = await upstream.forward(prepared, on_retries_settled=lambda: None)
            assert holders(body) == []
            assert await response.aread() == b"hello"
            await response.aclose()
        tg.cancel_scope.cancel()
    head, _, sent = received[0].partition(b"\r\n\r\n")
    assert sent == body
    assert f"host: 127.0.0.1:{port}".encode() in head.lower()
    assert f"content-length: {len(body)}".encode() in head.lower()


# --- per-request work that the request does not need ---------------------------------------------


async def test_each_upstream_url_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same few URLs are built for every request: each is parsed once (httpx's parse was two thirds
    of building a request); one with a query (a client's key may travel there) or a long one every time."""
    parsed: list[str] = []
    real = httpx._urls.urlparse  # type: ignore[attr-defined]

    def counting(url: str = "", **kwargs: Any) -> Any:
        parsed.append(url)
        return real(url, **kwargs)

    monkeypatch.setattr(httpx._urls, "urlparse", counting)
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200)

    long_path = "/v1/" + "x" * 2000
    paths = [PATH] * 3 + ["/v1/chat/completions?key=secret"] * 2 + [long_path] * 2
    async with make_upstream(Recorder(), transport=mock(handler)) as upstream:
        for path in paths:
            prepared = Prepared(method="POST", path=path, headers=[], body=b"{}")
            await (await upstream.forward(prepared, on_retries_settled=lambda: None)).aclose()
    assert seen == [BASE + path for path in paths]
    assert parsed.count(BASE + PATH) == 1
    assert parsed.count(BASE + "/v1/chat/completions?key=secret") == 2
    assert parsed.count(BASE + long_path) == 2


async def test_the_gateways_own_client_keeps_no_cookies() -> None:
    """Every client's answers go through one httpx client: it keeps none of their cookies (httpx would
    store each Set-Cookie, wrapping every response for the cookie code first). A client passed in is
    the caller's, cookies and all."""

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=[("set-cookie", f"affinity={request.url.path}; Path=/")])

    async with make_upstream(Recorder(), transport=mock(handler)) as upstream:
        response = await upstream.forward(simple(), on_retries_settled=lambda: None)
        await response.aclose()
        assert response.headers["set-cookie"].startswith("affinity=")  # relayed to the client as it came
        assert len(upstream._client.cookies) == 0
    own = httpx.AsyncClient(transport=mock(handler))
    async with UpstreamClient(settings=make_settings(), base_url=BASE, client=own) as upstream:
        await (await upstream.forward(simple(), on_retries_settled=lambda: None)).aclose()
    assert len(own.cookies) == 1
    await own.aclose()


async def test_response_headers_are_kept_as_received_when_nothing_changes() -> None:
    """The response's headers are rebuilt only when the framing or the key scrubber changes them."""
    sent: list[httpx.Headers] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream", "x-id": "1"}
        response = httpx.Response(200, headers=headers, stream=Tracked([b"data: x\n\n"]))
        sent.append(response.headers)
        return response

    async with make_upstream(Recorder(), transport=mock(handler)) as upstream:
        received = []
        for _ in range(2):
            response = await upstream.forward(simple(), on_retries_settled=lambda: None)
            received.append(response.headers)
            await response.aclose()
    assert len(sent) == len(received) == 2
    assert all(mine is theirs for mine, theirs in zip(received, sent, strict=True))
