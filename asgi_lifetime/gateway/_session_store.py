"""A session book shared by every replica: ``RedisSessionBook`` (``SESSION_STORE=redis://...``).

One gateway process keeps its sessions in memory (``SessionBook``). Several replicas behind a
load balancer see the same session on different processes: each would run ``on_change`` for
the same change, and none would know that another is streaming for it. This book keeps the
sessions in Redis, and keeps the in-memory book underneath as it always was:

- **What crosses the wire: scalars only.** Per session, under a key made from the 16-byte
  ``session_key`` digest (never the id itself), a hash of the same scalars as ``SessionEntry``:
  wire hash, verdict, size, request and byte counts, last status, outcome and time. Each record
  renews its ``SESSION_TTL``. Nothing of the body, raw or parsed, is ever sent.
- **on_change exactly once in the fleet, decided at admission.** Before a request with a session
  id is forwarded, the forwarder awaits ``claim``: one server-side script that compares the wire
  hash (known at admission: the fingerprint is taken before any preparer) with the session's
  claimed hash and, if they differ, sets it. A session's next turn is admitted only after this
  turn's answer was sent, so the order in which Redis runs the claims is the order of the turns:
  every change between two successive turns is claimed by exactly one request, wherever its
  record lands and however late. Of several replicas admitting the same hash, one claims it.
  ``on_change`` still runs at the record (the end of the response, as in the in-memory book), in
  the process whose admission claimed it, for every record whatever its status (a failed or
  disconnected request's change is still a change, as in one process). If ``on_change`` raises, the
  claim is given back, so the session's next request (on any replica) runs it again. A replica
  that dies between its claim and the end of ``on_change`` (its requests in flight) loses those
  runs: the change is claimed, and a re-send of the same body elsewhere finds it so.
  ``record`` without a claim (a caller that uses the book alone) is decided when it reaches Redis,
  ordered by admission (wall clock): a record that arrives after a newer one (or after a newer
  claim) is counted but claims nothing and moves no hash back. Replicas on different hosts need
  clocks closer than a session's requests are apart for that ordering only.
- **Pins are leases.** A pin is also a member of the session's lease set in Redis, taken at
  admission, renewed every third of ``SESSION_LEASE`` while the response streams, removed at
  settle. A replica that dies stops renewing: its pins are gone within ``SESSION_LEASE``. While
  a session has a lease, its entry's TTL is renewed too.
- **The request waits on Redis once, at admission, for at most ``SESSION_STORE_TIMEOUT``.**
  The claim is the only awaited call: shielded (a request cancelled meanwhile still knows what it
  claimed, and its record runs it) and bounded; past the bound the book falls back (below).
- **A claim whose answer is lost is asked again.** Past the bound, on a lost connection or on an
  answer that is not one, the call may have run: the request is ``"unsure"``. Each claim carries a
  token (this replica and the request's monotonic admission), which Redis keeps beside the claimed
  hash, so asking again is idempotent: the record asks (``_RECLAIM``) whether this request holds the
  change, and runs ``on_change`` if so. If Redis is still unusable at the record, ``on_change`` runs
  here: at least once, never zero times (a lost answer of a claim that ran would otherwise leave the
  change run by nobody). The changes this process ran while Redis was unusable (and the claims whose
  record could not reach it) are told to Redis when it answers again, unless the session moved on:
  the same body re-sent to another replica then is no change again. A claimed request's record puts
  its claim back if Redis lost it meanwhile (a restart without persistence, ``FLUSHALL``).
- **What the request does not wait for.** ``pin``, the release and ``record`` only
  update the in-memory book and put a small operation on a bounded queue; they never await. One
  task per book (``run``: started by the app's lifespan) writes the queue to Redis and renews the
  leases, each call bounded by ``SESSION_STORE_TIMEOUT``. Why a queue for those: the release runs
  at settle, on every path, cancellation included, where an await would hold the request open;
  and their order only matters for counts and leases, not for the decision.
- **Redis slow or down: the local book.** A call that fails or takes longer than the bound
  switches the book to its in-memory half: admissions do not ask Redis (``"local"``) and records are
  decided there (``on_change`` by this process alone), one warning line says so and
  ``asgi_lifetime_session_store_up`` drops to 0 (``..._fallbacks_total`` counts the switches).
  The task asks meanwhile with a write (``_PROBE``: a Redis that answers but refuses writes is
  not back), less often while Redis flaps (``_RETRY_MAX``); when Redis takes it, one line says so,
  this process's leases are written again and admissions and records go back to Redis. A full
  queue (Redis slower than the traffic) settles that one operation locally.

redis-py's asyncio client runs on asyncio only. On another event loop (trio) the book says so
in one warning line and stays on its in-memory half.

```python
book = RedisSessionBook("redis://127.0.0.1:6379/0", max_sessions=10_000, on_change=rederive)
async with anyio.create_task_group() as tg:
    await tg.start(book.run)                    # connects (bounded), then writes and renews
    unpin = book.pin("sess-1")                  # never awaits
    claim = await book.claim("sess-1", fingerprint, started)    # at admission: bounded, shielded
    book.record(dataclasses.replace(outcome, claim=claim))      # runs on_change if claimed
    unpin()
    tg.cancel_scope.cancel()                    # releases this process's leases on the way out
```

Needs the ``redis`` extra: ``pip install 'asgi-lifetime[redis]'``. Redis is imported by ``run``
only, so importing the gateway does not import it.
"""

from __future__ import annotations

import asyncio  # only to tell whether redis-py's client can run here (_on_asyncio); no asyncio calls
import dataclasses
import importlib.util
import itertools
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import urlsplit

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._fingerprint import Fingerprint
from .._middleware import Lifetime
from .._settings import LifetimeSettings, check_argument, positive, redact_url
from ._bookkeeping import Claim, Outcome, SessionBook, SessionEntry, StoreState, session_key

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.client import Pipeline
    from redis.commands.core import AsyncScript

__all__ = ["RedisSessionBook", "make_session_book"]

logger = logging.getLogger(__name__)

KEY_PREFIX: Final = "asgi_lifetime"
"""Every key starts with it; the session's digest is a hash tag (``{...}``), so its two keys share a slot."""

# Operations waiting for the task; past this, one is settled locally (Redis is not keeping up).
_QUEUE_SIZE: Final = 1024
# Operations written in one round trip (a pipeline), at most. One round trip per operation let the queue
# fall seconds behind under load, and a record that late arrives after its session's next one.
_BATCH: Final = 256
# Bytes one answer from Redis may take, at most: the book's answers are a few scalars (a hash of ten fields at
# most). Past it the answer is not one (see _connect).
_ANSWER_MAX: Final = 64 * 1024
# Connections to Redis per process, at most; a call past them waits for one (see _connect).
_CONNECTIONS: Final = 100
# While Redis is down, how often the task asks whether it is back (at most; a third of the lease if shorter).
_RETRY_INTERVAL: Final = 1.0
# A Redis that fails again within this of answering (it flaps: restarted in a loop, paused, refusing writes
# between answers) is asked twice as late each time, up to this: each switch costs a warning line, the
# fleet's claims and a round of writes, so a long flap must not cost them every second.
_RETRY_MAX: Final = 60.0

# The claim at admission. KEYS[1] the session's entry. ARGV: wire hash, TTL in ms, wall-clock admission, the
# request's claim token (the replica and its monotonic admission: unique in the fleet). Returns 1 if this call
# changed the synced hash (the request's record runs on_change), else 0. 'claimer' names the request that
# claimed the synced hash: an answer lost on the way back is asked for again (_RECLAIM). Awaited by
# the request before it is forwarded: a session's next turn is admitted only after this one's answer was
# sent, so the order in which Redis runs the claims is the order of the turns. 'admitted' (the newest
# admission that asked) keeps a record decided at settle (one not claimed at admission) from claiming a
# change a newer turn has already claimed.
_CLAIM: Final = """
local admitted = redis.call('HGET', KEYS[1], 'admitted')
if not admitted or tonumber(ARGV[3]) > tonumber(admitted) then
  redis.call('HSET', KEYS[1], 'admitted', ARGV[3])
end
local synced = redis.call('HGET', KEYS[1], 'synced_hash')
if synced == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('HSET', KEYS[1], 'synced_hash', ARGV[1], 'claimer', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# A claim whose answer never came (timeout, connection lost, garbage), asked again at the request's record.
# KEYS[1] the session's entry. ARGV as _CLAIM's. Returns 1 if the request carries its session's change (its
# record runs on_change), else 0. Idempotent: whether the lost call ran or not, the answer is the one it
# would have had. Its claim still stands: 1. Another request holds this hash: 0 (that one runs it). Else the
# change is this request's: claimed now if no newer request was admitted since, or (one was: it claimed its
# own change after this one, whether or not this one's call ran first) run without moving the hash back.
_RECLAIM: Final = """
if redis.call('HGET', KEYS[1], 'claimer') == ARGV[4] then
  return 1
end
if redis.call('HGET', KEYS[1], 'synced_hash') == ARGV[1] then
  return 0
end
local admitted = redis.call('HGET', KEYS[1], 'admitted')
if not admitted or tonumber(ARGV[3]) >= tonumber(admitted) then
  redis.call('HSET', KEYS[1], 'admitted', ARGV[3], 'synced_hash', ARGV[1], 'claimer', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
"""

# KEYS[1] the session's entry. ARGV: wire hash, verdict (0/1), size, bytes out, status, outcome, wall-clock
# end, TTL in ms, wall-clock start (admission), 1 if the record decides the change (it was not claimed at
# admission) else 0, the claim token of a request that claimed its change at admission else ''. Returns {1 if
# this call changed the synced hash (the caller runs on_change) else 0, the synced hash or ''}. One script:
# the compare-and-update is atomic.
# A claimed request's record finds no synced hash if Redis lost it between the claim and the record (a
# restart without persistence, FLUSHALL, an expiry while the lease renewals failed): the newest record puts
# its claim back, or a re-send of the same body elsewhere would claim (and run) the change again.
# Records reach Redis through per-process queues, so one can arrive after a newer record of its session
# (sent by another worker or replica): the order that counts is the requests' admission, not the arrival.
# A record older than the newest one taken (an earlier 'started') is counted (requests, bytes) but
# describes nothing current: it neither claims a change nor moves the hashes back; nor does a deciding
# record older than the newest claim at admission. Admission, not the end: a response ends (and is
# recorded) after its client has it, so the client's next request, on another process, can end first;
# it cannot start first.
_RECORD: Final = """
local started = tonumber(ARGV[9])
local newest = redis.call('HGET', KEYS[1], 'started')
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'bytes_out', ARGV[4])
local seen = redis.call('HGET', KEYS[1], 'last_seen')
if not seen or tonumber(ARGV[7]) > tonumber(seen) then
  redis.call('HSET', KEYS[1], 'last_seen', ARGV[7])
end
redis.call('PEXPIRE', KEYS[1], ARGV[8])
local synced = redis.call('HGET', KEYS[1], 'synced_hash')
if newest and started < tonumber(newest) then
  return {0, synced or ''}
end
redis.call('HSET', KEYS[1], 'wire_hash', ARGV[1], 'text_comparable', ARGV[2], 'size', ARGV[3],
           'last_status', ARGV[5], 'last_outcome', ARGV[6], 'started', ARGV[9])
if ARGV[10] == '0' then
  if not synced and ARGV[11] ~= '' then
    redis.call('HSET', KEYS[1], 'synced_hash', ARGV[1], 'claimer', ARGV[11])
    return {0, ARGV[1]}
  end
  return {0, synced or ''}
end
local admitted = redis.call('HGET', KEYS[1], 'admitted')
if admitted and started < tonumber(admitted) then
  return {0, synced or ''}
end
if synced == ARGV[1] then
  return {0, synced}
end
redis.call('HSET', KEYS[1], 'synced_hash', ARGV[1])
redis.call('HDEL', KEYS[1], 'claimer')
return {1, ARGV[1]}
"""

# on_change failed: give the claim back, unless another record changed it since.
_UNCLAIM: Final = """
if redis.call('HGET', KEYS[1], 'synced_hash') == ARGV[1] then
  return redis.call('HDEL', KEYS[1], 'synced_hash', 'claimer')
end
return 0
"""

# KEYS: (lease set, entry) per session. ARGV: lease ms, TTL ms, then per session a count and that
# many members. Expired members go; each member expires lease ms from the server's clock; the set
# itself expires with its last member; a leased session's entry gets its TTL back.
_RENEW: Final = """
local lease, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local a = 3
for k = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a])
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now)
  for i = a + 1, a + n do
    redis.call('ZADD', KEYS[k], now + lease, ARGV[i])
  end
  a = a + n + 1
  local last = redis.call('ZRANGE', KEYS[k], -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', KEYS[k], last[2])
  end
  redis.call('PEXPIRE', KEYS[k + 1], ttl)
end
return 1
"""

# Whether Redis takes the book's writes, not only answers: a replica (-READONLY), a full one under noeviction
# (-OOM), one that cannot persist (-MISCONF) or a user without the rights (-NOPERM) answer PING but refuse
# every claim. KEYS[1] a key of the book's own; nothing is left behind (a hash without fields is no key). Only
# commands the book's own writes use: an ACL granting exactly those (no SET, no DEL) must not keep it down.
_PROBE: Final = """
redis.call('HSET', KEYS[1], 'probe', '1')
redis.call('HDEL', KEYS[1], 'probe')
return 1
"""

# KEYS[1] a lease set: the members not expired by the server's clock.
_LIVE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""


def entry_key(key: bytes) -> str:
    """The Redis key of a session's entry (a hash), from its ``session_key`` digest."""
    return f"{KEY_PREFIX}:{{{key.hex()}}}:session"


def leases_key(key: bytes) -> str:
    """The Redis key of a session's lease set (a sorted set: member -> expiry in server ms)."""
    return f"{KEY_PREFIX}:{{{key.hex()}}}:leases"


@dataclass(frozen=True, slots=True)
class _LeaseOp:
    """Take (``take``) or give back a session's lease ``member``."""

    key: bytes
    member: str
    take: bool


@dataclass(frozen=True, slots=True)
class _Record:
    session_id: str  # stays in this process (on_change gets it); Redis gets session_key's digest
    outcome: Outcome
    started: float
    """Wall-clock admission of the request: the fleet orders a session's records by it (the monotonic
    clocks of two hosts do not compare)."""
    seen: float
    """Wall-clock end of the response."""
    decides: bool
    """True if Redis decides the change now (no claim at admission); False: the scalars only."""
    token: str = ""
    """The request's claim token if it claimed its change at admission, else ''."""


@dataclass(frozen=True, slots=True)
class _Unclaim:
    """``on_change`` failed for a change claimed at admission: give the claim back."""

    key: bytes
    wire_hash: str


@dataclass(frozen=True, slots=True)
class _Reclaim:
    """A claim whose answer never came, asked again at the request's record (``_RECLAIM``)."""

    session_id: str  # stays in this process (on_change gets it); Redis gets session_key's digest
    fingerprint: Fingerprint
    token: str
    admitted: float
    """Wall-clock admission of the request."""
    ran: bool = False
    """True: ``on_change`` already ran here (Redis was unusable at the record); Redis is only told, so that
    the same body re-sent to another replica is not a change again."""


_Op = _LeaseOp | _Record | _Unclaim | _Reclaim
_State = Literal["idle", "starting", "up", "down"]


class _Conn:
    """The client and its scripts, for as long as ``run`` runs."""

    __slots__ = ("client", "claim", "reclaim", "record", "unclaim", "renew", "probe", "live")

    def __init__(self, client: Redis) -> None:
        self.client = client
        self.claim: AsyncScript = client.register_script(_CLAIM)
        self.reclaim: AsyncScript = client.register_script(_RECLAIM)
        self.record: AsyncScript = client.register_script(_RECORD)
        self.unclaim: AsyncScript = client.register_script(_UNCLAIM)
        self.renew: AsyncScript = client.register_script(_RENEW)
        self.probe: AsyncScript = client.register_script(_PROBE)
        self.live: AsyncScript = client.register_script(_LIVE)


class _Lease:
    """The idempotent release ``RedisSessionBook.pin`` returns: the local pin, then the lease."""

    __slots__ = ("_book", "_unpin", "_member")

    def __init__(self, book: RedisSessionBook, unpin: Callable[[], None], member: str) -> None:
        self._book: RedisSessionBook | None = book
        self._unpin = unpin
        self._member = member

    def __call__(self) -> None:
        book, self._book = self._book, None
        if book is not None:
            self._unpin()
            book._end_lease(self._member)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (the package imports redis only to use it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it outright
        return False


def _on_asyncio() -> bool:
    """redis-py's asyncio client needs asyncio's loop; under trio there is none in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RedisSessionBook(SessionBook):
    """A ``SessionBook`` whose sessions, ``on_change`` decisions and pins are shared through Redis.

    ```python
    book = RedisSessionBook("redis://redis:6379/0", max_sessions=10_000, on_change=rederive)
    async with anyio.create_task_group() as tg:
        await tg.start(book.run)        # the app's lifespan does this for SESSION_STORE=redis://...
        ...
    ```

    The same interface as ``SessionBook`` (``pin`` returns the release, ``record`` takes an
    ``Outcome``), neither of which awaits, and ``claim``, which the forwarder awaits at admission
    (``claims_at_admission``: one bounded script call) and whose answer the record carries
    (``Outcome.claim``); the in-memory entries (``get``, ``len``) are this
    process's view, and decide alone while Redis cannot (see the module docstring). ``lookup``
    and ``live_leases`` read what the fleet shares.

    ``url``: ``redis://`` or ``rediss://`` (TLS), with ``user:password@`` and ``/db`` as redis-py
    reads them. ``ttl``: seconds a session's entry outlives its last request or lease. ``lease``:
    seconds a pin outlives a replica that stopped renewing it. ``timeout``: the bound on each call
    to Redis, at most half of ``lease``.
    """

    claims_at_admission = True

    __slots__ = (
        "_url",
        "_shown",
        "_ttl_ms",
        "_lease_ms",
        "_timeout",
        "_interval",
        "_replica",
        "_serial",
        "_leases",
        "_send",
        "_conn",
        "_state",
        "_idle_warned",
        "_retry",
        "_up_since",
        "_ran_here",
        "fallbacks",
        "local_records",
    )

    def __init__(
        self,
        url: str,
        *,
        max_sessions: int,
        lifetime: Lifetime | None = None,
        on_change: Callable[[str, Fingerprint], None] | None = None,
        ttl: float = 86_400.0,
        lease: float = 15.0,
        timeout: float = 0.25,
    ) -> None:
        super().__init__(max_sessions=max_sessions, lifetime=lifetime, on_change=on_change)
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("redis", "rediss") or not parts.hostname:
            shown = redact_url(url) if isinstance(url, str) else repr(url)
            raise ValueError(f"url must be a redis:// or rediss:// URL with a host, got {shown!r}")
        for name, value in (("ttl", ttl), ("lease", lease), ("timeout", timeout)):
            check_argument(name, value, positive)
        if timeout * 2 > lease:
            raise ValueError(f"timeout ({timeout:g}) must be at most half of lease ({lease:g})")
        if not _installed("redis"):
            raise ModuleNotFoundError(
                f"the session store {redact_url(url)} needs redis-py: pip install 'asgi-lifetime[redis]'", name="redis"
            )
        self._url = url
        self._shown = redact_url(url)
        self._ttl_ms = max(1, round(ttl * 1000))
        self._lease_ms = max(1, round(lease * 1000))
        self._timeout = float(timeout)
        self._interval = lease / 3
        self._replica = secrets.token_hex(8)  # names this process's lease members; nothing else
        self._serial = itertools.count()
        self._leases: dict[str, bytes] = {}  # member -> session key: this process's live pins
        self._send: MemoryObjectSendStream[_Op] | None = None
        self._conn: _Conn | None = None
        self._state: _State = "idle"
        self._idle_warned = False
        self._retry = min(self._interval, _RETRY_INTERVAL)  # the wait between two asks while Redis is down
        self._up_since = -math.inf  # monotonic time Redis last answered after not answering (or at the start)
        # Changes claimed by this process's requests that on_change ran for here while Redis was unusable:
        # told to Redis when it answers again (as claims asked again, ``_Reclaim.ran``). Bounded: past it,
        # the oldest is forgotten (a re-send of its body elsewhere runs on_change once more).
        self._ran_here: OrderedDict[str, _Reclaim] = OrderedDict()
        self.fallbacks = 0
        """Times the book switched to its in-memory half (Redis unusable, not asyncio, not started)."""
        self.local_records = 0
        """Records decided in memory, in place of Redis."""

    @property
    def url(self) -> str:
        """The store's URL, any password replaced by ``***``."""
        return self._shown

    @property
    def up(self) -> bool:
        """True while records and pins go to Redis."""
        return self._state == "up"

    def store_state(self) -> StoreState:
        return StoreState(up=self.up, fallbacks=self.fallbacks, local_records=self.local_records)

    # --- the request path: never awaits -------------------------------------------------------------

    def pin(self, session_id: str) -> Callable[[], None]:
        """Pin ``session_id`` here and take a lease on it in Redis; returns the idempotent release."""
        unpin = super().pin(session_id)
        key = session_key(session_id)
        member = f"{self._replica}:{next(self._serial)}"
        self._leases[member] = key  # renewed by the task from now on, even if the op below is dropped
        self._submit(_LeaseOp(key, member, take=True))
        return _Lease(self, unpin, member)

    def _end_lease(self, member: str) -> None:
        key = self._leases.pop(member, None)
        if key is not None:
            self._submit(_LeaseOp(key, member, take=False))  # if dropped, the lease runs out: nobody renews it now

    async def claim(self, session_id: str, fingerprint: Fingerprint, started: float) -> Claim | None:
        """At admission: ask Redis whether this request carries its session's change (one script call).

        Bounded by ``timeout`` and shielded (a cancelled request still knows what it claimed, and its record
        says so). Redis unusable already: ``"local"``, decided by this process's memory at the record. Past the
        bound, on an error or on an answer that is not one: the book falls back, and the request is
        ``"unsure"`` (the call may have run): its record asks again. ``started``: ``time.monotonic()`` at
        admission, the ``Outcome``'s own (it names the request's claim: see ``_token``).
        """
        conn = self._conn
        if self._state != "up" or conn is None:
            if self._state == "idle":
                self._warn_idle()
            return "local"
        admitted = started + time.time() - time.monotonic()  # wall clock: the fleet's hosts compare it
        args: list[str | int] = [fingerprint.wire_hash, self._ttl_ms, repr(admitted), self._token(started)]
        try:
            with anyio.fail_after(self._timeout, shield=True):
                answer: Any = await conn.claim(keys=[entry_key(session_key(session_id))], args=args)
            claimed = _flag(answer)
        except Exception as exc:  # whatever it is, the fleet's answer did not reach us
            self._fall_back(_why(exc, self._timeout))
            return "unsure"
        return "claimed" if claimed else "synced"

    def _token(self, started: float) -> str:
        """Names one request's claim in the fleet: this book (replica) and the request's monotonic admission,
        which the claim and the record (``Outcome.started``) both have."""
        return f"{self._replica}:{started!r}"

    def record(self, outcome: Outcome) -> None:
        session_id = outcome.session_id
        if session_id is None:
            return
        entry = self._update(session_id, outcome)
        claim = outcome.claim
        offset = time.time() - time.monotonic()  # monotonic -> wall clock, for the fleet's comparisons
        admitted = outcome.started + offset
        if claim == "local":
            self.local_records += 1
            runs = self.recomputations
            self._sync(session_id, outcome.fingerprint, entry)
            if self.recomputations != runs:  # a change this process decided alone: Redis learns it when back
                self._keep_ran(_Reclaim(session_id, outcome.fingerprint, self._token(outcome.started), admitted))
            return
        token = self._token(outcome.started) if claim == "claimed" else ""
        op = _Record(session_id, outcome, admitted, outcome.ended + offset, decides=claim is None, token=token)
        if claim is None:  # not claimed at admission (a caller of record alone): Redis decides now
            if not self._submit(op):
                self.local_records += 1
                self._sync(session_id, outcome.fingerprint, entry)
            return
        if not self._submit(op) and claim == "claimed":  # the scalars only (if dropped, Redis misses a count)...
            self._keep_ran(_Reclaim(session_id, outcome.fingerprint, token, admitted))  # ...and its claim is told
        if claim == "unsure":  # the claim's answer was lost: ask again, or run it (at least once, never zero)
            again = _Reclaim(session_id, outcome.fingerprint, self._token(outcome.started), admitted)
            if not self._submit(again):
                self.local_records += 1
                self._run_claimed(session_id, outcome.fingerprint, entry, claimed=True)
                self._keep_ran(again)
            return
        self._run_claimed(session_id, outcome.fingerprint, entry, claimed=claim == "claimed")

    def _keep_ran(self, op: _Reclaim) -> None:
        """Remember a change ``on_change`` ran for here while Redis was unusable, to tell Redis when it is back
        (a Redis that restarted meanwhile may have lost the claim)."""
        self._ran_here[op.token] = dataclasses.replace(op, ran=True)
        while len(self._ran_here) > _QUEUE_SIZE:
            self._ran_here.popitem(last=False)

    async def _tell_ran(self, conn: _Conn) -> None:
        """Redis answers again: write the changes run here meanwhile (``_RECLAIM`` claims each unless the
        session has moved on since, so a re-send of the same body elsewhere finds it synced). Written by
        the task itself, not queued: they would crowd the queue out. What Redis does not take is kept."""
        while self._ran_here and self._state == "up":
            ops: list[_Op] = []
            while self._ran_here and len(ops) < _BATCH:
                ops.append(self._ran_here.popitem(last=False)[1])
            await self._apply(conn, ops)  # on failure each is settled here: kept for the next time

    def _run_claimed(self, session_id: str, fp: Fingerprint, entry: SessionEntry, *, claimed: bool) -> None:
        """The fleet decided at admission: run ``on_change`` if this request claimed the change."""
        if claimed:
            self.recomputations += 1
            if self._on_change is not None:
                try:
                    self._on_change(session_id, fp)
                except Exception:
                    # The session's next request (on any replica) claims it again, as the in-memory book would.
                    if not self._submit(_Unclaim(session_key(session_id), fp.wire_hash)):
                        logger.warning("on_change failed and its claim could not be given back (session store down)")
                    raise
        entry.synced_hash = fp.wire_hash  # the fleet has run on_change for it (here or elsewhere)

    def _submit(self, op: _Op) -> bool:
        """Queue ``op`` for the task; False if it must be settled here (Redis not up, queue full)."""
        send = self._send
        if self._state != "up" or send is None:
            if self._state == "idle":
                self._warn_idle()
            return False
        try:
            send.send_nowait(op)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    def _warn_idle(self) -> None:
        if self._idle_warned:
            return
        self._idle_warned = True
        self.fallbacks += 1
        logger.warning(
            "session store %s is not running (RedisSessionBook.run was not started: an app mounted in another "
            "app does not get its lifespan): sessions are kept in this process only",
            self._shown,
        )

    # --- the task ---------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect (waiting at most ``timeout``), then write queued operations and renew leases until
        cancelled; on the way out, remove this process's leases. Start it with ``tg.start``.

        Never raises for Redis being unusable: the book falls back to memory and keeps trying.
        """
        if self._state != "idle":
            raise RuntimeError("RedisSessionBook.run() is already running")
        self._state = "starting"
        try:
            if not _on_asyncio():
                self._fall_back("redis-py's client needs asyncio and this event loop is not asyncio")
                task_status.started()
                await anyio.sleep_forever()
            conn = self._conn = _Conn(_connect(self._url, self._timeout))
            send, receive = anyio.create_memory_object_stream[_Op](_QUEUE_SIZE)
            with send, receive:  # closed after _leave has read what is left in the queue
                try:
                    await self._check(conn)
                    self._send = send
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._write, conn, receive)
                        tg.start_soon(self._keep_leases, conn)
                        task_status.started()
                finally:
                    self._send = None
                    with anyio.CancelScope(shield=True):
                        await self._leave(conn, receive)
                        with anyio.move_on_after(self._timeout):
                            await conn.client.aclose()
        finally:
            self._state, self._conn = "idle", None
            # Requests that outlive the lifespan release here afterwards: expected, not worth a warning.
            self._idle_warned = True

    async def _write(self, conn: _Conn, receive: MemoryObjectReceiveStream[_Op]) -> None:
        async for op in receive:
            ops = [op]  # and whatever else is queued: one round trip for all (the order is kept)
            while len(ops) < _BATCH:
                try:
                    ops.append(receive.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            # An operation taken is finished even when the lifespan ends meanwhile: each of its calls is
            # bounded, and a record cut in half would be lost (or its on_change claimed and never run).
            with anyio.CancelScope(shield=True):
                await self._apply(conn, ops)

    async def _apply(self, conn: _Conn, ops: list[_Op]) -> None:
        if self._state != "up":
            for op in ops:
                self._settle_here(op)
            return
        try:
            with anyio.fail_after(self._timeout):
                async with conn.client.pipeline(transaction=False) as pipe:
                    for op in ops:
                        await self._queue_op(conn, pipe, op)
                    answers: list[Any] = await pipe.execute()
            # Read every answer before acting on any: an answer that is not one is Redis failing, like no answer.
            decisions = [_decision(op, answer) for op, answer in zip(ops, answers, strict=True)]
        except Exception as exc:  # whatever it is, Redis did not take the operations: settle them here
            self._fall_back(_why(exc, self._timeout))
            for op in ops:
                self._settle_here(op)
            return
        for op, decision in zip(ops, decisions, strict=True):
            if isinstance(op, _Record) and op.decides and decision is not None:
                changed, synced = decision
                await self._decided(conn, op, changed, synced)
            elif isinstance(op, _Reclaim) and not op.ran and decision is not None:
                await self._reclaimed(conn, op, claimed=decision[0])

    async def _queue_op(self, conn: _Conn, pipe: Pipeline, op: _Op) -> None:
        """Add ``op`` to ``pipe`` (nothing is sent yet). A record's answer: {changed, synced hash or ''}."""
        if isinstance(op, _LeaseOp):
            if op.take:
                keys = [leases_key(op.key), entry_key(op.key)]
                await conn.renew(keys=keys, args=[self._lease_ms, self._ttl_ms, 1, op.member], client=pipe)
            else:
                pipe.zrem(leases_key(op.key), op.member)
            return
        if isinstance(op, _Unclaim):
            await conn.unclaim(keys=[entry_key(op.key)], args=[op.wire_hash], client=pipe)
            return
        if isinstance(op, _Reclaim):
            again: list[str | int] = [op.fingerprint.wire_hash, self._ttl_ms, repr(op.admitted), op.token]
            await conn.reclaim(keys=[entry_key(session_key(op.session_id))], args=again, client=pipe)
            return
        fp, outcome = op.outcome.fingerprint, op.outcome
        args: list[str | int] = [
            fp.wire_hash,
            int(fp.text_comparable),
            fp.size,
            outcome.bytes_out,
            outcome.status,
            outcome.outcome,
            repr(op.seen),
            self._ttl_ms,
            repr(op.started),
            int(op.decides),
            op.token,
        ]
        await conn.record(keys=[entry_key(session_key(op.session_id))], args=args, client=pipe)

    async def _decided(self, conn: _Conn, op: _Record, changed: bool, synced: str | None) -> None:
        """Redis took the record: run ``on_change`` if this process's record changed the synced hash.

        ``synced``: the fleet's synced hash after the record; not this record's own hash when a newer
        record of the session got to Redis first."""
        fp = op.outcome.fingerprint
        entry = self._entries.get(session_key(op.session_id))
        if changed:
            self.recomputations += 1
            if self._on_change is not None:
                try:
                    self._on_change(op.session_id, fp)
                except Exception:
                    logger.exception("on_change failed; the session's next record runs it again")
                    await self._unclaim(conn, op.session_id, fp.wire_hash)
                    return
        if entry is not None and synced is not None:
            entry.synced_hash = synced  # the fleet has run on_change for it (here or elsewhere)

    async def _reclaimed(self, conn: _Conn, op: _Reclaim, *, claimed: bool) -> None:
        """Redis answered a claim asked again: run ``on_change`` if the request carries its change."""
        entry = self._entries.get(session_key(op.session_id))
        if claimed:
            self.recomputations += 1
            if self._on_change is not None:
                try:
                    self._on_change(op.session_id, op.fingerprint)
                except Exception:
                    logger.exception("on_change failed; the session's next record runs it again")
                    await self._unclaim(conn, op.session_id, op.fingerprint.wire_hash)
                    return
        if entry is not None:
            entry.synced_hash = op.fingerprint.wire_hash  # the fleet has run on_change for it (here or elsewhere)

    async def _unclaim(self, conn: _Conn, session_id: str, wire_hash: str) -> None:
        key = entry_key(session_key(session_id))
        try:
            with anyio.fail_after(self._timeout):
                await conn.unclaim(keys=[key], args=[wire_hash])
        except Exception as exc:
            self._fall_back(_why(exc, self._timeout))

    def _settle_here(self, op: _Op) -> None:
        """An operation Redis did not take. A lease: the renewals restore it (or it runs out). A record:
        decided by the in-memory book, as the request would have had Redis been unused (unless it was
        decided at admission). A claim to give back: kept (the next record of that hash does not run it).
        A claim asked again: run (its first call may have claimed the change: at least once, never zero)."""
        if isinstance(op, _Reclaim) and op.ran:
            self._keep_ran(op)  # told when Redis is back
            return
        if isinstance(op, _Reclaim):
            self.local_records += 1
            entry = self._entries.get(session_key(op.session_id))
            if entry is None:
                entry = SessionEntry(op.fingerprint.wire_hash, op.fingerprint.text_comparable, op.fingerprint.size)
            try:
                self._run_claimed(op.session_id, op.fingerprint, entry, claimed=True)
            except Exception:
                logger.exception("on_change failed; the session's next record runs it again")
                return
            self._keep_ran(op)
            return
        if isinstance(op, _Record) and op.token:  # a claimed request's record: Redis is told of its claim when back
            self._keep_ran(_Reclaim(op.session_id, op.outcome.fingerprint, op.token, op.started))
            return
        if not isinstance(op, _Record) or not op.decides:
            return
        self.local_records += 1
        entry = self._entries.get(session_key(op.session_id))
        if entry is None:
            return  # evicted meanwhile: its next record decides
        try:
            self._sync(op.session_id, op.outcome.fingerprint, entry)
        except Exception:
            logger.exception("on_change failed; the session's next record runs it again")

    async def _keep_leases(self, conn: _Conn) -> None:
        """Renew this process's leases every third of the lease while up; while down, ask whether
        Redis is back."""
        while True:
            if self._state == "up":
                await anyio.sleep(self._interval)
                try:
                    with anyio.fail_after(self._timeout):
                        await self._renew(conn)
                except Exception as exc:
                    self._fall_back(_why(exc, self._timeout))
            else:
                await anyio.sleep(self._retry)
                await self._check(conn)

    async def _renew(self, conn: _Conn) -> None:
        by_session: dict[bytes, list[str]] = {}
        for member, key in self._leases.items():
            by_session.setdefault(key, []).append(member)
        if not by_session:
            return
        keys: list[str] = []
        args: list[str | int] = [self._lease_ms, self._ttl_ms]
        for key, members in by_session.items():
            keys += [leases_key(key), entry_key(key)]
            args += [len(members), *members]
        await conn.renew(keys=keys, args=args)

    async def _check(self, conn: _Conn) -> None:
        """Write (bounded, ``_PROBE``); up if Redis takes it, with this process's leases written again, else down."""
        try:
            with anyio.fail_after(self._timeout):
                _flag(await conn.probe(keys=[f"{KEY_PREFIX}:probe"]))
                await self._renew(conn)  # Redis may be a new, empty one: its leases come back first
        except Exception as exc:
            self._fall_back(_why(exc, self._timeout))
            return
        if self._state == "down":
            logger.warning("session store %s answers again: sessions are shared again", self._shown)
        else:
            logger.info("sessions are kept in %s", self._shown)
        self._state = "up"
        self._up_since = time.monotonic()
        await self._tell_ran(conn)  # and those of an earlier run

    def _fall_back(self, why: str) -> None:
        if self._state in ("down", "idle"):  # idle: a claim that failed after run ended; a new run starts afresh
            return
        self._state = "down"
        self.fallbacks += 1
        base = min(self._interval, _RETRY_INTERVAL)
        flapping = time.monotonic() - self._up_since < _RETRY_MAX
        self._retry = min(self._retry * 2, _RETRY_MAX) if flapping else base
        logger.warning(
            "session store %s unusable (%s): sessions are kept in this process only until it answers",
            self._shown,
            why,
        )

    async def _leave(self, conn: _Conn, receive: MemoryObjectReceiveStream[_Op]) -> None:
        """Stopping (shielded): write what is queued and remove this process's leases, within one bound."""
        with anyio.move_on_after(self._timeout):
            while self._state == "up":
                try:
                    op = receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                await self._apply(conn, [op])
            if self._state == "up" and self._leases:
                async with conn.client.pipeline(transaction=False) as pipe:
                    for member, key in self._leases.items():
                        pipe.zrem(leases_key(key), member)
                    await pipe.execute()

    # --- what the fleet shares ----------------------------------------------------------------------

    async def lookup(self, session_id: str) -> SessionEntry | None:
        """The session's entry as Redis has it (``last_seen`` in wall-clock seconds), or ``None``.

        Only while ``run`` runs; raises ``TimeoutError`` past ``timeout`` and redis-py's errors.
        """
        conn = self._running()
        with anyio.fail_after(self._timeout):
            raw = await conn.client.hgetall(entry_key(session_key(session_id)))
        if not raw:
            return None
        fields = {_text(k): _text(v) for k, v in raw.items()}
        # A session claimed at admission has no record yet until its first response ends.
        return SessionEntry(
            wire_hash=fields.get("wire_hash", ""),
            text_comparable=fields.get("text_comparable") == "1",
            size=int(fields.get("size", 0)),
            requests=int(fields.get("requests", 0)),
            bytes_out=int(fields.get("bytes_out", 0)),
            last_status=int(fields.get("last_status", 0)),
            last_outcome=fields.get("last_outcome", ""),
            last_seen=float(fields.get("last_seen", 0.0)),
            synced_hash=fields.get("synced_hash"),
        )

    async def live_leases(self, session_id: str) -> int:
        """How many pins the fleet holds on ``session_id`` right now (leases not run out)."""
        conn = self._running()
        with anyio.fail_after(self._timeout):
            count: Any = await conn.live(keys=[leases_key(session_key(session_id))])
        return int(count)

    def _running(self) -> _Conn:
        if self._conn is None:
            raise RuntimeError("RedisSessionBook.run() is not running")
        return self._conn


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _flag(answer: Any) -> bool:
    """A claim's answer: 1 or 0, else ``ValueError`` (not Redis, a proxy's garbage: as good as no answer)."""
    if isinstance(answer, int) and not isinstance(answer, bool) and answer in (0, 1):
        return answer == 1
    raise ValueError(f"unexpected answer from the session store: {type(answer).__name__}")


def _decision(op: _Op, answer: Any) -> tuple[bool, str | None] | None:
    """What Redis decided for ``op`` (a deciding record: changed and the synced hash; a claim asked again:
    claimed), ``None`` for the others; ``ValueError`` for an answer that is not one."""
    if isinstance(op, _Reclaim):
        return _flag(answer), None
    if not isinstance(op, _Record) or not op.decides:
        return None
    if not isinstance(answer, list) or len(answer) != 2 or not isinstance(answer[1], (bytes, str)):
        raise ValueError(f"unexpected answer from the session store: {type(answer).__name__}")
    return _flag(answer[0]), _text(answer[1]) or None


def _connect(url: str, timeout: float) -> Redis:
    from redis._parsers import _AsyncRESP2Parser
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import InvalidResponse

    class ShortAnswers(_AsyncRESP2Parser):
        """redis-py's RESP2 parser, refusing an answer past ``_ANSWER_MAX`` bytes. Alone, it read whatever a
        header announced from a peer on the port that is not Redis: ``$1000000000`` then bytes were buffered
        for the whole bound (121 MB in 0.2 s on loopback, per connection); ``*1000000000`` then integers were
        parsed from the buffer without an await, holding the event loop past the bound."""

        __slots__ = ("_taken",)

        def __init__(self, socket_read_size: int) -> None:
            super().__init__(socket_read_size)
            self._taken = 0

        async def read_response(self, disable_decoding: bool = False) -> Any:
            self._taken = 0
            return await super().read_response(disable_decoding)

        async def _read(self, length: int) -> bytes:
            self._take(length)
            return await super()._read(length)

        async def _readline(self) -> bytes:  # redis-py's stream bounds one line (64 KiB)
            line = await super()._readline()
            self._take(len(line))
            return line

        def _take(self, size: int) -> None:
            self._taken += size + 2
            if self._taken > _ANSWER_MAX:
                raise InvalidResponse(f"an answer over {_ANSWER_MAX} bytes: not the session store's")

    options: dict[str, Any] = {"parser_class": ShortAnswers}
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py before 7: no maintenance notifications, and the pool checks every connection
        pass
    else:
        # Enabled ("auto", redis-py's default), they turn off the pool's check of a connection before it is
        # lent: one the server closed meanwhile (a restart, its idle ``timeout``) then fails the next call on
        # it, and that call is a request's claim (the book falls back; the change is decided unsure). They
        # are for RESP3 clients of Redis Enterprise's maintenance; this client speaks RESP2.
        options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    # Each call is bounded by ``timeout`` here (anyio.fail_after); redis-py's own retries would only
    # wait longer under that bound. Its socket timeouts are a backstop, later than the bound.
    # A blocking pool: past its connections a call waits for one (within the same bound). redis-py's
    # default pool raises at once instead, so a burst of admissions on a healthy Redis made the book fall
    # back as if Redis were unusable.
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=_CONNECTIONS,
        timeout=timeout,
        socket_timeout=2 * timeout,
        socket_connect_timeout=2 * timeout,
        retry=Retry(NoBackoff(), 0),
        client_name="asgi-lifetime",
        # RESP2, as every Redis-compatible server speaks it (redis-py 8.2 defaults to RESP3: a ``HELLO 3``
        # that a server before Redis 6 refuses, and replies of other types to the ones read here).
        protocol=2,
        **options,
    )
    client: Redis = Redis.from_pool(pool)  # closes the pool with the client
    return client


def make_session_book(
    settings: LifetimeSettings,
    *,
    lifetime: Lifetime | None = None,
    on_change: Callable[[str, Fingerprint], None] | None = None,
) -> SessionBook:
    """The session book ``SESSION_STORE`` asks for: in memory, or shared through Redis."""
    if settings.session_store == "memory":
        return SessionBook(max_sessions=settings.bookkeeping_sessions, lifetime=lifetime, on_change=on_change)
    return RedisSessionBook(
        settings.session_store,
        max_sessions=settings.bookkeeping_sessions,
        lifetime=lifetime,
        on_change=on_change,
        ttl=settings.session_ttl,
        lease=settings.session_lease,
        timeout=settings.session_store_timeout,
    )
