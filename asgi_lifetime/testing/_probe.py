"""The retention probe: is a request's body still reachable while its response streams?

``probe_retention`` drives an ASGI app in-process, as a server would, with no socket:

1. A body of ``body_size`` bytes in which every ``chunk_size`` piece carries one random marker
   (``chat_completion_body`` by default) goes to the app through ``receive()``, chunk by chunk.
   The probe keeps the chunks not yet received and nothing else of it.
2. The app's first ``http.response.body`` with ``more_body`` true is held: ``send`` does not
   return until the check is over, so the app is suspended mid-stream, as it is while a real
   client reads a long answer.
3. The heap is searched for the marker (``_heap.find_holders``): every object still holding a
   piece of the body, raw or parsed, is a finding, named by the path that reaches it.
4. ``send`` returns and the stream runs to its end; ``receive()`` then says the client left.

Events order it all (no sleeps), each wait bounded by ``within``.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from starlette.types import ASGIApp, Message

from .._settings import KiB, MiB, check_argument, positive
from . import _heap

__all__ = [
    "Holder",
    "LifetimeProbe",
    "ProbeError",
    "RetentionReport",
    "chat_completion_body",
    "probe_retention",
]

_SHOWN = 20  # holder lines in a report's text (a failure message stays readable)
_PIECE = 1 * KiB  # the marker's period in the default body: any 1 KiB kept is found
_MESSAGE = 16 * KiB  # the default body's message size
_SHORT_END = 4 * KiB  # an unmarked end of a body this short is sent with the chunk before it
_FILLER = (
    "The quick brown fox jumps over the lazy dog while the gateway streams a long answer back. "
    "Nothing of this request should stay reachable once the handler has what it needs. "
) * (_PIECE // 64)


class ProbeError(Exception):
    """The probe could not check the app: it did not stream, raised, or took too long."""


@dataclass(frozen=True)
class Holder:
    """One way the request's body was still reachable while the response streamed.

    ``path``: how it is reached, from a recognisable object, e.g.
    ``coroutine myapp.chat local 'request' → Request._json['messages'][*]['content']``
    (``[*]``: every item of a list, counted once). ``kind``: the type of the objects holding
    body content (``bytes``, ``str``...); ``count`` of them; ``size``: their content, in bytes.
    """

    path: str
    kind: str
    count: int
    size: int

    def __str__(self) -> str:
        what = self.kind if self.count == 1 else f"{self.count} {self.kind} objects"
        return f"{self.path}: {what}, {_human(self.size)}"


@dataclass(frozen=True)
class RetentionReport:
    """What ``probe_retention`` saw. ``ok`` when nothing held the body during the stream.

    ``holders``: each path to what held it, largest first; ``held_bytes`` and ``held_objects``:
    the objects holding pieces of the body (each counted once, however many paths reach it).
    ``str(report)`` is the fixture's failure message.
    """

    method: str
    path: str
    body_size: int
    chunk_size: int
    status: int
    holders: tuple[Holder, ...] = ()
    held_bytes: int = 0
    held_objects: int = 0
    allowed: tuple[Holder, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return not self.holders

    def __str__(self) -> str:
        request = f"{self.method} {self.path} (a {_human(self.body_size)} body in {_human(self.chunk_size)} chunks)"
        if self.ok:
            allowed = f" ({len(self.allowed)} allowed holder(s))" if self.allowed else ""
            return f"{request}: nothing held the body while the response ({self.status}) streamed{allowed}"
        lines = [
            f"{request}: the body was still reachable while the response ({self.status}) streamed, "
            f"{_human(self.held_bytes)} in {self.held_objects} object(s), held by:"
        ]
        lines += [f"  - {holder}" for holder in self.holders[:_SHOWN]]
        if len(self.holders) > _SHOWN:
            lines.append(f"  - and {len(self.holders) - _SHOWN} more path(s), the smallest (RetentionReport.holders)")
        return "\n".join(lines)


class LifetimeProbe(Protocol):
    """The ``lifetime_probe`` fixture's type (``asgi_lifetime.testing.plugin``): ``probe_retention``
    that fails the test when the body was held."""

    async def __call__(
        self,
        app: ASGIApp,
        *,
        path: str = ...,
        method: str = ...,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] = ...,
        body_size: int = ...,
        chunk_size: int = ...,
        body_factory: Callable[[str, int], bytes] = ...,
        lifespan: bool = ...,
        within: float = ...,
        allow: Sequence[str] = ...,
    ) -> RetentionReport: ...


def chat_completion_body(marker: str, size: int) -> bytes:
    """A streaming chat-completions request of about ``size`` bytes (at least), ``marker`` in every KiB.

    A system message, then user and assistant turns of 16 KiB each; every message's content is
    made of 1 KiB pieces that start with ``marker`` and a piece number. Only long string values
    carry the marker: JSON libraries cache short strings and keys (pydantic-core below 64
    characters, msgspec and orjson keys), which would be found as held when they are not
    the request's. ``body_factory`` callables have this signature.
    """
    messages: list[dict[str, str]] = []
    total = piece = 0
    while total < size:
        pieces = []
        for _ in range(_MESSAGE // _PIECE):
            head = f"{marker}-{piece:07d} "
            pieces.append(head + _FILLER[: _PIECE - len(head)])
            piece += 1
        role = "system" if not messages else ("user", "assistant")[(len(messages) - 1) % 2]
        messages.append({"role": role, "content": "".join(pieces)})
        total += _MESSAGE
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": messages.pop()["content"]})
    request = {"model": "lifetime-probe", "stream": True, "max_tokens": 16, "messages": messages}
    return json.dumps(request).encode("utf-8")


async def probe_retention(
    app: ASGIApp,
    *,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    body_size: int = 4 * MiB,
    chunk_size: int = 64 * KiB,
    body_factory: Callable[[str, int], bytes] = chat_completion_body,
    lifespan: bool = False,
    within: float = 30.0,
    allow: Sequence[str] = (),
) -> RetentionReport:
    """Send a large request through ``app`` and report what still holds its body mid-stream.

    ```python
    report = await probe_retention(app, path="/v1/chat/completions")
    assert report.ok, report
    ```

    Runs in-process over ASGI (any ASGI 3 app: Starlette, FastAPI, a gateway from
    ``asgi_lifetime.gateway.create_app``); the caller's event loop may be asyncio or trio. The
    body (``body_factory(marker, body_size)``, a streaming chat-completions request by default)
    arrives in ``chunk_size`` pieces, each carrying the marker. When the app sends the first
    chunk of a streamed response (``more_body`` true), that ``send`` is held while every object
    the garbage collector can reach is searched for the marker: a ``bytes``, ``str``,
    ``bytearray``, ``memoryview``, ``array`` or ``io.BytesIO`` with any piece of the body, raw or
    parsed, is a holder, named by the path from a recognisable object (a suspended coroutine's
    local, a module global, a class or function, the app) down to it. Then the stream runs to its
    end.

    ``headers``: more request headers (``content-type: application/json`` unless given).
    ``lifespan``: run the app's lifespan around the request (off: run it yourself if your
    app needs it). ``within``: the bound, in seconds, of each wait (the stream to start, to end; lifespan
    steps). ``allow``: holders whose path contains one of these strings are listed in
    ``RetentionReport.allowed`` instead of ``holders`` (a retention the app means to have).

    Raises ``ProbeError`` when the app raises, answers without streaming, or does not start
    (or finish) streaming within ``within`` seconds; ``ValueError`` for a body without the marker in
    each ``chunk_size`` piece.
    """
    check_argument("body_size", body_size, positive, integer=True)
    check_argument("chunk_size", chunk_size, positive, integer=True)
    check_argument("within", within, positive)
    marker = "lp" + secrets.token_hex(10)
    exchange = _Exchange(_chunks(body_factory(marker, body_size), marker, chunk_size))
    target, _, query = path.partition("?")
    state: dict[str, Any] = {}
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": target,
        "raw_path": target.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": _headers(headers, exchange.size),
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "state": state,
        "extensions": {},
    }
    # Errors are raised once out of the task groups: trio would wrap them in an ExceptionGroup.
    outcome: list[_heap.Found] | ProbeError
    async with contextlib.AsyncExitStack() as stack:
        started = await stack.enter_async_context(_lifespan(app, within)) if lifespan else {}
        if isinstance(started, ProbeError):
            outcome = started
        else:
            state.update(started)
            outcome = await _drive(app, scope, exchange, marker, within)
    if isinstance(outcome, ProbeError):
        raise outcome
    found = outcome
    del scope, state
    groups = _heap.group(found)
    kept = [g for g in groups if not any(text in g.path for text in allow)]
    held: dict[int, int] = {}  # each object once, however many paths reach it
    for g in kept:
        held.update(g.sizes)
    return RetentionReport(
        method=method.upper(),
        path=path,
        body_size=exchange.size,
        chunk_size=chunk_size,
        status=exchange.status,
        holders=tuple(_holder(g) for g in kept),
        held_bytes=sum(held.values()),
        held_objects=len(held),
        allowed=tuple(_holder(g) for g in groups if g not in kept),
    )


class _Exchange:
    """The probe's side of one request: what is left to receive, and where the response is."""

    def __init__(self, chunks: deque[bytes]) -> None:
        self.pending = chunks
        self.size = sum(len(chunk) for chunk in chunks)
        self.status = 0
        self.streaming = False
        self.error: Exception | None = None
        self.wake = anyio.Event()  # streaming started, or the app returned
        self.resume = anyio.Event()  # the check is over: the held send returns
        self.finished = anyio.Event()  # the response is complete, or the app returned
        self.returned = anyio.Event()

    async def receive(self) -> Message:
        if self.pending:
            chunk = self.pending.popleft()
            return {"type": "http.request", "body": chunk, "more_body": bool(self.pending)}
        # As a server: nothing more until the response is over, then the client has gone.
        await self.finished.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
        elif kind == "http.response.body":
            more = bool(message.get("more_body", False))
            del message  # the app's chunk is the app's to hold, not the probe's
            if not more:
                self.finished.set()
            elif not self.streaming:
                self.streaming = True
                self.wake.set()
                await self.resume.wait()

    async def run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self.receive, self.send)
        except Exception as exc:
            self.error = exc
        finally:
            self.wake.set()
            self.finished.set()
            self.returned.set()


# The probe's coroutines are suspended inside the app's task during the search: not the app's.
_OWN_CODE = (_Exchange.receive.__code__, _Exchange.send.__code__, _Exchange.run.__code__)


async def _drive(
    app: ASGIApp, scope: dict[str, Any], exchange: _Exchange, marker: str, within: float
) -> list[_heap.Found] | ProbeError:
    found: list[_heap.Found] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(exchange.run, app, scope)
        with anyio.move_on_after(within):
            await exchange.wake.wait()
        if exchange.streaming and not exchange.returned.is_set():
            # The app is suspended in its send; the probe holds only the chunks not yet received.
            found = _heap.find_holders(marker, own=(exchange, exchange.pending), own_code=_OWN_CODE, app=app)
        exchange.resume.set()
        if exchange.wake.is_set():
            with anyio.move_on_after(within):
                await exchange.returned.wait()
        ended = exchange.returned.is_set()
        if not ended:
            tg.cancel_scope.cancel()
    return _verdict(exchange, found, ended, within)


def _verdict(
    exchange: _Exchange, found: list[_heap.Found], ended: bool, within: float
) -> list[_heap.Found] | ProbeError:
    error = exchange.error
    if not exchange.streaming:
        if error is not None:
            return _caused(ProbeError(f"the app raised {type(error).__name__}: {error}"), error)
        if not ended:
            received = exchange.size - sum(len(chunk) for chunk in exchange.pending)
            return ProbeError(
                f"the app did not start a streamed response within {within} s "
                f"(status {exchange.status or 'not sent'}; {received} of {exchange.size} body bytes received)"
            )
        return ProbeError(
            f"the app answered {exchange.status} without streaming (no body message with more_body=True): "
            "the probe looks while a response streams; send a request that it streams (path=, body_factory=)"
        )
    if not found and error is not None:
        return _caused(ProbeError(f"the app raised {type(error).__name__} after streaming began: {error}"), error)
    if not found and not ended:
        return ProbeError(f"the app's streamed response did not end within {within} s of the check")
    return found


def _caused(error: ProbeError, cause: Exception) -> ProbeError:
    error.__cause__ = cause
    return error


def _chunks(body: bytes, marker: str, chunk_size: int) -> deque[bytes]:
    if not isinstance(body, bytes):
        raise TypeError(f"body_factory must return bytes, not {type(body).__name__}")
    needle = marker.encode("utf-8")
    starts = list(range(0, len(body), chunk_size))
    if len(starts) > 1 and len(body) - starts[-1] <= _SHORT_END and body.find(needle, starts[-1]) < 0:
        starts.pop()  # a short unmarked end (a JSON document's closing brackets) goes with the chunk before
    for start, end in zip(starts, [*starts[1:], len(body)], strict=True):
        if body.find(needle, start, end) < 0:
            raise ValueError(
                f"the body has no marker in bytes {start}-{end}: body_factory must put the marker in every "
                "chunk_size piece (input kept from that piece would go unseen)"
            )
    return deque(body[start:end] for start, end in zip(starts, [*starts[1:], len(body)], strict=True))


def _headers(headers: Mapping[str, str] | Iterable[tuple[str, str]], size: int) -> list[tuple[bytes, bytes]]:
    items = list(headers.items() if isinstance(headers, Mapping) else headers)
    names = {name.lower() for name, _ in items}
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in items]
    if "host" not in names:
        raw.insert(0, (b"host", b"testserver"))
    if "content-type" not in names:
        raw.append((b"content-type", b"application/json"))
    if "content-length" not in names:
        raw.append((b"content-length", str(size).encode("ascii")))
    return raw


@contextlib.asynccontextmanager
async def _lifespan(app: ASGIApp, within: float) -> AsyncIterator[dict[str, Any] | ProbeError]:
    """Run the app's lifespan: startup, then shutdown on exit. Yields the lifespan state, or the
    ``ProbeError`` saying why startup failed (for the caller to raise out of the task group)."""
    state: dict[str, Any] = {}
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}
    to_app, inbox = anyio.create_memory_object_stream[Message](2)
    replies: dict[str, Message] = {}
    started, stopped = anyio.Event(), anyio.Event()
    failure: list[Exception] = []

    async def send(message: Message) -> None:
        step = str(message["type"]).rsplit(".", 1)[0]  # lifespan.startup / lifespan.shutdown
        replies[step] = message
        (started if step == "lifespan.startup" else stopped).set()

    async def run() -> None:
        try:
            await app(scope, inbox.receive, send)
        except Exception as exc:
            failure.append(exc)
        finally:
            started.set()
            stopped.set()

    async with to_app, inbox, anyio.create_task_group() as tg:
        tg.start_soon(run)
        await to_app.send({"type": "lifespan.startup"})
        with anyio.move_on_after(within):
            await started.wait()
        reply = replies.get("lifespan.startup", {})
        if reply.get("type") == "lifespan.startup.complete":
            try:
                yield state
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(within):
                    await to_app.send({"type": "lifespan.shutdown"})
                    await stopped.wait()
        else:
            why = reply.get("message") or (repr(failure[0]) if failure else f"no answer within {within} s")
            error = ProbeError(f"the app's lifespan startup failed: {why}")
            if failure:
                error.__cause__ = failure[0]
            yield error
        tg.cancel_scope.cancel()


def _holder(group: _heap.Group) -> Holder:
    return Holder(group.path, group.kind, len(group.sizes), group.size)


def _human(size: int) -> str:
    if size >= MiB:
        return f"{size / MiB:.1f} MiB"
    if size >= KiB:
        return f"{size / KiB:.1f} KiB"
    return f"{size} B"
