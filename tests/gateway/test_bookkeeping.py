from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Awaitable

import anyio
import anyio.lowlevel
import pytest

from asgi_lifetime import Lifetime, LifetimeSettings
from asgi_lifetime._fingerprint import Fingerprint
from asgi_lifetime._resources import RequestResources
from asgi_lifetime.gateway import _bookkeeping
from asgi_lifetime.gateway._bookkeeping import (
    OUTCOMES,
    SESSION_KEY_BYTES,
    Bookkeeper,
    Outcome,
    SessionBook,
    SessionEntry,
    record_outcome,
    session_key,
)


def fp(tag: str = "a", *, text_comparable: bool = True, size: int = 10) -> Fingerprint:
    return Fingerprint(wire_hash=(tag * 64)[:64], text_comparable=text_comparable, size=size)


def make_outcome(
    session_id: str | None = "s1",
    *,
    fingerprint: Fingerprint | None = None,
    status: int = 200,
    bytes_out: int = 100,
    outcome: str = "complete",
    ended: float = 12.0,
) -> Outcome:
    return Outcome(
        fingerprint=fingerprint if fingerprint is not None else fp(),
        session_id=session_id,
        path="/v1/chat/completions",
        status=status,
        bytes_out=bytes_out,
        attempts=1,
        upstream="primary",
        started=10.0,
        first_byte_at=10.5,
        ended=ended,
        outcome=outcome,
    )


# ---------------------------------------------------------------------------------------------
# Outcome


def test_outcome_timings() -> None:
    o = make_outcome()
    assert o.duration == pytest.approx(2.0)
    assert o.ttfb == pytest.approx(0.5)
    assert dataclasses.replace(o, first_byte_at=None).ttfb is None


@pytest.mark.parametrize("kind", sorted(OUTCOMES))
def test_outcome_kinds_accepted(kind: str) -> None:
    assert make_outcome(outcome=kind).outcome == kind


def test_outcome_kind_validated() -> None:
    with pytest.raises(ValueError, match="outcome"):
        make_outcome(outcome="finished")


def test_outcome_is_frozen() -> None:
    o = make_outcome()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.status = 500  # type: ignore[misc]


_SCALARS = (str, int, float, bool, type(None))


def _hint_types(hint: object) -> set[object]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return {t for arg in typing.get_args(hint) for t in _hint_types(arg)}
    if typing.get_origin(hint) is typing.Literal:  # a choice of constants: their types
        return {type(arg) for arg in typing.get_args(hint)}
    return {hint}


@pytest.mark.parametrize("cls", [Outcome, Fingerprint])
def test_outcome_declares_only_scalars(cls: type) -> None:
    """Bookkeeping must never be able to hold the body: no bytes, containers or objects."""
    allowed = {*_SCALARS, Fingerprint}
    for name, hint in typing.get_type_hints(cls).items():
        assert _hint_types(hint) <= allowed, f"{cls.__name__}.{name}: {hint!r} is not a scalar"


def test_outcome_values_are_scalars() -> None:
    o = make_outcome()
    values: list[tuple[str, object]] = []
    for field in dataclasses.fields(o):
        value = getattr(o, field.name)
        if isinstance(value, Fingerprint):
            values += [(f"{field.name}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
        else:
            values.append((field.name, value))
    for name, value in values:
        assert not isinstance(value, (bytes, bytearray, memoryview, dict, list, tuple, set)), name
        assert isinstance(value, _SCALARS), f"{name}: {type(value).__name__}"


# ---------------------------------------------------------------------------------------------
# SessionBook: recording and LRU


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_max_sessions_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        SessionBook(max_sessions=bad)  # type: ignore[arg-type]


def test_record_creates_and_updates_entry() -> None:
    book = SessionBook(max_sessions=4)
    book.record(make_outcome("s1", fingerprint=fp("a", size=10), bytes_out=100, ended=12.0))
    book.record(
        make_outcome(
            "s1",
            fingerprint=fp("b", text_comparable=False, size=20),
            status=502,
            bytes_out=5,
            outcome="upstream_error",
            ended=13.0,
        )
    )
    assert book.get("s1") == SessionEntry(
        wire_hash=fp("b").wire_hash,
        text_comparable=False,
        size=20,
        requests=2,
        bytes_out=105,
        last_status=502,
        last_outcome="upstream_error",
        last_seen=13.0,
        synced_hash=fp("b").wire_hash,
    )
    assert len(book) == 1
    assert book.get("nope") is None


def test_outcome_without_session_ignored() -> None:
    calls: list[str] = []
    book = SessionBook(max_sessions=4, on_change=lambda sid, _: calls.append(sid))
    book.record(make_outcome(None))
    assert len(book) == 0
    assert book.recomputations == 0
    assert calls == []


def test_lru_eviction_order() -> None:
    book = SessionBook(max_sessions=3)
    for sid in ("a", "b", "c"):
        book.record(make_outcome(sid))
    book.record(make_outcome("a"))  # a becomes most recent; b is now the oldest
    book.record(make_outcome("d"))
    assert "b" not in book
    assert {"a", "c", "d"} == {s for s in ("a", "b", "c", "d") if s in book}
    book.record(make_outcome("e"))  # evicts c
    assert "c" not in book
    assert len(book) == 3
    assert book.get("a") is not None and book.get("a").requests == 2  # type: ignore[union-attr]


def test_get_does_not_refresh_but_pin_does() -> None:
    book = SessionBook(max_sessions=2)
    book.record(make_outcome("a"))
    book.record(make_outcome("b"))
    book.get("a")
    book.record(make_outcome("c"))
    assert "a" not in book and "b" in book
    book.pin("b")()  # pin touches b; its release leaves c as the oldest
    book.record(make_outcome("d"))
    assert "c" not in book and "b" in book and "d" in book


# ---------------------------------------------------------------------------------------------
# on_change / recomputations


def test_on_change_only_when_hash_changes() -> None:
    calls: list[tuple[str, Fingerprint]] = []
    book = SessionBook(max_sessions=4, on_change=lambda sid, f: calls.append((sid, f)))
    book.record(make_outcome("s1", fingerprint=fp("a")))
    book.record(make_outcome("s1", fingerprint=fp("a")))
    assert calls == [("s1", fp("a"))]
    assert book.recomputations == 1
    book.record(make_outcome("s1", fingerprint=fp("b")))
    assert calls == [("s1", fp("a")), ("s1", fp("b"))]
    assert book.recomputations == 2
    book.record(make_outcome("s2", fingerprint=fp("b")))  # a new session recomputes, same hash or not
    assert calls[-1] == ("s2", fp("b"))
    assert book.recomputations == 3
    assert book.get("s1").requests == 3  # type: ignore[union-attr]


def test_recomputations_counted_without_callback() -> None:
    book = SessionBook(max_sessions=4)
    book.record(make_outcome("s1", fingerprint=fp("a")))
    book.record(make_outcome("s1", fingerprint=fp("a")))
    book.record(make_outcome("s1", fingerprint=fp("c")))
    assert book.recomputations == 2


def test_evicted_session_recomputes_when_it_returns() -> None:
    calls: list[str] = []
    book = SessionBook(max_sessions=1, on_change=lambda sid, _: calls.append(sid))
    book.record(make_outcome("a"))
    book.record(make_outcome("b"))
    book.record(make_outcome("a"))
    assert calls == ["a", "b", "a"]


def test_failed_on_change_is_retried() -> None:
    attempts: list[str] = []

    def on_change(sid: str, f: Fingerprint) -> None:
        attempts.append(f.wire_hash[0])
        if len(attempts) == 1:
            raise RuntimeError("boom")

    book = SessionBook(max_sessions=4, on_change=on_change)
    with pytest.raises(RuntimeError):
        book.record(make_outcome("s1", fingerprint=fp("a")))
    entry = book.get("s1")
    assert entry is not None and entry.requests == 1 and entry.synced_hash is None
    book.record(make_outcome("s1", fingerprint=fp("a")))  # not synced yet: runs again
    book.record(make_outcome("s1", fingerprint=fp("a")))  # synced: skipped
    assert attempts == ["a", "a"]
    assert entry.requests == 3


# ---------------------------------------------------------------------------------------------
# Pins


def test_pinned_entry_survives_eviction_then_book_shrinks() -> None:
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=3, lifetime=lifetime)
    book.record(make_outcome("pinned"))
    unpin = book.pin("pinned")
    for i in range(10):
        book.record(make_outcome(f"other-{i}"))
    assert "pinned" in book  # the oldest entry, but pinned
    assert len(book) == 3
    assert counters.pinned_sessions == 1
    unpin()
    assert counters.pinned_sessions == 0
    assert book.pinned == 0
    book.record(make_outcome("after"))
    assert "pinned" not in book
    assert len(book) == 3


def test_all_pinned_exceeds_max_then_shrinks_on_unpin() -> None:
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=2, lifetime=lifetime)
    unpins = [book.pin(f"s{i}") for i in range(5)]
    for i in range(5):
        book.record(make_outcome(f"s{i}"))
    assert len(book) == 5  # every entry pinned: temporarily over max_sessions
    assert book.pinned == 5 and counters.pinned_sessions == 5
    unpins[4]()  # the most recent one: the LRU still evicts down to the bound from the oldest unpinned
    assert len(book) == 4 and "s4" not in book
    for unpin in unpins[:3]:
        unpin()
    assert len(book) == 2
    assert "s2" in book and "s3" in book
    unpins[3]()
    assert len(book) == 2
    assert counters.pinned_sessions == 0 and book.pinned == 0


def test_pin_before_first_record_keeps_new_entry() -> None:
    book = SessionBook(max_sessions=1)
    unpin = book.pin("first")
    assert len(book) == 0  # a pin alone creates no entry
    book.record(make_outcome("first"))
    book.record(make_outcome("second"))
    book.record(make_outcome("third"))
    assert "first" in book and "third" in book and "second" not in book
    unpin()
    assert len(book) == 1 and "third" in book


def test_unpin_is_idempotent() -> None:
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=2, lifetime=lifetime)
    first, second = book.pin("s1"), book.pin("s1")
    assert book.pinned == 1 and counters.pinned_sessions == 2
    first()
    first()
    first()
    assert book.pinned == 1 and counters.pinned_sessions == 1  # a repeat must not release someone else's pin
    second()
    second()
    assert book.pinned == 0 and counters.pinned_sessions == 0
    assert counters.snapshot().idle


def test_refcounted_pins_keep_session_until_last_release() -> None:
    book = SessionBook(max_sessions=1)
    book.record(make_outcome("s"))
    a, b = book.pin("s"), book.pin("s")
    a()
    book.record(make_outcome("x"))
    assert "s" in book  # b still pins it
    b()
    assert "s" not in book and len(book) == 1


@pytest.mark.anyio
async def test_concurrent_same_session_requests() -> None:
    n, failing = 12, {2, 5, 9}
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    calls: list[str] = []
    book = SessionBook(max_sessions=1, lifetime=lifetime, on_change=lambda sid, _: calls.append(sid))
    all_recorded, checked = anyio.Event(), anyio.Event()
    recorded = 0
    failures = 0

    async def request(i: int) -> None:
        nonlocal recorded
        unpin = book.pin("shared")
        try:
            await anyio.sleep(0.001 * (i % 4))
            book.record(make_outcome("shared", bytes_out=i))
            book.record(make_outcome(f"other-{i}"))  # pressure on the LRU while "shared" is pinned
            recorded += 1
            if recorded == n:
                all_recorded.set()
            await checked.wait()  # hold every pin until the test has looked
            await anyio.sleep(0.001 * (i % 3))
            if i in failing:
                raise RuntimeError(f"request {i} failed")
            await anyio.sleep(0.001)
        finally:
            unpin()
            unpin()  # a second release in a cleanup path is harmless

    async def guarded(i: int) -> None:
        nonlocal failures
        try:
            await request(i)
        except RuntimeError:
            failures += 1

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(guarded, i)
        await all_recorded.wait()
        # Every request holds its own pin on the one session; the entry outlived the pressure.
        assert book.pinned == 1
        assert counters.pinned_sessions == n
        entry = book.get("shared")
        assert entry is not None
        assert len(book) == 2  # over max_sessions=1 by the pinned entry only
        checked.set()

    assert failures == len(failing)
    assert book.pinned == 0
    assert counters.pinned_sessions == 0
    assert entry is not None
    assert entry.requests == n
    assert entry.bytes_out == sum(range(n))
    assert calls.count("shared") == 1  # same hash every time: one recomputation
    book.record(make_outcome("later"))
    assert len(book) == 1 and "later" in book  # unpinned: "shared" is evictable again


@pytest.mark.anyio
async def test_concurrent_requests_released_by_request_scope_on_failure() -> None:
    """A failure that cancels sibling requests still releases every pin through the scope."""
    n = 6
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=2, lifetime=lifetime)
    started = 0
    all_started = anyio.Event()

    async def request(i: int) -> None:
        nonlocal started
        async with RequestResources(counters) as scope:
            scope.add(book.pin("shared"))
            book.record(make_outcome("shared"))
            started += 1
            if started == n:
                all_started.set()
            await all_started.wait()
            if i == 0:
                raise RuntimeError("upstream blew up")
            await anyio.sleep_forever()  # cancelled by the failure

    with pytest.raises(Exception) as excinfo:  # noqa: B017  (an exception group; checked below)
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(request, i)
    assert excinfo.group_contains(RuntimeError)
    assert counters.pinned_sessions == 0
    assert counters.snapshot().idle
    assert book.pinned == 0
    assert book.get("shared").requests == n  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# Bookkeeper protocol and record_outcome


def accepts_bookkeeper(bookkeeper: Bookkeeper) -> Bookkeeper:
    return bookkeeper


class AsyncBookkeeper:
    def __init__(self) -> None:
        self.recorded: list[Outcome] = []

    async def record(self, outcome: Outcome) -> None:
        await anyio.lowlevel.checkpoint()
        self.recorded.append(outcome)


class FailingBookkeeper:
    def record(self, outcome: Outcome) -> None:
        raise RuntimeError("metrics backend down")


class FailingAsyncBookkeeper:
    async def record(self, outcome: Outcome) -> None:
        await anyio.lowlevel.checkpoint()
        raise RuntimeError("metrics backend down")


class SlowBookkeeper:
    async def record(self, outcome: Outcome) -> None:
        await anyio.sleep_forever()


def test_session_book_is_a_bookkeeper() -> None:
    book = SessionBook(max_sessions=2)
    bk = accepts_bookkeeper(book)  # mypy checks the structural match
    assert isinstance(book, Bookkeeper)
    assert bk.record(make_outcome("s1")) is None
    assert book.get("s1") is not None


@pytest.mark.anyio
async def test_record_outcome_sync_bookkeeper() -> None:
    book = SessionBook(max_sessions=2)
    await record_outcome(book, make_outcome("s1"))
    assert book.get("s1") is not None


@pytest.mark.anyio
async def test_record_outcome_awaits_async_bookkeeper() -> None:
    bk = AsyncBookkeeper()
    assert isinstance(bk, Bookkeeper)
    o = make_outcome()
    result = accepts_bookkeeper(bk).record(o)
    assert isinstance(result, Awaitable)
    await result
    await record_outcome(bk, o)
    assert bk.recorded == [o, o]


@pytest.mark.anyio
@pytest.mark.parametrize("bookkeeper", [FailingBookkeeper(), FailingAsyncBookkeeper()], ids=["sync", "async"])
async def test_record_outcome_swallows_and_logs_failures(
    bookkeeper: Bookkeeper, caplog: pytest.LogCaptureFixture
) -> None:
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=2, lifetime=lifetime)
    with caplog.at_level(logging.ERROR, logger="asgi_lifetime.gateway._bookkeeping"):
        async with RequestResources(counters) as scope:
            scope.add(book.pin("s1"))
            await record_outcome(bookkeeper, make_outcome("s1"))  # must not raise
    assert counters.snapshot().idle
    [record] = caplog.records
    assert "failed to record" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)


@pytest.mark.anyio
async def test_record_outcome_swallows_on_change_failure(caplog: pytest.LogCaptureFixture) -> None:
    def on_change(sid: str, f: Fingerprint) -> None:
        raise ValueError("bad state")

    book = SessionBook(max_sessions=2, on_change=on_change)
    with caplog.at_level(logging.ERROR, logger="asgi_lifetime.gateway._bookkeeping"):
        await record_outcome(book, make_outcome("s1"))
    assert book.get("s1") is not None
    assert len(caplog.records) == 1


@pytest.mark.anyio
async def test_record_outcome_bounds_a_wedged_bookkeeper(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_bookkeeping, "_RECORD_TIMEOUT", 0.01)
    with caplog.at_level(logging.WARNING, logger="asgi_lifetime.gateway._bookkeeping"):
        with anyio.fail_after(2):
            await record_outcome(SlowBookkeeper(), make_outcome())
    [record] = caplog.records
    assert "did not record" in record.getMessage()


@pytest.mark.anyio
async def test_record_outcome_records_despite_cancellation() -> None:
    bk = AsyncBookkeeper()
    with anyio.CancelScope() as cancelled:
        cancelled.cancel()
        await record_outcome(bk, make_outcome(outcome="client_disconnected"))
        await anyio.lowlevel.checkpoint()  # the caller's cancellation is delivered at its next checkpoint
    assert cancelled.cancelled_caught
    assert [o.outcome for o in bk.recorded] == ["client_disconnected"]


def test_log_messages_carry_no_session_or_body(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        await record_outcome(FailingBookkeeper(), make_outcome("secret-session-id"))

    with caplog.at_level(logging.ERROR, logger="asgi_lifetime.gateway._bookkeeping"):
        anyio.run(main)
    assert "secret-session-id" not in caplog.text


@pytest.mark.parametrize("session_id", ["s1", "x" * 100_000, "é-ünïcode", "\udcff-surrogate"])
def test_the_book_keeps_a_fixed_size_digest_never_the_id(session_id: str) -> None:
    lifetime = Lifetime(LifetimeSettings())
    counters = lifetime.counters
    book = SessionBook(max_sessions=4, lifetime=lifetime)
    unpin = book.pin(session_id)
    book.record(make_outcome(session_id))
    assert session_id in book and book.get(session_id) is not None
    kept = [*book._entries, *book._pins]
    assert kept and all(isinstance(k, bytes) and len(k) == SESSION_KEY_BYTES for k in kept)
    assert kept[0] == session_key(session_id)
    unpin()
    assert counters.pinned_sessions == 0 and book.pinned == 0
