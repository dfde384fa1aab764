"""Stage forward: send a ``Prepared`` request upstream, retry, settle, hand back the response.

One retry loop covers every kind of second attempt: transport failures and 429/502/503/504
(backoff with full jitter, honouring ``Retry-After``), context overflows (refold, no
backoff) and rejected roles (rename, no backoff). All count against ``max_attempts`` and
the ``retry_deadline``. The rules are ``_retry.Retry``'s, an immutable value the loop advances
per attempt; the loop sends, asks it, and acts. When the loop ends, however it ends, the request settles:
``Prepared.settle`` drops the refold/remap closures (and the body unless retained), then
``on_retries_settled`` runs, before the first response byte can be streamed::

    async with UpstreamClient(settings=settings) as upstream:
        response = await upstream.forward(prepared, on_retries_settled=release_input)
        try:
            async for chunk in response.aiter_raw(): ...
        finally:
            await response.aclose()
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import anyio
import httpx

from .._asgi import OWS
from .._exceptions import NO_CLIENT_RETRY, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from .._middleware import Lifetime
from .._settings import LifetimeSettings, base_url_problem, redact_url
from .._stats import Counters
from ._auth import CREDENTIAL_HEADERS, REDACTED, KeyScrubber, has_key_param
from ._error_body import ErrorBody, read_error_body, replay
from ._pool import UpstreamPool
from ._prepare import Prepared, Spliced
from ._refold import match_overflow, match_rejected_role
from ._retry import Retry, asked_wait, body_wait, resend_safe, says_no_retry
from ._spill import SLICE, SpilledBody
from ._transport import UpstreamTransport

__all__ = ["AttemptEvent", "UpstreamClient"]

logger = logging.getLogger(__name__)

# Set from the URL and the body on every attempt; never taken from the client's request.
# Accept-Encoding is always identity: every answer is relayed as the upstream's plain bytes, so
# the stream guards read every event and the key scrubber sees every byte. (Those bytes cross
# a short hop; the input, not the answer, is what is large.)
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "accept-encoding"})


@dataclass(frozen=True, slots=True)
class AttemptEvent:
    """What happened to an attempt, for logging, metrics or a demo display."""

    kind: Literal["retry", "refold", "role", "settled"]
    attempt: int
    status: int | None
    reason: str
    delay: float = 0.0


@dataclass(frozen=True, slots=True)
class _Failure:
    """A transport failure before response headers; strings only, so no traceback is kept alive."""

    timeout: bool
    reason: str
    # False once the upstream may have the whole request (it timed out waiting for the answer):
    # a non-streamed answer sends no headers until it is generated, so re-sending bills it twice.
    retryable: bool = True
    # Our HTTP client refused the request (LocalProtocolError): our side of the wire, not the upstream's.
    local: bool = False

    def error(self, attempts: int) -> UpstreamError:
        if self.local:
            return UpstreamError(
                f"the gateway's HTTP client refused to send the request upstream ({self.reason}); it was not"
                " retried, as every attempt would fail the same way",
                code="request_unsendable",
            )
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        if self.timeout:
            return UpstreamTimeout(f"upstream did not answer in time ({self.reason}) after {tries}")
        return UpstreamUnreachable(f"upstream unreachable ({self.reason}) after {tries}")


# The body goes out in slices: handed one large bytes object, asyncio's socket transport
# (Python < 3.12) copies the unsent rest of it into its buffer, twice for a moment (a slice,
# then a bytearray): +2x the body at peak. Slices keep that copy at one slice. A body retained
# on disk is read back in the same slices.
_SEND_SLICE = SLICE

# Upstream URLs parsed once (``UpstreamClient._url``): how many, and how long each may be.
_URLS = 256
_URL_BYTES = 1024
# A user info secret shorter than this is scrubbed only as its Basic token, not decoded: "pass" would be cut
# out of every "password" in the answers (a key or a generated password is longer).
_SECRET_SCRUBBED = 8


def _scrubbed_secrets(settings: LifetimeSettings, urls: Iterable[str]) -> list[str]:
    """The user info secrets of ``urls`` scrubbed decoded (see ``_SECRET_SCRUBBED``)."""
    secrets = (settings.upstream_secret(url) or "" for url in urls)
    return [secret for secret in secrets if len(secret) >= _SECRET_SCRUBBED]


class _BodyIterator:
    __slots__ = ("_holder", "_body", "_spilled", "_offset", "_stream")

    def __init__(self, holder: Prepared, stream: _BodyStream) -> None:
        self._holder = holder
        self._body: bytes | Spliced | None = None
        self._spilled: SpilledBody | None = None
        self._offset = 0
        self._stream = stream

    def __aiter__(self) -> _BodyIterator:
        return self

    async def __anext__(self) -> bytes:
        if self._offset == 0:
            self._body = self._holder.body  # this attempt's body, as its Content-Length was computed
            self._spilled = self._holder.spilled if self._body is None else None
        if self._spilled is not None:
            return await self._next_from_disk(self._spilled)
        body = self._body
        if not body or self._offset >= len(body):
            self._body = None
            self._stream.sent = True
            raise StopAsyncIteration
        if isinstance(body, Spliced):
            piece = body.read(self._offset, _SEND_SLICE)
        elif self._offset == 0 and len(body) <= _SEND_SLICE:
            self._offset = len(body)
            return body  # small bodies: no copy
        else:
            piece = body[self._offset : self._offset + _SEND_SLICE]
        self._offset += len(piece)
        return piece

    async def _next_from_disk(self, spilled: SpilledBody) -> bytes:
        """The next slice of a body retained on disk (``OSError`` if it cannot be read back)."""
        if self._offset >= spilled.size:
            self._spilled = None
            self._stream.sent = True
            raise StopAsyncIteration
        piece = await spilled.read(self._offset, _SEND_SLICE)
        self._offset += len(piece)
        return piece


class _BodyStream(httpx.AsyncByteStream):
    """Reads the body from the ``Prepared`` holder when sent, so the ``httpx.Request`` never owns it."""

    def __init__(self, holder: Prepared) -> None:
        self._holder = holder
        self.sent = False  # the whole body was handed to the connection

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _BodyIterator(self._holder, self)


class _Tracked(httpx.AsyncByteStream):
    """An upstream response body that gives back its upstream's in-flight count when closed."""

    def __init__(self, stream: httpx.AsyncByteStream, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release = release

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release()


class _Masker:
    """Masks our upstream key in a body streamed in pieces, at the same length (so a Content-Length
    stays true): every spelling ``KeyScrubber`` knows, also one split across pieces. The end of a
    piece that could begin a spelling is held back until the next piece shows it does not; events
    and lines end in a newline, which no spelling starts with, so a stream is never delayed."""

    __slots__ = ("_pairs", "_firsts", "_window", "_carry")

    def __init__(self, scrubber: KeyScrubber) -> None:
        spellings = scrubber.spellings
        self._pairs = [(s, _mask(len(s))) for s in spellings]
        self._firsts = sorted({s[:1] for s in spellings})
        self._window = max(len(s) for s in spellings) - 1
        self._carry = b""

    def feed(self, piece: bytes) -> bytes:
        data = self._carry + piece if self._carry else piece
        for spelling, mask in self._pairs:
            if spelling in data:
                data = data.replace(spelling, mask)
        keep = self._partial(data)
        self._carry = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep] if keep else data

    def flush(self) -> bytes:
        carry, self._carry = self._carry, b""
        return carry

    def _partial(self, data: bytes) -> int:
        """The length of the longest end of ``data`` that is the start of a spelling (0 if none)."""
        start = max(0, len(data) - self._window)
        best = 0
        for first in self._firsts:
            at = data.find(first, start)
            while at >= 0:
                end = data[at:]
                if len(end) > best and any(spelling.startswith(end) for spelling, _ in self._pairs):
                    best = len(end)
                    break  # later starts are shorter ends
                at = data.find(first, at + 1)
        return best


def _mask(size: int) -> bytes:
    return REDACTED.encode().ljust(size, b"*") if size >= len(REDACTED) else b"*" * size


class _MaskedIterator:
    __slots__ = ("_inner", "_masker", "_ended")

    def __init__(self, inner: AsyncIterator[bytes], masker: _Masker) -> None:
        self._inner = inner
        self._masker = masker
        self._ended = False

    def __aiter__(self) -> _MaskedIterator:
        return self

    async def __anext__(self) -> bytes:
        while not self._ended:
            try:
                piece = await self._inner.__anext__()
            except StopAsyncIteration:
                self._ended = True
                rest = self._masker.flush()
                if rest:
                    return rest
                raise
            masked = self._masker.feed(piece)
            if masked:
                return masked
        raise StopAsyncIteration

    async def aclose(self) -> None:
        aclose = getattr(self._inner, "aclose", None)
        if aclose is not None:
            await aclose()


class _Masked(httpx.AsyncByteStream):
    """A response body with our upstream key masked (see ``_Masker``); an iterator, not a generator,
    so that stopping early leaves no generator to finalize."""

    def __init__(self, stream: httpx.AsyncByteStream, scrubber: KeyScrubber) -> None:
        self._stream = stream
        self._scrubber = scrubber

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _MaskedIterator(self._stream.__aiter__(), _Masker(self._scrubber))

    async def aclose(self) -> None:
        await self._stream.aclose()


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing: the gateway's own client serves every client of the gateway."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _Run:
    """Attempt count of one ``forward`` call."""

    __slots__ = ("attempts",)

    def __init__(self) -> None:
        self.attempts = 0


def _join(base: str, path: str) -> str:
    return base[:-1] + path if base.endswith("/") and path.startswith("/") else base + path


def _framed(response: httpx.Response, scrubber: KeyScrubber) -> None:
    """The response headers as they may be relayed: one framing, and no trace of our upstream key.

    RFC 9112 6.3: Transfer-Encoding overrides Content-Length, and a proxy must remove the
    Content-Length before forwarding (h11 read the body by its chunks; relaying the length
    would cut the body short, or promise a length the body does not have).
    """
    received = raw = response.headers.raw  # a new list at each access: compared with this one
    if "transfer-encoding" in response.headers and "content-length" in response.headers:
        raw = [(k, v) for k, v in raw if k.lower() != b"content-length"]
    raw = scrubber.headers(raw) or raw
    if raw is not received:  # rebuilt only when changed (it was rebuilt for every response)
        response.headers = httpx.Headers(raw)


class UpstreamClient:
    """Forwards prepared requests to one or several upstream base URLs.

    ```python
    async with UpstreamClient(settings=settings, base_url="http://127.0.0.1:8000") as upstream:
        response = await upstream.forward(prepared, on_retries_settled=drop_request_input)
    ```

    Without ``client`` an ``httpx.AsyncClient`` is created (over ``transport`` if given)
    and closed by ``aclose()``; a client passed in is used as it is and left open.
    """

    def __init__(
        self,
        *,
        settings: LifetimeSettings,
        base_url: str | Sequence[str] | None = None,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        lifetime: Lifetime | None = None,
        listener: Callable[[AttemptEvent], None] | None = None,
    ) -> None:
        if client is not None and transport is not None:
            raise ValueError("pass either client= or transport=, not both")
        urls = (base_url,) if isinstance(base_url, str) else tuple(base_url or settings.upstream_url)
        if not urls and client is not None and str(client.base_url):
            urls = (str(client.base_url),)
        if not urls:
            raise ValueError("no upstream: pass base_url= or set ASGI_LIFETIME_UPSTREAM_URL")
        for url in urls:
            problem = base_url_problem(url) if isinstance(url, str) else "is not one"
            if problem is not None:
                shown = redact_url(url) if isinstance(url, str) else repr(url)
                raise ValueError(
                    f"base_url={shown!r} is invalid: must be an http:// or https:// base URL; it {problem}"
                )
        self._settings = settings
        self._base_urls = urls
        # UPSTREAM_URL's user info, split off the URL so no log or error shows it: sent as
        # Authorization: Basic to its own upstream, on requests without a credential of their own.
        self._basic = {url: value for url in urls if (value := settings.upstream_authorization(url)) is not None}
        self._pool = UpstreamPool(urls, cooloff=settings.upstream_cooloff)
        self._owns_client = client is None
        self._transport: UpstreamTransport | None = None
        # An upstream may quote the credential it got, as the Basic token or decoded (a 401 quoting the key it
        # was given, as OpenAI's does): both are as secret as the key.
        basic_tokens = (value.removeprefix("Basic ") for value in self._basic.values())
        self._scrubber = KeyScrubber(
            settings.upstream_api_key, *basic_tokens, *_scrubbed_secrets(settings, self._basic)
        )
        if client is None:
            # No read timeout: the headers wait is bounded below, the body by the relay's stall guard.
            timeout = httpx.Timeout(
                connect=settings.connect_timeout,
                read=None,
                write=settings.headers_timeout,
                pool=settings.connect_timeout,
            )
            limits = httpx.Limits(
                max_connections=settings.max_inflight, max_keepalive_connections=settings.max_inflight
            )
            if transport is None:
                # UPSTREAM_TRANSPORT: aiohttp on asyncio, httpx's own on trio; either closes a
                # connection with bytes left over after a response instead of handing those bytes
                # to the next request.
                transport = self._transport = UpstreamTransport(choice=settings.upstream_transport, limits=limits)
            client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
            # httpx's defaults would go out as if the client had sent them: an Accept-Encoding it never
            # asked for (the upstream then compresses, and an encoded stream escapes the relay's
            # guards), and an Accept and User-Agent naming httpx. The client's own are forwarded.
            for name in ("accept", "accept-encoding", "user-agent"):
                del client.headers[name]
            # httpx stores every Set-Cookie of every answer in the client's jar (it is never sent: requests
            # are built here, without the jar), wrapping each response for the standard library's
            # cookie code first: most of httpx's own work per request, and an upstream could make the jar
            # grow with every answer. The aiohttp transport keeps none either (DummyCookieJar).
            client._cookies = _NoCookies()
        self._client = client
        # Retries and refolds count toward the middleware's stats when it is given.
        self._counters = lifetime.counters if lifetime is not None else Counters()
        self._listener = listener
        # Seams for tests: how to wait, what time it is, where jitter comes from.
        self._sleep: Callable[[float], Awaitable[None]] = anyio.sleep
        self._clock: Callable[[], float] = anyio.current_time
        self._random = random.Random()
        self._urls: OrderedDict[str, httpx.URL] = OrderedDict()  # see _url

    @property
    def transport_name(self) -> str:
        """``aiohttp`` or ``httpcore`` (``UPSTREAM_TRANSPORT``, once ``start()`` or a request chose it),
        ``custom`` for a client or transport passed in, or ``unchosen``."""
        if self._transport is None:
            return "custom"
        return self._transport.name or "unchosen"

    def start(self) -> None:
        """Choose the transport in the loop that will serve requests (the gateway's startup): an
        ``UPSTREAM_TRANSPORT`` this loop cannot run fails here (``ValueError``), not per request."""
        if self._transport is not None:
            self._transport.choose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _choose(self, session_id: str | None, failed: frozenset[str]) -> str:
        """The base URL for the next attempt: the session's upstream (or the least busy one),
        skipping upstreams that failed this request or are cooling off after failed connects."""
        return self._pool.choose(session_id, exclude=failed)

    def describe(self) -> list[dict[str, object]]:
        """The upstreams' state (in flight, cooling off, totals), for stats and metrics."""
        now = time.monotonic()
        return [
            {
                "url": state.url,
                "inflight": state.inflight,
                "down_for": None if state.down_until is None else max(0.0, state.down_until - now),
                "requests": state.total_requests,
                "failures": state.failures,
            }
            for state in self._pool.snapshot()
        ]

    async def reissue(self, prepared: Prepared, *, session_id: str | None = None) -> httpx.Response | None:
        """One blind re-issue of the retained outbound body (after a starved stream, or one whose first
        event is the upstream's transient error), from memory or streamed back from its file on disk.

        It is one more attempt of ``forward``'s: made only if ``MAX_ATTEMPTS`` and ``RETRY_DEADLINE``
        leave one, and to another upstream than the one whose answer it replaces when there is one
        (as a retried status is). Returns the new open response, or None if no attempt is left, the
        body was released, could not be read back from disk, or the attempt failed.
        """
        retry = prepared.retry
        if not prepared.has_body or retry is None or not retry.in_time(0.0, self._clock()):
            return None
        # Counted when made, as a retry is, whatever becomes of it (the access log counts it as an attempt),
        # with the attempt and status of the answer it replaces (the relay re-issues only 2xx streams).
        self._counters.retried += 1
        self._emit(AttemptEvent("retry", retry.attempt, 200, "re-issued: the stream failed before any output"))
        prepared.retry = retry = retry.increment(failed=prepared.upstream)
        try:
            outcome = await self._send(prepared, self._choose(session_id, retry.failed))
        except OSError as exc:  # the body's file failed while being sent (httpx errors are _Failures)
            logger.warning("re-issue: the retained outbound body could not be read back from disk (%s)", exc)
            return None
        if isinstance(outcome, _Failure):
            return None
        if outcome.status_code >= 400:
            await outcome.aclose()
            return None
        return outcome

    async def forward(
        self, prepared: Prepared, *, on_retries_settled: Callable[[], None], session_id: str | None = None
    ) -> httpx.Response:
        """Send ``prepared`` until an outcome is final; return the (open) response to stream.

        ``on_retries_settled`` runs exactly once, after ``prepared.settle()``, whether this
        returns, raises or is cancelled. Exhausted transport failures raise
        ``UpstreamUnreachable`` or ``UpstreamTimeout``; an exhausted retryable status is returned,
        with ``x-should-retry: false`` (unless ``max_attempts`` is 1) so SDKs do not retry it again.
        The response's ``extensions`` carry ``"asgi_lifetime.attempts"`` and, when it came from
        the network, ``"asgi_lifetime.upstream"`` (the base URL that answered).
        """
        if prepared.settled:
            raise RuntimeError("this request was already forwarded (its Prepared is settled)")
        run = _Run()
        response: httpx.Response | None = None
        try:
            response = await self._attempts(prepared, session_id, run)
        finally:
            try:
                prepared.settle(retain_outbound=self._settings.retain_outbound != "off")
                on_retries_settled()
            except BaseException:
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
                raise
            status = response.status_code if response is not None else None
            self._emit(AttemptEvent("settled", run.attempts, status, f"status {status}" if status else "no response"))
        response.extensions["asgi_lifetime.attempts"] = run.attempts
        return response

    async def _attempts(self, prepared: Prepared, session_id: str | None, run: _Run) -> httpx.Response:
        retry = Retry.start(self._settings, now=self._clock(), upstreams=len(self._pool.urls))
        while True:
            run.attempts = retry.attempt
            base = self._choose(session_id, retry.failed)
            outcome = await self._send(prepared, base)
            if isinstance(outcome, _Failure):
                retry = await self._after_failure(retry, outcome, base)
                continue
            answer = await self._answer(prepared, retry, outcome, base)
            if isinstance(answer, httpx.Response):
                prepared.retry = retry  # where a re-issue starts from
                return answer
            retry = answer

    async def _after_failure(self, retry: Retry, failure: _Failure, base: str) -> Retry:
        """Wait and go on to the next attempt, or raise the failure's error if it is final."""
        delay = retry.delay(self._jitter(retry))
        if not retry.retries_failure(failure.retryable, delay, self._clock()):
            raise failure.error(retry.attempt) from None
        await self._pause(retry.attempt, None, failure.reason, delay)
        return retry.increment(failed=base, backoff=True)

    async def _answer(
        self, prepared: Prepared, retry: Retry, response: httpx.Response, base: str
    ) -> httpx.Response | Retry:
        """The response to hand back, or the next attempt's state (``response`` is then closed)."""
        answer: httpx.Response | Retry | None = None
        try:
            status = response.status_code
            if retry.retries_status(status):
                answer = await self._after_status(retry, response, base)
            elif retry.may_reshape(status, refold=bool(prepared.refold), remap=bool(prepared.remap_role)):
                answer = await self._reshaped(prepared, retry, response)
            else:
                answer = response
            return answer
        finally:
            if not isinstance(answer, httpx.Response):
                with anyio.CancelScope(shield=True):
                    await response.aclose()

    async def _after_status(self, retry: Retry, response: httpx.Response, base: str) -> httpx.Response | Retry:
        """A busy or failing upstream's status: wait and go on (another upstream first), or hand it back."""
        asked = asked_wait(response.headers)
        no_retry = says_no_retry(response.headers)
        if asked is None and not no_retry:
            # No header: the wait may be in the body (Google's RetryInfo). Read as a relayed error is
            # (bounded, scrubbed); while another attempt could start, by the retry deadline too: the
            # read is then part of the attempts, and an upstream dripping its body must not hold the
            # request past it. The answer handed back is then the read copy.
            now = self._clock()
            until = anyio.current_time() + retry.deadline - now if retry.in_time(0.0, now) else math.inf
            error_body = await self._read_error(response, until=until)
            response = replay(response, error_body, self._scrubber, limit=self._settings.error_body_limit)
            asked = body_wait(error_body.data) if error_body.decoded else None
        if retry.answer_stands(base, asked=asked, no_retry=no_retry):
            # The upstream said whether or when to ask again: its answer goes to the client as it
            # is (the SDKs honour both headers).
            return response
        delay = retry.delay(self._jitter(retry), asked)
        if not retry.in_time(delay, self._clock()):
            if retry.marks_spent():
                response.headers.update(NO_CLIENT_RETRY)
            return response
        await response.aclose()  # before sleeping: the connection goes back to the pool
        status = response.status_code
        await self._pause(retry.attempt, status, f"status {status}", delay)
        return retry.increment(failed=base, backoff=True)

    async def _reshaped(self, prepared: Prepared, retry: Retry, response: httpx.Response) -> httpx.Response | Retry:
        """A 400 or 413: refold a context overflow or rename a rejected role and go on at once, or
        hand back the error (read, capped and scrubbed)."""
        status = response.status_code
        error_body = await self._read_error(response)
        if retry.reshapes_in_time(self._clock()):
            reshaped = self._reshape(prepared, retry, status, error_body.readable)
            if reshaped is not None:
                return reshaped
        return replay(response, error_body, self._scrubber, limit=self._settings.error_body_limit)

    def _reshape(self, prepared: Prepared, retry: Retry, status: int, captured: bytes) -> Retry | None:
        """The next attempt's state if the error asks for a refold or a role rename and the body changed."""
        refold, remap = prepared.refold, prepared.remap_role
        if refold is not None and (overflow := match_overflow(status, captured)) is not None:
            if not self._adopt(prepared, refold(overflow.window), retry):
                return None
            self._counters.refolded += 1
            self._emit(AttemptEvent("refold", retry.attempt, status, f"context overflow, window {overflow.window}"))
            return retry.increment()
        rejected = match_rejected_role(status, captured) if remap is not None else None
        target = retry.role_target(rejected) if rejected is not None else None
        if remap is None or rejected is None or target is None:
            return None
        if not self._adopt(prepared, remap(rejected, target), retry):
            return None
        self._emit(AttemptEvent("role", retry.attempt, 400, f"role {rejected!r} rejected, sent as {target!r}"))
        return retry.increment(role=target)

    def _adopt(self, prepared: Prepared, body: bytes | None, retry: Retry) -> bool:
        """Make ``body`` (a refold's or a rename's) the next attempt's, if it is one: it changed the body,
        and RETRY_DEADLINE still allows an attempt now that it is built (a large body's refold takes a
        while; the deadline bounds when an attempt starts, not only when its body is made)."""
        if body is None or body == prepared.body or not retry.reshapes_in_time(self._clock()):
            return False
        prepared.body = body
        return True

    async def _send(self, prepared: Prepared, base: str) -> httpx.Response | _Failure:
        """One attempt up to the response headers."""
        request = self._build(prepared, base)
        prepared.attempts += 1
        prepared.upstream = base
        release = self._pool.acquire(base)
        try:
            with anyio.fail_after(self._settings.headers_timeout):
                # Never a redirect followed, whatever client was passed in (the aiohttp transport does not
                # either): httpx builds a redirect request with the client's cookie jar, which holds the
                # Set-Cookie of every other client's answers (a client passed in keeps its jar), and
                # re-sends the body to wherever Location says. The 3xx goes to the client as it came.
                response = await self._client.send(request, stream=True, follow_redirects=False)
        except TimeoutError:
            release()
            return _Failure(
                timeout=True,
                reason=f"no response headers within {self._settings.headers_timeout:g}s",
                # Sent whole: the upstream may be generating the answer now.
                retryable=resend_safe(request.method, body_sent=getattr(request.stream, "sent", False)),
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            release()
            self._pool.mark_down(base)  # its sessions fail over until the cool-off ends
            return _Failure(timeout=isinstance(exc, httpx.TimeoutException), reason=type(exc).__name__)
        except httpx.TimeoutException as exc:
            release()
            # A read timeout comes after the request was sent; a write or pool timeout before.
            retryable = resend_safe(request.method, body_sent=isinstance(exc, httpx.ReadTimeout))
            return _Failure(timeout=True, reason=type(exc).__name__, retryable=retryable)
        except httpx.LocalProtocolError as exc:
            release()
            # Raised by our own client on a request HTTP/1.1 cannot carry (h11's checks, before it is sent):
            # deterministic, so never retried, and the upstream is not to blame.
            return _Failure(timeout=False, reason=type(exc).__name__, retryable=False, local=True)
        except httpx.TransportError as exc:
            release()
            return _Failure(timeout=False, reason=type(exc).__name__)
        except BaseException:
            release()
            raise
        self._pool.mark_up(base)
        if not 200 <= response.status_code <= 599:
            # No valid final status lies outside 200-599 (RFC 9110 15: a 1xx is interim, never the answer; aiohttp
            # hands back a 101 without an upgrade as one), and the server in front of the gateway may not send one
            # (uvicorn raised: the client's connection dropped, nothing answered): a malformed answer, as one h11
            # or aiohttp refuses to parse.
            try:
                await response.aclose()
            finally:
                release()
            # It answered: it may have done the work, so only what is safe to send twice is retried.
            return _Failure(
                timeout=False,
                reason=f"status {response.status_code} outside 200-599",
                retryable=resend_safe(request.method, body_sent=True),
            )
        _framed(response, self._scrubber)
        if response.is_closed:  # already complete (e.g. an in-memory transport): nothing in flight
            release()
            # Read and decoded: hand it on as a stream.
            response = replay(response, ErrorBody(response.content, decoded=True), self._scrubber)
        else:
            stream: httpx.AsyncByteStream = _Tracked(response.stream, release)  # type: ignore[arg-type]
            encoding = response.headers.get("content-encoding", "").strip().lower()
            response.stream = stream
            if self._scrubber and response.status_code < 400:
                if encoding not in ("", "identity"):
                    # Asked for identity, sent encoded anyway: its bytes cannot be checked for our key.
                    await response.aclose()
                    raise UpstreamError(
                        f"the upstream sent a {encoding!r}-encoded answer although the gateway asked for"
                        " identity; it cannot be checked for the gateway's upstream key, so it was withheld",
                        code="upstream_answer_withheld",
                    )
                # The upstream may quote our key in any body, not only an error's (those are read
                # whole and scrubbed by ``replay``): in a 200 answer, an in-band error event.
                response.stream = _Masked(stream, self._scrubber)
        response.extensions["asgi_lifetime.upstream"] = base
        return response

    def _build(self, prepared: Prepared, base: str) -> httpx.Request:
        url = self._url(_join(base, prepared.path))
        outbound = [(k, v) for k, v in prepared.headers if k.lower() not in _OWN_HEADERS]
        named = {k.lower() for k, _ in outbound} | _OWN_HEADERS
        defaults = [(k, v) for k, v in self._client.headers.multi_items() if k.lower() not in named]
        headers = [("Host", url.netloc.decode("ascii")), ("Accept-Encoding", "identity"), *defaults, *outbound]
        if prepared.has_body:
            headers.append(("Content-Length", str(prepared.body_size)))
        basic = self._basic.get(base)
        # A credential among the caller's client= default headers counts too (else two would go out), and so
        # does a client's key in the query (Gemini's ?key=).
        if (
            basic is not None
            and not has_key_param(url.query)
            and not any(k.lower().encode("latin-1") in CREDENTIAL_HEADERS for k, _ in (*defaults, *outbound))
        ):
            headers.append(("Authorization", basic))
        # Values are the latin-1 text of the client's bytes (obs-text included): send those bytes.
        # Given str, httpx encodes ASCII and fails on any byte over 0x7F. Spaces and tabs around a value
        # are not part of it (RFC 9110 5.5): dropped from every field (a preparer's, a client= default),
        # as h11 refuses them and aiohttp sends them, so that both transports send the same.
        encoded = [(k.encode("latin-1"), v.encode("latin-1").strip(OWS)) for k, v in headers]
        return httpx.Request(prepared.method, url, headers=encoded, stream=_BodyStream(prepared))

    def _url(self, text: str) -> httpx.URL:
        """``httpx.URL(text)``, parsed once per distinct URL: its parse and checks were two thirds of
        building each request, for the same few URLs (a URL is immutable: shared safely).
        Only short URLs without a query are kept (a query may carry a client's key), the ``_URLS`` used
        last: kept first-come, a client's made-up paths took every place for good, and every request paid
        the parse again."""
        urls = self._urls
        url = urls.get(text)
        if url is not None:
            urls.move_to_end(text)
            return url
        url = httpx.URL(text)
        if len(text) <= _URL_BYTES and "?" not in text:
            urls[text] = url
            if len(urls) > _URLS:
                urls.popitem(last=False)
        return url

    def _jitter(self, retry: Retry) -> float:
        """Full jitter: a wait drawn from ``[0, retry.ceiling()]`` (see ``Retry.delay``)."""
        return self._random.uniform(0, retry.ceiling())

    async def _read_error(self, response: httpx.Response, *, until: float = math.inf) -> ErrorBody:
        """Up to ``error_body_limit`` bytes of an error body, decoded with bounds, whole within
        ``stall_timeout`` and by ``until`` (anyio's clock); the response is closed whatever
        happens (see ``_error_body``)."""
        settings = self._settings
        limit, stall = settings.error_body_limit, settings.stall_timeout
        return await read_error_body(response, limit=limit, stall_timeout=stall, until=until)

    async def _pause(self, attempt: int, status: int | None, reason: str, delay: float) -> None:
        self._counters.retried += 1
        logger.info("upstream attempt %d failed (%s); retrying in %.2fs", attempt, reason, delay)
        self._emit(AttemptEvent("retry", attempt, status, reason, delay))
        await self._sleep(delay)

    async def capped(self, response: httpx.Response) -> httpx.Response:
        """An error response as the client gets it: at most ``ERROR_BODY_LIMIT`` bytes of its body,
        read now (the upstream's error page is not streamed through unbounded), our upstream key
        scrubbed from it, and an honest gateway error if it is incomplete. Closes ``response``."""
        return replay(response, await self._read_error(response), self._scrubber, limit=self._settings.error_body_limit)

    def _emit(self, event: AttemptEvent) -> None:
        if self._listener is None:
            return
        try:
            self._listener(event)
        except Exception:
            logger.exception("attempt listener failed")
