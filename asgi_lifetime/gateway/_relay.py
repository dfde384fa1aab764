"""Relay an open upstream response to an ASGI client, with stall and starvation guards.

``relay`` streams ``response.aiter_raw()`` (encoded bytes pass through untouched) one chunk
at a time: it awaits ``send`` for each chunk before reading the next, so a slow client slows
the upstream read instead of filling a buffer. ``http.response.start`` goes out lazily, so
anything that fails before the first byte becomes a proper JSON error response::

    response = await client.send(request, stream=True)
    result = await relay(response, send=send, receive=receive, stall_timeout=120, keepalive_interval=15)

Guards, for ``text/event-stream`` without a ``content-encoding`` (an *in-band* stream):

- whole events only: the bytes of the event still being received are held (at most
  ``EVENT_HOLD_LIMIT``, the parser's ``MAX_BUFFER``, 1 MiB, so that every event the guard can
  read is also one it can withdraw) and sent when its blank line arrives. So the client's
  parser is always between events: keep-alive comments and the gateway's ``event: error`` go
  there, and an upstream that breaks, stalls or ends in the middle of an event leaves no half
  event behind (the held part is dropped, as a browser drops an unfinished last event).
  An event larger than the hold is streamed through as it arrives; if the upstream fails
  inside it, nothing can be appended without completing a half event, so the response is
  left unfinished (the server closes the connection; clients report a broken connection);
- keep-alive comments while the upstream is quiet, an ``event: error`` when it stalls or
  breaks, or ends in the middle of an event (``bad_gateway``; for a recognised format that
  already sent its terminal event the unfinished tail is only dropped, the answer is whole);
  each in the dialect of the client's SDK (``_sse.DIALECTS``: a Gemini client gets no keep-alive,
  and the error as a data-only event);
- starvation, judged only for formats ``SSETracker`` recognises (OpenAI chat completions,
  OpenAI Responses, Anthropic Messages, Gemini): a stream that ends without a terminal
  event, or with nothing to show for it (see ``SSETracker.starved``), ends with an
  ``upstream_starved`` error event. Any other event stream (transcription, image, speech
  events, custom ones) is output as soon as it has one event; only an event-less stream is
  starved. A starving terminal (``[DONE]`` with nothing before it) is held back (at most
  ``_WITHHOLD_LIMIT``) so that the error event replaces it. A starved stream is re-issued
  once via ``reissue`` only if the client has received no upstream event at all
  (keep-alives and comments do not count), so a client never gets an answer twice;
- a first error, the same way: when the upstream's first error event names its own failure
  before any content (``SSETracker.failed_early``: ``overloaded_error``, ``server_error``...,
  never an error naming the request) and that one re-issue is still possible, the event (and
  any event read with it) is withheld, the response is not read further, and the request is
  re-issued. If the re-issue fails or its answer cannot continue the stream, the client gets the
  withheld events and the end of the stream, what it would have had without the re-issue.

Other streams only get the stall guard (the body just ends). The upstream response is
closed whatever happens, cancellation included.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, TypeVar

import anyio
import anyio.lowlevel
import httpx
from starlette.types import Message, Receive, Send

from .._asgi import FIELD_NAME, task_group, wait_disconnect
from .._exceptions import (
    ErrorShape,
    LifetimeError,
    UpstreamError,
    UpstreamStalled,
    UpstreamStarved,
    UpstreamTimeout,
)
from .._settings import check_argument, positive
from .._stats import Counters
from ._bookkeeping import Ending
from ._shutdown import StopSignal, shutting_down
from ._sse import BOM, DIALECTS, MAX_BUFFER, SSETracker, sse_event
from ._transport import close_response, stop_reading

__all__ = ["EVENT_HOLD_LIMIT", "HOP_BY_HOP", "ClientWatch", "RelayResult", "filter_headers", "relay"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

HOP_BY_HOP: frozenset[str] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",  # not in RFC 9110, but sent by old clients; Go's reverse proxy drops it too
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in HOP_BY_HOP)
# Set by the ASGI server on every response: the upstream's would be a second Date (a singleton
# field) and would name the upstream's software. Reverse proxies drop them too (nginx does).
_SERVER_SET = frozenset({b"date", b"server"})
# nginx buffers what it proxies unless told otherwise (proxy_buffering is on by default): an event
# stream would reach the client in lumps, its keep-alives too late to hold the client's read timeout
# off. This field turns the buffering off for one answer; nginx acts on it and does not pass it on.
_UNBUFFERED: Final = (b"x-accel-buffering", b"no")
_SSE_REPLACED: Final = frozenset({b"content-length", _UNBUFFERED[0]})

# Bounded time for closing an upstream response, even when the caller is being cancelled.
# The unfinished event held back from the client (see the module docstring): the same bound as
# what the SSE parser keeps of one event, so an event it can read is one the relay can withdraw.
EVENT_HOLD_LIMIT = MAX_BUFFER
# Whole events held back after a terminal event that would count as starvation (see _Relay._release).
_WITHHOLD_LIMIT = 64 * 1024
# Chunks relayed between two event-loop turns at most. Neither the send lock (fast_acquire) nor,
# often, the read yields: httpcore returns the HTTP chunks h11 already parsed from one socket read
# without awaiting anything, so an upstream sending 2-byte chunks would hold the loop for all of a
# 64 KiB read (~9,000 chunks, hundreds of ms in which no other request moves).
_CHUNKS_PER_TURN = 32
_COLLECT_LIMIT = 64 * 1024 * 1024
_CLIENT_DISCONNECTED_STATUS = 499
_NO_BODY_STATUSES = frozenset({204, 304})


@dataclass(slots=True)
class RelayResult:
    """How a relay ended.

    ``status`` is the status sent to the client (499 if it left before anything was sent);
    ``bytes_out`` counts body bytes sent, keep-alives and error bodies included;
    ``first_byte_at`` is the ``time.monotonic()`` of the first upstream byte; ``code`` is the error's
    code when the client got a JSON error of the gateway's own instead of the upstream's answer.
    """

    status: int
    bytes_out: int
    first_byte_at: float | None
    outcome: Ending
    reissued: bool
    code: str | None = None


def filter_headers(headers: Iterable[tuple[bytes, bytes]] | httpx.Headers) -> list[tuple[bytes, bytes]]:
    """Drop hop-by-hop headers (``HOP_BY_HOP`` and any named in ``Connection``); names come back lower-case.

    Works in both directions: ASGI ``scope["headers"]`` (names lower-cased where the gateway first read
    them, ``_asgi.normalize_headers``: not again here, on every request) or an ``httpx.Headers`` (names
    as the upstream sent them).
    """
    if isinstance(headers, httpx.Headers):
        pairs = [(name.lower(), value) for name, value in headers.raw]
    else:
        pairs = list(headers)
    drop = set(_HOP_BY_HOP_RAW)
    for name, value in pairs:
        if name == b"connection":
            drop.update(token.strip().lower() for token in value.split(b","))
    return [(name, value) for name, value in pairs if name not in drop]


# RFC 9110 5.1, 5.5: a field name is a token; a value has no control character but HTAB. aiohttp's parser
# passes some that are not (a control character in a value), and the ASGI server refuses to send them
# (uvicorn raises): the client got no answer at all, which its SDK retries (the upstream's work again).
_FIELD_VALUE_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _sendable(name: bytes, value: bytes) -> bool:
    return FIELD_NAME.fullmatch(name) is not None and _FIELD_VALUE_CTL.search(value) is None


def _sendable_only(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` without the fields no server can send; each dropped name is logged (never a value)."""
    kept = []
    for name, value in headers:
        if _sendable(name, value):
            kept.append((name, value))
        else:
            logger.warning("dropped an upstream response header that cannot be sent: %r", name[:64])
    return kept


def _is_sse(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.partition(";")[0].strip().lower() == "text/event-stream"


def _answers_head(response: httpx.Response) -> bool:
    """The answer to a HEAD: the headers a GET would get, and no body (RFC 9110 9.3.2)."""
    try:
        return response.request.method == "HEAD"
    except RuntimeError:  # a response built without its request has none to tell
        return False


def _is_encoded(response: httpx.Response) -> bool:
    encoding: str = response.headers.get("content-encoding", "")
    return encoding.strip().lower() not in ("", "identity")


class _ClientGone(Exception):
    """``send`` raised OSError: the client connection is gone."""


class _Stalled(Exception):
    pass


class _Relay:
    """Per-call state of one ``relay``; nothing here outlives the call."""

    def __init__(
        self,
        *,
        send: Send,
        stall_timeout: float,
        keepalive_interval: float,
        reissue: Callable[[], Awaitable[httpx.Response | None]] | None,
        counters: Counters | None,
        on_start: Callable[[int], None] | None,
        stop: StopSignal | None = None,
        error_shape: ErrorShape = "openai",
    ) -> None:
        self.send = send
        self.stop = stop
        self.error_shape: ErrorShape = error_shape
        self.dialect = DIALECTS[error_shape]  # what the gateway may add to the client's stream
        self.stop_scope = anyio.CancelScope()
        self.stall_timeout = stall_timeout
        self.keepalive_interval = keepalive_interval
        self.reissue = reissue
        self.counters = counters
        self.on_start = on_start
        # The keep-alive task and the main task send under it. fast_acquire: an uncontended acquire does
        # not yield to the event loop (anyio's default sleeps once, shielded, per acquire: a loop turn per
        # chunk relayed); the main task yields at each upstream read anyway.
        self.lock = anyio.Lock(fast_acquire=True)
        self.responses: list[httpx.Response] = []
        self.started = False
        self.status = 0
        self.bytes_out = 0
        self.first_byte_at: float | None = None
        self.reissued = False
        self.code: str | None = None  # the gateway's own JSON error was the answer (the access log says which)
        self.disconnected = False
        # The last body message was handed to the server: a disconnect from then on (servers
        # report one as soon as the response is complete) does not cut the response short.
        self.ended = False
        # The response being relayed.
        self.start: Message | None = None
        self.declared: int | None = None  # the Content-Length the client was promised
        self.inband = False
        self.tracker: SSETracker | None = None
        self.guarded = False  # in-band and 2xx: the starvation guard applies
        self.hold_ok = False  # starving terminals may still be withheld
        # The unfinished event, not sent yet: one growing buffer, not a list of chunks (an upstream
        # sending it in 2-byte HTTP chunks would make a list of them cost ~40x the bytes held).
        self.tail = bytearray()
        # No byte of the response being relayed was released yet: a BOM it starts with is dropped.
        self.fresh = False
        self.passthrough = False  # the client is inside an event too large to hold
        self.event_ids = False  # the client was sent an ``id`` field: keep-alives without a blank line
        self.cr_last = False  # the last byte sent is an upstream's \r (its \n may still come)
        # A keep-alive followed that \r: the upstream's \n right after it is not sent (see _on_chunk).
        self.lf_dropped = False
        self.withheld: list[bytes] = []  # whole events held back after a starving terminal or a first error
        self.withheld_size = 0
        # The upstream's first event is a transient error (SSETracker.failed_early), withheld: this attempt
        # is over, and a re-issue may replace it (see _failed_early).
        self.failing = False
        self.delivered = False  # the client has received (part of) an upstream event
        # Keep-alive bookkeeping: is the main task waiting on the upstream, and when did the client last get bytes.
        self.waiting = False
        # The stall guard (run by the ClientWatch, see _stall_due): the scope of the response being read, and
        # when (time.monotonic()) the upstream read under way began; None between reads.
        self.stall: anyio.CancelScope | None = None
        self.read_since: float | None = None
        # time.monotonic(), not anyio.current_time() (a backend lookup per send): only differences of it
        # are used, as the relative delay of anyio.sleep().
        self.last_sent = time.monotonic()
        self.helper_error: Exception | None = None
        self.chunks = 0  # chunks relayed (see _CHUNKS_PER_TURN)

    async def run(self, response: httpx.Response, receive: Receive, watch: ClientWatch | None) -> RelayResult:
        self.responses.append(response)
        outcome: Ending = "client_disconnected"
        error: Exception | None = None
        try:
            self._use(response)
            if watch is None:  # called on its own: a helper task of its own watches the client
                outcome, error = await ClientWatch.watching(receive, functools.partial(self._watched, response))
            else:
                outcome, error = await self._watched(response, watch)
            if error is None and self.helper_error is not None:
                error = self.helper_error
            if isinstance(error, _ClientGone):
                error, self.disconnected = None, True
            if error is not None:
                raise error
        finally:
            error = None
            answered = self._answered()
            for upstream in self.responses:
                await close_response(upstream)
            self.responses.clear()
            self._drop_held()
        if self.disconnected:
            # A client that leaves once it has the terminal event had the whole answer (the openai
            # SDK closes at [DONE], often before the upstream's end of body arrives).
            outcome = "complete" if answered else "client_disconnected"
        status = self.status or _CLIENT_DISCONNECTED_STATUS
        return RelayResult(status, self.bytes_out, self.first_byte_at, outcome, self.reissued, self.code)

    async def _watched(self, response: httpx.Response, watch: ClientWatch) -> tuple[Ending, Exception | None]:
        """Relay under ``watch``: a disconnect cancels it, and the watch sends its keep-alives. ``stop`` needs
        no task: setting it cancels the scope registered here. Returns the outcome and the error that ended it."""
        outcome: Ending = "client_disconnected"
        error: Exception | None = None
        stopping = self.stop.cancels(self.stop_scope) if self.stop is not None else contextlib.nullcontext()
        with watch.over(self):
            try:
                with self.stop_scope, stopping:
                    outcome = await self._relay(response)
                if self.stop_scope.cancelled_caught:
                    # Graceful shutdown ran out of grace: end the stream with a clear error.
                    await self._fail(shutting_down())
                    outcome = "shutdown"
            except Exception as exc:  # raised by run(), after the closes (and out of any task group)
                error = exc
        return outcome, error

    def _answered(self) -> bool:
        """The client was sent a recognised stream's terminal event after its content."""
        tracker = self.tracker
        return tracker is not None and tracker.saw_terminal and not tracker.starved and not self.withheld

    # -- keep-alives (sent by the ClientWatch's task) -----------------------------------------------

    async def _keepalive(self) -> bool:
        """Send a keep-alive comment if the client is between events and the main task waits on the upstream."""
        async with self.lock:
            # Checked under the lock: the main task sends under it too. Only whole events were
            # sent, so the client is between events unless one is streaming through.
            if self.waiting and not self.passthrough:
                keepalive = self.dialect.keepalive_after_id if self._holds_id() else self.dialect.keepalive
                if keepalive is not None:  # a dialect without keep-alives: the client hears nothing
                    self.lf_dropped = self.lf_dropped or self.cr_last
                    # A client that takes nothing holds this send up, and the watch with it: meanwhile the
                    # read's stall is a deadline on its scope (lifted when the read ends: see _pump). Not a
                    # cancel of the send: an ASGI send cut short may have written part of the comment.
                    stall, since = self.stall, self.read_since
                    if stall is not None and since is not None:
                        stall.deadline = _on_anyio_clock(since + self.stall_timeout)
                    try:
                        await self._send_body(keepalive)
                    finally:
                        if stall is not None:
                            stall.deadline = math.inf
                    return True
        return False

    def _stall_due(self) -> float:
        """When (``time.monotonic()``) the upstream read under way stalls. Between reads, or once this read
        was found stalled, the next read's stall is at least a whole ``stall_timeout`` away."""
        since, stall = self.read_since, self.stall
        if since is None or stall is None or stall.cancel_called:
            return time.monotonic() + self.stall_timeout
        return since + self.stall_timeout

    def _cut_if_stalled(self, now: float) -> bool:
        """Cancel the read under way if it has waited ``stall_timeout`` (``_pump`` raises ``_Stalled``)."""
        stall = self.stall
        if stall is None or now < self._stall_due():
            return False
        stall.cancel()
        return True

    def _holds_id(self) -> bool:
        """The client was sent an ``id`` field: its parser keeps it, even across a re-issued response,
        and even one too large for the guard's parser. Once true, stays true."""
        if not self.event_ids:
            tracker = self.tracker
            self.event_ids = tracker is not None and tracker.parser.carried_id
        return self.event_ids

    # -- relaying -------------------------------------------------------------------------------

    def _use(self, response: httpx.Response) -> None:
        """Make ``response`` the one being relayed. Its status/headers are used only if nothing was sent."""
        if not self.started:
            sse = _is_sse(response)
            # An event stream's answer to a HEAD has no events to judge: judged, it was "starved", sent
            # again, then a 502.
            self.inband = sse and not _is_encoded(response) and not _answers_head(response)
            headers = [(name, value) for name, value in filter_headers(response.headers) if name not in _SERVER_SET]
            if not all(_sendable(name, value) for name, value in headers):
                headers = _sendable_only(headers)
            # SSE: keep-alives and error events change the length, and the upstream's X-Accel-Buffering was
            # meant for its own proxies. 204 and 304 have no body, whatever length the upstream gave (RFC 9110
            # 8.6): uvicorn's httptools server would wait for it, then fail the response.
            if sse:
                headers = [(name, value) for name, value in headers if name not in _SSE_REPLACED]
                headers.append(_UNBUFFERED)
            elif response.status_code in _NO_BODY_STATUSES:
                headers = [(name, value) for name, value in headers if name != b"content-length"]
            lengths = [value for name, value in headers if name == b"content-length"]
            self.declared = int(lengths[0]) if len(lengths) == 1 and lengths[0].isdigit() else None
            self.start = {"type": "http.response.start", "status": response.status_code, "headers": headers}
        self._holds_id()  # noted before the response that carried it is replaced
        self.tracker = SSETracker() if self.inband else None
        self.fresh = self.inband
        self.guarded = self.hold_ok = self.inband and 200 <= response.status_code < 300
        self._drop_held()

    async def _relay(self, response: httpx.Response) -> Ending:
        while True:
            failed = await self._read(response)
            if failed is not None:
                return failed
            tracker = self.tracker
            if tracker is None or not self.guarded:
                # Not judged: the body is the upstream's (an error status's body is read whole, not as events).
                async with self.lock:
                    await self._send_body(self._take_tail(), more_body=False)
                return "upstream_error" if tracker is not None and tracker.saw_error else "complete"
            if self.failing:
                next_response = await self._failed_early(response, tracker)
                if next_response is None:
                    return "upstream_error"
                response = next_response
                continue
            if tracker.starved and not self.passthrough:
                next_response = await self._starved(response, tracker)
                if next_response is None:
                    return "starved"
                response = next_response
                continue
            async with self.lock:
                await self._flush_withheld()
            if self.passthrough or (tracker.parser.mid_event and not tracker.judged):
                # Per the SSE rules an unfinished last event is not an event: it is dropped (or, if
                # it is streaming through, the response is cut), and the client is told the stream
                # broke. (A judged stream that gets here has had its terminal event: the answer is
                # whole, and the unfinished tail is just dropped, as a client would drop it.)
                logger.warning("upstream stream ended in the middle of an event")
                await self._fail(UpstreamError("the upstream stream ended in the middle of an event"))
                return "upstream_error"
            async with self.lock:
                await self._send_body(b"", more_body=False)
            return "upstream_error" if tracker.saw_error else "complete"

    async def _read(self, response: httpx.Response) -> Ending | None:
        """Relay ``response`` until it ends: None when it ended cleanly, else the outcome of its failure."""
        try:
            await self._pump(response)
        except _Stalled:
            if self.counters is not None:
                self.counters.stalled += 1
            logger.warning("upstream stalled: no data for %gs", self.stall_timeout)
            await self._fail(UpstreamStalled(f"the upstream sent no data for {self.stall_timeout:g} seconds"))
            return "stalled"
        except httpx.ReadTimeout:
            await self._fail(UpstreamTimeout("the upstream read timed out"))
            return "upstream_error"
        except httpx.TransportError as exc:
            logger.warning("upstream read failed: %s", type(exc).__name__)
            await self._fail(
                UpstreamError(f"the upstream connection failed while sending the response ({type(exc).__name__})")
            )
            return "upstream_error"
        return None

    async def _starved(self, response: httpx.Response, tracker: SSETracker) -> httpx.Response | None:
        """Re-issue a starved stream if allowed (the response to continue with), else end with the error event."""
        if self.counters is not None:
            self.counters.starved += 1
        logger.warning(
            "upstream starved: format=%s terminal=%s content=%s",
            tracker.format.name if tracker.format is not None else None,
            tracker.saw_terminal,
            tracker.saw_content,
        )
        if tracker.saw_content:
            message = "the upstream stream ended without a terminal event; the output may be incomplete"
        else:
            message = "the upstream produced no output"
        reissue = self._reissuer()
        if reissue is not None:
            next_response = await self._reissue(response, reissue)
            if next_response is not None:
                return next_response
        await self._fail(UpstreamStarved(message))
        return None

    async def _failed_early(self, response: httpx.Response, tracker: SSETracker) -> httpx.Response | None:
        """The upstream's first event is a transient error, withheld (``self.failing``): re-issue (the response
        to continue with), else send the client what it would have had without the re-issue, that error."""
        self.failing = False
        # Not the upstream's message: it may quote the request.
        logger.warning(
            "upstream failed before any output: format=%s, a transient in-band error event; re-issuing",
            tracker.format.name if tracker.format is not None else None,
        )
        reissue = self._reissuer()  # still allowed: nothing was read since the error was withheld
        next_response = None if reissue is None else await self._reissue(response, reissue)
        if next_response is not None:
            return next_response
        async with self.lock:
            # The events withheld are whole; what followed them was not read, or is an unfinished event.
            self.tail.clear()
            await self._flush_withheld()
            await self._send_body(b"", more_body=False)
        return None

    def _reissuer(self) -> Callable[[], Awaitable[httpx.Response | None]] | None:
        """``reissue`` if a second answer may still replace this one: the client has received no upstream
        event (keep-alives and comments do not count, so it never gets two answers), and the one re-issue
        is not spent."""
        return None if self.delivered or self.reissued else self.reissue

    async def _reissue(
        self, response: httpx.Response, reissue: Callable[[], Awaitable[httpx.Response | None]]
    ) -> httpx.Response | None:
        """Re-issue once; return the response to continue with, or None (the withheld events are then
        still held: the caller sends or drops them)."""
        self.reissued = True
        await close_response(response)
        async with self.lock:
            self.tail.clear()  # the client saw none of it, and is between events
        self.waiting = True  # keep-alives continue while the new request is under way
        try:
            new = await reissue()
        except (LifetimeError, httpx.HTTPError) as exc:
            logger.warning("re-issue failed: %s", type(exc).__name__)
            return None
        finally:
            self.waiting = False
        if new is None:
            return None
        self.responses.append(new)
        if self.started and not (200 <= new.status_code < 300 and _is_sse(new) and not _is_encoded(new)):
            # The client already has a 200 event stream; this response cannot continue it.
            logger.warning("re-issued response cannot continue the stream (status %s)", new.status_code)
            await close_response(new)
            return None
        self._use(new)
        return new

    async def _pump(self, response: httpx.Response) -> None:
        """Relay ``response``'s bytes until it ends; raises ``_Stalled`` or the httpx error that ended it."""
        iterator = response.aiter_raw()
        finished = False  # the chain of stream generators ended (its end, an error, a cancellation)
        chunk = b""
        try:
            while True:
                # One stall scope for the whole response, cancelled by the ClientWatch when a read has waited
                # ``stall_timeout`` (it wakes for the keep-alives anyway): a deadline pushed back before each read
                # and lifted while the chunk is sent (a slow client is not a stalled upstream) cost a timer
                # armed and cancelled per chunk, and a scope per read more than the rest of relaying the chunk.
                stall = self.stall = anyio.CancelScope()
                with stall:
                    while True:
                        if self.failing:
                            return  # an attempt that failed early is not read further (see _failed_early)
                        self.waiting = finished = True
                        self.read_since = time.monotonic()
                        try:
                            chunk = await iterator.__anext__()
                        except StopAsyncIteration:
                            return
                        finally:
                            self.waiting = False
                            self.read_since = None
                            if stall.deadline != math.inf:  # armed by a keep-alive still being sent
                                stall.deadline = math.inf  # a slow client is not a stalled upstream
                        finished = False
                        if stall.cancel_called:
                            break
                        await self._forward(chunk)
                        chunk = b""  # hold no chunk while waiting for the next one
                if stall.cancelled_caught:
                    raise _Stalled
                # The watch found the read stalled as this chunk arrived: it cancelled the scope before the reading
                # task resumed (trio's socket read ends in a shielded checkpoint; asyncio's wake-up may come after
                # the watch's under load). The chunk came in time, but the scope stays cancelled (a cancel cannot
                # be undone) and would cancel its sending: it is relayed outside, and a new scope follows.
                await self._forward(chunk)
                chunk = b""
        finally:
            self.waiting = False
            self.stall = None
            await stop_reading(response, iterator, finished=finished)

    async def _forward(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.chunks += 1
        if not self.chunks % _CHUNKS_PER_TURN:
            await anyio.lowlevel.checkpoint()  # let the other requests move (see _CHUNKS_PER_TURN)
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        async with self.lock:
            await self._on_chunk(chunk)

    async def _on_chunk(self, chunk: bytes) -> None:
        """Send the whole events ``chunk`` completes; hold the unfinished one (or stream it through if too large)."""
        tracker = self.tracker
        if tracker is None:
            await self._send_body(chunk)
            return
        if self.lf_dropped:
            self.lf_dropped = False
            if chunk[:1] == b"\n":
                # The second half of a CRLF split from its \r by a keep-alive: the client's line ended
                # at the \r, and after the keep-alive's line this \n would be an empty line of its own
                # (an empty event for an SDK that holds a last event id). Parsed, not sent.
                tracker.feed(b"\n")
                chunk = chunk[1:]
                if not chunk:
                    return
        completed = tracker.feed(chunk)
        cut = tracker.parser.boundary  # chunk[:cut] ends a whole event; -1: it ends none
        if self.passthrough:
            await self._send_body(chunk if cut < 0 else chunk[:cut])
            self.passthrough = cut < 0
        elif cut >= 0:
            await self._release(tracker, self._unmarked(self._take_tail() + chunk[:cut]), completed)
        if cut < 0 and self.passthrough:
            return
        rest = chunk if cut < 0 else chunk[cut:]
        if rest:
            self.tail += rest
        if len(self.tail) > EVENT_HOLD_LIMIT:
            # An event larger than the hold: stream it through. From now until its end the client
            # is inside it, and nothing (keep-alive, error event, second answer) can be added.
            await self._flush_withheld()
            self.hold_ok = False
            self.passthrough = self.delivered = True
            await self._send_body(self._unmarked(self._take_tail()))

    async def _release(self, tracker: SSETracker, events: bytes, completed: int) -> None:
        """Send whole events, unless they follow a terminal that would count as starvation, or the
        upstream's first error is one a re-issue may cure."""
        if self.hold_ok and not tracker.saw_content:
            failing = tracker.failed_early and self._reissuer() is not None
            if failing or self.withheld or (tracker.saw_terminal and tracker.starved):
                # If the stream ends like this it starved, and the client must get the error event
                # (or the re-issued stream), not this terminal. Held until the stream ends; bounded.
                # An early failure ends the attempt at once: the re-issue (or, failing that, the
                # upstream's error) follows.
                if self.withheld_size + len(events) <= _WITHHOLD_LIMIT:
                    self.withheld.append(events)
                    self.withheld_size += len(events)
                    self.failing = failing
                    return
                self.hold_ok = False
        await self._flush_withheld()
        if events:
            await self._send_body(events)
            self.delivered = self.delivered or completed > 0

    def _unmarked(self, data: bytes) -> bytes:
        """``data``, the response's bytes released from the hold, without the BOM the response starts with.

        A BOM marks the start of a stream only (the parser drops it there, as clients do), and the
        client's stream may not start here: keep-alives sent while the upstream was silent, or the
        comments of a starved first attempt, come first. A BOM after them is part of a field name
        (``\\ufeffdata``): the client would drop the event the guard counted as delivered.
        """
        if not self.fresh or not data:
            return data
        self.fresh = False
        return data[len(BOM) :] if data.startswith(BOM) else data

    def _take_tail(self) -> bytes:
        tail = bytes(self.tail)
        self.tail.clear()
        return tail

    async def _flush_withheld(self) -> None:
        withheld, self.withheld = self.withheld, []
        self.withheld_size = 0
        self.failing = False  # the client gets the events: no re-issue replaces them now
        if withheld:
            self.delivered = True  # withheld bytes hold at least the terminal event
            await self._send_body(b"".join(withheld))

    def _drop_held(self) -> None:
        """Forget what the client has not seen: the unfinished event and withheld events."""
        self.tail.clear()
        self.withheld.clear()
        self.withheld_size = 0

    async def _fail(self, exc: LifetimeError) -> None:
        """End the client response because of ``exc``: a JSON error if nothing was sent yet."""
        async with self.lock:
            self._drop_held()
            if not self.started:
                self.start, body = exc.asgi_response(shape=self.error_shape)
                self.code = exc.code
                await self._send_body(body, more_body=False)
            elif self.passthrough:
                # The client is inside an event: an error event would complete a half event. Leave the
                # response unfinished instead: the server closes the connection, the client sees it cut off.
                logger.warning(
                    "ending the response abruptly: the upstream failed inside an event of over %d bytes",
                    EVENT_HOLD_LIMIT,
                )
            elif self.inband:
                await self._send_body(
                    sse_event(self.dialect.error_event, exc.to_dict(self.error_shape)), more_body=False
                )
            elif self.declared is not None and self.bytes_out >= self.declared:
                await self._send_body(b"", more_body=False)  # everything promised was sent
            else:
                # Cut short. Ending it would make it look complete (a chunked body gets its last
                # chunk; one short of its Content-Length makes the server raise). Leave it
                # unfinished instead: the server closes the connection, the client sees it cut off.
                return

    async def _send_body(self, body: bytes, *, more_body: bool = True) -> None:
        if not self.started and self.start is not None:
            start, self.start = self.start, None
            self.started = True
            self.status = start["status"]
            if self.on_start is not None:
                self.on_start(self.status)
            await self._send(start)
        self.ended = not more_body
        if body:
            self.cr_last = body[-1] == 0x0D
        await self._send({"type": "http.response.body", "body": body, "more_body": more_body})
        self.bytes_out += len(body)
        self.last_sent = time.monotonic()

    async def _send(self, message: Message) -> None:
        try:
            await self.send(message)
        except OSError as exc:
            raise _ClientGone from exc


class ClientWatch:
    """A request's one helper task, from forwarding to the end of the relay: ``run`` waits for the client
    to disconnect and then cancels the scope it watches over (``over``); while a relay of an in-band
    stream is attached, it also sends the relay's keep-alives (after ``keepalive_interval`` of client
    silence, when the client is between events; if it is not, it tries again one interval later).

    It also guards the attached relay against a stalled upstream: when a read has waited ``stall_timeout``
    it cancels that read (checked when it wakes, so a read that ends in time costs no timer).

    A disconnect once the relay handed over the response's last message changes nothing (servers report
    one as soon as the response is complete). A ``receive()`` that fails ends the watching of the client
    and the keep-alives (logged); the stall guard goes on.

    ```python
    async def work(watch: ClientWatch) -> RelayResult:
        return await relay(response, send=send, receive=receive, watch=watch, ...)

    result = await ClientWatch.watching(receive, work)
    ```
    """

    __slots__ = ("receive", "gone", "answered", "running", "_deaf", "_target", "_relay", "_waiting", "_not_before")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False  # the client disconnected before its response was complete
        self.answered = False  # a relay it watched handed the response's last message to the server
        self.running = True  # run() has not returned
        self._deaf = False  # receive() failed: the client is not watched any more, nor kept alive
        self._target: anyio.CancelScope | None = None
        self._relay: _Relay | None = None
        self._waiting: anyio.CancelScope | None = None
        self._not_before = -math.inf

    @classmethod
    async def watching(cls, receive: Receive, work: Callable[[ClientWatch], Awaitable[_T]]) -> _T:
        """Run ``work(watch)`` while a new watch's task watches the client; the task ends with ``work``.
        ``work``'s exception is raised as it is, not wrapped in the task group's ExceptionGroup."""
        async with task_group() as tg:
            watch = cls(receive)
            tg.start_soon(watch.run)
            result = await work(watch)
            if watch.running and watch.answered:
                # The server reports a disconnect once the response is complete (ASGI): the watch ends by
                # itself at the next loop turn. Cheaper than cancelling it (anyio formats the cancelling
                # task's repr into each cancel's reason).
                await anyio.lowlevel.checkpoint()
            if watch.running:
                tg.cancel_scope.cancel()
        return result

    @contextlib.contextmanager
    def over(self, relay: _Relay | None = None) -> Iterator[anyio.CancelScope]:
        """A cancel scope the watch cancels when the client leaves (at once if it has left), watching
        ``relay``'s stalls and keep-alives too, until the block ends."""
        cut = anyio.CancelScope()
        self._target, self._relay, self._not_before = cut, relay, -math.inf
        if self.gone:
            if relay is not None:
                relay.disconnected = True
            cut.cancel()
        elif relay is not None and self._waiting is not None:
            self._waiting.deadline = self._deadline()
        try:
            with cut:
                yield cut
        finally:
            if relay is not None and relay.ended:
                self.answered = True
            self._target = self._relay = None

    async def run(self) -> None:
        try:
            while True:
                # receive() is cancelled when a stall check or a keep-alive is due: an ASGI server's receive()
                # loses nothing by being cancelled (it waits for its next message).
                with anyio.CancelScope(deadline=self._deadline()) as self._waiting:
                    if not self._deaf:
                        if await self._disconnected():
                            self._on_disconnect()
                            return
                        self._deaf = True
                    await anyio.sleep_forever()  # receive() failed: only the stall guard is left to run
                await self._wake()
        except Exception as exc:  # a keep-alive could not be sent: the relay ends with that error
            relay, target = self._relay, self._target
            if relay is not None:
                relay.helper_error = exc
            if target is not None:
                target.cancel()
        finally:
            self._waiting = None
            self.running = False

    def _due(self) -> float:
        """When (``time.monotonic()``) the watch has work: the attached relay's stall check or its next
        keep-alive; never without a relay."""
        relay = self._relay
        if relay is None:
            return math.inf
        due = relay._stall_due()
        if relay.inband and not self._deaf:
            due = min(due, self._keepalive_due(relay))
        return due

    def _keepalive_due(self, relay: _Relay) -> float:
        return max(relay.last_sent + relay.keepalive_interval, self._not_before)

    def _deadline(self) -> float:
        """``_due()`` on anyio's clock, for a cancel scope's deadline."""
        return _on_anyio_clock(self._due())

    async def _wake(self) -> None:
        relay = self._relay
        now = time.monotonic()
        if relay is None or relay._cut_if_stalled(now) or self._deaf or not relay.inband:
            return
        if now < self._keepalive_due(relay):
            return  # the client got bytes meanwhile (or the clocks differ by a hair): wait again
        if not await relay._keepalive():
            self._not_before = now + relay.keepalive_interval

    async def _disconnected(self) -> bool:
        try:
            await wait_disconnect(self.receive)
        except Exception:
            logger.debug("receive() failed while watching for a disconnect", exc_info=True)
            return False
        return True

    def _on_disconnect(self) -> None:
        if self.answered:
            return  # the disconnect a server reports once the response is complete
        relay = self._relay
        if relay is not None:
            if relay.ended:
                return
            relay.disconnected = True
        self.gone = True
        if self._target is not None:
            self._target.cancel()


def _on_anyio_clock(due: float) -> float:
    """``due`` (``time.monotonic()``) on anyio's clock, for a cancel scope's deadline."""
    return due if due == math.inf else anyio.current_time() + max(due - time.monotonic(), 0.0)


async def relay(
    response: httpx.Response,
    *,
    send: Send,
    receive: Receive,
    stall_timeout: float,
    keepalive_interval: float,
    reissue: Callable[[], Awaitable[httpx.Response | None]] | None = None,
    counters: Counters | None = None,
    on_start: Callable[[int], None] | None = None,
    stop: StopSignal | None = None,
    error_shape: ErrorShape = "openai",
    watch: ClientWatch | None = None,
) -> RelayResult:
    """Stream an open httpx response (``client.send(request, stream=True)``) to an ASGI client.

    ``reissue`` is called at most once, when an in-band stream starved, or its first event is
    the upstream's transient error, before the client received any upstream event; it returns a
    new open response (relayed into the same client response) or None. ``counters.stalled`` /
    ``counters.starved`` count each stalled / starved upstream response (a re-issued first error
    is neither). The upstream response (and a re-issued one) is always closed on return.
    ``stop``, when set, ends the stream early (graceful shutdown out of grace): a 503 if
    nothing was sent yet, else an in-band SSE ``error`` event with code ``shutting_down``.
    The gateway's own errors take ``error_shape`` (see ``error_shape()``). ``watch``: the request's
    ``ClientWatch``, already running (it then watches this relay); without it, the relay runs one of its own.
    ``on_start`` is called with the status as the response starts: what the client got, should the relay
    then fail with an unexpected error (it is raised, without a ``RelayResult``).
    """
    check_argument("stall_timeout", stall_timeout, positive)
    check_argument("keepalive_interval", keepalive_interval, positive)
    state = _Relay(
        send=send,
        stall_timeout=stall_timeout,
        keepalive_interval=keepalive_interval,
        reissue=reissue,
        counters=counters,
        on_start=on_start,
        stop=stop,
        error_shape=error_shape,
    )
    return await state.run(response, receive, watch)
