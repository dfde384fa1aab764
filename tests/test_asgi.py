"""The ASGI chores of ``asgi_lifetime._asgi`` that no other test reaches directly."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import pytest

from asgi_lifetime._asgi import BodyWatch, normalize_headers, route_path, send_error, task_group, under, upstream_path
from asgi_lifetime._exceptions import BodyTooComplex, BodyTooLarge

pytestmark = pytest.mark.anyio


async def test_an_exception_of_the_block_is_raised_as_it_is_and_cancels_the_tasks() -> None:
    cancelled = anyio.Event()

    async def beside() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    refused = BodyTooComplex(10, 100)
    with pytest.raises(BodyTooComplex) as caught:
        async with task_group() as tg:
            tg.start_soon(beside)
            await anyio.lowlevel.checkpoint()  # the task is running
            raise refused
    assert caught.value is refused  # not an ExceptionGroup around it
    assert cancelled.is_set()


async def test_a_block_that_returns_waits_for_its_tasks() -> None:
    done: list[str] = []

    async def beside() -> None:
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        done.append("task")

    async with task_group() as tg:
        tg.start_soon(beside)
        done.append("block")
    assert done == ["block", "task"]


async def test_an_exception_of_a_task_is_wrapped_as_anyio_does() -> None:
    async def beside() -> None:
        raise ValueError("task")

    with pytest.raises(Exception) as caught:  # ExceptionGroup (a backport before Python 3.11)
        async with task_group() as tg:
            tg.start_soon(beside)
            await anyio.sleep_forever()
    assert not isinstance(caught.value, ValueError)
    assert [type(e) for e in getattr(caught.value, "exceptions", ())] == [ValueError]


async def test_cancelling_from_outside_cancels_block_and_tasks() -> None:
    ended: list[str] = []

    async def beside() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            ended.append("task")

    with anyio.CancelScope() as outer:
        async with task_group() as tg:
            tg.start_soon(beside)
            await anyio.lowlevel.checkpoint()
            outer.cancel()
            try:
                await anyio.sleep_forever()
            finally:
                ended.append("block")
    assert outer.cancelled_caught
    assert sorted(ended) == ["block", "task"]


async def test_headers_as_asgi_promises_them_are_left_alone() -> None:
    headers = [(b"content-type", b"application/json"), (b"cookie", b"a=1"), (b"x-1", b"Value"), (b"x-r", b"1")]
    scope = {"headers": [*headers, (b"x-r", b"2")]}
    kept = scope["headers"]
    normalize_headers(scope)
    assert scope["headers"] is kept  # nothing allocated on the usual path


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        (
            [(b"Authorization", b"Bearer K"), (b"X-Api-Key", b"K")],
            [(b"authorization", b"Bearer K"), (b"x-api-key", b"K")],
        ),
        ([(b"CONTENT-ENCODING", b"GZIP")], [(b"content-encoding", b"GZIP")]),  # values as given
        ([(b"123", b"1")], [(b"123", b"1")]),  # no letter: rebuilt the same
        # Several cookie fields (RFC 9113 8.2.3): one, where the first was, padding dropped; others as they came.
        (
            [
                (b"cookie", b"a=1"),
                (b"x-r", b"1"),
                (b"Cookie", b" b=2\t"),
                (b"x-r", b"2"),
                (b"cookie", b""),
                (b"cookie", b"c=3"),
            ],
            [(b"cookie", b"a=1; b=2; c=3"), (b"x-r", b"1"), (b"x-r", b"2")],
        ),
        ([(b"Cookie", b" a=1 ")], [(b"cookie", b" a=1 ")]),  # one field: as a lower-case one would be
    ],
)
async def test_header_names_are_lowercased_and_cookie_fields_joined(
    given: list[tuple[bytes, bytes]], normal: list[tuple[bytes, bytes]]
) -> None:
    scope = {"headers": given}
    normalize_headers(scope)
    assert scope["headers"] == normal
    normalize_headers(scope)
    assert scope["headers"] == normal  # once is enough


# -- send_error for a request whose body may be unread ------------------------------------------------


def _scope(version: str) -> dict[str, object]:
    return {"type": "http", "http_version": version, "path": "/v1/chat/completions", "headers": []}


def _script(*messages: dict[str, object], then: str = "hang") -> Any:
    """A ``receive`` returning ``messages``, then hanging (``then="hang"``) or ``http.disconnect``."""
    queue = list(messages)

    async def receive() -> dict[str, object]:
        if queue:
            return queue.pop(0)
        if then == "hang":
            await anyio.sleep_forever()
        return {"type": "http.disconnect"}

    return receive


async def _refuse(version: str, watch: BodyWatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await send_error(_scope(version), send, BodyTooLarge(10), unread=watch)
    return sent


def _watch(receive: Any, *, idle: float = 5.0, total: float = 5.0) -> BodyWatch:
    return BodyWatch(receive, idle, total)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
async def test_over_http1_an_unread_body_closes_the_connection_and_nothing_is_read(version: str) -> None:
    receive = _script({"type": "http.request", "body": b"x", "more_body": True})
    sent = await _refuse(version, _watch(receive))
    assert (b"connection", b"close") in sent[0]["headers"]
    assert [m.get("more_body") for m in sent[1:]] == [False]


@pytest.mark.parametrize("version", ["2", "3"])
async def test_over_http2_the_answer_ends_once_the_body_has_been_read_and_dropped(version: str) -> None:
    chunks = [{"type": "http.request", "body": b"x" * 100, "more_body": True} for _ in range(3)]
    receive = _script(*chunks, {"type": "http.request", "body": b"", "more_body": False})
    watch = _watch(receive)
    sent = await _refuse(version, watch)
    assert all(name != b"connection" for name, _ in sent[0]["headers"])
    assert sent[1]["more_body"] is True and b"request_too_large" in sent[1]["body"]
    assert sent[2] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert watch.ended


async def test_over_http2_a_body_already_ended_is_not_waited_for() -> None:
    watch = _watch(_script())
    watch.ended = True
    sent = await _refuse("2", watch)
    assert [m.get("more_body") for m in sent[1:]] == [False]


def _endless() -> Any:
    async def receive() -> dict[str, object]:
        await anyio.sleep(0.001)
        return {"type": "http.request", "body": b"x" * 600, "more_body": True}

    return receive


BOUNDED: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "silent": (lambda: _script(then="hang"), {"idle": 0.05}),  # one idle timeout
    "gone": (lambda: _script(then="disconnect"), {}),
    "endless": (  # a chunk at a time, never the end: BODY_TIMEOUT
        lambda: _endless(),
        {"total": 0.1},
    ),
}


@pytest.mark.parametrize("case", BOUNDED)
async def test_over_http2_the_wait_for_the_body_is_bounded(case: str) -> None:
    make, limits = BOUNDED[case]
    with anyio.fail_after(2):
        sent = await _refuse("2", _watch(make(), **limits))
    assert [m.get("more_body") for m in sent[1:]] == [True, False]


@pytest.mark.parametrize(
    ("path", "prefix", "covered"),
    [
        ("/v1", "/v1/", True),
        ("/v1/models", "/v1", True),
        ("/v1beta/models", "/v1", False),
        ("/v1beta/models", "/v1/", False),
        ("/", "/", True),
        ("/x", "/", True),
        ("/v1/responses_x", "/v1/responses", False),
    ],
)
def test_a_prefix_covers_whole_segments(path: str, prefix: str, covered: bool) -> None:
    assert under(path, prefix) is covered


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/api/v1/x", "/v1/x"), ("/api", ""), ("/apiv1/x", "/apiv1/x")],  # a mount at /api does not own /apiv1
)
def test_the_mount_is_removed_at_a_segment_boundary(path: str, expected: str) -> None:
    scope = {"type": "http", "path": path, "raw_path": path.encode(), "root_path": "/api"}
    assert route_path(scope) == expected
    assert upstream_path(scope) == expected
