"""The retry policy (``asgi_lifetime.gateway._retry``): its decisions as tables, no sockets.

The loop's behaviour end to end is specified by ``test_upstream.py``, ``test_sdk_retries.py``
and ``test_faults.py``; these pin each rule of the policy on its own, and that its state is
scalars only (a suspended backoff must not keep the request's input alive).
"""

from __future__ import annotations

import dataclasses
import email.utils
import gc
import json
import time
from typing import Any

import httpx
import pytest
import respx

import asgi_lifetime
from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway._prepare import Prepared
from asgi_lifetime.gateway._retry import (
    RETRY_STATUSES,
    Retry,
    asked_wait,
    body_wait,
    resend_safe,
    retry_after,
    says_no_retry,
)

from .test_upstream import (
    BASE,
    DEVELOPER_REJECTED,
    OK,
    OVERFLOW,
    PATH,
    Recorder,
    chat,
    conversation,
    make_settings,
    make_upstream,
)

A, B = "http://a.test", "http://b.test"


def policy(**changes: Any) -> Retry:
    base: dict[str, Any] = {
        "max_attempts": 4,
        "deadline": 100.0,
        "backoff_base": 0.5,
        "backoff_max": 8.0,
        "retry_after_cap": 10.0,
        "upstreams": 1,
    }
    return Retry(**{**base, **changes})


def test_start_takes_the_settings_and_the_deadline_from_now() -> None:
    settings = LifetimeSettings(
        max_attempts=5, retry_deadline=30.0, backoff_base=0.25, backoff_max=3.0, retry_after_cap=7.0
    )
    retry = Retry.start(settings, now=1000.0, upstreams=3)
    assert retry == policy(
        max_attempts=5, deadline=1030.0, backoff_base=0.25, backoff_max=3.0, retry_after_cap=7.0, upstreams=3
    )
    assert (retry.attempt, retry.backoffs, retry.failed, retry.roles_tried) == (1, 0, frozenset(), frozenset())


# --- increment: a new value, the old one untouched -------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "attempt", "backoffs", "failed", "roles"),
    [
        ({}, 2, 0, frozenset(), frozenset()),  # a refold: at once, nothing failed
        ({"failed": A, "backoff": True}, 2, 1, frozenset({A}), frozenset()),  # a transport failure or a busy status
        ({"role": "system"}, 2, 0, frozenset(), frozenset({"system"})),  # a role rename
    ],
)
def test_increment_returns_the_next_state_and_leaves_this_one(
    changes: dict[str, Any], attempt: int, backoffs: int, failed: frozenset[str], roles: frozenset[str]
) -> None:
    first = policy()
    second = first.increment(**changes)
    assert (second.attempt, second.backoffs, second.failed, second.roles_tried) == (attempt, backoffs, failed, roles)
    assert first == policy() and second is not first
    assert (second.max_attempts, second.deadline, second.upstreams) == (first.max_attempts, first.deadline, 1)


def test_increment_accumulates_and_counts_an_upstream_once() -> None:
    retry = policy(upstreams=2)
    retry = retry.increment(failed=A, backoff=True).increment(failed=A, backoff=True).increment(role="system")
    retry = retry.increment(failed=B, backoff=True).increment(role="user")
    assert (retry.attempt, retry.backoffs) == (6, 3)
    assert retry.failed == {A, B} and retry.roles_tried == {"system", "user"}


def test_the_state_is_frozen() -> None:
    retry = policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        retry.attempt = 2  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        retry.extra = 1  # type: ignore[attr-defined]  # slots: no room to hang anything else on it
    assert isinstance(retry.failed, frozenset) and isinstance(retry.roles_tried, frozenset)


SCALARS = (int, float, bool, str)


def assert_scalars_only(retry: Retry) -> None:
    """Everything the state reaches is a number, a name, or a frozenset of names."""
    for field in dataclasses.fields(retry):
        value = getattr(retry, field.name)
        if isinstance(value, frozenset):
            assert all(isinstance(item, str) for item in value), field.name
        else:
            assert isinstance(value, SCALARS), (field.name, type(value))
    seen: list[object] = []
    pending: list[object] = list(gc.get_referents(retry))
    while pending:
        item = pending.pop()
        assert isinstance(item, (*SCALARS, frozenset, type)), type(item)
        if isinstance(item, frozenset):
            pending.extend(item)
        seen.append(item)
    assert not any(isinstance(item, (bytes, bytearray, memoryview, Prepared, httpx.Response)) for item in seen)


def test_the_fields_are_scalars_only() -> None:
    hints = {field.name: field.type for field in dataclasses.fields(Retry)}
    assert set(hints.values()) <= {"int", "float", "frozenset[str]"}, hints
    assert_scalars_only(policy().increment(failed=A, backoff=True).increment(role="system"))


@pytest.mark.anyio
async def test_every_state_of_a_real_forward_holds_no_body_prepared_or_response(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Transport failure, busy status, refold and role rename, each advancing the state."""
    states: list[Retry] = []
    increment = Retry.increment

    def recording(self: Retry, **changes: Any) -> Retry:
        states.append(self)
        following = increment(self, **changes)
        states.append(following)
        return following

    monkeypatch.setattr(Retry, "increment", recording)
    recorder = Recorder()
    prepared = await chat(conversation(system_role="developer"))
    with respx.mock(base_url=BASE, assert_all_called=True) as router:
        router.post(PATH).mock(
            side_effect=[
                httpx.ConnectError("refused"),
                httpx.Response(503, headers={"Retry-After": "0"}),
                httpx.Response(400, json=OVERFLOW),
                httpx.Response(400, json=DEVELOPER_REJECTED),
                httpx.Response(200, json=OK),
            ]
        )
        async with make_upstream(recorder, make_settings(max_attempts=6)) as upstream:
            response = await upstream.forward(prepared, on_retries_settled=recorder.on_settled)
            await response.aclose()
    assert response.status_code == 200 and response.extensions["asgi_lifetime.attempts"] == 5
    assert [e.kind for e in recorder.events] == ["retry", "retry", "refold", "role", "settled"]
    assert [s.attempt for s in states[1::2]] == [2, 3, 4, 5]
    assert states[-1].failed == {BASE} and states[-1].roles_tried == {"system"} and states[-1].backoffs == 2
    for state in states:
        assert_scalars_only(state)


def test_retry_is_private() -> None:
    assert "Retry" not in asgi_lifetime.__all__ and not hasattr(asgi_lifetime, "Retry")


# --- transport failures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "body_sent", "safe"),
    [
        ("POST", False, True),  # refused, or failed while sending: the upstream has no whole request
        ("POST", True, False),  # sent whole, then no answer: it may be generating it (billed twice)
        ("PUT", True, False),
        ("GET", True, True),
        ("HEAD", True, True),
        ("GET", False, True),
    ],
)
def test_resend_safe(method: str, body_sent: bool, safe: bool) -> None:
    assert resend_safe(method, body_sent=body_sent) is safe


@pytest.mark.parametrize(
    ("retryable", "attempt", "delay", "now", "retried"),
    [
        (True, 1, 0.5, 0.0, True),
        (False, 1, 0.5, 0.0, False),  # sent whole: not re-sent
        (True, 4, 0.5, 0.0, False),  # the last attempt
        (True, 3, 0.5, 0.0, True),  # one left
        (True, 1, 10.0, 90.0, True),  # starts exactly at the deadline
        (True, 1, 10.5, 90.0, False),  # would start after it
        (True, 1, 0.0, 100.5, False),  # already past it
    ],
)
def test_retries_failure(retryable: bool, attempt: int, delay: float, now: float, retried: bool) -> None:
    assert policy(attempt=attempt).retries_failure(retryable, delay, now) is retried


# --- statuses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 400, 401, 403, 404, 408, 409, 413, 422, 500, 501, 505, 520])
def test_other_statuses_are_not_retried(status: int) -> None:
    assert not Retry.retries_status(status)


@pytest.mark.parametrize("status", [429, 502, 503, 504, 529])
def test_busy_and_failing_statuses_are_retried(status: int) -> None:
    assert Retry.retries_status(status) and status in RETRY_STATUSES


@pytest.mark.parametrize(
    ("upstreams", "failed", "asked", "no_retry", "stands"),
    [
        (1, set(), None, False, False),  # the usual backoff
        (1, set(), 3.0, False, False),  # a wait under the cap is waited
        (1, set(), 10.0, False, False),  # at the cap too
        (1, set(), 10.5, False, True),  # over it, with nowhere else to go: the client gets the wait
        (2, set(), 10.5, False, False),  # over it: another upstream is tried
        (2, {B}, 10.5, False, True),  # ...unless every one has failed
        (2, {A}, 10.5, False, False),  # A failing twice is still one upstream
        (1, set(), None, True, True),  # x-should-retry: false
        (3, set(), 0.0, True, True),
    ],
)
def test_answer_stands(upstreams: int, failed: set[str], asked: float | None, no_retry: bool, stands: bool) -> None:
    retry = policy(upstreams=upstreams, failed=frozenset(failed))
    assert retry.answer_stands(A, asked=asked, no_retry=no_retry) is stands


@pytest.mark.parametrize(
    ("drawn", "asked", "delay"),
    [
        (0.3, None, 0.3),  # no asked wait: the jitter
        (0.3, 2.0, 2.0),  # the asked wait, longer
        (0.3, 0.1, 0.3),  # the jitter, longer
        (0.3, 10.0, 10.0),  # at the cap
        (0.3, 10.5, 0.3),  # over it: not waited out, the usual backoff
        (0.3, float("inf"), 0.3),
        (0.3, 0.0, 0.3),
    ],
)
def test_delay(drawn: float, asked: float | None, delay: float) -> None:
    assert policy().delay(drawn, asked) == delay
    assert policy().too_long(asked) is (asked is not None and asked > 10.0)


@pytest.mark.parametrize(
    ("backoffs", "ceiling"), [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (60, 8.0)]
)
def test_ceiling_is_exponential_up_to_backoff_max(backoffs: int, ceiling: float) -> None:
    assert policy(backoffs=backoffs).ceiling() == ceiling


def test_the_ceiling_counts_waits_not_attempts() -> None:
    refolded = policy().increment().increment(role="system")
    assert refolded.attempt == 3 and refolded.ceiling() == 0.5
    assert refolded.increment(failed=A, backoff=True).ceiling() == 1.0


@pytest.mark.parametrize(
    ("attempt", "delay", "now", "in_time"),
    [(1, 1.0, 0.0, True), (4, 0.0, 0.0, False), (3, 0.0, 99.0, True), (1, 1.0, 99.0, True), (1, 1.01, 99.0, False)],
)
def test_in_time(attempt: int, delay: float, now: float, in_time: bool) -> None:
    assert policy(attempt=attempt).in_time(delay, now) is in_time


@pytest.mark.parametrize(("max_attempts", "marks"), [(1, False), (2, True), (10, True)])
def test_an_exhausted_status_tells_sdks_not_to_retry_unless_retrying_is_theirs(max_attempts: int, marks: bool) -> None:
    assert policy(max_attempts=max_attempts).marks_spent() is marks


# --- refold and role rename ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "refold", "remap", "read"),
    [
        (400, True, False, True),
        (413, True, False, True),
        (400, False, True, True),
        (413, False, True, False),  # a 413 is never a rejected role
        (400, False, False, False),  # nothing to do with it: handed back unread
        (413, False, False, False),
        (422, True, True, False),
        (404, True, True, False),
    ],
)
def test_may_reshape(status: int, refold: bool, remap: bool, read: bool) -> None:
    assert Retry.may_reshape(status, refold=refold, remap=remap) is read


@pytest.mark.parametrize(
    ("attempt", "now", "in_time"),
    [(1, 0.0, True), (3, 99.9, True), (4, 0.0, False), (1, 100.0, False), (1, 100.5, False)],
)
def test_reshapes_in_time(attempt: int, now: float, in_time: bool) -> None:
    # No wait before a reshaped body: only an attempt left before the deadline.
    assert policy(attempt=attempt).reshapes_in_time(now) is in_time


@pytest.mark.parametrize(
    ("rejected", "tried", "target"),
    [
        ("developer", set(), "system"),
        ("developer", {"system"}, "user"),
        ("system", set(), "user"),
        ("system", {"system"}, "user"),
        ("developer", {"system", "user"}, None),
        ("system", {"user"}, None),
        ("user", set(), None),
        ("assistant", set(), None),
        ("tool", set(), None),
    ],
)
def test_role_ladder(rejected: str, tried: set[str], target: str | None) -> None:
    assert policy(roles_tried=frozenset(tried)).role_target(rejected) == target


# --- what the upstream asked for ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({}, None),
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after": "-2"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # the finer one wins
        ({"retry-after-ms": "-5"}, 0.0),
        ({"retry-after-ms": "x", "retry-after": "9"}, 9.0),  # invalid: the other is read
        ({"retry-after-ms": "inf", "retry-after": "9"}, 9.0),
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),  # a date in the past
    ],
)
def test_asked_wait(headers: dict[str, str], wait: float | None) -> None:
    assert asked_wait(httpx.Headers(headers)) == wait


_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def _google(*details: object) -> bytes:
    return json.dumps({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": list(details)}}).encode()


@pytest.mark.parametrize(
    ("body", "wait"),
    [
        (_google({"@type": _RETRY_INFO, "retryDelay": "37s"}), 37.0),
        (_google({"@type": _RETRY_INFO, "retryDelay": "0.500s"}), 0.5),
        (
            _google(
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure"}, {"@type": _RETRY_INFO, "retryDelay": "2s"}
            ),
            2.0,
        ),
        (_google({"@type": _RETRY_INFO, "retryDelay": "soon"}), None),
        (_google({"@type": _RETRY_INFO, "retryDelay": "-3s"}), None),
        # A Duration's JSON form is ASCII: other scripts' digits, which float() would read, are not one.
        (_google({"@type": _RETRY_INFO, "retryDelay": "\u0663s"}), None),
        (_google({"@type": _RETRY_INFO, "retryDelay": "\uff13.5s"}), None),
        (_google({"@type": _RETRY_INFO}), None),
        (_google({"@type": "RetryInfoLookalike", "retryDelay": "9s"}), None),
        (_google(), None),
        (b'{"error": {"message": "RetryInfo", "details": "RetryInfo"}}', None),
        (b'{"error": "RetryInfo"}', None),
        (b'["RetryInfo"]', None),
        (b"RetryInfo, not JSON", None),
        (b"", None),
    ],
)
def test_body_wait(body: bytes, wait: float | None) -> None:
    """Google's ``google.rpc.RetryInfo`` in an error body; anything else asks for nothing."""
    assert body_wait(body) == wait


@pytest.mark.parametrize("usegmt", [True, False])
def test_retry_after_http_date(usegmt: bool) -> None:
    # usegmt=False writes "-0000", a date without a zone: HTTP dates are GMT.
    when = email.utils.formatdate(time.time() + 20, usegmt=usegmt)
    wait = retry_after(when)
    assert wait is not None and 17.0 <= wait <= 20.0


@pytest.mark.parametrize(
    ("value", "no_retry"),
    [("false", True), (" False ", True), ("FALSE", True), ("true", False), ("", False), ("0", False), (None, False)],
)
def test_says_no_retry(value: str | None, no_retry: bool) -> None:
    headers = httpx.Headers({} if value is None else {"x-should-retry": value})
    assert says_no_retry(headers) is no_retry
