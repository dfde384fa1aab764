"""Post-forward bookkeeping, from scalars only.

When a response ends the gateway hands its bookkeeper an ``Outcome``: the request's
``Fingerprint`` (wire hash, text-comparable verdict, size, all taken from the body as
received and before any mutation), the session id, status, bytes out and timings.
Never the body itself, raw or parsed.

Why: bookkeeping runs at the *end* of the response, which for an LLM stream can be
minutes after the body was read. Anything this stage needs from the body must be
derived up front, or the raw bytes, the parse tree and every closure that captured
them stay alive for the whole stream (external memory / RSS that scales with request
size x response time). Keeping ``Outcome`` scalar makes that retention impossible by
construction; ``tests/test_bookkeeping.py`` fails if a bytes or container field is added.

``SessionBook``, the default bookkeeper, keeps a bounded LRU of per-session entries and
calls ``on_change`` (the per-session "recomputation") only when a session's wire hash
changes. Sessions are pinned from admission until their response ends, so an active
session's entry is never evicted under it::

    book = SessionBook(max_sessions=10_000, lifetime=lifetime, on_change=rederive)
    async with RequestResources() as resources:
        resources.add(book.pin(session_id))     # unpinned on every settlement path
        ...                                     # forward, stream the response
        await record_outcome(book, outcome)     # never raises
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, Protocol, get_args, runtime_checkable

import anyio
from blake3 import blake3

from .._fingerprint import Fingerprint
from .._middleware import Lifetime
from .._settings import at_least_one, check_argument
from .._stats import Counters

__all__ = [
    "OUTCOMES",
    "Claim",
    "Ending",
    "SESSION_KEY_BYTES",
    "Bookkeeper",
    "Outcome",
    "SessionBook",
    "SessionEntry",
    "StoreState",
    "record_outcome",
    "session_key",
]

logger = logging.getLogger(__name__)

Ending = Literal["complete", "client_disconnected", "stalled", "starved", "upstream_error", "shutdown", "error"]
"""How a forwarded request ended: what the relay reports and ``Outcome.outcome`` records."""

OUTCOMES: Final = frozenset(get_args(Ending))
"""The values ``Outcome.outcome`` may take."""

Claim = Literal["claimed", "synced", "local", "unsure"]
"""What a shared session book decided when it admitted a request (``Outcome.claim``):

- ``"claimed"``: the fleet gave this request its session's change; its record runs ``on_change``.
- ``"synced"``: the fleet already has this wire hash (an earlier or concurrent request claimed it).
- ``"local"``: the shared store was not asked (unusable already); this process's book decides at the record.
- ``"unsure"``: the store was asked and its answer never came (timeout, connection lost, garbage): the
  claim may have been made. The record asks again (the claim is idempotent) or, if the store is still
  unusable then, runs ``on_change``: at least once rather than never.
"""

SESSION_KEY_BYTES: Final = 16
"""Size of the digest the book keys sessions by (128 bits: collisions are not a practical concern)."""


def session_key(session_id: str) -> bytes:
    """The fixed-size key a session is kept under: 16 bytes of the id's blake3 digest.

    The id is chosen by the client; keeping it whole would let each request leave as many bytes
    behind as its header carried, for as long as the book remembers the session.
    """
    return blake3(session_id.encode("utf-8", "surrogatepass")).digest(length=SESSION_KEY_BYTES)


# A user bookkeeper that awaits is bounded (and shielded, so a cancelled request is still
# recorded): a wedged bookkeeper must not hold the response open.
_RECORD_TIMEOUT: Final = 5.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one forwarded request ended. Scalars only: no body, no headers, no parse tree."""

    fingerprint: Fingerprint
    session_id: str | None
    path: str
    status: int
    bytes_out: int
    attempts: int
    upstream: str | None
    """The base URL of the upstream tried last, whether or not it answered; ``None`` if none was tried."""
    started: float
    """``time.monotonic()`` at admission."""
    first_byte_at: float | None
    """Monotonic time of the first response body byte; ``None`` if none was sent."""
    ended: float
    """Monotonic time the response ended."""
    outcome: str
    """One of ``OUTCOMES``."""
    claim: Claim | None = None
    """A shared session book's decision at admission (see ``Claim``); ``None`` when none was made (no
    session id, the in-memory book, which decides at the record)."""
    code: str | None = None
    """The error's code when the gateway answered with an error of its own (``invalid_header``,
    ``request_unsendable``, ``upstream_unreachable``...); ``None`` when it relayed the upstream's answer."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {self.outcome!r}")

    @property
    def duration(self) -> float:
        """Seconds from admission to the end of the response."""
        return self.ended - self.started

    @property
    def ttfb(self) -> float | None:
        """Seconds from admission to the first response byte, or ``None``."""
        return None if self.first_byte_at is None else self.first_byte_at - self.started


@runtime_checkable
class Bookkeeper(Protocol):
    """Anything with a ``record(outcome)`` method, sync or async.

    ```python
    class MetricsBookkeeper:
        async def record(self, outcome: Outcome) -> None:
            await metrics.observe(outcome.path, outcome.status, outcome.duration)
    ```

    Call it through ``record_outcome``, which awaits when needed and contains failures.
    """

    def record(self, outcome: Outcome) -> None | Awaitable[None]: ...


async def record_outcome(bookkeeper: Bookkeeper, outcome: Outcome) -> None:
    """Hand ``outcome`` to ``bookkeeper``, awaiting its result if it returns an awaitable.

    Never raises: an exception from the bookkeeper is logged and swallowed, so a failing bookkeeper cannot break a
    response or skip the request's releases. An awaiting bookkeeper is shielded from
    cancellation (a disconnected request is still recorded; the caller's cancellation is
    delivered at its next checkpoint) and bounded by
    ``_RECORD_TIMEOUT`` seconds; the shield is why the bound is here and not the caller's.
    """
    timeout = _RECORD_TIMEOUT
    try:
        result = bookkeeper.record(outcome)
        if result is None:  # a synchronous bookkeeper (the built-in ones): nothing to shield or bound
            return
        with anyio.move_on_after(timeout, shield=True) as deadline:
            await result
        if deadline.cancelled_caught:
            logger.warning(
                "bookkeeper %s did not record %s outcome for %s within %ss",
                type(bookkeeper).__qualname__,
                outcome.outcome,
                outcome.path,
                timeout,
            )
    except Exception:
        logger.exception(
            "bookkeeper %s failed to record %s outcome for %s",
            type(bookkeeper).__qualname__,
            outcome.outcome,
            outcome.path,
        )


@dataclass(slots=True)
class SessionEntry:
    """What ``SessionBook`` keeps about one session: the latest request's fingerprint and totals."""

    wire_hash: str
    text_comparable: bool
    size: int
    requests: int = 0
    bytes_out: int = 0
    last_status: int = 0
    last_outcome: str = ""
    last_seen: float = 0.0
    """Monotonic ``Outcome.ended`` of the latest recorded request."""
    synced_hash: str | None = None
    """The wire hash ``on_change`` last completed for; ``None`` until it has once."""


@dataclass(frozen=True, slots=True)
class StoreState:
    """Where a session book keeps its sessions right now, for the metrics."""

    up: bool
    """True while sessions are kept in the configured store (always, for the in-memory book)."""
    fallbacks: int
    """Times the book fell back to this process's memory because its shared store was unusable."""
    local_records: int
    """Records this process's memory decided alone in place of the shared store."""


class _Unpin:
    """The idempotent release returned by ``SessionBook.pin``."""

    __slots__ = ("_book", "_key")

    def __init__(self, book: SessionBook, key: bytes) -> None:
        self._book: SessionBook | None = book
        self._key = key

    def __call__(self) -> None:
        book, self._book = self._book, None
        if book is not None:
            book._unpin(self._key)


class SessionBook:
    """The default bookkeeper: a bounded, pin-aware LRU of per-session entries.

    ```python
    book = SessionBook(max_sessions=10_000, lifetime=lifetime, on_change=rederive)
    unpin = book.pin("sess-1")                  # at admission; register with the RequestResources
    book.record(outcome)                        # at the end of the response
    unpin()                                     # idempotent
    ```

    - ``record`` stores outcomes that carry a session id (others are ignored), making the
      session the most recently used. ``on_change(session_id, fingerprint)`` runs when the
      session is new or its wire hash differs from the one ``on_change`` last completed
      for; an unchanged hash skips it. ``recomputations`` counts the runs. If ``on_change``
      raises, the entry is still updated, the exception propagates (``record_outcome``
      logs it), and the next record of that session runs it again.
    - ``pin`` is reference counted: each concurrent request on a session takes its own pin
      and the session is unpinned when the last one is released. A pinned session's entry
      is never evicted, including an entry created by ``record`` after the pin was taken.
      When the entries over the bound are all pinned the book temporarily holds more than
      ``max_sessions``: at most ``max(max_sessions, pinned entries + 1)``, the +1 being the
      entry just recorded, which always survives its own record. Every unpin evicts back
      toward the bound, so the book shrinks to ``max_sessions`` as pins are released.
    - ``pinned_sessions`` (in ``lifetime.stats()``) counts pinned *requests* (outstanding pins: +1 per
      ``pin``, -1 per first call of its unpin), so it returns to 0 exactly when every
      request has released. ``pinned`` counts distinct pinned session ids.
    - ``get`` is a peek: it does not refresh recency. ``pin`` does.
    - Entries and pins are keyed by ``session_key(session_id)``, a 16-byte digest: the book never
      keeps a client's id itself, so what it holds per session does not grow with the id's length.
    """

    __slots__ = ("_max_sessions", "_counters", "_on_change", "_entries", "_pins", "recomputations")

    claims_at_admission: ClassVar[bool] = False
    """Whether the forwarder awaits ``claim`` at admission. This book decides at the record: the
    single-process path adds no await."""

    def __init__(
        self,
        *,
        max_sessions: int,
        lifetime: Lifetime | None = None,
        on_change: Callable[[str, Fingerprint], None] | None = None,
    ) -> None:
        check_argument("max_sessions", max_sessions, at_least_one, integer=True)
        self._max_sessions = max_sessions
        # The pins count toward the middleware's stats (``pinned_sessions``) when it is given.
        self._counters = lifetime.counters if lifetime is not None else Counters()
        self._on_change = on_change
        self._entries: OrderedDict[bytes, SessionEntry] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self.recomputations = 0

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    @property
    def pinned(self) -> int:
        """Number of distinct session ids pinned right now."""
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return isinstance(session_id, str) and session_key(session_id) in self._entries

    def get(self, session_id: str) -> SessionEntry | None:
        """The session's entry, or ``None``. Does not refresh recency."""
        return self._entries.get(session_key(session_id))

    def pin(self, session_id: str) -> Callable[[], None]:
        """Pin ``session_id`` for one request; returns its idempotent unpin."""
        key = session_key(session_id)
        self._pins[key] = self._pins.get(key, 0) + 1
        self._counters.pinned_sessions += 1
        if key in self._entries:
            self._entries.move_to_end(key)
        return _Unpin(self, key)

    def _unpin(self, key: bytes) -> None:
        self._counters.pinned_sessions -= 1
        remaining = self._pins[key] - 1
        if remaining:
            self._pins[key] = remaining
        else:
            del self._pins[key]
            self._evict()

    async def claim(self, session_id: str, fingerprint: Fingerprint, started: float) -> Claim | None:
        """Decide at admission whether this request carries its session's change (``Outcome.claim``).

        Awaited only where ``claims_at_admission`` is true. This book decides at the record: ``None``.
        """
        return None

    def record(self, outcome: Outcome) -> None:
        session_id = outcome.session_id
        if session_id is None:
            return
        self._sync(session_id, outcome.fingerprint, self._update(session_id, outcome))

    def store_state(self) -> StoreState:
        """The session store's health for the metrics: this book is its own store, always up."""
        return StoreState(up=True, fallbacks=0, local_records=0)

    def _update(self, session_id: str, outcome: Outcome) -> SessionEntry:
        """Store the outcome's scalars in the session's entry (made most recently used); ``on_change`` aside."""
        fp = outcome.fingerprint
        key = session_key(session_id)
        entry = self._entries.get(key)
        if entry is None:
            entry = SessionEntry(wire_hash=fp.wire_hash, text_comparable=fp.text_comparable, size=fp.size)
            self._entries[key] = entry
        else:
            entry.wire_hash, entry.text_comparable, entry.size = fp.wire_hash, fp.text_comparable, fp.size
            self._entries.move_to_end(key)
        entry.requests += 1
        entry.bytes_out += outcome.bytes_out
        entry.last_status = outcome.status
        entry.last_outcome = outcome.outcome
        entry.last_seen = outcome.ended
        self._evict(keep=key)
        return entry

    def _sync(self, session_id: str, fp: Fingerprint, entry: SessionEntry) -> None:
        """This process decides: run ``on_change`` unless it last completed for this wire hash."""
        if entry.synced_hash == fp.wire_hash:
            return
        self.recomputations += 1
        if self._on_change is not None:
            self._on_change(session_id, fp)
        entry.synced_hash = fp.wire_hash

    def _evict(self, keep: bytes | None = None) -> None:
        """Drop least recently used unpinned entries down to ``max_sessions``, as far as pins allow.

        ``keep``, the session just recorded, is never the victim: the most recently used
        entry always survives its own record, even when every older entry is pinned.
        """
        excess = len(self._entries) - self._max_sessions
        if excess <= 0:
            return
        victims: list[bytes] = []
        for key in self._entries:
            if key not in self._pins and key != keep:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            del self._entries[key]
