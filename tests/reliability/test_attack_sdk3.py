"""The official ``openai`` and ``anthropic`` SDKs on the endpoints the other SDK attacks did not try.

The gateway (``create_app``) runs under uvicorn on loopback in front of ``_Recorder``: an upstream that
records every request whole (method, path, query, headers, body) and answers each path from a script
(status, headers, the body in the chunks it is sent in, optionally held open until the peer leaves). Each
test checks what the SDK got against the bytes the upstream sent, what the upstream got against the bytes
the SDK sent (an event hook on the SDK's own ``httpx2`` client), and how many upstream attempts there were.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import anyio
import anyio.to_thread
import httpx2
import openai
import pytest
from anthropic.types import ToolParam
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from asgi_lifetime._settings import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import held
from asgi_lifetime.testing._serve import serve_in_thread

from ..gateway.test_sdk import CLAUDE_HELLO, SDK_ASYNCGENS_ON_TRIO, SETTINGS, settle

SDK_TIMEOUT = 20.0
HOLD_BOUND = 10.0  # how long a held answer waits for the peer to leave
# Hop-by-hop and per-connection fields: the gateway sets its own; everything else the SDK sent reaches the upstream.
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length", "accept-encoding"}


@dataclass
class Answer:
    """One scripted answer: ``chunks`` are sent one ``http.response.body`` each; with ``hold_after`` the
    answer sends that many chunks and then waits for the peer to hang up (counted) instead of ending; with
    ``cut_after`` it sends that many and drops the connection; with ``pause_after`` it is silent for ``pause``
    seconds there, then goes on."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=lambda: [("content-type", "application/json")])
    chunks: list[bytes] = field(default_factory=list)
    hold_after: int | None = None
    cut_after: int | None = None
    pause_after: int | None = None
    pause: float = 0.0

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def json_answer(document: Any, *, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    return Answer(status, [("content-type", "application/json"), *headers], [json.dumps(document).encode()])


@dataclass
class Recorded:
    method: str
    path: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[str, str]]
    body: bytes


class _Cut(Exception):
    """Raised inside the answer: uvicorn then drops the connection mid-body."""


class _Recorder:
    """The upstream: answers ``script[path]`` in order (the last one again when it runs out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.peer_left = 0
        self.finished = 0
        self._script: dict[str, deque[Answer]] = defaultdict(deque)

    def answer(self, path: str, *answers: Answer) -> None:
        with self._lock:
            self._script[path].extend(answers)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self._script.clear()

    def at(self, path: str) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        with self._lock:
            self.requests.append(
                Recorded(scope["method"], scope["path"], scope["raw_path"], scope["query_string"], headers, bytes(body))
            )
            queue = self._script[scope["path"]]
            script = queue.popleft() if len(queue) > 1 else (queue[0] if queue else json_answer({}, status=404))
        raw = [(k.encode(), v.encode()) for k, v in script.headers]
        await send({"type": "http.response.start", "status": script.status, "headers": raw})
        for index, chunk in enumerate(script.chunks):
            if script.hold_after == index:
                await self._hold(receive)
                return
            if script.cut_after == index:
                raise _Cut
            if script.pause_after == index:
                await anyio.sleep(script.pause)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if script.hold_after is not None:
            await self._hold(receive)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        with self._lock:
            self.finished += 1

    async def _hold(self, receive: Receive) -> None:
        with anyio.move_on_after(HOLD_BOUND):
            while (await receive())["type"] != "http.disconnect":
                pass
            with self._lock:
                self.peer_left += 1


@dataclass
class Stack:
    upstream: _Recorder
    gateway: Starlette
    url: str
    upstream_url: str
    sent: list[httpx2.Request] = field(default_factory=list)  # what the SDKs put on the wire, in order
    clients: list[Any] = field(default_factory=list)

    def _http(self) -> httpx2.Client:
        def record(request: httpx2.Request) -> None:
            request.read()  # multipart bodies are streams: read once here, replayed to the wire
            self.sent.append(request)

        return httpx2.Client(event_hooks={"request": [record]}, timeout=SDK_TIMEOUT)

    def openai(self, **options: Any) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="sk-test", http_client=self._http(), **options)
        self.clients.append(client)
        return client

    def anthropic(self, **options: Any) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key="sk-ant-test", http_client=self._http(), **options)
        self.clients.append(client)
        return client

    def reset(self) -> None:
        """Forget what was sent and scripted so far (one stack for a table of cases)."""
        self.sent.clear()
        self.upstream.reset()

    def wait_idle(self) -> None:
        settle(lambda: not held(self.gateway), what=lambda: f"gateway idle (busy: {held(self.gateway)})")

    def same_request(self, sent: httpx2.Request, got: Recorded) -> None:
        """The upstream got what the SDK sent: method, path, query, body bytes, and every end-to-end header."""
        assert (got.method, got.raw_path, got.query) == (sent.method, sent.url.raw_path.split(b"?")[0], sent.url.query)
        assert got.body == sent.content
        mine = {(k.lower(), v) for k, v in sent.headers.multi_items() if k.lower() not in _HOP}
        theirs = {(k, v) for k, v in got.headers if k not in _HOP}
        assert mine - theirs == set(), "headers the SDK sent that did not reach the upstream"


@contextlib.contextmanager
def stack(**settings: Any) -> Iterator[Stack]:
    upstream = _Recorder()
    with serve_in_thread(upstream) as upstream_url:
        gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,), **{**SETTINGS, **settings}))
        with serve_in_thread(gateway) as url:
            running = Stack(upstream, gateway, url, upstream_url)
            try:
                yield running
            finally:
                for client in running.clients:
                    client.close()


@pytest.fixture
def served() -> Iterator[Stack]:
    with stack() as running:
        yield running


def one_exchange(served: Stack, path: str) -> Recorded:
    """The SDK sent one request, the upstream got exactly it, once."""
    assert len(served.sent) == 1, [r.url for r in served.sent]
    assert [r.path for r in served.upstream.requests] == [path]
    served.same_request(served.sent[0], served.upstream.requests[0])
    return served.upstream.requests[0]


# --- openai: bodies that are not chat ---------------------------------------------------------------


def test_embeddings_with_a_large_batch_of_inputs(served: Stack) -> None:
    inputs = [f"document {i}: " + "lorem ipsum " * 20 for i in range(2048)]
    data = [{"object": "embedding", "index": i, "embedding": [0.5, -0.25, float(i)]} for i in range(len(inputs))]
    answer = json_answer(
        {"object": "list", "data": data, "model": "e", "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    )
    served.upstream.answer("/v1/embeddings", answer)
    raw = served.openai().embeddings.with_raw_response.create(model="e", input=inputs, encoding_format="float")
    assert raw.content == answer.body
    assert [e.embedding[2] for e in raw.parse().data] == [float(i) for i in range(len(inputs))]
    one_exchange(served, "/v1/embeddings")
    served.wait_idle()


def _file_object(size: int, purpose: str = "batch") -> dict[str, Any]:
    return {
        "id": "file-scripted",
        "object": "file",
        "bytes": size,
        "created_at": 1_700_000_000,
        "filename": "requests.jsonl",
        "purpose": purpose,
        "status": "processed",
    }


# JSON lines, so a body parser that looked inside a multipart body would find something to touch.
_JSONL = b"".join(
    json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"n": i}}).encode()
    + b"\n"
    for i in range(40_000)
)


@pytest.mark.parametrize("first", [None, 503], ids=["answered", "retried"])
def test_files_create_uploads_a_multipart_body_of_a_few_mib_byte_exact(first: int | None) -> None:
    # A multipart body is no JSON: forwarded as received, and re-sent whole by a retry (the gateway keeps it).
    with stack() as served:
        answer = json_answer(_file_object(len(_JSONL)))
        if first is not None:
            served.upstream.answer("/v1/files", json_answer({"error": {"message": "busy"}}, status=first))
        served.upstream.answer("/v1/files", answer)
        raw = served.openai().files.with_raw_response.create(
            file=("requests.jsonl", _JSONL, "application/jsonl"), purpose="batch"
        )
        assert raw.content == answer.body and raw.parse().bytes == len(_JSONL)
        assert len(_JSONL) > 3 * 2**20
        got = served.upstream.at("/v1/files")
        assert len(got) == (1 if first is None else 2)
        for request in got:
            served.same_request(served.sent[0], request)
        assert _JSONL in got[-1].body
        served.wait_idle()


# Audio bytes that look like SSE and JSON to anything that would look: they must arrive untouched.
_AUDIO = [b"ID3\x04\x00", b'data: {"x": 1}\n\n', b"\r\n\r\nevent: error\n", bytes(range(256)) * 64, b"\n\n"]


@pytest.mark.parametrize("kind", ["audio/mpeg", "application/octet-stream", "audio/wav"])
def test_speech_with_streaming_response_relays_the_audio_byte_exact(served: Stack, kind: str) -> None:
    answer = Answer(200, [("content-type", kind)], list(_AUDIO))
    served.upstream.answer("/v1/audio/speech", answer)
    with served.openai().audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="hello"
    ) as response:
        assert response.headers["content-type"] == kind
        got = b"".join(response.iter_bytes())
    assert got == answer.body
    one_exchange(served, "/v1/audio/speech")
    served.wait_idle()


def test_images_generate_with_a_large_b64_answer(served: Stack) -> None:
    image = "A" * (3 * 2**20)
    answer = json_answer({"created": 1, "data": [{"b64_json": image}]})
    served.upstream.answer("/v1/images/generations", answer)
    raw = served.openai().images.with_raw_response.generate(model="gpt-image-1", prompt="a fox")
    assert raw.content == answer.body
    one_exchange(served, "/v1/images/generations")
    served.wait_idle()


def test_models_list_and_retrieve_are_bodiless_gets(served: Stack) -> None:
    model = {"id": "gpt-test", "object": "model", "created": 1, "owned_by": "me"}
    served.upstream.answer("/v1/models", json_answer({"object": "list", "data": [model]}))
    served.upstream.answer("/v1/models/gpt-test", json_answer(model))
    client = served.openai()
    assert [m.id for m in client.models.list()] == ["gpt-test"]
    assert client.models.retrieve("gpt-test").id == "gpt-test"
    assert [r.method for r in served.upstream.requests] == ["GET", "GET"]
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
        assert got.body == b"" and "transfer-encoding" not in dict(got.headers)
    served.wait_idle()


def test_moderations(served: Stack) -> None:
    result = {"flagged": False, "categories": {}, "category_scores": {}}
    answer = json_answer({"id": "modr-1", "model": "omni-moderation-latest", "results": [result]})
    served.upstream.answer("/v1/moderations", answer)
    raw = served.openai().moderations.with_raw_response.create(input=["one", "two"])
    assert raw.content == answer.body
    one_exchange(served, "/v1/moderations")
    served.wait_idle()


def _batch(status: str) -> dict[str, Any]:
    return {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-scripted",
        "completion_window": "24h",
        "status": status,
        "created_at": 1,
    }


def test_batches_create_retrieve_list_cancel_and_the_output_file(served: Stack) -> None:
    # cancel is a POST with no body at all: nothing to parse, forwarded as it is.
    served.upstream.answer("/v1/batches", json_answer(_batch("validating")))
    served.upstream.answer("/v1/batches/batch_1", json_answer(_batch("completed")))
    served.upstream.answer("/v1/batches/batch_1/cancel", json_answer(_batch("cancelling")))
    output = Answer(200, [("content-type", "application/octet-stream")], [_JSONL[:70_000], _JSONL[70_000:140_000]])
    served.upstream.answer("/v1/files/file-out/content", output)
    client = served.openai()
    assert (
        client.batches.create(
            input_file_id="file-scripted", endpoint="/v1/chat/completions", completion_window="24h"
        ).status
        == "validating"
    )
    assert client.batches.retrieve("batch_1").status == "completed"
    assert client.batches.cancel("batch_1").status == "cancelling"
    assert client.files.content("file-out").content == output.body
    assert len(served.sent) == len(served.upstream.requests) == 4
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
    served.wait_idle()


def test_raw_response_headers_are_relayed(served: Stack) -> None:
    relayed = (
        ("x-request-id", "req_abc123"),
        ("openai-processing-ms", "17"),
        ("openai-organization", "org-x"),
        ("x-ratelimit-remaining-requests", "99"),
        ("x-ratelimit-reset-tokens", "6ms"),
    )
    served.upstream.answer("/v1/moderations", json_answer({"id": "m", "model": "x", "results": []}, headers=relayed))
    raw = served.openai().moderations.with_raw_response.create(input="hi")
    for name, value in relayed:
        assert raw.headers[name] == value
    assert raw.request_id == "req_abc123"
    served.wait_idle()


# --- retries: the SDK's on top of the gateway's ----------------------------------------------------

# (upstream status, its x-should-retry or None) -> the SDK's attempts and the upstream's requests, with the
# gateway's MAX_ATTEMPTS=2 and the SDK's max_retries=2. The gateway retries 429 and the busy 5xx, then says
# x-should-retry: false; the other statuses are the SDK's to retry, as its rules and the upstream's header say.
RETRIES = {
    "408": (408, None, 3, 3),
    "409": (409, None, 3, 3),
    "409 should-retry false": (409, "false", 1, 1),
    "400 should-retry true": (400, "true", 3, 3),
    "429": (429, None, 1, 2),
    "429 should-retry true": (429, "true", 1, 2),
    "429 should-retry false": (429, "false", 1, 1),
    "500": (500, None, 3, 3),
    "500 should-retry false": (500, "false", 1, 1),
    "503": (503, None, 1, 2),
    "503 should-retry true": (503, "true", 1, 2),
    "529": (529, None, 1, 2),
}


def _status_of(call: Any) -> int:
    try:
        call()
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return exc.status_code
    raise AssertionError("no error")


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_the_sdks_retries_on_top_of_the_gateways(sdk: str) -> None:
    with stack() as served:
        path = "/v1/moderations" if sdk == "openai" else "/v1/messages/count_tokens"
        oai, claude = served.openai(max_retries=2), served.anthropic(max_retries=2)
        for case, (status, should, attempts, requests) in RETRIES.items():
            served.reset()
            headers = () if should is None else (("x-should-retry", should),)
            served.upstream.answer(path, json_answer({"error": {"message": "x"}}, status=status, headers=headers))
            if sdk == "openai":
                got = _status_of(lambda: oai.moderations.create(input="hi"))
            else:
                got = _status_of(lambda: claude.messages.count_tokens(model="c", messages=CLAUDE_HELLO))
            assert got == status, case
            assert len(served.upstream.at(path)) == requests, case
            retry_counts = [r.headers.get("x-stainless-retry-count") for r in served.sent]
            assert retry_counts == [str(n) for n in range(attempts)], case
        served.wait_idle()


def test_max_retries_zero_asks_once_and_the_gateway_retries_alone() -> None:
    with stack() as served:
        served.upstream.answer("/v1/moderations", json_answer({"error": {"message": "x"}}, status=500))
        with pytest.raises(openai.InternalServerError):
            served.openai(max_retries=0).moderations.create(input="hi")
        assert len(served.upstream.requests) == 1
        served.upstream.answer("/v1/embeddings", json_answer({"error": {"message": "x"}}, status=503))
        with pytest.raises(openai.APIStatusError) as caught:
            served.openai(max_retries=0).embeddings.create(model="e", input="hi")
        assert caught.value.status_code == 503 and len(served.upstream.at("/v1/embeddings")) == 2
        served.wait_idle()


# --- anthropic -------------------------------------------------------------------------------------


def sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _message_start() -> bytes:
    message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }
    return sse("message_start", {"type": "message_start", "message": message})


def _block(index: int, block: dict[str, Any], deltas: list[dict[str, Any]]) -> list[bytes]:
    frames = [sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})]
    frames += [sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
    return [*frames, sse("content_block_stop", {"type": "content_block_stop", "index": index})]


def _message_end(stop_reason: str) -> list[bytes]:
    delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None}}
    return [
        sse("message_delta", {**delta, "usage": {"output_tokens": 30}}),
        sse("message_stop", {"type": "message_stop"}),
    ]


TOOL_INPUT = {"city": "Paris", "days": [1, 2, 3], "units": "metric"}
_TOOL_JSON = json.dumps(TOOL_INPUT)
THINKING = "Let me think about the weather in Paris, step by step."
SIGNATURE = "EqQBCkgIARABGAIiQL" + "x" * 300


def tool_and_thinking_stream() -> list[bytes]:
    thinking = _block(
        0,
        {"type": "thinking", "thinking": "", "signature": ""},
        [
            *({"type": "thinking_delta", "thinking": THINKING[i : i + 7]} for i in range(0, len(THINKING), 7)),
            {"type": "signature_delta", "signature": SIGNATURE},
        ],
    )
    tool = _block(
        1,
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
        [{"type": "input_json_delta", "partial_json": _TOOL_JSON[i : i + 5]} for i in range(0, len(_TOOL_JSON), 5)],
    )
    ping = sse("ping", {"type": "ping"})
    return [_message_start(), ping, *thinking, *tool, *_message_end("tool_use")]


SSE_HEADERS = [("content-type", "text/event-stream; charset=utf-8"), ("request-id", "req_stream")]
TOOL: ToolParam = {"name": "weather", "description": "w", "input_schema": {"type": "object"}}


def _stream_call(served: Stack) -> Any:
    return served.anthropic().messages.stream(
        model="claude-test",
        max_tokens=64,
        messages=CLAUDE_HELLO,
        tools=[TOOL],
        thinking={"type": "enabled", "budget_tokens": 32},
    )


def test_a_tool_use_and_thinking_stream_is_relayed_byte_exact_and_accumulates(served: Stack) -> None:
    frames = tool_and_thinking_stream()
    served.upstream.answer("/v1/messages", Answer(200, SSE_HEADERS, frames), Answer(200, SSE_HEADERS, frames))
    with served.anthropic().messages.with_streaming_response.create(
        model="claude-test", max_tokens=64, messages=CLAUDE_HELLO, stream=True
    ) as response:
        assert b"".join(response.iter_bytes()) == b"".join(frames)
    with _stream_call(served) as stream:
        final = stream.get_final_message()
    thinking, tool = final.content
    assert thinking.type == "thinking" and (thinking.thinking, thinking.signature) == (THINKING, SIGNATURE)
    assert tool.type == "tool_use" and tool.input == TOOL_INPUT
    assert final.stop_reason == "tool_use"
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
    assert len(served.upstream.requests) == 2
    served.wait_idle()


def _overloaded(frames: list[bytes], after: int) -> list[bytes]:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    return [*frames[:after], sse("error", error)]


def _raised_by(client: anthropic.Anthropic) -> BaseException:
    with pytest.raises(anthropic.APIError) as caught:
        with client.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as stream:
            for _ in stream:
                pass
    return caught.value


def test_an_overloaded_error_event_mid_stream_is_the_sdks_error_as_without_the_gateway(served: Stack) -> None:
    frames = _overloaded(tool_and_thinking_stream(), 6)
    served.upstream.answer("/v1/messages", Answer(200, SSE_HEADERS, frames))
    through = _raised_by(served.anthropic())
    assert len(served.upstream.requests) == 1  # the client had content: the error is not re-issued
    with anthropic.Anthropic(base_url=served.upstream_url, api_key="k", max_retries=0) as direct_client:
        direct = _raised_by(direct_client)
    # The SDK raises APIStatusError (status 200: the stream had begun), the same class either way.
    assert type(through) is type(direct), (through, direct)
    assert str(through) == str(direct)
    served.wait_idle()


def _message_batch(results_url: str | None) -> dict[str, Any]:
    counts = {"processing": 0, "succeeded": 2, "errored": 0, "canceled": 0, "expired": 0}
    return {
        "id": "msgbatch_1",
        "type": "message_batch",
        "processing_status": "ended" if results_url else "in_progress",
        "request_counts": counts,
        "ended_at": None,
        "created_at": "2026-01-01T00:00:00Z",
        "expires_at": "2026-01-02T00:00:00Z",
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": results_url,
    }


def _batch_results(count: int) -> list[bytes]:
    message: dict[str, Any] = json.loads(_message_start().split(b"data: ", 1)[1])["message"]
    line = {"custom_id": "", "result": {"type": "succeeded", "message": {**message, "stop_reason": "end_turn"}}}
    return [json.dumps({**line, "custom_id": f"r{i}"}).encode() + b"\n" for i in range(count)]


BATCH_REQUESTS: list[Any] = [
    {"custom_id": f"r{i}", "params": {"model": "claude-test", "max_tokens": 8, "messages": CLAUDE_HELLO}}
    for i in range(200)
]


def test_message_batches_create_and_results_streamed_as_jsonl_through_the_gateway(served: Stack) -> None:
    results = _batch_results(500)
    # Lines cut across chunks: the SDK's JSONL decoder reassembles them, the gateway relays the bytes as they are.
    joined = b"".join(results)
    chunks = [joined[i : i + 7000] for i in range(0, len(joined), 7000)]
    served.upstream.answer("/v1/messages/batches", json_answer(_message_batch(None)))
    url = f"{served.url}/v1/messages/batches/msgbatch_1/results"  # here the upstream names the gateway
    served.upstream.answer("/v1/messages/batches/msgbatch_1", json_answer(_message_batch(url)))
    served.upstream.answer(
        "/v1/messages/batches/msgbatch_1/results", Answer(200, [("content-type", "application/binary")], chunks)
    )
    client = served.anthropic()
    assert client.messages.batches.create(requests=BATCH_REQUESTS).processing_status == "in_progress"
    got = [entry.custom_id for entry in client.messages.batches.results("msgbatch_1")]
    assert got == [f"r{i}" for i in range(500)]
    assert [r.path for r in served.upstream.requests] == [
        "/v1/messages/batches",
        "/v1/messages/batches/msgbatch_1",
        "/v1/messages/batches/msgbatch_1/results",
    ]
    for sent, request in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, request)
    served.wait_idle()


def test_batch_results_follow_the_upstreams_own_results_url_not_the_gateway() -> None:
    """``messages.batches.results`` GETs the ``results_url`` the batch names, an absolute URL on the upstream's
    own host (Anthropic's API names itself): the SDK goes there directly, with the key it holds (a gateway key
    the upstream does not know), not through the gateway. A known limit (docs/operators.md), with the way round
    it: GET the results path through the gateway."""
    with stack(upstream_api_key="sk-upstream", upstream_auth="x-api-key", gateway_keys=("gateway-key",)) as served:
        path = "/v1/messages/batches/msgbatch_1/results"
        served.upstream.answer(
            "/v1/messages/batches/msgbatch_1", json_answer(_message_batch(served.upstream_url + path))
        )
        served.upstream.answer(path, Answer(200, [("content-type", "application/binary")], _batch_results(3)))
        client = anthropic.Anthropic(base_url=served.url, api_key="gateway-key", max_retries=0)
        served.clients.append(client)
        assert [entry.custom_id for entry in client.messages.batches.results("msgbatch_1")] == ["r0", "r1", "r2"]
        retrieve, results = served.upstream.requests
        assert dict(retrieve.headers)["x-api-key"] == "sk-upstream"  # through the gateway
        sent_upstream = {v for k, v in results.headers if k in ("x-api-key", "authorization")}
        assert sent_upstream == {"Bearer gateway-key"}  # not: the client's own key went to the upstream
        # The way round: the same path, through the gateway.
        response = client.get(path, cast_to=httpx2.Response, options={"headers": {"accept": "application/binary"}})
        lines = [json.loads(line)["custom_id"] for line in response.iter_lines()]
        assert lines == ["r0", "r1", "r2"]
        assert dict(served.upstream.requests[-1].headers)["x-api-key"] == "sk-upstream"
        served.wait_idle()


def test_count_tokens_and_models_with_beta_headers(served: Stack) -> None:
    served.upstream.answer("/v1/messages/count_tokens", json_answer({"input_tokens": 11}))
    model = {"id": "claude-test", "type": "model", "display_name": "C", "created_at": "2026-01-01T00:00:00Z"}
    served.upstream.answer(
        "/v1/models", json_answer({"data": [model], "has_more": False, "first_id": None, "last_id": None})
    )
    client = served.anthropic(default_headers={"anthropic-beta": "token-counting-2024-11-01,files-api-2025-04-14"})
    assert client.messages.count_tokens(model="claude-test", messages=CLAUDE_HELLO, tools=[TOOL]).input_tokens == 11
    assert [m.id for m in client.models.list(limit=5)] == ["claude-test"]
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
        assert dict(got.headers)["anthropic-beta"] == "token-counting-2024-11-01,files-api-2025-04-14"
    assert served.upstream.requests[1].query == b"limit=5"
    served.wait_idle()


# --- the gateway's own errors, the upstream's errors on bodies that are not conversations ----------


def test_a_multipart_upload_over_the_body_limit_is_the_sdks_413_with_the_gateways_message() -> None:
    with stack(max_body_bytes=2**20, max_inflight_bytes=4 * 2**20) as served:
        with pytest.raises(openai.APIStatusError) as caught:
            served.openai(max_retries=0).files.create(
                file=("requests.jsonl", _JSONL, "application/jsonl"), purpose="batch"
            )
        assert caught.value.status_code == 413
        assert isinstance(caught.value.body, dict) and "1048576" in str(caught.value.body.get("message"))
        assert served.upstream.requests == []
        with pytest.raises(anthropic.RequestTooLargeError) as too_large:
            served.anthropic(max_retries=0).messages.batches.create(requests=BATCH_REQUESTS * 100)
        assert "1048576" in str(too_large.value)
        assert served.upstream.requests == []
        served.wait_idle()


def test_a_context_overflow_answer_to_a_multipart_upload_is_relayed_once() -> None:
    # The refold only ever reshapes a conversation: a multipart body has none, so the 400 goes to the SDK as sent.
    with stack() as served:
        error = {"message": "This model's maximum context length is 8192 tokens.", "code": "context_length_exceeded"}
        answer = json_answer({"error": {**error, "type": "invalid_request_error", "param": None}}, status=400)
        served.upstream.answer("/v1/files", answer)
        with pytest.raises(openai.BadRequestError) as caught:
            served.openai().files.create(file=("requests.jsonl", _JSONL[:5000], "application/jsonl"), purpose="batch")
        assert caught.value.response.content == answer.body
        one_exchange(served, "/v1/files")
        served.wait_idle()


# --- a client that stops reading: the upstream request ends, recorded once --------------------------

SESSION = "sdk3-session"


def _chat_frames(words: int) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        document = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        return b"data: " + json.dumps(document).encode() + b"\n\n"

    return [chunk({"role": "assistant", "content": ""}), *(chunk({"content": f"w{i} "}) for i in range(words))]


def _held_stream(served: Stack, path: str, frames: list[bytes], times: int = 1) -> None:
    answer = Answer(200, [("content-type", "text/event-stream")], frames, hold_after=len(frames))
    served.upstream.answer(path, *[answer] * times)


def _recorded_once(served: Stack, requests: int) -> None:
    entry = served.gateway.state.book.get(SESSION)
    assert entry is not None and entry.requests == requests, entry


def test_closing_the_client_while_streams_are_open_ends_each_upstream_request_once(served: Stack) -> None:
    _held_stream(served, "/v1/chat/completions", _chat_frames(3), times=2)
    _held_stream(served, "/v1/messages", tool_and_thinking_stream()[:4])
    oai = served.openai(max_retries=2)
    claude = served.anthropic(max_retries=2)
    session = {"x-session-id": SESSION}
    streams = [
        oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, extra_headers=session
        )
        for _ in range(2)
    ]
    claude_stream = claude.messages.create(
        model="claude-test", max_tokens=8, messages=CLAUDE_HELLO, stream=True, extra_headers=session
    )
    for stream in streams:
        assert next(iter(stream)).choices[0].delta.role == "assistant"
    assert next(iter(claude_stream)).type == "message_start"
    oai.close()
    claude.close()
    settle(lambda: served.upstream.peer_left == 3, what=lambda: served.upstream.peer_left)
    served.wait_idle()
    assert len(served.upstream.requests) == 3  # nothing re-sent by the SDKs or the gateway
    _recorded_once(served, 3)


def test_an_sdk_read_timeout_mid_stream_ends_the_upstream_request_and_is_not_retried(served: Stack) -> None:
    _held_stream(served, "/v1/chat/completions", _chat_frames(3))
    client = served.openai(max_retries=2, timeout=openai.Timeout(SDK_TIMEOUT, read=0.5))
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, extra_headers={"x-session-id": SESSION}
    )
    seen = 0
    with pytest.raises(openai.APITimeoutError):
        for _ in stream:
            seen += 1
    assert seen == 4  # every event the upstream sent, then the timeout
    settle(lambda: served.upstream.peer_left == 1, what=lambda: served.upstream.peer_left)
    served.wait_idle()
    assert len(served.upstream.requests) == 1
    _recorded_once(served, 1)


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_closing_an_async_client_while_a_stream_is_open(anyio_backend: str) -> None:
    with stack() as served:
        _held_stream(served, "/v1/chat/completions", _chat_frames(2))
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="k", timeout=SDK_TIMEOUT)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for event in stream:
            assert event.choices[0].delta.role == "assistant"
            break
        await client.close()
        await stream.close()
        with anyio.fail_after(5):
            while served.upstream.peer_left < 1:  # noqa: ASYNC110  (uvicorn's thread sets it: nothing to await)
                await anyio.sleep(0.01)
        served.wait_idle()
        assert len(served.upstream.requests) == 1


# --- encodings and bodies the gateway must not look into -------------------------------------------


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, mtime=0)


@pytest.mark.parametrize("kind", ["application/json", "application/octet-stream", None])
def test_a_gzip_encoded_answer_reaches_the_sdk_decoded_once(served: Stack, kind: str | None) -> None:
    document = {"id": "modr-1", "model": "m", "results": [{"flagged": False, "categories": {}, "category_scores": {}}]}
    plain = json.dumps(document).encode()
    encoded = _gzip(plain)
    headers = [("content-encoding", "gzip")] + ([("content-type", kind)] if kind else [])
    served.upstream.answer("/v1/moderations", Answer(200, headers, [encoded[:10], encoded[10:]]))
    raw = served.openai().moderations.with_raw_response.create(input="hi")
    assert raw.content == plain
    assert raw.headers.get("content-encoding") == "gzip"
    served.upstream.answer("/v1/files/file-out/content", Answer(200, headers, [encoded]))
    with served.openai().files.with_streaming_response.content("file-out") as response:
        assert b"".join(response.iter_bytes()) == plain
    served.wait_idle()


def test_an_answer_without_a_content_type_is_relayed_byte_exact(served: Stack) -> None:
    answer = Answer(200, [], list(_AUDIO))
    served.upstream.answer("/v1/audio/speech", answer)
    with served.openai().audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="hi") as r:
        assert b"".join(r.iter_bytes()) == answer.body
    one_exchange(served, "/v1/audio/speech")
    served.wait_idle()


def test_files_list_with_a_query_and_delete(served: Stack) -> None:
    served.upstream.answer("/v1/files", json_answer({"object": "list", "data": [_file_object(3)], "has_more": False}))
    served.upstream.answer(
        "/v1/files/file-scripted", json_answer({"id": "file-scripted", "object": "file", "deleted": True})
    )
    client = served.openai()
    assert [f.id for f in client.files.list(purpose="batch", after="file a/b&c", limit=2)] == ["file-scripted"]
    assert client.files.delete("file-scripted").deleted
    assert [r.method for r in served.upstream.requests] == ["GET", "DELETE"]
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
    served.wait_idle()


@pytest.mark.parametrize("retain", ["off", "memory", "disk"])
def test_a_multipart_upload_retried_under_each_retention(retain: str) -> None:
    with stack(retain_outbound=retain) as served:
        served.upstream.answer("/v1/files", json_answer({"error": {"message": "busy"}}, status=502))
        served.upstream.answer("/v1/files", json_answer(_file_object(len(_JSONL))))
        assert (
            served.openai(max_retries=0)
            .files.create(file=("requests.jsonl", _JSONL, "application/jsonl"), purpose="batch")
            .id
            == "file-scripted"
        )
        got = served.upstream.at("/v1/files")
        assert len(got) == 2
        for request in got:
            served.same_request(served.sent[0], request)
        served.wait_idle()


def test_the_anthropic_files_api_upload_and_download(served: Stack) -> None:
    meta = {
        "id": "file_1",
        "type": "file",
        "filename": "a.pdf",
        "mime_type": "application/pdf",
        "size_bytes": 3,
        "created_at": "2026-01-01T00:00:00Z",
        "downloadable": True,
    }
    pdf = b"%PDF-1.7\n" + bytes(range(256)) * 4000
    served.upstream.answer("/v1/files", json_answer(meta))
    served.upstream.answer("/v1/files/file_1/content", Answer(200, [("content-type", "application/pdf")], [pdf]))
    client = served.anthropic()
    assert client.beta.files.upload(file=("a.pdf", pdf, "application/pdf")).id == "file_1"
    assert client.beta.files.download("file_1").read() == pdf
    for sent, got in zip(served.sent, served.upstream.requests, strict=True):
        served.same_request(sent, got)
    assert served.upstream.requests[0].body.count(pdf) == 1
    served.wait_idle()


# --- a binary answer is never an event stream: no keep-alive, no error event in it ----------------

_AUDIO_HEADERS = [("content-type", "audio/mpeg")]


def _speech(served: Stack) -> bytes:
    with served.openai(max_retries=0).audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="hi"
    ) as response:
        return b"".join(response.iter_bytes())


@pytest.mark.parametrize("length", [False, True], ids=["chunked", "content-length"])
def test_a_binary_answer_quiet_for_longer_than_the_keepalive_interval_is_byte_exact(length: bool) -> None:
    headers = [*_AUDIO_HEADERS, *([("content-length", str(sum(map(len, _AUDIO))))] if length else [])]
    with stack(keepalive_interval=0.05) as served:
        served.upstream.answer("/v1/audio/speech", Answer(200, headers, list(_AUDIO), pause_after=2, pause=0.4))
        assert _speech(served) == b"".join(_AUDIO)
        served.upstream.answer(
            "/v1/moderations",
            Answer(200, _JSON, [b'{"id": "m", "model": "x",', b' "results": []}'], pause_after=1, pause=0.4),
        )
        assert (
            served.openai().moderations.with_raw_response.create(input="hi").content
            == b'{"id": "m", "model": "x", "results": []}'
        )
        served.wait_idle()


_JSON = [("content-type", "application/json")]


@pytest.mark.parametrize("length", [False, True], ids=["chunked", "content-length"])
@pytest.mark.parametrize("fault", ["stall", "cut"])
def test_a_binary_answer_broken_midway_is_a_broken_connection_not_a_short_file(length: bool, fault: str) -> None:
    headers = [*_AUDIO_HEADERS, *([("content-length", str(sum(map(len, _AUDIO))))] if length else [])]
    broken: dict[str, Any] = {"hold_after": 2} if fault == "stall" else {"cut_after": 2}
    with stack(stall_timeout=0.3) as served:
        served.upstream.answer("/v1/audio/speech", Answer(200, headers, list(_AUDIO), **broken))
        got = bytearray()
        with pytest.raises((openai.APIConnectionError, httpx2.TransportError)):
            with served.openai(max_retries=0).audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input="hi"
            ) as response:
                for chunk in response.iter_bytes():
                    got += chunk
        assert bytes(got) == b"".join(_AUDIO[:2])  # what the upstream sent, nothing added
        assert len(served.upstream.requests) == 1
        served.wait_idle()


@pytest.mark.parametrize("model", ["accounts/fireworks/models/x", "ft:gpt-4o:org:custom:id", "a b?c#d%2F"])
def test_ids_the_sdk_encodes_in_the_path_reach_the_upstream_as_encoded(served: Stack, model: str) -> None:
    # Nothing scripted for the path: the upstream's 404, which is all this needs (the path it was asked).
    client = served.openai()
    with contextlib.suppress(openai.NotFoundError):
        client.models.retrieve(model)
    (got,) = served.upstream.requests
    served.same_request(served.sent[0], got)
    served.wait_idle()


def test_anthropic_request_id_is_relayed(served: Stack) -> None:
    served.upstream.answer(
        "/v1/messages/count_tokens", json_answer({"input_tokens": 3}, headers=(("request-id", "req_011"),))
    )
    raw = served.anthropic().messages.with_raw_response.count_tokens(model="c", messages=CLAUDE_HELLO)
    assert raw.request_id == "req_011" and raw.parse().input_tokens == 3
    served.wait_idle()


# --- the openai SDK's chunked upload against MAX_BODY_BYTES -----------------------------------------

_UPLOAD = {
    "id": "upload_1",
    "object": "upload",
    "bytes": 0,
    "created_at": 1,
    "filename": "big.jsonl",
    "purpose": "batch",
    "status": "pending",
    "expires_at": 2,
}


def _chunked_upload(served: Stack, size: int, part_size: int) -> Any:
    served.upstream.answer("/v1/uploads", json_answer({**_UPLOAD, "bytes": size}))
    part = {"id": "part_1", "object": "upload.part", "created_at": 1, "upload_id": "upload_1"}
    served.upstream.answer("/v1/uploads/upload_1/parts", json_answer(part))
    served.upstream.answer(
        "/v1/uploads/upload_1/complete", json_answer({**_UPLOAD, "bytes": size, "status": "completed"})
    )
    return served.openai(max_retries=0).uploads.upload_file_chunked(
        file=_JSONL[:size],
        bytes=size,
        filename="big.jsonl",
        mime_type="application/jsonl",
        purpose="batch",
        part_size=part_size,
    )


def test_a_chunked_upload_part_of_max_body_bytes_is_refused_by_its_multipart_framing() -> None:
    """``uploads.upload_file_chunked`` sends each part as a multipart body: the part's bytes plus a few hundred
    bytes of framing. A part of exactly ``MAX_BODY_BYTES`` is a 413 (the SDK raises it with the gateway's
    message, nothing forwarded); a limit a little over the part size passes it. The SDK's default part size
    *is* the default limit, 64 MiB (docs/operators.md says to raise the limit or lower ``part_size``)."""
    from openai.resources.uploads.uploads import DEFAULT_PART_SIZE

    assert DEFAULT_PART_SIZE == LifetimeSettings().max_body_bytes == 64 * 2**20
    part = 2**20
    with stack(max_body_bytes=part) as served:
        with pytest.raises(openai.APIStatusError) as caught:
            _chunked_upload(served, 2 * part, part)
        assert caught.value.status_code == 413 and f"limit of {part} bytes" in caught.value.message
        assert [r.path for r in served.upstream.requests] == ["/v1/uploads"]  # created, no part forwarded
        served.wait_idle()
    with stack(max_body_bytes=part + 4096) as served:
        assert _chunked_upload(served, 2 * part, part).status == "completed"
        parts = served.upstream.at("/v1/uploads/upload_1/parts")
        assert len(parts) == 2 and all(_JSONL[:part] in r.body or _JSONL[part : 2 * part] in r.body for r in parts)
        for sent, got in zip(served.sent, served.upstream.requests, strict=True):
            served.same_request(sent, got)
        served.wait_idle()


@pytest.mark.anyio
@SDK_ASYNCGENS_ON_TRIO
async def test_the_async_clients_on_binary_answers_tool_streams_and_a_mid_stream_error(anyio_backend: str) -> None:
    frames = tool_and_thinking_stream()
    with stack() as served:
        served.upstream.answer("/v1/audio/speech", Answer(200, _AUDIO_HEADERS, list(_AUDIO)))
        served.upstream.answer(
            "/v1/messages", Answer(200, SSE_HEADERS, frames), Answer(200, SSE_HEADERS, _overloaded(frames, 6))
        )
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="k", timeout=SDK_TIMEOUT) as oai:
            async with oai.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="hi") as r:
                assert b"".join([chunk async for chunk in r.iter_bytes()]) == b"".join(_AUDIO)
        async with anthropic.AsyncAnthropic(base_url=served.url, api_key="k", timeout=SDK_TIMEOUT) as claude:
            async with claude.messages.stream(
                model="claude-test", max_tokens=64, messages=CLAUDE_HELLO, tools=[TOOL]
            ) as stream:
                final = await stream.get_final_message()
            assert [block.type for block in final.content] == ["thinking", "tool_use"]
            with pytest.raises(anthropic.APIStatusError, match="Overloaded"):
                async with claude.messages.stream(model="claude-test", max_tokens=64, messages=CLAUDE_HELLO) as failing:
                    async for _ in failing:
                        pass
        assert [r.path for r in served.upstream.requests] == ["/v1/audio/speech", "/v1/messages", "/v1/messages"]
        await anyio.to_thread.run_sync(served.wait_idle)


def test_a_wrong_gateway_key_is_each_sdks_authentication_error_off_the_chat_paths() -> None:
    with stack(upstream_api_key="sk-upstream", gateway_keys=("gateway-key",)) as served:
        oai = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
        claude = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
        served.clients += [oai, claude]
        calls: list[Callable[[], object]] = [
            lambda: oai.files.create(file=("a.jsonl", _JSONL[:1000], "application/jsonl"), purpose="batch"),
            lambda: oai.models.list(),
            lambda: oai.embeddings.create(model="e", input="hi"),
        ]
        for call in calls:
            with pytest.raises(openai.AuthenticationError) as caught:
                call()
            assert isinstance(caught.value.body, dict) and caught.value.body.get("code") == "invalid_api_key"
        claude_calls: list[Callable[[], object]] = [
            lambda: claude.models.list(),
            lambda: claude.messages.batches.create(requests=BATCH_REQUESTS[:2]),
            lambda: claude.beta.files.upload(file=("a.pdf", b"%PDF", "application/pdf")),
        ]
        for claude_call in claude_calls:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                claude_call()
            assert isinstance(refused.value.body, dict) and refused.value.body.get("type") == "error"
        assert served.upstream.requests == []
        served.wait_idle()
