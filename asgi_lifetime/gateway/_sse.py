"""Incremental server-sent-events parsing and the classification the relay guards use.

``SSEParser`` turns raw bytes into ``SSEEvent`` values as they arrive: ``\\n``, ``\\r\\n``
and ``\\r`` line endings, split anywhere across chunks, comments, multi-line ``data``,
``event``/``id``/``retry`` fields, a leading BOM. It also reports where the byte stream
stands: after each ``feed`` the offset of the last *event boundary* in the chunk (the relay
forwards whole events only), and whether an event is unfinished.

Memory is bounded by ``limit`` (``MAX_BUFFER``): a line or an event's ``data`` larger than
that is not kept. Such an event is still delimited exactly and dispatched, with
``oversized=True`` and its data left out; a large event is legitimate (a base64 image),
never a reason to judge the stream broken.

``SSETracker`` feeds the parser and judges the stream for the relay's starvation guard::

    tracker = SSETracker()
    for chunk in chunks:
        tracker.feed(chunk)
    if tracker.starved:
        ...  # ended without a terminal event, or with nothing to show for it

The stream's format is recognised from its first event: each provider has a detector
(``_is_chat``, ``_is_responses``, ``_is_anthropic``, ``_is_gemini``) and its own classifier,
and the first event with a JSON object (other than an error or a ping) picks one, or none.
Only a recognised format is judged event by event. An event can be *content* (a non-empty
text / tool-call / reasoning delta), *terminal* (``[DONE]``, a ``finish_reason``,
``stop_reason``, ``message_stop``, ``response.completed`` ...) and, when terminal, a
*natural stop* (the terminal names a normal reason such as ``stop``, ``length``,
``end_turn``) or an *error* (the upstream said why it failed); an error is *transient* when it
names the upstream's own failure, one a second request would likely not meet (``_transient``:
``overloaded_error``, ``server_error``...), and ``SSETracker.failed_early`` says a stream's first
error was one, before any content (the relay then re-issues it). Any other stream
(transcription, image or speech events, a custom format), and a stream once it carried an
oversized event, is output as soon as it has one event: only an event-less stream starves.
Once a stream has shown content, an event whose text shows it can be neither terminal nor an
error (``StreamFormat.inert``: most of a stream's events) is counted and not parsed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, AnyStr

from .._exceptions import ErrorShape
from .._json import JSONDecodeFailure, dumps, loads
from .._parse import too_costly
from .._settings import at_least_one, check_argument

__all__ = [
    "BOM",
    "DIALECTS",
    "FORMATS",
    "KEEPALIVE",
    "KEEPALIVE_LINE",
    "MAX_BUFFER",
    "Dialect",
    "EventClass",
    "SSEEvent",
    "SSEParser",
    "SSETracker",
    "StreamFormat",
    "classify",
    "classify_data",
    "detect_format",
    "sse_event",
]

KEEPALIVE = b": keep-alive\n\n"
# The keep-alive of a stream that has carried an ``id`` field: one comment line, no blank line.
# The openai and anthropic SDKs dispatch an empty event at a blank line once they hold a last
# event id (kept across events, as the spec says) and fail to parse its empty data.
KEEPALIVE_LINE = b": keep-alive\n"


@dataclass(frozen=True, slots=True)
class Dialect:
    """What the gateway itself may write into a client's event stream, by the SDK the client speaks
    (its error shape, ``error_shape()``): its keep-alives (``None``: none) and its error event's name
    (``None``: a data-only event)."""

    keepalive: bytes | None
    keepalive_after_id: bytes | None
    error_event: str | None


DIALECTS: dict[ErrorShape, Dialect] = {
    "openai": Dialect(KEEPALIVE, KEEPALIVE_LINE, "error"),
    "anthropic": Dialect(KEEPALIVE, KEEPALIVE_LINE, "error"),
    # Google's SDKs read a stream's ``data:`` lines only: google-genai takes any other line (a
    # comment, ``event: error``) for a JSON document and fails the stream with
    # ``UnknownApiResponseError``; the JS and Dart SDKs match ``^data: `` at the start of what they
    # hold and stop matching at anything else. Gemini's own errors come as ``data: {"error": ...}``.
    "gemini": Dialect(None, None, None),
}

# The most of one line (in bytes on the wire), or of one event's data (in bytes in memory), that is
# kept; a larger event is dispatched without its data (``SSEEvent.oversized``).
MAX_BUFFER = 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")
_TEXT_LINE_END = re.compile(r"\r\n|\r|\n")
# A stream may start with a UTF-8 BOM; it is dropped there (and only there), as clients do.
BOM = b"\xef\xbb\xbf"
_ERROR_MESSAGE_LIMIT = 500
# What is kept of a line over the limit: enough to tell a comment or a ``data`` field.
_HEAD = 16

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
    """One dispatched event. ``event`` defaults to ``"message"``; ``data`` lines are joined by ``\\n``.

    ``oversized``: the data was larger than the parser's limit and was not kept (``data`` is ``""``).
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None
    oversized: bool = False


class SSEParser:
    """Incremental SSE parser following the WHATWG event-stream rules (bytes in, events out).

    An event still being assembled when the stream ends is not dispatched, as in browsers.
    ``boundary`` (after each ``feed``) and ``at_boundary`` / ``mid_event`` say where the byte
    stream stands, so that a relay can forward whole events only and inject its own (keep-alive
    comments, error events) where a client's parser is between events.
    """

    __slots__ = (
        "limit",
        "boundary",
        "_buf",
        "_line_size",
        "_fields",
        "_data",
        "_data_size",
        "_data_width",
        "_oversized",
        "_event",
        "_id",
        "_big_id",
        "_retry",
        "_skip_lf",
        "_first",
    )

    def __init__(self, *, limit: int = MAX_BUFFER) -> None:
        check_argument("limit", limit, at_least_one, integer=True)
        self.limit = limit
        self.boundary = -1
        self._buf = bytearray()  # the unfinished line; only its first _HEAD bytes once it is over the limit
        self._line_size = 0  # bytes of the unfinished line, kept or not
        self._fields = False  # a field line was read since the last blank line
        self._data: list[str] = []
        self._data_size = 0  # characters of the event's data so far (with a separator each)
        self._data_width = 1  # bytes a character of it takes in memory (see _width)
        self._oversized = False  # the event being assembled has more data than the limit
        self._event: str | None = None
        self._id: str | None = None
        self._big_id = False  # an id field too large to keep came (a client keeps it)
        self._retry: int | None = None
        self._skip_lf = False  # the last byte was \r: a \n starting the next chunk belongs to it
        self._first = True

    @property
    def at_boundary(self) -> bool:
        """Between events: no line and no event is unfinished.

        Bytes sent up to here are whole events, and a comment or an event injected here is
        parsed by a client as itself. (After a final ``\\r`` the upstream's ``\\n`` may still
        follow: after an injected line a client would read it as an empty line of its own, so the
        relay parses it but does not send it.)
        """
        return not self._line_size and not self._fields

    @property
    def last_event_id(self) -> str | None:
        """The last ``id`` field's value (kept across events, as in browsers), None if none came."""
        return self._id

    @property
    def carried_id(self) -> bool:
        """An ``id`` field came: a client holds a last event id (perhaps one too large for this parser)."""
        return self._id is not None or self._big_id

    @property
    def mid_event(self) -> bool:
        """An event has begun (a field line, or a partial line that is not a comment) and has not ended."""
        return self._fields or (self._line_size > 0 and self._buf[:1] != b":")

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse ``chunk`` and return the events it completed.

        Afterwards ``boundary`` is the offset in ``chunk`` just after its last event boundary
        (0 if only its start is one, -1 if none is): ``chunk[:boundary]`` ends a whole event.
        """
        if self._first and chunk and not self._line_size and not BOM.startswith(chunk[: len(BOM)]):
            # The stream does not start with a BOM: its first line is read like any other (the first
            # chunk is often the whole of a short stream).
            self._first = False
        if self._line_size or self._skip_lf or self._first or len(chunk) > self.limit or b"\r" in chunk:
            return self._feed_any(chunk)
        # The usual chunk (the relay's guard parses every chunk of every stream): whole
        # ``\n``-ended lines after a line end, most often one ``data`` line and a blank line.
        # Nothing is carried into it and no line in it can exceed the limit, so this is
        # ``_feed_any`` without its calls per line: ``_take`` would only slice, ``_keep`` would
        # keep the whole tail, and ``at_boundary`` is ``not self._fields`` throughout. An ASCII
        # chunk (most are) is decoded once, not line by line, and its characters take a byte each.
        self.boundary = -1 if self._fields else 0
        events: list[SSEEvent] = []
        if chunk.isascii():
            pos = self._lines(chunk.decode("ascii").split("\n"), ":", self._text_field, events)
        else:
            pos = self._lines(chunk.split(b"\n"), b":", self._field, events)
        if pos < len(chunk):
            self._buf += memoryview(chunk)[pos:]
            self._line_size = len(chunk) - pos
        return events

    def _lines(
        self, lines: list[AnyStr], colon: AnyStr, field: Callable[[AnyStr], None], events: list[SSEEvent]
    ) -> int:
        """``feed``'s whole lines (``lines`` ends with the unfinished one, left out); the offset after the last."""
        pos = 0
        for line in lines[:-1]:
            pos += len(line) + 1
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif line[:1] != colon:
                self._fields = True
                field(line)
            if not self._fields:
                self.boundary = pos
        return pos

    def _feed_any(self, chunk: bytes) -> list[SSEEvent]:
        """``feed`` for any chunk: every line ending, lines split across chunks or over the limit, the BOM."""
        self.boundary = 0 if self.at_boundary else -1
        events: list[SSEEvent] = []
        pos = 0
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                pos = 1
                self._mark(pos)
        for match in _LINE_END.finditer(chunk, pos):
            line, over = self._take(chunk, pos, match.start())
            pos = match.end()
            event = self._line(line, over)
            if event is not None:
                events.append(event)
            self._mark(pos)
        if pos < len(chunk):
            self._keep(chunk, pos)
        elif chunk[-1:] == b"\r":
            self._skip_lf = True
        return events

    def _mark(self, pos: int) -> None:
        if self.at_boundary:
            self.boundary = pos

    def _keep(self, chunk: bytes, start: int) -> None:
        """Keep the start of a line that continues in the next chunk (bounded by the limit)."""
        size = self._line_size + len(chunk) - start
        if size <= self.limit:
            self._buf += memoryview(chunk)[start:]
        else:
            if len(self._buf) < _HEAD:
                self._buf += memoryview(chunk)[start : start + _HEAD - len(self._buf)]
            del self._buf[_HEAD:]
        self._line_size = size

    def _take(self, chunk: bytes, start: int, end: int) -> tuple[bytes, bool]:
        """The line ending at ``end``, and whether it was over the limit (then only its head)."""
        size = self._line_size + end - start
        self._line_size = 0
        if size > self.limit:
            head = (bytes(self._buf) + chunk[start : start + _HEAD])[:_HEAD]
            self._buf.clear()
            return head, True
        if not self._buf:
            return chunk[start:end], False
        self._buf += memoryview(chunk)[start:end]
        line = bytes(self._buf)
        self._buf.clear()
        return line, False

    def _line(self, line: bytes, over: bool) -> SSEEvent | None:
        if self._first:
            self._first = False
            if line.startswith(BOM):
                line = line[len(BOM) :]
        if not line:
            return self._dispatch()
        if line[:1] == b":":
            return None
        self._fields = True
        if over:
            # A field too large to keep: only data (the event is dispatched without it) and id matter.
            self._too_large(line.partition(b":")[0])
            return None
        self._field(line)
        return None

    def _field(self, line: bytes) -> None:
        """Read one field line (not a comment, within the limit in bytes)."""
        text = line.decode("utf-8", "replace")
        width = _width(text)
        if width > 1 and len(text) * width > self.limit:
            # Within the limit on the wire, over it in memory: one wide character makes every
            # character of a str take 2 or 4 bytes. As for a line over the limit.
            self._too_large(line.partition(b":")[0])
            return
        self._text_field(text, width)

    def _text_field(self, text: str, width: int = 1) -> None:
        """Read one decoded field line whose characters take ``width`` bytes each in memory (see ``_field``)."""
        name, colon, value = text.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_size += len(value) + 1
            if width > self._data_width:
                self._data_width = width
            if self._data_size * self._data_width > self.limit:  # what the joined data takes in memory
                self._overflow()
            elif not self._oversized:
                self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._retry = int(value)

    def _too_large(self, name: bytes) -> None:
        """A field line too large to keep, named ``name``."""
        if name == b"data":
            self._overflow()
        elif name == b"id":
            self._big_id = True

    def _overflow(self) -> None:
        self._oversized = True
        self._data = []

    def _dispatch(self) -> SSEEvent | None:
        self._fields = False
        event_type, self._event = self._event, None
        oversized, self._oversized = self._oversized, False
        self._data_size, self._data_width = 0, 1
        if not (self._data or oversized):
            return None
        data = "\n".join(self._data)
        self._data = []
        retry, self._retry = self._retry, None
        # Positional: keyword arguments cost a frozen dataclass a third more, once per event.
        return SSEEvent(data, event_type or "message", self._id, retry, oversized)


# The header of a CPython str that is not ASCII (the same for 1, 2 and 4 bytes a character).
_STR_HEADER = sys.getsizeof("\xe9\xe9") - 3


def _width(text: str) -> int:
    """The bytes a character of ``text`` takes in memory: CPython stores a str at 1, 2 or 4 bytes a
    character, as its widest one needs."""
    if text.isascii():  # a flag: no scan
        return 1
    # Read off the str's size (its header, then len + 1 characters): no scan. ``max(text)`` walked
    # every character at ~10x the cost of decoding the line, on every line of a non-English stream.
    width = (sys.getsizeof(text) - _STR_HEADER) // (len(text) + 1)
    if width in (1, 2, 4):
        return width
    widest = ord(max(text))  # not CPython's layout
    return 1 if widest < 0x100 else 2 if widest < 0x10000 else 4


@dataclass(frozen=True, slots=True)
class EventClass:
    """What one event (or one complete JSON response object) tells the guards."""

    content: bool = False
    terminal: bool = False
    natural_stop: bool = False
    error: bool = False
    text: str = ""  # the visible answer text it adds (not reasoning, not tool arguments)
    message: str = ""  # the upstream's own error message, if it is an error
    transient: bool = False  # an error that says the upstream failed on its side (see _transient)


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
    __slots__ = ("content", "terminal", "natural", "error", "transient", "text", "message")

    def __init__(self) -> None:
        self.content = self.terminal = self.natural = self.error = self.transient = False
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
            transient=self.error and self.transient,
        )

    def fail(self, error: Any) -> None:
        """The upstream says the response failed; ``error`` is its error object, if it gave one."""
        self.error = True
        self.message = _error_message(error) or "the upstream response failed"
        self.transient = _transient(error)


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
        acc.fail(response.get("error"))
    for item in _dicts(response.get("output")):
        if item.get("type") == "message":
            for part in _dicts(item.get("content")):
                if part.get("type") == "output_text":
                    acc.add_text(part.get("text"))
                elif _nonempty_str(part.get("refusal")):
                    acc.content = True
        elif item.get("type") in ("function_call", "custom_tool_call"):
            acc.content = True


def _kind(payload: dict[str, Any]) -> str:
    kind = payload.get("type")
    return kind if isinstance(kind, str) else ""


# What names an in-band error as the upstream's own failure, one a second request would likely not meet:
# Anthropic's ``api_error`` (its 500) and ``overloaded_error`` (529), OpenAI's ``server_error`` (a type in
# chat completions, a code in Responses), Gemini's ``INTERNAL`` / ``UNAVAILABLE`` statuses, and the HTTP
# codes OpenRouter and Gemini put in the error: the statuses the SDKs retry when they come as statuses
# (``_retry.RETRY_STATUSES`` and 500). Not a rate limit (429, ``rate_limit_error``, a quota): it wants a
# wait, and an in-band error is re-issued at once. Not a timeout (504, ``timeout_error``): the upstream
# may have done the work. Not anything naming the request (invalid, too long, unauthorized, not found).
_TRANSIENT_NAMES = frozenset({"api_error", "overloaded_error", "server_error", "INTERNAL", "UNAVAILABLE"})
_TRANSIENT_CODES = frozenset({500, 502, 503, 529})


def _transient(error: Any) -> bool:
    """An error object that names only the upstream's own failure (see ``_TRANSIENT_NAMES``).

    Conservative: every name it gives (``type``, ``code``, ``status``; the ``"type": "error"`` of the
    event itself aside) must be one of those, so a ``server_error`` with a code naming the request, or
    with a code not known here, is not transient, nor is an error naming nothing.
    """
    if not isinstance(error, dict):
        return False
    names = [error[key] for key in ("type", "code", "status") if error.get(key) not in (None, "error")]
    return bool(names) and all(
        name in _TRANSIENT_NAMES if isinstance(name, str) else type(name) is int and name in _TRANSIENT_CODES
        for name in names
    )


def _error_class(event: str, payload: Any) -> EventClass | None:
    """An upstream error event, in any format: ``event: error``, ``"type": "error"`` or an ``error`` member.

    Its error object is the ``error`` member, or else the event itself (the Responses API's ``error``
    event carries ``code`` and ``message`` at the top).
    """
    if isinstance(payload, dict):
        if event == "error" or _kind(payload) == "error" or payload.get("error") is not None:
            error = payload.get("error")
            message = _error_message(error) or "the upstream reported an error"
            transient = _transient(payload if error is None else error)
            return EventClass(terminal=True, error=True, message=message, transient=transient)
        return None
    if event == "error":
        return EventClass(terminal=True, error=True, message="the upstream reported an error")
    return None


# -- one detector and one classifier per provider -------------------------------------------------


def _is_chat(event: str, payload: dict[str, Any]) -> bool:
    """OpenAI chat completions (and legacy completions): chunks and complete objects have ``choices``."""
    return isinstance(payload.get("choices"), list)


def _chat(event: str, payload: dict[str, Any], acc: _Accumulator) -> None:
    for choice in _dicts(payload.get("choices")):
        acc.stop(choice.get("finish_reason"), _OPENAI_NATURAL)
        for key in ("delta", "message"):
            if isinstance(choice.get(key), dict):
                _openai_message(acc, choice[key])
        acc.add_text(choice.get("text"))


def _is_responses(event: str, payload: dict[str, Any]) -> bool:
    """OpenAI Responses: ``response.*`` events, or a complete ``"object": "response"``."""
    return (
        _kind(payload).startswith("response.") or event.startswith("response.") or payload.get("object") == "response"
    )


def _responses(event: str, payload: dict[str, Any], acc: _Accumulator) -> None:
    kind = _kind(payload)
    if kind in ("response.completed", "response.incomplete"):
        acc.terminal = acc.natural = True
    elif kind == "response.failed":
        acc.fail(_dict(payload.get("response")).get("error"))
    elif kind == "response.output_text.delta":
        acc.add_text(payload.get("delta"))
    elif kind in _RESPONSES_CONTENT_DELTAS:
        acc.content = acc.content or _nonempty_str(payload.get("delta"))
    if payload.get("object") == "response":
        _responses_object(acc, payload)


_ANTHROPIC_EVENTS = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    }
)


def _is_anthropic(event: str, payload: dict[str, Any]) -> bool:
    """Anthropic Messages: its event types (as ``type`` or event name), a complete message, a ``stop_reason``."""
    kind = _kind(payload)
    return kind in _ANTHROPIC_EVENTS or kind == "message" or event in _ANTHROPIC_EVENTS or "stop_reason" in payload


def _anthropic(event: str, payload: dict[str, Any], acc: _Accumulator) -> None:
    acc.stop(payload.get("stop_reason"), _ANTHROPIC_NATURAL)
    for key in ("delta", "message"):
        acc.stop(_dict(payload.get(key)).get("stop_reason"), _ANTHROPIC_NATURAL)
    kind = _kind(payload)
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


def _is_gemini(event: str, payload: dict[str, Any]) -> bool:
    """Gemini generateContent / streamGenerateContent: ``candidates``, ``promptFeedback``, ``usageMetadata``."""
    return (
        isinstance(payload.get("candidates"), list)
        or isinstance(payload.get("promptFeedback"), dict)
        or isinstance(payload.get("usageMetadata"), dict)
    )


def _gemini(event: str, payload: dict[str, Any], acc: _Accumulator) -> None:
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


# -- events that cannot end a stream ---------------------------------------------------------------
#
# Once a stream has shown content, an event can change the verdict only by being terminal or an
# error: the guard needs nothing else from it. Each format says, from the event's name and data
# text, when that is certain without the parse (``StreamFormat.inert``); the tracker checks first
# what holds for every format (``_plain``). Without a backslash every ``"`` in the data delimits a
# string, so a key or a type name the classifier reads can only appear spelled out: an event whose
# text lacks them cannot be terminal. Anything unsure (an escape, the word "error" anywhere, a
# mention of a terminal field) is parsed and classified as before.

# An inert event is skipped only below this size, far from where ``_payload`` checks the parse's
# cost (``_COST_CHECKED`` bytes: 4 bytes per character at most), so a skipped event is never one the
# rules would have found unreadable.
_INERT_LIMIT = 16 * 1024


def _plain(event: str, data: str) -> bool:
    """A JSON object in plain text that no format could read as an error."""
    return (
        data[:1] == "{" and len(data) < _INERT_LIMIT and event != "error" and "\\" not in data and "error" not in data
    )


def _chat_inert(event: str, data: str) -> bool:
    # OpenAI sends ``"finish_reason":null`` in every chunk until the last; others add a space.
    return data.count("finish_reason") == data.count('"finish_reason":null') + data.count('"finish_reason": null')


def _responses_inert(event: str, data: str) -> bool:
    # Terminal: the response.completed / incomplete / failed types, or a complete response object.
    return not any(word in data for word in ("response.completed", "response.incomplete", "response.failed", "object"))


def _anthropic_inert(event: str, data: str) -> bool:
    return event != "message_stop" and "message_stop" not in data and "stop_reason" not in data


def _gemini_inert(event: str, data: str) -> bool:
    return "finishReason" not in data and "blockReason" not in data


@dataclass(frozen=True, slots=True)
class StreamFormat:
    """A provider's format: ``detect`` recognises one of its events, ``classify`` reads it into an accumulator.

    ``inert(event, data)``, if given, is true only for an event that is neither terminal nor an error
    whatever it parses to (given ``_plain``): after content such an event is not parsed at all.
    """

    name: str
    detect: Callable[[str, dict[str, Any]], bool]
    classify: Callable[[str, dict[str, Any], _Accumulator], None]
    inert: Callable[[str, str], bool] | None = None


# The formats the guards judge, in the order they are tried.
FORMATS: tuple[StreamFormat, ...] = (
    StreamFormat("openai-chat", _is_chat, _chat, _chat_inert),
    StreamFormat("openai-responses", _is_responses, _responses, _responses_inert),
    StreamFormat("anthropic-messages", _is_anthropic, _anthropic, _anthropic_inert),
    StreamFormat("gemini", _is_gemini, _gemini, _gemini_inert),
)


def detect_format(event: str, payload: Any) -> StreamFormat | None:
    """The format whose detector recognises this event (name and parsed data), or None."""
    if not isinstance(payload, dict):
        return None
    return next((fmt for fmt in FORMATS if fmt.detect(event, payload)), None)


def classify(event: str, payload: Any, fmt: StreamFormat | None = None) -> EventClass:
    """Classify one parsed payload: a streamed chunk/event, or a complete JSON response object.

    Errors are recognised in any format. Anything else is read with ``fmt``'s rules, or with
    those of the format it is recognised as (OpenAI chat/completions, OpenAI Responses,
    Anthropic Messages, Gemini); in no known format it tells nothing.
    """
    error = _error_class(event, payload)
    if error is not None:
        return error
    if fmt is None:
        fmt = detect_format(event, payload)
    return _read(event, payload, fmt)


def _read(event: str, payload: Any, fmt: StreamFormat | None) -> EventClass:
    """``fmt``'s reading of a payload that is not an error (see ``classify``)."""
    if fmt is None or not isinstance(payload, dict):
        return _NOTHING
    acc = _Accumulator()
    fmt.classify(event, payload, acc)
    return acc.result()


# Parsing multiplies memory (an event of ``[{},{},...]`` costs ~25x its size in dicts): an event
# from this size on is parsed only if its parse stays within the bound request bodies have
# (``_parse.too_costly``). Smaller events cost at most ~2 MiB to parse, whatever their shape.
_COST_CHECKED = 64 * 1024
# An event whose parse would cost too much: not read, like an oversized one.
_UNREADABLE: Any = object()


def _payload(data: str) -> Any:
    stripped = data.lstrip()
    if stripped.startswith(("{", "[")):
        raw = stripped.encode()
        del stripped
        if len(raw) >= _COST_CHECKED and too_costly(raw):
            return _UNREADABLE
        try:
            return loads(raw)
        except JSONDecodeFailure:
            return None
    return None


def _is_done(data: str) -> bool:
    return data.strip() == "[DONE]"


def classify_data(event: str, data: str, fmt: StreamFormat | None = None) -> EventClass:
    """Classify one SSE event from its name and ``data`` text (see ``classify``)."""
    if _is_done(data):
        return _DONE
    payload = _payload(data)
    return classify(event, None if payload is _UNREADABLE else payload, fmt)


class SSETracker:
    """Feed raw upstream chunks; tracks whether the stream showed content and ended properly.

    The first event with a JSON object (not an error, not ``{"type": "ping"}``) fixes the
    format (``format``; None if no detector recognises it), and later events are read with
    that format's rules. ``starved`` resolves "no terminal, or no content" like this: an
    upstream error event is never starvation (the upstream said why); a stream without any
    event (``[DONE]`` does not count) always is. A stream that is not ``judged`` (no known
    format, or an ``oversized`` event the rules cannot read) is output once it has an event.
    A judged stream without a terminal event is starvation; a terminal with no content is
    starvation unless some terminal named a natural stop (``finish_reason: "stop"``,
    ``stop_reason: "end_turn"``, ``message_stop``...). So ``[DONE]`` alone is starvation, but
    ``finish_reason: "stop"`` and then ``[DONE]`` is an (empty) natural stop.
    """

    __slots__ = (
        "_parser",
        "_keep_text",
        "_text",
        "_decided",
        "format",
        "events",
        "saw_event",
        "saw_oversized",
        "saw_content",
        "saw_terminal",
        "saw_natural_stop",
        "saw_error",
        "error_message",
        "error_transient",
    )

    def __init__(self, *, keep_text: bool = False, limit: int = MAX_BUFFER) -> None:
        self._parser = SSEParser(limit=limit)
        self._keep_text = keep_text
        self._text: list[str] = []
        self._decided = False
        self.format: StreamFormat | None = None
        self.events = 0  # events dispatched so far
        self.saw_event = False  # an event other than [DONE], an error or a ping
        self.saw_oversized = False
        self.saw_content = False
        self.saw_terminal = False
        self.saw_natural_stop = False
        self.saw_error = False
        self.error_message = ""  # the upstream's own message from its first error event
        self.error_transient = False  # that event names the upstream's own failure (see _transient)

    @property
    def parser(self) -> SSEParser:
        return self._parser

    @property
    def judged(self) -> bool:
        """The stream is in a recognised format and every event so far could be read."""
        return self.format is not None and not self.saw_oversized

    @property
    def starved(self) -> bool:
        if self.saw_error:
            return False
        if not self.judged:
            return not self.saw_event
        if not self.saw_terminal:
            return True
        return not (self.saw_content or self.saw_natural_stop)

    @property
    def failed_early(self) -> bool:
        """The upstream failed on its side before producing anything: its first error event names a
        failure a second request would likely not meet (``_transient``), and no content came, nor any
        event the rules could not judge. Re-issuing such a stream loses nothing."""
        return self.error_transient and not self.saw_content and (self.judged or not self.saw_event)

    @property
    def text(self) -> str:
        """The visible text so far (only with ``keep_text=True``)."""
        return "".join(self._text)

    def feed(self, chunk: bytes) -> int:
        """Parse and judge ``chunk``; returns the number of events it completed."""
        events = self._parser.feed(chunk)
        for event in events:
            self.observe(event)
        return len(events)

    def observe(self, event: SSEEvent) -> EventClass:
        self.events += 1
        if self.saw_content and not self._keep_text and self._inert(event):
            # Content was seen: only a terminal or an error event could change the verdict, and this
            # one is neither (most events of a stream: each costs a parse and a walk otherwise).
            return _NOTHING
        done = not event.oversized and _is_done(event.data)
        payload = None if event.oversized or done else _payload(event.data)
        if event.oversized or payload is _UNREADABLE:
            # Too large (or too costly) to read: real output, in whatever format; the rules stop here.
            self.saw_oversized = self.saw_event = self._decided = True
            return _NOTHING
        if done:
            kind = _DONE
        else:
            kind = _error_class(event.event, payload) or self._classify(event.event, payload)
        self._record(kind)
        return kind

    def _inert(self, event: SSEEvent) -> bool:
        fmt = self.format
        if fmt is None or fmt.inert is None or self.saw_oversized or event.oversized:
            return False
        return _plain(event.event, event.data) and fmt.inert(event.event, event.data)

    def _classify(self, name: str, payload: Any) -> EventClass:
        if isinstance(payload, dict) and _kind(payload) == "ping":
            return _NOTHING  # a keep-alive in event form: neither output nor a sign of the format
        self.saw_event = True
        if not self._decided:
            self._decided = True
            self.format = detect_format(name, payload)
        if self.format is None or self.saw_oversized:
            return _NOTHING
        return _read(name, payload, self.format)  # observe found it is not an error

    def _record(self, kind: EventClass) -> None:
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
            self.error_transient = kind.transient


def sse_event(event: str | None, data: Mapping[str, Any]) -> bytes:
    """Serialize one SSE event whose ``data`` is ``data`` as compact JSON, named ``event`` unless it is None."""
    if event is not None and _TEXT_LINE_END.search(event):
        raise ValueError(f"event={event!r} is invalid: an event name cannot contain a line break")
    lines = _TEXT_LINE_END.split(dumps(data).decode())
    name = b"" if event is None else f"event: {event}\n".encode()
    return name + "".join(f"data: {line}\n" for line in lines).encode() + b"\n"
