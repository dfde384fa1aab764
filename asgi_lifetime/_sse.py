"""Incremental server-sent-events parsing and the classification the relay guards use.

``SSEParser`` turns raw bytes into ``SSEEvent`` values as they arrive: ``\\n``, ``\\r\\n``
and ``\\r`` line endings, split anywhere across chunks, comments, multi-line ``data``,
``event``/``id``/``retry`` fields, a leading BOM. Its buffer is capped: an upstream that
never ends a line (or an event) marks the stream *malformed* and parsing stops.

``SSETracker`` feeds the parser and classifies each event (``classify``) for the relay's
starvation guard::

    tracker = SSETracker()
    for chunk in chunks:
        tracker.feed(chunk)
    if tracker.starved:
        ...  # ended without a terminal event, or with nothing to show for it

An event can be *content* (a non-empty text / tool-call / reasoning delta), *terminal*
(``[DONE]``, a ``finish_reason``, ``stop_reason``, ``message_stop``, ``response.completed``
...) and, when terminal, a *natural stop* (the terminal names a normal reason such as
``stop``, ``length``, ``end_turn``) or an *error* (the upstream said why it failed).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._json import JSONDecodeFailure, dumps, loads

__all__ = [
    "KEEPALIVE",
    "MAX_BUFFER",
    "EventClass",
    "SSEEvent",
    "SSEParser",
    "SSETracker",
    "classify",
    "classify_data",
    "sse_event",
]

KEEPALIVE = b": keep-alive\n\n"
# A partial line plus the data lines of the event being assembled may not exceed this.
MAX_BUFFER = 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")
_TEXT_LINE_END = re.compile(r"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_ERROR_MESSAGE_LIMIT = 500

# Terminal reasons that mean "the model stopped normally" (or a filter stopped it and said
# so). A terminal event with one of these is never starvation, even with no content.
_OPENAI_NATURAL = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
_ANTHROPIC_NATURAL = frozenset({"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"})
_GEMINI_NATURAL = frozenset(
    {
        "STOP",
        "MAX_TOKENS",
        "SAFETY",
        "RECITATION",
        "LANGUAGE",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
    }
)
_RESPONSES_CONTENT_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    }
)
_ANTHROPIC_DELTA_FIELDS = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event. ``event`` defaults to ``"message"``; ``data`` lines are joined by ``\\n``."""

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEParser:
    """Incremental SSE parser following the WHATWG event-stream rules (bytes in, events out).

    An event still being assembled when the stream ends is not dispatched, as in browsers.
    """

    __slots__ = ("_buf", "_data", "_data_size", "_event", "_id", "_retry", "_skip_lf", "_first", "malformed", "limit")

    def __init__(self, *, limit: int = MAX_BUFFER) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} is invalid: must be at least 1")
        self.limit = limit
        self.malformed = False
        self._buf = bytearray()
        self._data: list[str] = []
        self._data_size = 0
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self._skip_lf = False  # the last byte was \r: a \n starting the next chunk belongs to it
        self._first = True

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse ``chunk`` and return the events it completed. A malformed stream returns nothing."""
        if self.malformed or not chunk:
            return []
        events: list[SSEEvent] = []
        pos = 0
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                pos = 1
        for match in _LINE_END.finditer(chunk, pos):
            if self._buf:
                self._buf += chunk[pos : match.start()]
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = chunk[pos : match.start()]
            pos = match.end()
            if len(line) + self._data_size > self.limit:
                self._set_malformed()
                return events
            event = self._line(line)
            if event is not None:
                events.append(event)
        if pos < len(chunk):
            if len(self._buf) + len(chunk) - pos + self._data_size > self.limit:
                self._set_malformed()
                return events
            self._buf += chunk[pos:]
        elif chunk[-1:] == b"\r":
            self._skip_lf = True
        return events

    # Where the byte stream stands, so that bytes injected between upstream chunks (keep-alives,
    # error events) cannot change how a client parses what the upstream sent.

    @property
    def in_line(self) -> bool:
        """A line has started and not ended (or parsing stopped, so the position is unknown)."""
        return self.malformed or bool(self._buf)

    @property
    def in_event(self) -> bool:
        """Fields of an event were read and no blank line has dispatched it yet."""
        return bool(self._data) or self._event is not None

    def keepalive_bytes(self) -> bytes | None:
        """Bytes that keep the connection warm without disturbing the stream, or None if there are none.

        Between events: ``KEEPALIVE``. Inside an event, at a line start: a comment line (a blank
        line would dispatch the event early). Inside a line, or right after a ``\\r`` inside an
        event (the upstream's ``\\n`` may still follow): nothing is safe.
        """
        if self.in_line:
            return None
        if not self.in_event:
            return KEEPALIVE
        return None if self._skip_lf else b": keep-alive\n"

    def resync_prefix(self) -> bytes:
        """Bytes that bring a client's parser to an event boundary before an injected event."""
        if self.in_line:
            return b"\n\n"
        if not self.in_event:
            return b""
        # A lone \n after \r would complete the upstream's \r\n instead of ending the event.
        return b"\n\n" if self._skip_lf else b"\n"

    def _set_malformed(self) -> None:
        self.malformed = True
        self._buf = bytearray()
        self._data = []
        self._data_size = 0

    def _line(self, line: bytes) -> SSEEvent | None:
        if self._first:
            self._first = False
            if line.startswith(_BOM):
                line = line[len(_BOM) :]
        if not line:
            return self._dispatch()
        if line[:1] == b":":
            return None
        name, colon, value = line.decode("utf-8", "replace").partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_size += len(value) + 1
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        event_type, self._event = self._event, None
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        self._data_size = 0
        retry, self._retry = self._retry, None
        return SSEEvent(data=data, event=event_type or "message", id=self._id, retry=retry)


@dataclass(frozen=True, slots=True)
class EventClass:
    """What one event (or one complete JSON response object) tells the guards."""

    content: bool = False
    terminal: bool = False
    natural_stop: bool = False
    error: bool = False
    text: str = ""  # the visible answer text it adds (not reasoning, not tool arguments)
    message: str = ""  # the upstream's own error message, if it is an error


_NOTHING = EventClass()
_DONE = EventClass(terminal=True)


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _error_message(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("message", value.get("type", ""))
    return str(value)[:_ERROR_MESSAGE_LIMIT] if value else ""


class _Accumulator:
    __slots__ = ("content", "terminal", "natural", "error", "text", "message")

    def __init__(self) -> None:
        self.content = self.terminal = self.natural = self.error = False
        self.text: list[str] = []
        self.message = ""

    def stop(self, reason: Any, natural: frozenset[str]) -> None:
        if reason is not None:
            self.terminal = True
            self.natural = self.natural or (isinstance(reason, str) and reason in natural)

    def add_text(self, value: Any) -> None:
        if _nonempty_str(value):
            self.content = True
            self.text.append(value)

    def result(self) -> EventClass:
        if not (self.content or self.terminal or self.error):
            return _NOTHING
        return EventClass(
            content=self.content,
            terminal=self.terminal or self.error,
            natural_stop=self.natural and not self.error,
            error=self.error,
            text="".join(self.text),
            message=self.message,
        )


def _openai_message(acc: _Accumulator, message: dict[str, Any]) -> None:
    """A chat ``delta`` (streaming) or ``message`` (complete response)."""
    content = message.get("content")
    if isinstance(content, list):
        for part in _dicts(content):
            acc.add_text(part.get("text"))
    else:
        acc.add_text(content)
    if (
        _nonempty_str(message.get("reasoning_content"))
        or _nonempty_str(message.get("reasoning"))
        or _nonempty_str(message.get("refusal"))
        or (isinstance(message.get("tool_calls"), list) and message["tool_calls"])
        or (isinstance(message.get("function_call"), dict) and message["function_call"])
    ):
        acc.content = True


def _anthropic_block(acc: _Accumulator, block: dict[str, Any]) -> None:
    kind = block.get("type")
    if kind == "text":
        acc.add_text(block.get("text"))
    elif kind in ("tool_use", "server_tool_use"):
        acc.content = True
    elif kind == "thinking" and _nonempty_str(block.get("thinking")):
        acc.content = True


def _responses_object(acc: _Accumulator, response: dict[str, Any]) -> None:
    status = response.get("status")
    if status in ("completed", "incomplete"):
        acc.terminal = acc.natural = True
    elif status == "failed":
        acc.error = True
        acc.message = _error_message(response.get("error")) or "the upstream response failed"
    for item in _dicts(response.get("output")):
        if item.get("type") == "message":
            for part in _dicts(item.get("content")):
                if part.get("type") == "output_text":
                    acc.add_text(part.get("text"))
                elif _nonempty_str(part.get("refusal")):
                    acc.content = True
        elif item.get("type") in ("function_call", "custom_tool_call"):
            acc.content = True


def classify(event: str, payload: Any) -> EventClass:
    """Classify one parsed payload: a streamed chunk/event, or a complete JSON response object.

    Covers OpenAI chat/completions, OpenAI Responses, Anthropic Messages and Gemini.
    """
    acc = _Accumulator()
    if event == "error":
        acc.error = True
    if not isinstance(payload, dict):
        if acc.error:
            acc.message = "the upstream reported an error"
        return acc.result()
    kind = payload.get("type")
    kind = kind if isinstance(kind, str) else ""

    if kind == "error" or payload.get("error") is not None or acc.error:
        acc.error = True
        acc.message = _error_message(payload.get("error")) or "the upstream reported an error"
        return acc.result()

    # OpenAI chat completions / legacy completions, streamed chunks and complete objects.
    for choice in _dicts(payload.get("choices")):
        acc.stop(choice.get("finish_reason"), _OPENAI_NATURAL)
        for key in ("delta", "message"):
            if isinstance(choice.get(key), dict):
                _openai_message(acc, choice[key])
        acc.add_text(choice.get("text"))

    # Anthropic Messages.
    acc.stop(payload.get("stop_reason"), _ANTHROPIC_NATURAL)
    for key in ("delta", "message"):
        acc.stop(_dict(payload.get(key)).get("stop_reason"), _ANTHROPIC_NATURAL)
    if kind == "message_stop" or event == "message_stop":
        acc.terminal = acc.natural = True
    elif kind == "content_block_delta":
        delta = _dict(payload.get("delta"))
        field = _ANTHROPIC_DELTA_FIELDS.get(str(delta.get("type")))
        if field == "text":
            acc.add_text(delta.get("text"))
        elif field is not None and _nonempty_str(delta.get(field)):
            acc.content = True
    elif kind == "content_block_start":
        _anthropic_block(acc, _dict(payload.get("content_block")))
    elif kind == "message":
        for block in _dicts(payload.get("content")):
            _anthropic_block(acc, block)

    # OpenAI Responses: streamed events, and the complete response object.
    if kind in ("response.completed", "response.incomplete"):
        acc.terminal = acc.natural = True
    elif kind == "response.failed":
        acc.error = True
        acc.message = _error_message(_dict(payload.get("response")).get("error")) or "the upstream response failed"
    elif kind == "response.output_text.delta":
        acc.add_text(payload.get("delta"))
    elif kind in _RESPONSES_CONTENT_DELTAS:
        acc.content = acc.content or _nonempty_str(payload.get("delta"))
    if payload.get("object") == "response":
        _responses_object(acc, payload)

    # Gemini generateContent / streamGenerateContent.
    for candidate in _dicts(payload.get("candidates")):
        acc.stop(candidate.get("finishReason"), _GEMINI_NATURAL)
        for part in _dicts(_dict(candidate.get("content")).get("parts")):
            if part.get("thought") is True:
                acc.content = acc.content or _nonempty_str(part.get("text"))
            else:
                acc.add_text(part.get("text"))
            if isinstance(part.get("functionCall"), dict):
                acc.content = True
    if _dict(payload.get("promptFeedback")).get("blockReason") is not None:
        acc.terminal = acc.natural = True  # the prompt was refused, and the upstream said so

    return acc.result()


def classify_data(event: str, data: str) -> EventClass:
    """Classify one SSE event from its name and ``data`` text."""
    if data.strip() == "[DONE]":
        return _DONE
    payload: Any = None
    stripped = data.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            payload = loads(stripped.encode())
        except JSONDecodeFailure:
            payload = None
    return classify(event, payload)


class SSETracker:
    """Feed raw upstream chunks; tracks whether the stream showed content and ended properly.

    ``starved`` resolves "no terminal, or no content" like this: an upstream error event is
    never starvation (the upstream said why); a stream without a terminal event always is;
    a terminal with no content is starvation unless some terminal named a natural stop
    (``finish_reason: "stop"``, ``stop_reason: "end_turn"``, ``message_stop``...). So
    ``[DONE]`` alone is starvation, but ``finish_reason: "stop"`` and then ``[DONE]`` is an
    (empty) natural stop.
    """

    __slots__ = (
        "_parser",
        "_keep_text",
        "_text",
        "saw_content",
        "saw_terminal",
        "saw_natural_stop",
        "saw_error",
        "error_message",
    )

    def __init__(self, *, keep_text: bool = False, limit: int = MAX_BUFFER) -> None:
        self._parser = SSEParser(limit=limit)
        self._keep_text = keep_text
        self._text: list[str] = []
        self.saw_content = False
        self.saw_terminal = False
        self.saw_natural_stop = False
        self.saw_error = False
        self.error_message = ""  # the upstream's own message from its first error event

    @property
    def parser(self) -> SSEParser:
        return self._parser

    @property
    def malformed(self) -> bool:
        return self._parser.malformed

    @property
    def starved(self) -> bool:
        if self.saw_error:
            return False
        if not self.saw_terminal:
            return True
        return not (self.saw_content or self.saw_natural_stop)

    @property
    def text(self) -> str:
        """The visible text so far (only with ``keep_text=True``)."""
        return "".join(self._text)

    def feed(self, chunk: bytes) -> None:
        for event in self._parser.feed(chunk):
            self.observe(event)

    def observe(self, event: SSEEvent) -> EventClass:
        kind = classify_data(event.event, event.data)
        if kind.content:
            self.saw_content = True
            if self._keep_text and kind.text:
                self._text.append(kind.text)
        if kind.terminal:
            self.saw_terminal = True
        if kind.natural_stop:
            self.saw_natural_stop = True
        if kind.error and not self.saw_error:
            self.saw_error = True
            self.error_message = kind.message
        return kind


def sse_event(event: str, data: Mapping[str, Any]) -> bytes:
    """Serialize one named SSE event whose ``data`` is ``data`` as compact JSON."""
    if _TEXT_LINE_END.search(event):
        raise ValueError(f"event={event!r} is invalid: an event name cannot contain a line break")
    lines = _TEXT_LINE_END.split(dumps(data).decode())
    return f"event: {event}\n".encode() + "".join(f"data: {line}\n" for line in lines).encode() + b"\n"
