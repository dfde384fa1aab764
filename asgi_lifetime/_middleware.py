"""``LifetimeMiddleware``: admit, read, fingerprint, replay once, release on every path."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

import anyio
from blake3 import blake3
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _json
from ._admission import Admission, Ticket
from ._asgi import REFUSED, BodyWatch, is_json, list_field, normalize_headers, route_path, send_error, task_group, under
from ._body import parse_content_length, read_body
from ._exceptions import (
    BodyAborted,
    BodyIdleTimeout,
    BodyTimeout,
    BodyTooComplex,
    BodyTooLarge,
    LifetimeError,
    MalformedBody,
)
from ._fingerprint import Fingerprint, fingerprint, wire_hash
from ._lazy import DeferredParse, inspect_body
from ._parse import THREAD_THRESHOLD, Raised, in_thread_caught, offload, parse_body
from ._resources import RequestResources, Resource
from ._settings import LifetimeSettings
from ._stats import Counters, LifetimeStats

__all__ = ["Lifetime", "LifetimeMiddleware", "RequestLifetime"]

logger = logging.getLogger(__name__)

_NOT_PARSED: Any = object()


class Lifetime:
    """The live state one middleware (or gateway) owns: settings, counters and admission.

    Published as ``app.state.lifetime``; ``lifetime.stats()`` is a ``LifetimeStats`` snapshot.
    """

    def __init__(self, settings: LifetimeSettings) -> None:
        if not isinstance(settings, LifetimeSettings):  # a mapping (app.state takes one) failed later, unnamed
            raise TypeError(
                f"settings must be a LifetimeSettings, not {type(settings).__name__}; "
                "LifetimeSettings.from_mapping() builds one from a mapping"
            )
        self.settings = settings
        self.counters = Counters()
        self.admission = Admission(
            max_inflight=settings.max_inflight,
            max_inflight_bytes=settings.max_inflight_bytes,
            timeout=settings.admission_timeout,
            counters=self.counters,
            target_delay=settings.admission_target_delay,
            interval=settings.admission_interval,
        )

    def stats(self) -> LifetimeStats:
        return self.counters.snapshot()

    def handles(self, scope: Scope) -> bool:
        """Whether a scope is an HTTP request under one of the configured path prefixes (whole segments)."""
        if scope["type"] != "http":
            return False
        path = route_path(scope)
        return any(under(path, prefix) for prefix in self.settings.paths)


class RequestLifetime:
    """Per-request facts, at ``request.state.lifetime``. Never holds the raw body.

    - ``fingerprint``: wire hash, text-comparability verdict and size of the body as received.
    - ``size``: decoded body size in bytes; ``admission_wait``: seconds spent waiting for admission.
    - ``resources``: the request's ``RequestResources``; register anything that must be released
      when the request settles (``request.state.lifetime.resources.add(close)``).
    """

    __slots__ = ("fingerprint", "size", "admission_wait", "resources", "_parsed", "_parsed_hold")

    def __init__(self, fp: Fingerprint, *, admission_wait: float, resources: RequestResources) -> None:
        self.fingerprint = fp
        self.size = fp.size
        self.admission_wait = admission_wait
        self.resources = resources
        self._parsed: Any = _NOT_PARSED
        self._parsed_hold: Resource | None = None

    def take_parsed(self) -> Any:
        """Take ownership of the first parse of the body (only with ``handoff_parsed=True``).

        Returns it once and forgets it, so the middleware holds no reference afterwards.
        Raises ``LookupError`` when there is none (not handed off, not JSON, or already taken).
        With ``handoff_parsed="on_demand"`` it is a ``DeferredParse`` when the body's verdict was
        found without the parse (``DeferredParse.parse(body)`` builds it, charged and bounded).
        """
        parsed, self._parsed = self._parsed, _NOT_PARSED
        if parsed is _NOT_PARSED:
            raise LookupError("no parsed body to take")
        hold, self._parsed_hold = self._parsed_hold, None
        if hold is not None:
            hold.release_now()  # the taker accounts for what it keeps
        return parsed

    async def _drop_parsed(self) -> None:
        self._parsed = _NOT_PARSED
        if self._parsed_hold is not None:
            await self._parsed_hold.release()


class _Replay:
    """Holds the body until the inner app's first ``receive()``, then holds nothing.

    The message it returns is the app's: never changed afterwards. A receiver may hand it on
    before reading it (a disconnect poller that queues messages for the app, FastAPI discussion
    11360) or record it and read it after the response: emptying it at a later ``receive()``
    gave those an empty body. A receiver that keeps it while it waits for the next message
    (Starlette's disconnect listener, when the endpoint did not read the body) keeps the body as
    long; such an endpoint takes the replay and drops it (docs/testing.md).
    """

    __slots__ = ("body", "hold", "receive")

    def __init__(self, body: bytes, hold: Resource, receive: Receive) -> None:
        self.body: bytes | None = body
        self.hold: Resource | None = hold
        self.receive = receive

    async def __call__(self) -> Message:
        body, self.body = self.body, None
        if body is None:
            return await self.receive()
        hold, self.hold = self.hold, None
        if hold is not None:
            await hold.release()
        return {"type": "http.request", "body": body, "more_body": False}


class _Settle:
    """Settles one request the moment its response is complete, before the server sees the end.

    The final ``http.response.body`` (``more_body`` false) is passed on only after admission,
    pins, retained bytes and every other resource are released and ``completed`` is counted,
    so a client that reads ``/lifetime/stats`` right after its response sees the request settled.
    """

    __slots__ = ("_lifetime", "_resources", "_counters", "_send", "_settled", "_counted")

    def __init__(self, lifetime: RequestLifetime, resources: RequestResources, counters: Counters, send: Send) -> None:
        self._lifetime = lifetime
        self._resources = resources
        self._counters = counters
        self._send = send
        self._settled = False
        self._counted = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False) and not self._settled:
            await self.settle()
            self.count_completed()
        await self._send(message)

    def count_completed(self) -> None:
        """Count the request as completed (once): at its final message, or when the app returns
        normally without one (a response it chose to cut short)."""
        if not self._counted:
            self._counted = True
            self._counters.completed += 1

    async def settle(self) -> None:
        """Release what the request holds (idempotent)."""
        if self._settled:
            return
        self._settled = True
        await self._lifetime._drop_parsed()
        await self._resources.aclose()


class LifetimeMiddleware:
    """Admits each request, reads its body safely, fingerprints it and replays it once.

    ```python
    app = FastAPI()
    app.add_middleware(LifetimeMiddleware, settings=LifetimeSettings(max_body_bytes=32 * MiB))
    ```

    Without ``settings`` it uses ``app.state.lifetime_settings`` (a ``LifetimeSettings`` or a
    mapping; a lifespan handler may set it) if set once the app's startup has run, else the
    environment (``ASGI_LIFETIME_*`` and ``.env``). Requests outside ``PATHS`` and websockets
    pass through untouched; of the lifespan, only the startup's answer is read (to resolve the
    settings then, and to report invalid ones as a failed startup). The admission slot and byte budget
    come back on every settlement path. ``handoff_parsed=True`` keeps the first parse for the
    inner app to ``take_parsed()`` (413 ``body_too_complex`` when it would cost too much).
    Otherwise a large JSON body is not parsed at all when the lazy walk (``_lazy``) can tell
    its verdict, nor when its parse would cost too much (then it is not text comparable); with
    ``handoff_parsed="on_demand"`` (the gateway) ``take_parsed()`` then hands over a
    ``DeferredParse`` instead of the parse.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: LifetimeSettings | None = None,
        lifetime: Lifetime | None = None,
        handoff_parsed: bool | Literal["on_demand"] = False,
    ) -> None:
        if settings is not None and lifetime is not None:
            raise ValueError("pass either settings= or lifetime= (a Lifetime shared with other parts), not both")
        self.app = app
        self.handoff_parsed = handoff_parsed
        self._lifetime = lifetime if lifetime is not None else Lifetime(settings) if settings is not None else None

    @property
    def lifetime(self) -> Lifetime:
        if self._lifetime is None:
            raise RuntimeError("LifetimeMiddleware has not resolved its settings yet (no request or lifespan seen)")
        return self._lifetime

    def stats(self) -> LifetimeStats:
        return self.lifetime.stats()

    def _bind(self, scope: Scope) -> Lifetime:
        lifetime = self._lifetime
        app = scope.get("app")
        state = getattr(app, "state", None)
        if lifetime is None:
            configured = getattr(state, "lifetime_settings", None) if state is not None else None
            if isinstance(configured, LifetimeSettings):
                settings = configured
            elif isinstance(configured, Mapping):
                try:
                    settings = LifetimeSettings.from_mapping(configured)
                except ValueError as exc:  # it names the setting by its variable: say where it was set
                    raise ValueError(f"app.state.lifetime_settings: {exc}") from None
            else:
                settings = LifetimeSettings.from_environ()
            lifetime = self._lifetime = Lifetime(settings)
        if state is not None and getattr(state, "lifetime", None) is None:
            state.lifetime = lifetime
        return lifetime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._binding_after_startup(scope, send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lifetime = self._bind(scope)
        if not lifetime.handles(scope):
            await self.app(scope, receive, send)
            return
        normalize_headers(scope)  # every name compared below, and by the app, is lower-case
        counters = lifetime.counters
        settings = lifetime.settings
        body = BodyWatch(receive, settings.body_idle_timeout, settings.body_timeout)
        async with RequestResources(counters) as resources:
            try:
                inner_scope, replay = await self._admit_and_read(lifetime, scope, body, resources)
            except LifetimeError as exc:
                _count(counters, exc)
                if isinstance(exc, BodyAborted):
                    logger.info("%s %s: %s", scope["method"], scope["path"], exc.message)
                else:
                    # The body may be unread: the server must not parse what follows on this
                    # connection as a new request (smuggling), nor fail it for the data still coming.
                    await send_error(scope, send, exc, unread=body)
                return
            settle = _Settle(inner_scope["state"]["lifetime"], resources, counters, send)
            try:
                await self.app(inner_scope, replay, settle.send)
                settle.count_completed()
            finally:
                # Paths that never sent a final body message (an error, a disconnect, a
                # cancellation) settle here; the RequestResources's exit releases the rest.
                await settle.settle()

    def _binding_after_startup(self, scope: Scope, send: Send) -> Send:
        # Resolve the settings once the app's startup has run, not before: a lifespan handler is
        # where an app loads its configuration, app.state.lifetime_settings included. Bound at the
        # start of the lifespan, the environment's defaults silently won. An invalid setting fails
        # the startup: reported to the server here, not left to the app (an app that lets the error
        # out of its lifespan reads to uvicorn and hypercorn as "lifespan unsupported": they served,
        # a 500 for every request), and raised into the app, whose own report is then not passed on.
        failed = False

        async def send_bound(message: Message) -> None:
            nonlocal failed
            if message["type"] == "lifespan.startup.complete":
                try:
                    self._bind(scope)
                except ValueError as exc:
                    failed = True
                    await send({"type": "lifespan.startup.failed", "message": f"LifetimeMiddleware: {exc}"})
                    raise
            elif failed and message["type"] == "lifespan.startup.failed":
                return
            await send(message)

        return send_bound

    async def _admit_and_read(
        self, lifetime: Lifetime, scope: Scope, receive: Receive, resources: RequestResources
    ) -> tuple[Scope, _Replay]:
        # Everything that touches the body happens in this frame, which has returned by the
        # time the inner app runs: no suspended frame of ours keeps the body alive.
        settings = lifetime.settings
        if scope.get("http_version") == "0.9":  # uvicorn's httptools parser serves "GET /path" (h11 refuses it)
            raise MalformedBody("HTTP/0.9 requests are not served", code="unsupported_http_version")
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        length = parse_content_length(headers)
        if length is not None and length > settings.max_body_bytes:
            raise BodyTooLarge(settings.max_body_bytes)
        encoding = list_field(headers, b"content-encoding")
        json_body = is_json(headers)

        started = time.monotonic()
        # A slot, but no bytes yet: a declared Content-Length costs budget only as it is sent.
        if lifetime.admission.admits_now():
            ticket = await lifetime.admission.acquire(0)
            body_receive = receive
        else:
            ticket, early = await _acquire_watching(lifetime.admission, receive)
            body_receive = _replaying(early, receive)
        resources.add(ticket.release)
        admission_wait = time.monotonic() - started

        try:
            raw = await read_body(
                body_receive,
                max_bytes=settings.max_body_bytes,
                expected_length=length,
                idle_timeout=settings.body_idle_timeout,
                body_timeout=settings.body_timeout,
                content_encoding=encoding,
                on_progress=ticket.grow_to,  # charged before the body grows, raw or decoded
            )
        except BaseException:
            # Nothing of the body is held any more: the slot and bytes go back now, not after the
            # error response is sent (a server may hold that send while the client still sends).
            ticket.release()
            raise
        ticket.shrink_to(len(raw))  # give back the last inflate step's unused reservation
        hold = resources.retain(len(raw))
        digest, parsed, verdict = await _hash_and_look(raw, ticket, self.handoff_parsed if json_body else None)
        if verdict is None:
            first = None if parsed is _NOT_PARSED else parsed
            fp = await offload(len(raw), lambda: fingerprint(raw, parsed=first, wire_hash=digest))
        else:
            fp = Fingerprint(wire_hash=digest, text_comparable=verdict, size=len(raw))
        state = RequestLifetime(fp, admission_wait=admission_wait, resources=resources)
        if self.handoff_parsed and parsed is not _NOT_PARSED:
            state._parsed = parsed
            if not isinstance(parsed, DeferredParse):  # that holds nothing of the body
                state._parsed_hold = resources.retain(len(raw))

        inner_scope = dict(scope)
        # Handed over: the app's own bookkeeping records the request from here, its errors included.
        inner_scope.pop(REFUSED, None)
        # One state dict for both scopes: what the inner app puts in ``request.state`` is seen
        # by middleware outside this one (Starlette's ``BaseHTTPMiddleware`` reads it after the call).
        shared_state = scope.setdefault("state", {})
        shared_state["lifetime"] = state
        inner_scope["state"] = shared_state
        if encoding is not None or length != len(raw):
            # The inner app sees the decoded body: describe it truthfully.
            inner_scope["headers"] = [
                (k, v) for k, v in headers if k not in (b"content-encoding", b"content-length", b"transfer-encoding")
            ] + [(b"content-length", str(len(raw)).encode())]
        return inner_scope, _Replay(raw, hold, receive)


# While a request waits for its slot, how much of its body may be taken off the server to see
# whether its client is still there (uncharged: the server would hold these bytes anyway).
_WATCH_BYTES = 64 * 1024


async def _acquire_watching(admission: Admission, receive: Receive) -> tuple[Ticket, list[Message]]:
    """A slot, while watching the client: one that hangs up while queued leaves the queue at once
    (``BodyAborted``) instead of holding its place until admitted or ``ADMISSION_TIMEOUT``.

    ASGI says a hang-up only through ``receive()``, which also hands over the body: the messages
    read meanwhile are returned, to be read first. Watching stops after ``_WATCH_BYTES`` of body
    (the server's flow control holds the rest; a later hang-up is seen once admitted). Cancelling
    a pending ``receive()`` loses nothing: servers keep what it had not returned yet.
    """
    early: list[Message] = []
    ticket: Ticket | None = None
    failure: Exception | None = None  # raised here, not wrapped in the task group's ExceptionGroup
    gone = False

    async def watch() -> None:
        nonlocal gone, failure
        taken, more = 0, True
        try:
            while taken <= _WATCH_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone = True
                    break
                if not more:  # no body message after the last one; keep it for read_body to refuse
                    early.append(message)
                    return
                early.append(message)
                taken += len(message.get("body", b""))
                more = message.get("more_body", False)
                # With the body complete, what the next receive() returns is the hang-up.
            else:
                return  # watched enough: stop taking the body off the server
        except Exception as exc:
            failure = exc
        tg.cancel_scope.cancel()

    async def admit() -> None:
        nonlocal ticket, failure
        try:
            ticket = await admission.acquire(0)
        except Exception as exc:  # AdmissionRejected
            failure = exc
        tg.cancel_scope.cancel()  # stop watching: the body is read from here on

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(admit)
    except BaseException:  # cancelled from outside: a ticket won meanwhile is nobody's yet
        if ticket is not None:
            ticket.release()
        raise
    if ticket is not None and (gone or failure is not None):
        ticket.release()  # admitted in the same turn as the hang-up was seen
    if failure is not None:
        raise failure
    if gone:
        raise BodyAborted("the client hung up while waiting for admission")
    assert ticket is not None  # admit() returned a ticket or set failure
    return ticket, early


def _replaying(early: list[Message], receive: Receive) -> Receive:
    """``receive`` that first hands out ``early`` (read while the request was queued), releasing each."""

    async def replay() -> Message:
        if early:
            return early.pop(0)
        return await receive()

    return replay


async def _hash_and_look(
    raw: bytes, ticket: Ticket, handoff: bool | Literal["on_demand"] | None
) -> tuple[str, Any, bool | None]:
    """The wire hash of ``raw``, and ``_first_look``'s parse and verdict (``None`` for ``handoff``: not
    JSON, nothing to look at).

    A large body is hashed in a worker thread while the look runs in another: blake3 releases the GIL,
    so the hash costs no time beside the look, where hashing chunk by chunk as they came made the read
    (bound by the event loop's CPU) a third slower."""
    if handoff is None:
        return await offload(len(raw), lambda: wire_hash(raw)), _NOT_PARSED, None
    if len(raw) < THREAD_THRESHOLD:
        return wire_hash(raw), *await _first_look(raw, ticket, handoff)
    hashed: str | Raised = ""

    async def hash_raw() -> None:
        nonlocal hashed
        # One thread: the other core is the look's. Its error comes back as a value, raised below as
        # itself (not wrapped in the group's ExceptionGroup, and held by no cycle with the body).
        hashed = await in_thread_caught(lambda: blake3(raw).hexdigest())
        if isinstance(hashed, Raised):
            tg.cancel_scope.cancel()  # the look is not needed (its thread runs to its end all the same)

    # A refused look cancels the hash (its thread runs to its end all the same); else the group waits for it.
    async with task_group() as tg:
        tg.start_soon(hash_raw)
        looked = await _first_look(raw, ticket, handoff)
    if isinstance(hashed, Raised):
        raise hashed.take()
    return hashed, *looked


async def _first_look(raw: bytes, ticket: Ticket, handoff: bool | Literal["on_demand"]) -> tuple[Any, bool | None]:
    """The parse to hand over (or ``_NOT_PARSED``, or a ``DeferredParse``) and the verdict, if known
    without the parse. Unless the app asked for the parse itself (``handoff_parsed=True``), the lazy
    walk answers first; the full parse (refused with 413 when too costly, charged to the ticket)
    only when it cannot."""
    if handoff is not True:
        found = await inspect_body(raw, charge=ticket.grow_to)
        ticket.shrink_to(len(raw))  # the walk's working set is gone
        if found is not None:
            deferred = DeferredParse(found, ticket.grow_to) if handoff == "on_demand" else _NOT_PARSED
            return deferred, found.text_comparable
    try:
        return await parse_body(raw, charge=ticket.grow_to), None
    except _json.JSONDecodeFailure:
        ticket.shrink_to(len(raw))  # the standard library's parse may have failed after its charge
        return _NOT_PARSED, None
    except BodyTooComplex as exc:
        if handoff is True or (handoff == "on_demand" and not exc.valid):
            # The app wants the parse: it cannot have it. Or the gateway would forward the body as
            # JSON, and whether it is could not be told without the parse (an integer over 4300 digits).
            raise
        # Valid JSON whose parse would cost too much (token-id arrays: 9x), and nobody asked for it:
        # it goes on as received, judged not comparable as a body that is not JSON is. Whoever
        # needs the parse after all gets this 413 then (``DeferredParse.parse``).
        ticket.shrink_to(len(raw))
        return (DeferredParse(None, ticket.grow_to) if handoff == "on_demand" else _NOT_PARSED), False


def _count(counters: Counters, exc: LifetimeError) -> None:
    if isinstance(exc, BodyAborted):
        counters.aborted += 1
    elif isinstance(exc, BodyTooLarge):
        counters.too_large += 1
    elif isinstance(exc, (BodyIdleTimeout, BodyTimeout)):
        counters.timed_out += 1
