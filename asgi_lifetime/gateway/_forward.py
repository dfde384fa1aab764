"""The gateway's request flow: read -> fingerprint -> prepare -> forward -> relay -> bookkeep.

``LifetimeMiddleware`` (outside) admits the request, reads and fingerprints the body and
hands over the first parse. ``Forwarder`` (inside) takes it from there. Input lives in the
``Prepared`` holder that the retries' settle point clears (``_InputCharge`` accounts for it until
then), never in a local of a frame that stays suspended while the answer streams.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from .._asgi import OWS, is_json, send_error, task_group, upstream_path
from .._exceptions import LifetimeError, MalformedBody, error_shape
from .._middleware import Lifetime, RequestLifetime
from .._resources import RequestResources, Resource
from ._bookkeeping import Bookkeeper, Claim, Outcome, SessionBook, record_outcome
from ._head import session_id as read_session_id
from ._memory import trim_after_large_request
from ._prepare import Prepared, Preparer, prepare
from ._refold import Conversation, Refold, default_refold
from ._relay import ClientWatch, RelayResult, filter_headers, relay
from ._shutdown import StopSignal, shutting_down
from ._spill import spill
from ._transport import close_response
from ._upstream import UpstreamClient

__all__ = ["Forwarder"]

logger = logging.getLogger(__name__)

# Request headers the gateway never forwards as received: the body is re-framed (and was
# decoded by the middleware), and the upstream's Host is its own.
_NOT_FORWARDED = frozenset({b"host", b"content-length", b"content-encoding", b"transfer-encoding", b"expect"})


class _InputCharge:
    """Accounts for the request's input from read until retries settle.

    The input itself is never held here: ``prepare()`` gets the only references to the raw
    body and its parse (it forwards the raw body unchanged, or frees it and the parse as it
    serializes a changed one), and the refold/remap closures re-parse the outbound body.
    """

    __slots__ = ("held", "size", "trim")

    def __init__(self, held: Resource, size: int, *, trim: bool) -> None:
        self.held: Resource | None = held
        self.size = size
        self.trim = trim  # the MALLOC_TRIM setting

    def release(self) -> None:
        """The settle point: the input's accounting ends, and freed heap goes back to the OS."""
        held, self.held = self.held, None
        if held is not None:
            held.release_now()
            trim_after_large_request(self.size, enabled=self.trim)  # give the freed parse back to the OS (glibc)


class _Exchange:
    """What forwarding and relaying one request tell its bookkeeping, filled in as they go."""

    __slots__ = ("attempts", "upstream", "result", "started")

    def __init__(self) -> None:
        self.attempts = 0
        self.upstream: str | None = None
        self.result: RelayResult | None = None  # None: the client left before the relay
        self.started = 0  # the status of the answer the relay started, 0 before

    def start(self, status: int) -> None:
        self.started = status


class Forwarder:
    """ASGI endpoint for forwarded routes. Per request state lives in holders and locals of
    ``__call__``; the instance only holds what all requests share."""

    def __init__(
        self,
        *,
        lifetime: Lifetime,
        upstream: UpstreamClient,
        preparers: Sequence[Preparer],
        bookkeepers: Sequence[Bookkeeper],
        book: SessionBook,
        refold_factory: Callable[[Conversation], Refold] = default_refold,
        stop: StopSignal | None = None,
    ) -> None:
        self.lifetime = lifetime
        self.settings = lifetime.settings
        self.upstream = upstream
        self.preparers = tuple(preparers)
        self.bookkeepers = tuple(bookkeepers)
        self.book = book
        self.refold_factory = refold_factory
        self.stop = stop
        # A shared book decides a session's change at admission; not if it records nothing (replaced by a
        # bookkeeper of the caller's): its claim would never run on_change.
        self._claims = book.claims_at_admission and any(each is book for each in self.bookkeepers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: RequestLifetime = scope["state"]["lifetime"]
        resources = state.resources
        started = time.monotonic()
        session_id: str | None = None
        status, outcome, bytes_out, first_byte_at = 0, "error", 0, None
        code: str | None = None
        exchange = _Exchange()
        claim: Claim | None = None
        try:
            session_id = read_session_id(scope["headers"], self.settings)  # RequestHead judged it
            if session_id is not None:
                resources.add(self.book.pin(session_id))
                if self._claims:  # bounded by SESSION_STORE_TIMEOUT; the in-memory book never gets here
                    claim = await self.book.claim(session_id, state.fingerprint, started)
            prepared, held = await self._prepare(scope, receive, state, session_id)
            await ClientWatch.watching(
                receive, functools.partial(self._exchange, scope, send, prepared, held, session_id, exchange)
            )
            result = exchange.result
            if result is None:  # the client left while retries were running
                status, outcome = 499, "client_disconnected"
                return
            status, outcome, bytes_out, first_byte_at, code = (
                result.status,
                result.outcome,
                result.bytes_out,
                result.first_byte_at,
                result.code,
            )
        except LifetimeError as exc:
            status, code = exc.status_code, exc.code
            if code == "shutting_down":  # ended by the drain before any answer, as a relay's would be
                outcome = "shutdown"
            await send_error(scope, send, exc)
        except Exception:
            # A defect escaped (the app's handler logs it, and answers 500 if nothing was sent yet): the
            # record says what the client got, not the status 0 of an answer it never learned.
            status = exchange.started or 500
            raise
        finally:
            finished = Outcome(
                fingerprint=state.fingerprint,
                session_id=session_id,
                path=scope["path"],
                status=status,
                bytes_out=bytes_out,
                attempts=exchange.attempts,
                upstream=exchange.upstream,
                started=started,
                first_byte_at=first_byte_at,
                ended=time.monotonic(),
                outcome=outcome,
                claim=claim,
                code=code,
            )
            for bookkeeper in self.bookkeepers:
                await record_outcome(bookkeeper, finished)

    async def _exchange(
        self,
        scope: Scope,
        send: Send,
        prepared: Prepared,
        held: _InputCharge,
        session_id: str | None,
        exchange: _Exchange,
        watch: ClientWatch,
    ) -> None:
        """Forward, then relay the answer (``exchange.result``; left None if the client left first)."""
        try:
            try:
                response = await self._forward(prepared, held, watch, session_id)
            finally:
                held.release()  # already done at settle; here for the paths that never reached it
            if response is None:
                return
            resources: RequestResources = scope["state"]["lifetime"].resources
            # Closed when the request settles, whatever happens below. Most often the relay read it to its end
            # and it is closed by then: its aclose() would do nothing, and awaiting it costs a shielded scope.
            resources.add(lambda: None if response.is_closed else response.aclose())
            exchange.result = await self._relay(scope, watch, send, response, prepared, session_id, exchange.start)
        finally:
            # Also when every attempt failed, the client left meanwhile, or a starved stream was re-issued:
            # the upstream tried last is named whether or not it answered (which one failed, for the operator).
            exchange.attempts = prepared.attempts
            exchange.upstream = prepared.upstream

    async def _relay(
        self,
        scope: Scope,
        watch: ClientWatch,
        send: Send,
        response: httpx.Response,
        prepared: Prepared,
        session_id: str | None,
        on_start: Callable[[int], None],
    ) -> RelayResult:
        """Relay ``response``, keeping the retained outbound body (in memory, or on disk as soon as it
        is written there) for one re-issue until the relay ends."""
        resources: RequestResources = scope["state"]["lifetime"].resources
        retained = prepared.body_size
        kept = resources.retain(retained) if retained else None  # the retained outbound body, for one re-issue

        async def reissue() -> httpx.Response | None:
            return await self.upstream.reissue(prepared, session_id=session_id)

        async def relay_response() -> RelayResult:
            return await relay(
                response,
                send=send,
                receive=watch.receive,
                watch=watch,
                stall_timeout=self.settings.stall_timeout,
                keepalive_interval=self.settings.keepalive_interval,
                reissue=reissue if prepared.has_body else None,
                counters=self.lifetime.counters,
                on_start=on_start,
                stop=self.stop,
                error_shape=error_shape(scope["path"], scope["headers"]),
            )

        if kept is not None and self._spills(retained):
            result = await self._relay_spilling(relay_response, prepared, kept, resources)
        else:
            result = await relay_response()
        in_memory = prepared.body is not None  # a body moved to disk was trimmed away when it moved
        prepared.release_body()
        if in_memory:
            # Below 32 MiB glibc may have put the body on the heap (its mmap threshold grows): give it back too.
            trim_after_large_request(retained, enabled=self.settings.malloc_trim)
        return result

    def _spills(self, size: int) -> bool:
        """A retained body of ``size`` bytes goes to disk (``RETAIN_OUTBOUND=disk``, above ``RETAIN_SPILL_BYTES``)."""
        return self.settings.retain_outbound == "disk" and size > self.settings.retain_spill_bytes

    async def _relay_spilling(
        self,
        relay_response: Callable[[], Awaitable[RelayResult]],
        prepared: Prepared,
        held: Resource,
        resources: RequestResources,
    ) -> RelayResult:
        """Relay while the retained body moves to disk: the first byte does not wait for the write,
        and a relay that ends first cancels it (the half-written file is closed at once)."""
        async with task_group() as tg:
            tg.start_soon(
                functools.partial(
                    spill,
                    prepared,
                    held=held,
                    resources=resources,
                    directory=self.settings.retain_dir,
                    counters=self.lifetime.counters,
                    malloc_trim=self.settings.malloc_trim,
                )
            )
            result = await relay_response()
            tg.cancel_scope.cancel()
        return result

    async def _forward(
        self, prepared: Prepared, held: _InputCharge, watch: ClientWatch, session_id: str | None
    ) -> httpx.Response | None:
        """``UpstreamClient.forward``, abandoned (None) if the client disconnects meanwhile:
        retries and backoff must not outlive the client that asked for them."""
        response: httpx.Response | None = None
        error: LifetimeError | None = None
        # A drain out of grace ends the wait for the answer too (its headers, a retry's backoff, a refold),
        # as it ends a relay: left to the server's backstop, the request got its plain-text 500.
        stopped = anyio.CancelScope()
        stopping = self.stop.cancels(stopped) if self.stop is not None else contextlib.nullcontext()
        with watch.over():
            try:
                with stopped, stopping:
                    response = await self.upstream.forward(
                        prepared, on_retries_settled=held.release, session_id=session_id
                    )
                    if response.status_code >= 400:
                        # Read here, where a client leaving is noticed: the read stops, the upstream is closed.
                        response = await self.upstream.capped(response)
            except LifetimeError as exc:
                error = exc.with_traceback(None)  # a kept traceback would keep the retry loop's frames
        if watch.gone or stopped.cancelled_caught:
            if response is not None:  # answered in the same moment the client left (or the grace ended)
                await close_response(response)
            if watch.gone:
                return None
            raise shutting_down()
        if error is not None:
            raise error
        return response

    async def _prepare(
        self, scope: Scope, receive: Receive, state: RequestLifetime, session_id: str | None
    ) -> tuple[Prepared, _InputCharge]:
        # This frame returns before forwarding starts, so its locals never outlive preparation.
        # (A head that cannot be forwarded, a '.' segment or a header HTTP/1.1 cannot carry, was refused
        # by ``RequestHead`` before the body was read.)
        message = await receive()  # the middleware's replay: the whole body, once
        raw: bytes = message.get("body", b"")
        del message
        try:
            parsed: Any = state.take_parsed()
        except LookupError:
            if raw and is_json(scope["headers"]):
                raise MalformedBody("request body is not valid JSON", code="invalid_json") from None
            parsed = None
        held = _InputCharge(state.resources.retain(len(raw)), len(raw), trim=self.settings.malloc_trim)
        preparers = self.preparers if parsed is not None else ()
        # prepare() gets the only references to the body and its parse: what it drops (the
        # received body once a preparer changed it, each message once serialized) is freed.
        handover = [raw, parsed]
        del raw, parsed
        # Spaces and tabs around a value (OWS) are not part of it: servers strip them, a scope may not;
        # stripped here so that preparers read what a server would give, and the upstream gets it.
        headers = [
            (k.decode("latin-1"), v.strip(OWS).decode("latin-1"))
            for k, v in filter_headers(scope["headers"])
            if k not in _NOT_FORWARDED
        ]  # names are lower-case
        prepared = await prepare(
            handover.pop(0),
            handover.pop(0),
            preparers=preparers,
            fingerprint=state.fingerprint,
            session_id=session_id,
            method=scope["method"],
            path=upstream_path(scope),
            headers=headers,
            resources=state.resources,
            refold_factory=self.refold_factory,
            malloc_trim=self.settings.malloc_trim,
        )
        return prepared, held
