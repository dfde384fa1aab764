"""A built-in OpenAI-compatible upstream with scriptable faults, for the demo, tests and benchmarks.

Behaviours come from the ``x-demo-behaviour`` request header and from ``app.state.behaviour``
(the app-wide default; header entries win), both a comma-separated list of ``name`` or
``name=value`` (seconds and byte counts are numbers)::

    fail=N [status=CODE]  first N requests with this behaviour string fail (default 503, Retry-After: 0);
                          status=CODE alone fails every request
    overflow=N            bodies over N bytes get 400 context_length_exceeded
    reject_role=ROLE      400 if any message has that role
    error_body=BYTES      500 with a JSON error body of exactly BYTES bytes (at least the bare envelope)
    headers_delay=S       wait S seconds before the response headers
    stall=S               send headers and the first chunk, then go silent for S seconds (0: forever)
    starve                stream only the role delta, then end without content or [DONE]
    reset                 drop the connection mid-body (uvicorn closes it when the app raises)
    malformed[=BYTES]     garbage SSE lines, then a ``data:`` line of BYTES (default 65536) with no newline
    gzip                  gzip the response body (``content-encoding: gzip``) whatever the client accepts
    delay=S               per-chunk delay instead of the tokens_per_second pacing
    id=TAG                no effect; gives a behaviour string its own ``fail`` counter

``app.state.stats`` (a :class:`DemoStats`) counts what the upstream saw. Client disconnects are
detected by a task watching ``receive()`` for ``http.disconnect`` while the response is produced.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._settings import check_argument, positive

__all__ = ["DemoStats", "create_demo_upstream", "parse_behaviour"]

_WORDS = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et dolore "
    "magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea commodo"
).split()
_MAX_TOKENS = 4096
_BEHAVIOURS = frozenset(
    "fail status overflow reject_role error_body headers_delay stall starve reset malformed gzip delay id".split()
)
_FAILURES = {
    429: ("Rate limit reached for the demo model.", "requests", "rate_limit_exceeded"),
    503: ("The demo server is overloaded. Please retry.", "server_error", None),
}
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

_Step = bytes | float  # bytes are sent, floats are pauses in seconds (inf: until disconnect)


@dataclass
class DemoStats:
    """What the demo upstream saw. Counters only; request bodies are never kept."""

    requests: int = 0  # chat requests received
    completed: int = 0  # responses sent to the end
    disconnects: int = 0  # requests cut short because the client went away (reading the body or responding)
    active_streams: int = 0  # chat responses in progress (streamed or not)
    last_body_size: int = 0  # bytes in the last request body


@dataclass
class _Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    steps: list[_Step] = field(default_factory=list)
    headers_delay: float = 0.0
    gzip_stream: bool = False  # compress each step with a sync flush
    reset: bool = False  # raise instead of finishing the body


class _ResetConnection(Exception):
    """Raised by the app to make uvicorn drop the connection (the ``reset`` behaviour)."""


class _HideReset(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _ResetConnection))


def parse_behaviour(text: str) -> dict[str, str]:
    """Parse ``"fail=2,gzip"`` into ``{"fail": "2", "gzip": ""}``; unknown names raise ValueError."""
    parsed: dict[str, str] = {}
    for item in text.split(","):
        name, _, value = (part.strip() for part in item.partition("="))
        if not name:
            continue
        if name not in _BEHAVIOURS:
            raise ValueError(f"unknown demo behaviour {name!r}; known: {', '.join(sorted(_BEHAVIOURS))}")
        parsed[name] = value
    return parsed


def _number(spec: dict[str, str], name: str, bare: float | None = None) -> float | None:
    """The behaviour's value; None when absent, ``bare`` when given without a value."""
    if name not in spec:
        return None
    if spec[name] == "" and bare is not None:
        return bare
    try:
        value = float(spec[name])
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"demo behaviour {name}={spec[name]!r}: expected a number >= 0")
    return value


def _error(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None when the client hangs up first. A function of its own: its
    locals (the chunks, the last message) are gone when it returns, before the answer streams."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class _Upstream:
    def __init__(self, *, tokens_per_second: float, default_tokens: int, seed: int) -> None:
        self.tokens_per_second = tokens_per_second
        self.default_tokens = default_tokens
        self.seed = seed
        self.stats = DemoStats()
        self.app_state: Any = None  # set by create_demo_upstream; holds the app-wide ``behaviour``
        self._attempts: dict[str, int] = {}  # fail counters, by normalised behaviour string

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.requests += 1
        body = await _read_body(receive)
        if body is None:
            self.stats.disconnects += 1
            return
        self.stats.last_body_size = len(body)
        try:
            spec = parse_behaviour(str(getattr(self.app_state, "behaviour", "") or ""))
            spec.update(parse_behaviour(Headers(scope=scope).get("x-demo-behaviour", "")))
            reply = self._plan(body, spec)
        except ValueError as exc:
            reply = self._fixed(400, _error(str(exc), "invalid_request_error"), {})
        del body  # the reply is planned: do not hold the request while streaming the answer
        await self._respond(reply, receive, send)

    def _plan(self, body: bytes, spec: dict[str, str]) -> _Reply:
        """The whole reply, decided before anything is sent: the first behaviour that applies answers."""
        reply = self._failure(spec) or self._error_body(spec) or self._overflow(body, spec)
        if reply is not None:
            return reply
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            return self._fixed(400, _error("The request body is not a JSON object.", "invalid_request_error"), spec)
        reply = self._rejected_role(request, spec)
        if reply is not None:
            return reply
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens", self.default_tokens))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            return self._fixed(400, _error("max_tokens must be an integer >= 0.", "invalid_request_error"), spec)
        return self._completion(body, request, max_tokens, spec)

    def _failure(self, spec: dict[str, str]) -> _Reply | None:
        """``fail=N`` and ``status=CODE``; a bad ``status`` is refused even without ``fail``."""
        key = ",".join(f"{name}={value}" for name, value in sorted(spec.items()))
        status = int(_number(spec, "status") or 503)
        if not 400 <= status <= 599:
            raise ValueError(f"demo behaviour status={status}: expected an HTTP error status (400-599)")
        fail = _number(spec, "fail", bare=math.inf)
        if fail is None and "status" in spec:
            fail = math.inf
        if not fail:
            return None
        self._attempts[key] = attempt = self._attempts.get(key, 0) + 1
        if attempt > fail:
            return None
        message, type_, code = _FAILURES.get(status, (f"Demo upstream failure ({status}).", "server_error", None))
        return self._fixed(status, _error(message, type_, code), spec, [(b"retry-after", b"0")])

    def _error_body(self, spec: dict[str, str]) -> _Reply | None:
        """``error_body=BYTES``."""
        if "error_body" not in spec:
            return None
        size = int(_number(spec, "error_body") or 0)
        envelope = _dumps(_error("", "server_error"))
        message = "x" * max(0, size - len(envelope))
        return self._fixed(500, _error(message, "server_error"), spec)

    def _overflow(self, body: bytes, spec: dict[str, str]) -> _Reply | None:
        """``overflow=N``."""
        overflow = _number(spec, "overflow")
        if overflow is None or len(body) <= overflow:
            return None
        message = (
            f"This model's maximum context length is {int(overflow) // 4} tokens. "
            f"However, your messages resulted in {len(body) // 4} tokens."
        )
        return self._fixed(400, _error(message, "invalid_request_error", "context_length_exceeded"), spec)

    def _rejected_role(self, request: dict[str, Any], spec: dict[str, str]) -> _Reply | None:
        """``reject_role=ROLE``."""
        messages = request.get("messages")
        roles = [m.get("role") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        if "reject_role" not in spec or spec["reject_role"] not in roles:
            return None
        message = f"Unexpected role '{spec['reject_role']}' in messages[{roles.index(spec['reject_role'])}]."
        return self._fixed(400, _error(message, "invalid_request_error"), spec)

    def _completion(self, body: bytes, request: dict[str, Any], max_tokens: int, spec: dict[str, str]) -> _Reply:
        """The answer (``starve`` and ``malformed`` spoil it), streamed when the request asks."""
        rng = random.Random(f"{self.seed}:{zlib.crc32(_dumps(request.get('messages')))}")
        words = [rng.choice(_WORDS) for _ in range(min(max_tokens, _MAX_TOKENS))]
        model = str(request.get("model") or "demo")
        meta = {"id": f"chatcmpl-demo{self.stats.requests}", "object": "", "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": len(body) // 4, "completion_tokens": len(words)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if request.get("stream") is True:
            return self._stream(words, meta, usage, request, rng, spec)
        if "starve" in spec:
            return self._raw(200, [_JSON], [b""], spec)
        if "malformed" in spec:
            return self._raw(200, [_JSON], [b'{"choices": [{"message": garbage'], spec)
        choice = {"index": 0, "message": {"role": "assistant", "content": " ".join(words)}, "finish_reason": "stop"}
        completion = {**meta, "object": "chat.completion", "choices": [choice], "usage": usage}
        return self._fixed(200, completion, spec)

    def _stream(
        self,
        words: list[str],
        meta: dict[str, Any],
        usage: dict[str, int],
        request: dict[str, Any],
        rng: random.Random,
        spec: dict[str, str],
    ) -> _Reply:
        def event(delta: dict[str, str], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return b"data: " + _dumps({**meta, "object": "chat.completion.chunk", "choices": [choice]}) + b"\n\n"

        steps: list[_Step] = [event({"role": "assistant", "content": ""})]
        reply = _Reply(200, list(_SSE), steps, reset="reset" in spec)
        reply.headers_delay = _number(spec, "headers_delay") or 0.0
        reply.gzip_stream = "gzip" in spec
        if reply.gzip_stream:
            reply.headers.append((b"content-encoding", b"gzip"))
        stall = _number(spec, "stall", bare=0.0)
        if stall is not None:
            steps.append(stall or math.inf)
        if "starve" in spec:
            return reply
        delay = _number(spec, "delay")
        if "malformed" in spec:
            size = int(_number(spec, "malformed", bare=65536.0) or 0)
            steps += [b"this line is not server-sent events\n", b'data: {"choices": [{"delta": \n\n']
            steps += [b"data: \xff\xfe not utf-8\n\n", b"data: "]
            steps += [b"x" * min(1024, size - offset) for offset in range(0, size, 1024)]
            return reply
        sent = events = 0
        while sent < len(words):
            group = words[sent : sent + rng.randint(1, 3)]
            steps += [delay if delay is not None else len(group) / self.tokens_per_second]
            steps += [event({"content": (" " if sent else "") + " ".join(group)})]
            sent, events = sent + len(group), events + 1
            if reply.reset and events == 3:
                break
        if reply.reset:
            return reply
        steps.append(event({}, "stop"))
        options = request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            steps.append(b"data: " + _dumps({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage}))
            steps.append(b"\n\n")
        steps.append(b"data: [DONE]\n\n")
        return reply

    def _fixed(
        self, status: int, payload: Any, spec: dict[str, str], extra: list[tuple[bytes, bytes]] | None = None
    ) -> _Reply:
        return self._raw(status, [_JSON, *(extra or [])], [_dumps(payload)], spec)

    def _raw(self, status: int, headers: list[tuple[bytes, bytes]], parts: list[bytes], spec: dict[str, str]) -> _Reply:
        """A response with a known body (sent with content-length), split around a stall or reset."""
        body = b"".join(parts)
        if "gzip" in spec:
            body = gzip.compress(body, mtime=0)
            headers = [*headers, (b"content-encoding", b"gzip")]
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        reply = _Reply(status, headers, [body], headers_delay=_number(spec, "headers_delay") or 0.0)
        stall = _number(spec, "stall", bare=0.0)
        if "reset" in spec or stall is not None:
            half = len(body) // 2
            reply.steps = [body[:half]] if "reset" in spec else [body[:half], stall or math.inf, body[half:]]
            reply.reset = "reset" in spec
        return reply

    async def _respond(self, reply: _Reply, receive: Receive, send: Send) -> None:
        finished = False

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                self.stats.disconnects += 1
                scope.cancel()

        self.stats.active_streams += 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect, tg.cancel_scope)
                await self._send(reply, send)
                finished = True
                tg.cancel_scope.cancel()
        finally:
            self.stats.active_streams -= 1
        if finished and reply.reset:
            raise _ResetConnection("demo behaviour 'reset'")

    async def _send(self, reply: _Reply, send: Send) -> None:
        if reply.headers_delay:
            await anyio.sleep(reply.headers_delay)
        await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
        compressor = zlib.compressobj(wbits=31) if reply.gzip_stream else None
        for step in reply.steps:
            if isinstance(step, float):
                await (anyio.sleep_forever() if math.isinf(step) else anyio.sleep(step))
                continue
            if compressor:
                step = compressor.compress(step) + compressor.flush(zlib.Z_SYNC_FLUSH)
            await send({"type": "http.response.body", "body": step, "more_body": True})
        if not reply.reset:
            await send({"type": "http.response.body", "body": compressor.flush() if compressor else b""})
            self.stats.completed += 1


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def create_demo_upstream(*, tokens_per_second: float = 50.0, default_tokens: int = 40, seed: int = 0) -> Starlette:
    """An OpenAI-compatible upstream (``POST /v1/chat/completions``, ``GET /healthz``) for loopback use.

    Replies are deterministic lorem-ipsum words (one word per token, seeded by ``seed`` and the
    request's messages), ``max_tokens`` long (default ``default_tokens``, capped at 4096), streamed at
    ``tokens_per_second``. Serve it with ``asgi_lifetime.testing.serve_in_thread``:

        app = create_demo_upstream(tokens_per_second=1000)
        app.state.behaviour = "fail=1"  # app-wide; a request's x-demo-behaviour header adds to it
        with serve_in_thread(app) as url:
            ...
        app.state.stats.disconnects
    """
    check_argument("tokens_per_second", tokens_per_second, positive)
    if not 0 <= default_tokens <= _MAX_TOKENS:
        raise ValueError(f"default_tokens must be between 0 and {_MAX_TOKENS}, got {default_tokens!r}")
    upstream = _Upstream(tokens_per_second=tokens_per_second, default_tokens=default_tokens, seed=seed)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", upstream, methods=["POST"]),
            Route("/healthz", _healthz, methods=["GET"]),
        ]
    )
    app.state.behaviour = ""
    app.state.stats = upstream.stats
    upstream.app_state = app.state
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, _HideReset) for existing in uvicorn_log.filters):
        uvicorn_log.addFilter(_HideReset())  # a scripted reset is not an application error
    return app
