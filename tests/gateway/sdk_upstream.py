"""A scripted upstream speaking the wire formats the official ``openai`` and ``anthropic`` SDKs parse.

Served with uvicorn on loopback (``serve_in_thread(upstream.app)``), it answers:

- ``POST /v1/chat/completions``: a chat completion, or ``chat.completion.chunk`` events and ``[DONE]``;
- ``POST /v1/responses``: a Response, or the Responses event sequence (``response.created`` ...
  ``response.output_text.delta`` ... ``response.completed``); with an ``image_generation`` tool the
  ``response.output_item.done`` and ``response.completed`` events carry a ~1.5 MiB base64 image;
- ``POST /v1/audio/transcriptions`` (multipart) with ``stream=true``: ``transcript.text.delta`` / ``.done``;
- ``POST /v1/images/generations`` with ``stream``: ``image_generation.partial_image`` / ``.completed``;
- ``POST /v1/audio/speech`` with ``stream_format="sse"``: ``speech.audio.delta`` / ``speech.audio.done``;
- ``POST /v1/messages``: an Anthropic message, or message_start, content_block_start, ping,
  content_block_delta..., content_block_stop, message_delta, message_stop;
- ``POST /v1beta/models/<model>:generateContent``, ``:streamGenerateContent?alt=sse`` (data-only
  events, the last with ``finishReason``), ``:countTokens``, ``:batchEmbedContents``; ``GET /v1beta/models``
  and ``/v1beta/models/<model>``; ``POST /upload/v1beta/files`` (the resumable upload protocol):
  Gemini's API as the ``google-genai`` SDK calls it.

Errors come in each provider's shape (OpenAI ``{"error": {...}}``, Anthropic ``{"type": "error", ...}``,
Gemini ``{"error": {"code", "message", "status"}}``).

The upstream counts requests per path, records body sizes (never bodies) and a few request
headers, and notices disconnects. A test scripts faults per path with ``upstream.fail(path, Fault(...))``:
an error status, a connection cut after N events (optionally in the middle of an event), a stall.
Everything the test thread reads is guarded by a lock: uvicorn runs in another thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

TEXT = "The quick brown fox jumps over the lazy dog, twice, and then rests."
WORDS = [word + " " for word in TEXT.split(" ")]
WORDS[-1] = WORDS[-1].rstrip()
TRANSCRIPT = "Hello from the scripted upstream; this is a transcript."
CREATED = 1_700_000_000
# A deterministic, incompressible-looking ~1.5 MiB base64 image (1.1 MiB of bytes).
_IMAGE_BYTES = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(36_000))
BIG_IMAGE_B64 = base64.b64encode(_IMAGE_BYTES).decode()
PARTIAL_IMAGE_B64 = base64.b64encode(_IMAGE_BYTES[:3000]).decode()
SMALL_IMAGE_B64 = base64.b64encode(_IMAGE_BYTES[:20_000]).decode()
AUDIO_CHUNKS = [base64.b64encode(bytes([i]) * 2400).decode() for i in range(6)]
# Safety bound for a scripted stall (a stall normally ends when the gateway hangs up).
STALL_BOUND = 30.0
ANTHROPIC_PATH = "/v1/messages"
GEMINI = "/v1beta"


@dataclass(frozen=True)
class Fault:
    """What the upstream does to one request instead of answering normally.

    ``status``: answer with this error status and a provider-shaped body (``message``, ``code``),
    plus ``headers``. ``cut_after``: send this many events, then drop the connection (with
    ``half=True`` it first sends the first half of the next event). ``stall_after``: send this many
    events, then go silent until the peer hangs up (bounded by ``STALL_BOUND``). ``hold``: wait this
    long before answering at all (no headers), or until the peer hangs up. ``error_after``: send this
    many events, then the provider's in-band error event (``message``, ``code``; on the Anthropic path
    ``code`` is the error's type, ``overloaded_error`` if None; on Gemini's its ``status``), and end the
    stream. ``pause_after``: send this many events, then stay silent for ``pause`` seconds and go on.
    """

    status: int | None = None
    message: str = "scripted failure"
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None
    half: bool = False
    stall_after: int | None = None
    hold: float | None = None
    error_after: int | None = None
    pause_after: int | None = None
    pause: float = 0.0


class _Cut(Exception):
    """Raised inside the streaming body: uvicorn then closes the connection mid-body."""


@dataclass
class Seen:
    """What arrived at one path: thread-safe copies are handed out by ``ScriptedUpstream``."""

    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    cuts: int = 0
    body_sizes: list[int] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)


# Request headers recorded per request (values), so tests can check what the gateway forwarded.
_RECORDED = (
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "x-stainless-retry-count",
    "x-stainless-lang",
    "x-stainless-read-timeout",
    "x-stainless-timeout",
    "idempotency-key",
    "content-type",
    "accept",
    "user-agent",
    "x-goog-api-key",
    "x-goog-api-client",
    "x-goog-upload-protocol",
    "x-goog-upload-command",
)


class ScriptedUpstream:
    """The upstream app plus its records and fault script (see the module docstring)."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay  # seconds between events of a stream
        self._lock = threading.Lock()
        self._seen: dict[str, Seen] = defaultdict(Seen)
        self._faults: dict[str, deque[Fault]] = defaultdict(deque)
        self._sticky: dict[str, Fault] = {}
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/audio/transcriptions", self._transcriptions, methods=["POST"]),
                Route("/v1/images/generations", self._images, methods=["POST"]),
                Route("/v1/audio/speech", self._speech, methods=["POST"]),
                Route("/v1/messages", self._messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model}", self._model, methods=["GET"]),
                Route(f"{GEMINI}/models", self._gemini_models, methods=["GET"]),
                Route(GEMINI + "/models/{name}", self._gemini, methods=["GET", "POST"]),
                Route(f"/upload{GEMINI}/files", self._gemini_upload, methods=["POST"]),
            ]
        )

    # --- the test's side -------------------------------------------------------------------------

    def fail(self, path: str, fault: Fault, *, times: int | None = 1) -> None:
        """The next ``times`` requests to ``path`` get ``fault`` (``times=None``: every request)."""
        with self._lock:
            if times is None:
                self._sticky[path] = fault
            else:
                self._faults[path].extend([fault] * times)

    def seen(self, path: str) -> Seen:
        with self._lock:
            record = self._seen[path]
            return Seen(
                record.requests,
                record.completed,
                record.disconnects,
                record.cuts,
                list(record.body_sizes),
                [dict(h) for h in record.headers],
                list(record.queries),
            )

    def total_requests(self) -> int:
        with self._lock:
            return sum(record.requests for record in self._seen.values())

    # --- bookkeeping -----------------------------------------------------------------------------

    def _arrived(self, request: Request, size: int) -> Fault | None:
        path = request.url.path
        with self._lock:
            record = self._seen[path]
            record.requests += 1
            record.body_sizes.append(size)
            record.headers.append({k: request.headers[k] for k in _RECORDED if k in request.headers})
            record.queries.append(request.url.query)
            if self._faults[path]:
                return self._faults[path].popleft()
            return self._sticky.get(path)

    def _count(self, path: str, what: str) -> None:
        with self._lock:
            record = self._seen[path]
            setattr(record, what, getattr(record, what) + 1)

    async def _start(self, request: Request) -> tuple[dict[str, Any], Fault | None]:
        body = await request.body()
        fault = self._arrived(request, len(body))
        await self._hold(request, fault)
        document: dict[str, Any] = json.loads(body) if body else {}
        return document, fault

    async def _hold(self, request: Request, fault: Fault | None) -> None:
        """Answer nothing for ``fault.hold`` seconds; a peer hanging up meanwhile is counted."""
        if fault is None or fault.hold is None:
            return
        with anyio.move_on_after(fault.hold):
            # The body was read: the next message is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self._count(request.url.path, "disconnects")

    # --- endpoints -------------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        body, fault = await self._start(request)
        model = body.get("model", "gpt-test")
        if fault is not None and fault.status is not None:
            return openai_error(fault)
        if not body.get("stream"):
            self._count(request.url.path, "completed")
            return JSONResponse(chat_completion(model), headers={"x-request-id": "req_chat"})
        return self._stream(request, chat_chunks(model), fault)

    async def _responses(self, request: Request) -> Response:
        body, fault = await self._start(request)
        model = body.get("model", "gpt-test")
        image = any(tool.get("type") == "image_generation" for tool in body.get("tools", []))
        if fault is not None and fault.status is not None:
            return openai_error(fault)
        events = response_image_events(model) if image else response_text_events(model)
        if not body.get("stream"):
            self._count(request.url.path, "completed")
            return JSONResponse(events[-1][1]["response"])
        return self._stream(request, events, fault)

    async def _transcriptions(self, request: Request) -> Response:
        body = await request.body()
        fault = self._arrived(request, len(body))
        await self._hold(request, fault)
        # The SDK sends multipart/form-data; the one field that matters here is ``stream``
        # (starlette's form parser would need python-multipart, which is not a dependency).
        stream = b'name="stream"\r\n\r\ntrue' in body
        if fault is not None and fault.status is not None:
            return openai_error(fault)
        if not stream:
            self._count(request.url.path, "completed")
            return JSONResponse({"text": TRANSCRIPT})
        return self._stream(request, transcription_events(), fault)

    async def _images(self, request: Request) -> Response:
        body, fault = await self._start(request)
        if fault is not None and fault.status is not None:
            return openai_error(fault)
        if not body.get("stream"):
            self._count(request.url.path, "completed")
            return JSONResponse({"created": CREATED, "data": [{"b64_json": SMALL_IMAGE_B64}]})
        return self._stream(request, image_events(int(body.get("partial_images") or 2)), fault)

    async def _speech(self, request: Request) -> Response:
        body, fault = await self._start(request)
        if fault is not None and fault.status is not None:
            return openai_error(fault)
        if body.get("stream_format") != "sse":
            self._count(request.url.path, "completed")
            return Response(b"".join(base64.b64decode(chunk) for chunk in AUDIO_CHUNKS), media_type="audio/mpeg")
        return self._stream(request, speech_events(), fault)

    async def _messages(self, request: Request) -> Response:
        body, fault = await self._start(request)
        model = body.get("model", "claude-test")
        if fault is not None and fault.status is not None:
            return anthropic_error(fault)
        if not body.get("stream"):
            self._count(request.url.path, "completed")
            return JSONResponse(anthropic_message(model))
        return self._stream(request, anthropic_events(model), fault)

    async def _count_tokens(self, request: Request) -> Response:
        await self._start(request)
        return JSONResponse({"input_tokens": 11})

    async def _models(self, request: Request) -> Response:
        await self._start(request)
        if "anthropic-version" in request.headers:
            data: list[dict[str, object]] = [
                {"type": "model", "id": "claude-test", "display_name": "Claude", "created_at": "2025-01-01T00:00:00Z"}
            ]
            return JSONResponse({"data": data, "has_more": False, "first_id": "claude-test", "last_id": "claude-test"})
        data = [{"id": "gpt-test", "object": "model", "created": CREATED, "owned_by": "scripted"}]
        return JSONResponse({"object": "list", "data": data})

    async def _model(self, request: Request) -> Response:
        await self._start(request)
        model = request.path_params["model"]
        return JSONResponse({"id": model, "object": "model", "created": CREATED, "owned_by": "scripted"})

    async def _gemini_models(self, request: Request) -> Response:
        await self._start(request)
        return JSONResponse({"models": [gemini_model("gemini-test")]})

    async def _gemini(self, request: Request) -> Response:
        """``models/<model>`` (GET) and ``models/<model>:<method>`` (POST)."""
        model, _, method = request.path_params["name"].partition(":")
        body, fault = await self._start(request)
        if fault is not None and fault.status is not None:
            return gemini_error(fault)
        if request.method == "GET":
            return JSONResponse(gemini_model(model))
        if method == "countTokens":
            return JSONResponse({"totalTokens": 11})
        if method == "batchEmbedContents":
            return JSONResponse({"embeddings": [{"values": EMBEDDING} for _ in body.get("requests", [])]})
        if method == "streamGenerateContent":
            return self._stream(request, gemini_chunks(model), fault)
        self._count(request.url.path, "completed")
        return JSONResponse(gemini_response(model))

    async def _gemini_upload(self, request: Request) -> Response:
        """The resumable upload protocol: ``start`` answers where the bytes go (``x-goog-upload-url``,
        here this upstream itself, as Google names its own host); ``upload, finalize`` takes them."""
        body = await request.body()
        self._arrived(request, len(body))
        if request.headers.get("x-goog-upload-command") == "start":
            where = f"{request.base_url}upload{GEMINI}/files?upload_id=scripted"
            headers = {"x-goog-upload-url": where, "x-goog-upload-status": "active"}
            return Response(b"", headers=headers)
        file = {"name": "files/scripted", "sizeBytes": str(len(body)), "state": "ACTIVE", "mimeType": "text/plain"}
        return JSONResponse({"file": file}, headers={"x-goog-upload-status": "final"})

    def _stream(self, request: Request, events: list[tuple[str | None, Any]], fault: Fault | None) -> Response:
        return _ScriptedStream(self, request.url.path, events, fault, self.delay)


class _ScriptedStream(Response):
    """An SSE response that follows its fault script and notices the peer hanging up."""

    def __init__(
        self,
        upstream: ScriptedUpstream,
        path: str,
        events: list[tuple[str | None, Any]],
        fault: Fault | None,
        delay: float,
    ) -> None:
        super().__init__(media_type="text/event-stream")
        self.upstream, self.path, self.events, self.fault, self.delay = upstream, path, events, fault, delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = cut = finished = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self._body(send)
                finished = True  # uvicorn reports a disconnect once the response is complete: not one
            except OSError:  # the peer went away while we wrote
                gone = True
            except _Cut:
                cut = True
            tg.cancel_scope.cancel()
        self.upstream._count(self.path, "cuts" if cut else "completed" if finished else "disconnects")
        if cut:
            # An exception after the response started: uvicorn drops the connection mid-body.
            raise _Cut("scripted cut")

    async def _body(self, send: Send) -> None:
        fault = self.fault or Fault()
        for index, (name, data) in enumerate(self.events):
            if fault.error_after == index:
                frame = sse_frame(*error_event(self.path, fault))
                await send({"type": "http.response.body", "body": frame, "more_body": False})
                return
            frame = sse_frame(name, data)
            if fault.cut_after == index:
                if fault.half:
                    await send({"type": "http.response.body", "body": frame[: len(frame) // 2], "more_body": True})
                raise _Cut(f"scripted cut after {index} events")
            if fault.stall_after == index:
                await anyio.sleep(STALL_BOUND)
                return
            if fault.pause_after == index:
                await anyio.sleep(fault.pause)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            if self.delay:
                await anyio.sleep(self.delay)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse_frame(name: str | None, data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {text}\n\n".encode()


# --- error shapes ------------------------------------------------------------------------------------


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def openai_error(fault: Fault) -> Response:
    status = fault.status or 500
    error = {
        "message": fault.message,
        "type": _OPENAI_TYPES.get(status, "server_error"),
        "param": None,
        "code": fault.code,
    }
    return JSONResponse({"error": error}, status_code=status, headers=fault.headers)


def anthropic_error(fault: Fault) -> Response:
    status = fault.status or 500
    body = {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": fault.message},
        "request_id": "req_scripted",
    }
    return JSONResponse(body, status_code=status, headers={"request-id": "req_scripted", **fault.headers})


_GOOGLE_STATUSES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}
_GOOGLE_STATUSES |= {429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def gemini_error_object(status: int, fault: Fault) -> dict[str, Any]:
    """Google's error object; ``fault.code`` is its ``status`` when given (``UNAVAILABLE``...)."""
    return {"code": status, "message": fault.message, "status": fault.code or _GOOGLE_STATUSES.get(status, "UNKNOWN")}


def gemini_error(fault: Fault) -> Response:
    """Google's error body; a ``x-retry-delay`` in ``fault.headers`` goes in it as ``google.rpc.RetryInfo``
    (Google sends the wait there, with no ``Retry-After``), not as a header."""
    status = fault.status or 500
    headers = dict(fault.headers)
    error = gemini_error_object(status, fault)
    if (delay := headers.pop("x-retry-delay", None)) is not None:
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}]
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def error_event(path: str, fault: Fault) -> tuple[str | None, Any]:
    """The in-band error each API sends when a stream fails after it started."""
    if path.startswith(GEMINI):  # a data-only event, as Google sends it
        return None, {"error": gemini_error_object(503 if fault.code in (None, "UNAVAILABLE") else 500, fault)}
    if path == ANTHROPIC_PATH:
        return "error", {"type": "error", "error": {"type": fault.code or "overloaded_error", "message": fault.message}}
    if path == "/v1/responses":
        error = {"type": "error", "code": fault.code, "message": fault.message, "param": None, "sequence_number": 99}
        return "error", error
    # Chat completions and the audio/image streams: a data-only ``{"error": {...}}`` event.
    return None, {"error": {"message": fault.message, "type": "server_error", "param": None, "code": fault.code}}


# --- OpenAI chat -------------------------------------------------------------------------------------


def chat_completion(model: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TEXT, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": len(WORDS), "total_tokens": 9 + len(WORDS)},
    }


def chat_chunks(model: str) -> list[tuple[str | None, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return None, {
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "choices": [choice],
        }

    events: list[tuple[str | None, Any]] = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"content": word}) for word in WORDS]
    events += [chunk({}, "stop"), (None, "[DONE]")]
    return events


# --- OpenAI Responses --------------------------------------------------------------------------------


def _response(model: str, status: str, output: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    done = status == "completed"
    return {
        "id": "resp_scripted",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": tools,
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": (
            {
                "input_tokens": 12,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(WORDS),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 12 + len(WORDS),
            }
            if done
            else None
        ),
        "user": None,
        "metadata": {},
    }


def _numbered(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str | None, Any]]:
    """Give each Responses event its ``type`` and ``sequence_number``; the SSE event name is the type."""
    return [(name, {"type": name, "sequence_number": n, **data}) for n, (name, data) in enumerate(events)]


def response_text_events(model: str) -> list[tuple[str | None, Any]]:
    item_id = "msg_scripted"
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    message = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    done_part = {**part, "text": TEXT}
    done_message = {**message, "status": "completed", "content": [done_part]}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": _response(model, "in_progress", [], [])}),
        ("response.in_progress", {"response": _response(model, "in_progress", [], [])}),
        ("response.output_item.added", {"output_index": 0, "item": message}),
        ("response.content_part.added", {**where, "part": part}),
        *[("response.output_text.delta", {**where, "delta": word, "logprobs": []}) for word in WORDS],
        ("response.output_text.done", {**where, "text": TEXT, "logprobs": []}),
        ("response.content_part.done", {**where, "part": done_part}),
        ("response.output_item.done", {"output_index": 0, "item": done_message}),
        ("response.completed", {"response": _response(model, "completed", [done_message], [])}),
    ]
    return _numbered(events)


def response_image_events(model: str) -> list[tuple[str | None, Any]]:
    item_id = "ig_scripted"
    tools = [{"type": "image_generation", "size": "1024x1024", "quality": "high", "output_format": "png"}]
    item = {"id": item_id, "type": "image_generation_call", "status": "in_progress", "result": None}
    done_item = {
        **item,
        "status": "completed",
        "result": BIG_IMAGE_B64,
        "revised_prompt": "a scripted image",
        "background": "opaque",
        "output_format": "png",
        "quality": "high",
        "size": "1024x1024",
    }
    where = {"item_id": item_id, "output_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": _response(model, "in_progress", [], tools)}),
        ("response.in_progress", {"response": _response(model, "in_progress", [], tools)}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.image_generation_call.in_progress", where),
        ("response.image_generation_call.generating", where),
        (
            "response.image_generation_call.partial_image",
            {**where, "partial_image_b64": PARTIAL_IMAGE_B64, "partial_image_index": 0},
        ),
        ("response.image_generation_call.completed", where),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        ("response.completed", {"response": _response(model, "completed", [done_item], tools)}),
    ]
    return _numbered(events)


# --- audio and images --------------------------------------------------------------------------------


def transcription_events() -> list[tuple[str | None, Any]]:
    words = [word + " " for word in TRANSCRIPT.split(" ")]
    words[-1] = words[-1].rstrip()
    usage = {"type": "tokens", "input_tokens": 40, "output_tokens": len(words), "total_tokens": 40 + len(words)}
    events: list[tuple[str | None, Any]] = [
        (None, {"type": "transcript.text.delta", "delta": word, "logprobs": None}) for word in words
    ]
    events.append((None, {"type": "transcript.text.done", "text": TRANSCRIPT, "logprobs": None, "usage": usage}))
    return events


def image_events(partials: int) -> list[tuple[str | None, Any]]:
    common = {"background": "opaque", "created_at": CREATED, "output_format": "png", "quality": "high"}
    common["size"] = "1024x1024"
    events: list[tuple[str | None, Any]] = [
        (
            "image_generation.partial_image",
            {
                "type": "image_generation.partial_image",
                "b64_json": PARTIAL_IMAGE_B64,
                "partial_image_index": i,
                **common,
            },
        )
        for i in range(partials)
    ]
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 10},
        "output_tokens": 4160,
        "total_tokens": 4170,
    }
    completed = {"type": "image_generation.completed", "b64_json": SMALL_IMAGE_B64, "usage": usage, **common}
    events.append(("image_generation.completed", completed))
    return events


def speech_events() -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = [
        (None, {"type": "speech.audio.delta", "audio": chunk}) for chunk in AUDIO_CHUNKS
    ]
    usage = {"input_tokens": 14, "output_tokens": 101, "total_tokens": 115}
    events.append((None, {"type": "speech.audio.done", "usage": usage}))
    return events


# --- Anthropic ---------------------------------------------------------------------------------------


def anthropic_message(model: str) -> dict[str, Any]:
    return {
        "id": "msg_scripted",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": TEXT}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 25, "output_tokens": len(WORDS)},
    }


def anthropic_events(model: str) -> list[tuple[str | None, Any]]:
    start = {
        **anthropic_message(model),
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 25, "output_tokens": 1},
    }
    events: list[tuple[str | None, Any]] = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        ("ping", {"type": "ping"}),
    ]
    events += [
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}},
        )
        for word in WORDS
    ]
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": len(WORDS)},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


# --- Gemini ------------------------------------------------------------------------------------------


EMBEDDING = [0.25, -0.5, 0.125]


def gemini_model(model: str) -> dict[str, Any]:
    return {
        "name": f"models/{model}",
        "displayName": "Gemini (scripted)",
        "inputTokenLimit": 1_048_576,
        "outputTokenLimit": 8192,
        "supportedGenerationMethods": ["generateContent", "countTokens"],
    }


def _gemini_usage(output: int) -> dict[str, int]:
    return {"promptTokenCount": 9, "candidatesTokenCount": output, "totalTokenCount": 9 + output}


def gemini_response(model: str) -> dict[str, Any]:
    candidate = {"content": {"parts": [{"text": TEXT}], "role": "model"}, "finishReason": "STOP", "index": 0}
    return {
        "candidates": [candidate],
        "usageMetadata": _gemini_usage(len(WORDS)),
        "modelVersion": model,
        "responseId": "resp_scripted",
    }


def gemini_chunks(model: str) -> list[tuple[str | None, Any]]:
    """streamGenerateContent?alt=sse: one GenerateContentResponse per word, the last with ``finishReason``."""
    events: list[tuple[str | None, Any]] = []
    for index, word in enumerate(WORDS):
        candidate: dict[str, Any] = {"content": {"parts": [{"text": word}], "role": "model"}, "index": 0}
        last = index == len(WORDS) - 1
        if last:
            candidate["finishReason"] = "STOP"
        chunk = {"candidates": [candidate], "usageMetadata": _gemini_usage(index + 1), "modelVersion": model}
        events.append((None, {**chunk, "responseId": "resp_scripted"}))
    return events
