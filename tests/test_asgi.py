"""The ASGI chores of ``asgi_lifetime._asgi`` that no other test reaches directly."""

from __future__ import annotations

import anyio
import pytest

from asgi_lifetime._asgi import normalize_headers, task_group
from asgi_lifetime._exceptions import BodyTooComplex

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
