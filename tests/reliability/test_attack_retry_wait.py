"""A hostile or broken upstream against the wait read from a retryable status's error body.

A 429/502/503/504/529 without ``Retry-After`` is read for Google's ``google.rpc.RetryInfo``
(``_retry.body_wait``): the gateway (``create_app``) runs under uvicorn in front of a raw-socket
upstream (``tests/gateway/_raw_upstream.py``) answering scripted bytes; the client is httpx. What
is checked: how many requests the upstream saw (never one billed twice, the wait over the cap
relayed at once), what the client got, how long it took, and that nothing is held after.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from ..gateway._raw_upstream import HOLD, RawRequest, Script, chunked, raw_upstream, response
from .test_attack_upstream import KEY, chunk
from .test_faults import CHAT, PATH, assert_idle, running

pytestmark = pytest.mark.anyio

RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
OK = response(200, b'{"ok": true}', headers=(("content-type", "application/json"),))
# Within the cap a wait is waited; over it (the only upstream) the 429 goes to the client at once.
SETTINGS: dict[str, Any] = {"max_attempts": 2, "retry_after_cap": 1.0, "retry_deadline": 10.0}


def google(*details: object, status: int = 429) -> bytes:
    return json.dumps({"error": {"code": status, "status": "RESOURCE_EXHAUSTED", "details": list(details)}}).encode()


def retry_info(delay: object) -> dict[str, object]:
    return {"@type": RETRY_INFO, "retryDelay": delay}


def first_then_ok(first: Script, then: Script | None = None) -> Callable[[RawRequest], Script]:
    """``first`` answers the first request; every later one gets ``then`` (a 200)."""
    seen: list[RawRequest] = []

    def answer(request: RawRequest) -> Script:
        seen.append(request)
        return first if len(seen) == 1 else (then or [OK])

    return answer


def error(body: bytes, *, status: int = 429, headers: tuple[tuple[str, str], ...] = ()) -> Script:
    return [response(status, body, headers=(("content-type", "application/json"), *headers))]


async def post(url: str) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = time.monotonic()
        answer = await client.post(PATH, json=CHAT)
        return answer, time.monotonic() - started


# (body, status): over the cap, the upstream's answer goes to the client after one request;
# anything else is not a wait over the cap and the request is retried once.
OVER_THE_CAP = {
    "5s": google(retry_info("5s")),
    "spaces around": google(retry_info(" 3s ")),
    "400 nines (inf)": google(retry_info("9" * 400 + "s")),
    "first of two": google(retry_info("5s"), retry_info("0s")),
    "after another detail": google({"@type": "type.googleapis.com/google.rpc.QuotaFailure"}, retry_info("2s")),
    "502": google(retry_info("5s"), status=502),
    "503": google(retry_info("5s"), status=503),
    "504": google(retry_info("5s"), status=504),
    "529": google(retry_info("5s"), status=529),
}
NOT_OVER_THE_CAP = {
    "0s": google(retry_info("0s")),
    "1 ns": google(retry_info("0.000000001s")),
    "exponent": google(retry_info("1e3s")),
    "negative": google(retry_info("-5s")),
    "no unit": google(retry_info("3")),
    "a number": google(retry_info(3)),
    "nan": google(retry_info("nan")),
    "null": google(retry_info(None)),
    "a list": google(retry_info(["5s"])),
    "details a string": json.dumps({"error": {"details": f"{RETRY_INFO} 5s"}}).encode(),
    "details null": json.dumps({"error": {"details": None, "message": "RetryInfo"}}).encode(),
    "details an object": json.dumps({"error": {"details": retry_info("5s")}}).encode(),
    "nested @type": google({"inner": retry_info("5s")}),
    "spoofed outside error": json.dumps({"details": [retry_info("5s")], "error": {}}).encode(),
    "not JSON": b"<html>RetryInfo retryDelay 5s</html>",
    "deeply nested": b'{"error": {"details": ' + b"[" * 30_000 + b'"RetryInfo"' + b"]" * 30_000 + b"}}",
    "over ERROR_BODY_LIMIT": google(retry_info("5s"), {"pad": "x" * 70_000}),
}


@pytest.mark.parametrize(
    ("body", "status", "requests"),
    [pytest.param(body, json.loads(body)["error"]["code"], 1, id=name) for name, body in OVER_THE_CAP.items()]
    + [pytest.param(body, 429, 2, id=name) for name, body in NOT_OVER_THE_CAP.items()],
)
async def test_a_retry_delay_over_the_cap_is_relayed_anything_else_retried(
    body: bytes, status: int, requests: int
) -> None:
    with (
        raw_upstream(first_then_ok(error(body, status=status))) as upstream,
        running(upstream_url=upstream.url, error_body_limit=65536, **SETTINGS) as stack,
    ):
        answer, waited = await post(stack.url)
        assert len(upstream.requests) == requests
        if requests == 1:
            assert (answer.status_code, answer.content) == (status, body)
            assert "x-should-retry" not in answer.headers  # the client's SDK waits what was asked
        else:
            assert answer.json() == {"ok": True}
            assert waited < 5.0  # never the 5 s asked where it is not a RetryInfo wait
        await assert_idle(stack.app, stack.url)


async def test_an_error_body_dripped_under_the_stall_timeout_is_bounded_by_the_retry_deadline() -> None:
    """Each read of the body waits less than ``STALL_TIMEOUT``, and the body would take 20 s:
    ``RETRY_DEADLINE``, before ``STALL_TIMEOUT`` (which bounds the whole body too), bounds the request
    (the read for a wait is part of its attempts)."""
    head = b"HTTP/1.1 429 X\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    def piece() -> bytes:
        time.sleep(0.2)  # the upstream's own pace: just under STALL_TIMEOUT
        return chunk(b" ")

    def dripped() -> Script:
        return [head + chunk(b'{"error": {"details": ['), *[piece] * 100]  # 20 s in all

    with (
        raw_upstream(lambda request: dripped()) as upstream,
        running(upstream_url=upstream.url, **{**SETTINGS, "retry_deadline": 1.5, "stall_timeout": 10.0}) as stack,
    ):
        answer, waited = await post(stack.url)
        assert answer.status_code == 429  # the upstream's status, an honest "incomplete" error body
        assert answer.json()["error"]["code"] == "upstream_error_incomplete", waited
        assert "deadline" in answer.json()["error"]["message"], waited
        assert answer.headers["x-should-retry"] == "false"
        assert waited < 1.5 + 3.0, waited  # the body would take 20 s
        assert len(upstream.requests) == 1
        await assert_idle(stack.app, stack.url)


OVER = google(retry_info("5s"))
WITHIN = google(retry_info("0s"))
HEAD_429 = "HTTP/1.1 429 X\r\ncontent-type: application/json\r\n"
# Within the cap, read whole: the connection goes back to the pool for the retry.
READ_WHOLE = {
    "within, whole": error(WITHIN),
    "within, chunked": [(HEAD_429 + "transfer-encoding: chunked\r\n\r\n").encode() + chunked(WITHIN, size=7)],
}
BOMB = gzip.compress(b'{"error": {"details": [{"@type": "' + RETRY_INFO.encode() + b'", "x": "' + b" " * 8 * 2**20)


@pytest.mark.parametrize(
    ("first", "requests", "body"),
    [
        # A gzip body is decoded (and scrubbed) as a relayed error is: the client gets it decoded.
        pytest.param(error(gzip.compress(OVER), headers=(("content-encoding", "gzip"),)), 1, OVER, id="gzip"),
        # br is not decoded by the gateway: no wait is read from it, the status is retried.
        pytest.param(error(b"\x0b\x02\x80RetryInfo", headers=(("content-encoding", "br"),)), 2, None, id="br"),
        pytest.param(error(BOMB, headers=(("content-encoding", "gzip"),)), 2, None, id="gzip bomb"),
        pytest.param(error(b"RetryInfo, not gzip", headers=(("content-encoding", "gzip"),)), 2, None, id="not gzip"),
        pytest.param(error(OVER, headers=(("content-encoding", "zstd, gzip"),)), 2, None, id="unknown coding"),
        # Cut, stalled, or cut with a content-length promising more: incomplete, so no wait; retried.
        pytest.param([response(429, OVER)[:-10], "close"], 2, None, id="closed mid-body"),
        pytest.param([response(429, OVER)[:-10], HOLD], 2, None, id="stalled mid-body"),
        pytest.param(
            [(HEAD_429 + "transfer-encoding: chunked\r\n\r\n").encode() + chunk(OVER[:-1])],
            2,
            None,
            id="chunked, stalled",
        ),
        # Within the cap: waited, retried; the next request on the pooled connection gets its own bytes.
        *[pytest.param(script, 2, None, id=name) for name, script in READ_WHOLE.items()],
    ],
)
async def test_the_read_error_body(first: Script, requests: int, body: bytes | None) -> None:
    with (
        raw_upstream(first_then_ok(first)) as upstream,
        running(upstream_url=upstream.url, **SETTINGS) as stack,
    ):
        answer, _ = await post(stack.url)
        assert len(upstream.requests) == requests
        if body is None:
            assert answer.json() == {"ok": True}
            if first in READ_WHOLE.values():
                assert [r.connection for r in upstream.requests] == [0, 0]  # reused, its own bytes
        else:
            assert (answer.status_code, answer.content) == (429, body)
            assert answer.headers["content-length"] == str(len(body))
            assert "content-encoding" not in answer.headers and "transfer-encoding" not in answer.headers
        await assert_idle(stack.app, stack.url)


@pytest.mark.parametrize("header", [("retry-after", "0"), ("retry-after-ms", "0")])
async def test_a_wait_in_a_header_leaves_the_body_unread(header: tuple[str, str]) -> None:
    """With the wait in a header the body is not read: one that never ends costs nothing."""
    head = f"{HEAD_429}{header[0]}: {header[1]}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    with (
        raw_upstream(first_then_ok([head + chunk(b'{"error": {"details": ['), HOLD])) as upstream,
        running(upstream_url=upstream.url, **{**SETTINGS, "stall_timeout": 20.0}) as stack,
    ):
        answer, waited = await post(stack.url)
        assert answer.json() == {"ok": True}
        assert len(upstream.requests) == 2
        assert waited < 10.0  # not the 20 s stall
        assert upstream.released.wait(10.0)  # the first connection was closed, not kept half-read
        await assert_idle(stack.app, stack.url)


async def test_a_client_gone_during_the_read_closes_the_upstream() -> None:
    head = f"{HEAD_429}transfer-encoding: chunked\r\n\r\n".encode()
    with (
        raw_upstream(first_then_ok([head + chunk(b'{"error": {"details": ["RetryInfo"'), HOLD])) as upstream,
        running(upstream_url=upstream.url, **{**SETTINGS, "stall_timeout": 20.0, "retry_deadline": 20.0}) as stack,
    ):
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(PATH, json=CHAT, timeout=httpx.Timeout(60, read=0.5))
        assert upstream.released.wait(10.0)
        assert len(upstream.requests) == 1
        await assert_idle(stack.app, stack.url)


@pytest.mark.parametrize(
    "last",
    [error(OVER), error(b'{"error": {}}', headers=(("retry-after", "5"),))],
    ids=["RetryInfo", "Retry-After"],
)
async def test_a_wait_over_the_cap_on_the_last_attempt_is_the_clients(last: Script) -> None:
    """The last attempt's wait over the cap goes to the client unmarked, in the body as in a header
    (its SDK waits it); a wait within the cap would be marked ``x-should-retry: false``."""
    with (
        raw_upstream(first_then_ok(error(WITHIN), last)) as upstream,
        running(upstream_url=upstream.url, **SETTINGS) as stack,
    ):
        answer, _ = await post(stack.url)
        assert (answer.status_code, len(upstream.requests)) == (429, 2)
        assert "x-should-retry" not in answer.headers
        await assert_idle(stack.app, stack.url)


async def test_the_relayed_body_is_scrubbed_of_the_upstream_key() -> None:
    quoting = google(retry_info("5s"), {"echo": f"Bearer {KEY}"})
    with (
        raw_upstream(first_then_ok(error(quoting))) as upstream,
        running(upstream_url=upstream.url, upstream_api_key=KEY, **SETTINGS) as stack,
    ):
        answer, _ = await post(stack.url)
        assert (answer.status_code, len(upstream.requests)) == (429, 1)
        assert KEY.encode() not in answer.content and b"[redacted]" in answer.content
        assert answer.headers["content-length"] == str(len(answer.content))
        await assert_idle(stack.app, stack.url)


@pytest.mark.parametrize(("delay", "requests"), [("5s", 2), ("0s", 2)], ids=["over the cap", "within"])
async def test_the_openai_sdk_retries_as_it_would_against_the_upstream(delay: str, requests: int) -> None:
    """Over the cap: relayed unmarked, the SDK retries it (``max_retries=1``) as it would the upstream's
    own, one upstream request each; within: the gateway's two attempts, then ``x-should-retry: false``
    stops the SDK. Never more requests than the SDK alone would make."""
    body = google(retry_info(delay))
    with (
        raw_upstream(lambda request: error(body)) as upstream,
        running(upstream_url=upstream.url, **SETTINGS) as stack,
    ):
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="k", max_retries=1, timeout=30)
        async with client:
            with pytest.raises(openai.RateLimitError) as caught:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.response.content == body
        assert len(upstream.requests) == requests
        await assert_idle(stack.app, stack.url)
