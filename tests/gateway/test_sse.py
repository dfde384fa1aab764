from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asgi_lifetime.gateway._sse import (
    FORMATS,
    KEEPALIVE,
    MAX_BUFFER,
    SSEEvent,
    SSEParser,
    SSETracker,
    classify,
    classify_data,
    detect_format,
    sse_event,
)

# One stream exercising every line ending, a comment, a multi-line event, names, ids, retry,
# a field without a colon, an empty-data-less event, non-ASCII text and a BOM.
STREAM = (
    b"\xef\xbb\xbf: opening comment\n"
    b"data: first\n\n"
    b"event: delta\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"id: 7\rdata:no-space\rretry: 1500\r\r"
    b"event: only-a-name\n\n"
    b"data\n\n"
    b"data: caf\xc3\xa9 \xe2\x9c\x93\n"
    b": comment inside an event\n"
    b"data:  two spaces\n\n"
    b"data: [DONE]\n\n"
    b"data: unterminated at the end"
)
EXPECTED = [
    SSEEvent(data="first"),
    SSEEvent(data="line one\nline two", event="delta"),
    SSEEvent(data="no-space", id="7", retry=1500),
    SSEEvent(data="", id="7"),
    SSEEvent(data="café ✓\n two spaces", id="7"),
    SSEEvent(data="[DONE]", id="7"),
]


def parse(*chunks: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


def test_whole_stream() -> None:
    assert parse(STREAM) == EXPECTED


@pytest.mark.parametrize("split", range(len(STREAM) + 1))
def test_every_split_point(split: int) -> None:
    assert parse(STREAM[:split], STREAM[split:]) == EXPECTED


@pytest.mark.parametrize("split", range(0, len(STREAM) + 1, 7))
def test_three_pieces(split: int) -> None:
    second = min(len(STREAM), split + 5)
    assert parse(STREAM[:split], STREAM[split:second], STREAM[second:]) == EXPECTED


def test_byte_by_byte() -> None:
    assert parse(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == EXPECTED


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_line_endings_are_equivalent(ending: bytes) -> None:
    raw = ending.join([b"event: x", b"data: a", b"data: b", b"", b"data: c", b"", b""])
    assert parse(raw) == [SSEEvent(data="a\nb", event="x"), SSEEvent(data="c")]


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    # If the \n after a chunk-final \r were a second line end, "a" would be dispatched alone.
    assert parse(b"data: a\r", b"\ndata: b\r\n\r\n") == [SSEEvent(data="a\nb")]


def test_comments_and_unknown_fields_are_ignored() -> None:
    assert parse(b": hi\nfoo: bar\n:\n\n") == []
    assert parse(KEEPALIVE) == []


def test_event_without_data_is_not_dispatched_and_resets_the_name() -> None:
    assert parse(b"event: ping\n\ndata: x\n\n") == [SSEEvent(data="x")]


def test_id_with_nul_is_ignored_and_bad_retry_is_ignored() -> None:
    assert parse(b"id: a\0b\nretry: 1x\ndata: x\n\n") == [SSEEvent(data="x")]


def test_partial_event_at_end_is_not_dispatched() -> None:
    assert parse(b"data: [DONE]\n") == []


def test_oversized_event_is_dispatched_without_its_data_and_memory_is_bounded() -> None:
    parser = SSEParser(limit=1000)
    assert parser.feed(b"data: ok\n\ndata: ") == [SSEEvent(data="ok")]
    for _ in range(50):
        assert parser.feed(b"x" * 100) == []
        assert len(parser._buf) <= 1000
    assert len(parser._buf) <= 16  # only the head of a line over the limit is kept
    assert parser.mid_event and not parser.at_boundary
    # Parsing goes on: the large event ends at its blank line, and later events are seen.
    assert parser.feed(b"\n\ndata: later\n\n") == [SSEEvent(data="", oversized=True), SSEEvent(data="later")]
    assert parser.at_boundary


def test_oversized_line_inside_one_chunk() -> None:
    parser = SSEParser(limit=100)
    events = parser.feed(b"event: big\ndata: " + b"y" * 200 + b"\n\ndata: after\n\n")
    assert events == [SSEEvent(data="", event="big", oversized=True), SSEEvent(data="after")]


def test_many_data_lines_over_the_limit_make_one_oversized_event() -> None:
    parser = SSEParser(limit=1000)
    for _ in range(200):
        assert parser.feed(b"data: 0123456789\n") == []
    assert parser._data == []
    assert parser.feed(b"\n") == [SSEEvent(data="", oversized=True)]


# The limit is on what the parser keeps in memory: CPython stores a str at 1, 2 or 4 bytes a character,
# as its widest character needs, so one emoji in a line of ASCII makes it take 4 bytes a character.
# Counted in characters, these events were kept at up to 4x the limit. Fed whole and byte by byte.
WIDE = {
    "ascii-then-emoji": (b"data: " + b"x" * 400 + "\U0001f600".encode() + b"\n\n", True),
    "emoji-in-its-own-line": (b"data: " + b"x" * 600 + b"\ndata: " + "\U0001f600".encode() + b"\n\n", True),
    "ascii-then-cjk": (b"data: " + b"x" * 600 + "\u4e2d".encode() + b"\n\n", True),
    "latin-1-at-one-byte-each": (b"data: " + "\u00e9".encode() * 450 + b"\n\n", False),
    "cjk-within-the-limit": (b"data: " + "\u4e2d".encode() * 300 + b"\n\n", False),
}


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "bytewise"])
@pytest.mark.parametrize("name", list(WIDE))
def test_the_data_limit_counts_bytes_in_memory(name: str, whole: bool) -> None:
    raw, over = WIDE[name]
    parser = SSEParser(limit=1000)
    events = parser.feed(raw) if whole else [event for i in range(len(raw)) for event in parser.feed(raw[i : i + 1])]
    text = raw.decode().replace("data: ", "").rstrip("\n")
    assert events == [SSEEvent(data="", oversized=True) if over else SSEEvent(data=text)]
    assert parser.at_boundary


def test_a_wide_event_name_over_the_limit_in_memory_is_dropped() -> None:
    parser = SSEParser(limit=1000)
    name = "n" * 300 + "\U0001f600"  # 304 bytes on the wire, 1204 in memory
    assert parser.feed(f"event: {name}\ndata: x\n\n".encode()) == [SSEEvent(data="x")]
    assert parser.feed(f"event: {name[:200]}\ndata: y\n\n".encode()) == [SSEEvent(data="y", event="n" * 200)]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_oversized_comment_and_other_fields_are_dropped_not_dispatched(ending: bytes) -> None:
    parser = SSEParser(limit=50)
    raw = b":" + b"c" * 100 + ending + b"event: " + b"n" * 100 + ending + b"data: x" + ending + ending
    # The over-long name is not kept (the default applies); the event itself is whole.
    assert parser.feed(raw) == [SSEEvent(data="x")]


# Where the parser says the stream stands after these bytes (fed to a new parser, whose start
# is a boundary): the offset of the last boundary in them, and whether an event is unfinished.
BOUNDARIES = [
    (b"", 0, False),
    (b"data: a\n\n", 9, False),
    (b"data: a\r\r", 9, False),
    (b"data: a\r\n\r\n", 11, False),
    (b"data: a\r\n\r", 10, False),  # a CR alone ends the blank line: the event is complete
    (b"data: a\n", 0, True),
    (b"event: x\n", 0, True),
    (b"data: a\r", 0, True),
    (b'data: {"cho', 0, True),
    (b"data: a\n\ndata: b", 9, True),
    (b"data: a\n\n: keep-", 9, False),  # a partial comment line: not at a boundary, but no event
    (b": ping\n", 7, False),
    (b"data: a\n\n: ping\n\ndata", 17, True),
]


@pytest.mark.parametrize(("fed", "boundary", "mid_event"), BOUNDARIES)
def test_boundaries(fed: bytes, boundary: int, mid_event: bool) -> None:
    parser = SSEParser()
    parser.feed(fed)
    assert parser.boundary == boundary
    assert parser.mid_event is mid_event
    assert parser.at_boundary is (boundary == len(fed))
    # What is before the boundary is whole events, and an event injected there is parsed alone.
    if boundary > 0:
        client = SSEParser()
        dispatched = client.feed(fed[:boundary])
        assert client.at_boundary
        injected = client.feed(sse_event("error", {"error": {"code": "x"}}))
        assert injected == [SSEEvent(data='{"error":{"code":"x"}}', event="error", id=None)]
        assert dispatched == SSEParser().feed(fed[:boundary] + b"\n\n")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
def test_boundaries_over_every_split_keep_whole_events(size: int) -> None:
    # Sending only up to each boundary (as the relay does) yields the same events as the whole stream.
    parser = SSEParser()
    sent = b""
    pending = b""
    for i in range(0, len(STREAM), size):
        chunk = STREAM[i : i + size]
        parser.feed(chunk)
        if parser.boundary >= 0:
            sent += pending + chunk[: parser.boundary]
            pending = chunk[parser.boundary :]
        else:
            pending += chunk
        client = SSEParser()
        client.feed(sent)
        assert client.at_boundary or sent.endswith(b"\r")
    assert parse(sent) == EXPECTED
    assert pending == b"data: unterminated at the end"


def test_crlf_split_after_the_cr_of_a_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r\n\r") == [SSEEvent(data="a")]
    assert parser.at_boundary
    parser.feed(b"\ndata: b")
    assert parser.boundary == 1  # the LF belongs to the CR before it


# -- the usual chunk's short way, against the general one ----------------------------------------
#
# ``feed`` reads a usual chunk (whole ``\n`` lines after a line end, no BOM, none over the limit)
# without the general path's calls per line. Whatever the stream and its chunking, it must see
# the same events and report the same position after every chunk as the general path alone.


class GeneralParser(SSEParser):
    """The reference: every chunk through the general path."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._feed_any(chunk)


_VALUES = st.one_of(
    st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), max_size=12).map(str.encode),
    st.binary(max_size=90).map(lambda raw: raw.replace(b"\r", b"").replace(b"\n", b"")),  # invalid UTF-8, long lines
    st.integers(0, 10**6).map(lambda n: str(n).encode()),
    st.just(b"a\0b"),
)
_NAMES = st.sampled_from([b"data", b"data", b"data", b"event", b"id", b"retry", b"", b"other"])
# Mostly \n (the short way's case), with the others mixed in.
_ENDINGS = st.sampled_from([b"\n", b"\n", b"\n", b"\r\n", b"\r"])


@st.composite
def _streams(draw: st.DrawFn) -> tuple[int, bytes, list[bytes]]:
    """A limit, a stream of random lines and line endings, and a random chunking of it."""
    limit = draw(st.one_of(st.integers(1, 64), st.just(MAX_BUFFER)))
    sizes = st.integers(max(0, limit - 8), limit + 2) if limit < MAX_BUFFER else st.just(0)
    near = sizes.map(lambda size: b"x" * size)  # a line just within the limit or just over it
    field = st.tuples(_NAMES, st.sampled_from([b":", b": ", b""]), _VALUES | near).map(b"".join)  # "": a comment
    line = st.tuples(field | st.just(b"") | st.just(b"data"), _ENDINGS).map(b"".join)
    raw = draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf"])) + b"".join(draw(st.lists(line, max_size=30)))
    raw += draw(_VALUES)  # an unfinished line, perhaps empty
    line_ends = [i + 1 for i in range(len(raw)) if raw[i : i + 1] == b"\n"]
    cuts = set(draw(st.lists(st.sampled_from(line_ends)))) if line_ends else set()  # whole lines, as most streams
    if draw(st.booleans()):
        cuts.update(draw(st.lists(st.integers(0, len(raw)), max_size=20)))  # anywhere
    if draw(st.booleans()):
        cuts.update(i + 1 for i in range(len(raw)) if raw[i : i + 1] == b"\r")  # between \r and \n
    if draw(st.integers(0, 9)) == 0:
        cuts.update(range(len(raw)))  # byte by byte
    edges = [0, *sorted(cuts), len(raw)]
    return limit, raw, [raw[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=_streams())
def test_the_short_way_reads_like_the_general_one(stream: tuple[int, bytes, list[bytes]]) -> None:
    limit, raw, chunks = stream
    parser, reference = SSEParser(limit=limit), GeneralParser(limit=limit)
    for chunk in chunks:
        assert parser.feed(chunk) == reference.feed(chunk), (raw, chunks)
        assert (parser.boundary, parser.at_boundary, parser.mid_event) == (
            reference.boundary,
            reference.at_boundary,
            reference.mid_event,
        ), (raw, chunks, chunk)


def test_a_usual_chunk_takes_the_short_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the first line (BOM or not), a chunk of whole \n lines within the limit is read without
    # the general way; a line carried over, a \r or a chunk over the limit takes it.
    parsers = [SSEParser(), SSEParser(), SSEParser(), SSEParser(limit=8)]
    for parser in parsers:
        assert parser.feed(b": opening\n") == []
    assert parsers[1].feed(b"data: a") == []
    general: list[bytes] = []

    def feed_any(self: SSEParser, chunk: bytes) -> list[SSEEvent]:
        general.append(chunk)
        return []

    monkeypatch.setattr(SSEParser, "_feed_any", feed_any)
    usual, carried, cr, over = parsers
    events = usual.feed(b'data: {"a":1}\n\ndata: b\n: c\n\nevent: x\ndata')
    assert events == [SSEEvent(data='{"a":1}'), SSEEvent(data="b")]
    assert (usual.boundary, usual.mid_event) == (28, True)
    assert general == []
    carried.feed(b"\n\n")
    cr.feed(b"data: a\r\n\r\n")
    over.feed(b"data: 123456\n")
    assert general == [b"\n\n", b"data: a\r\n\r\n", b"data: 123456\n"]


def test_a_first_chunk_without_a_bom_takes_the_short_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first chunk is often the whole of a short stream: only one that starts with a BOM, or with a piece
    # of one (the rest may follow), needs the general way, which strips it.
    general: list[bytes] = []
    feed_any = SSEParser._feed_any

    def counting(self: SSEParser, chunk: bytes) -> list[SSEEvent]:
        general.append(chunk)
        return feed_any(self, chunk)

    monkeypatch.setattr(SSEParser, "_feed_any", counting)
    assert SSEParser().feed(b"data: a\n\ndata: b\n\n") == [SSEEvent(data="a"), SSEEvent(data="b")]
    assert general == []
    assert SSEParser().feed(b"\xef\xbb\xbfdata: a\n\n") == [SSEEvent(data="a")]
    split = SSEParser()
    assert split.feed(b"\xef") == [] and split.feed(b"\xbb\xbfdata: a\n\n") == [SSEEvent(data="a")]
    assert general == [b"\xef\xbb\xbfdata: a\n\n", b"\xef", b"\xbb\xbfdata: a\n\n"]


def test_sse_event_round_trip() -> None:
    data = {"error": {"message": "line\nbreak \u2028 ü", "code": "upstream_stalled"}}
    raw = sse_event("error", data)
    assert raw.startswith(b"event: error\ndata: ") and raw.endswith(b"\n\n")
    (event,) = parse(raw)
    assert event.event == "error" and json.loads(event.data) == data


def test_sse_event_rejects_line_break_in_name() -> None:
    with pytest.raises(ValueError, match="event="):
        sse_event("a\nb", {})


# -- classification ---------------------------------------------------------------------------

C, T, N, E = "content", "terminal", "natural", "error"


def chat(**delta: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def chat_finish(reason: str | None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}


def gemini(parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}}
    if finish is not None:
        candidate["finishReason"] = finish
    return {"candidates": [candidate]}


CLASSIFICATION = [
    # OpenAI chat completions
    ("oai-role-only", "message", chat(role="assistant"), set()),
    ("oai-role-empty-content", "message", chat(role="assistant", content=""), set()),
    ("oai-text", "message", chat(content="Hi"), {C}),
    ("oai-tool-call", "message", chat(tool_calls=[{"index": 0, "function": {"arguments": ""}}]), {C}),
    ("oai-empty-tool-calls", "message", chat(tool_calls=[]), set()),
    ("oai-reasoning", "message", chat(reasoning_content="hmm"), {C}),
    ("oai-finish-stop", "message", chat_finish("stop"), {T, N}),
    ("oai-finish-length", "message", chat_finish("length"), {T, N}),
    ("oai-finish-tool-calls", "message", chat_finish("tool_calls"), {T, N}),
    ("oai-finish-content-filter", "message", chat_finish("content_filter"), {T, N}),
    ("oai-finish-abort", "message", chat_finish("abort"), {T}),
    ("oai-text-and-finish", "message", chat_finish("stop", content="!"), {C, T, N}),
    ("oai-second-choice-finishes", "message", {"choices": [{"delta": {}}, {"finish_reason": "stop"}]}, {T, N}),
    ("oai-completions-text", "message", {"choices": [{"text": "x", "finish_reason": None}]}, {C}),
    ("oai-completions-empty-text", "message", {"choices": [{"text": "", "finish_reason": None}]}, set()),
    ("oai-usage-only", "message", {"choices": [], "usage": {"total_tokens": 3}}, set()),
    ("oai-error-payload", "message", {"error": {"message": "overloaded", "type": "server_error"}}, {T, E}),
    # OpenAI Responses
    ("resp-created", "response.created", {"type": "response.created", "response": {"status": "in_progress"}}, set()),
    ("resp-text", "response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"}, {C}),
    ("resp-empty-text", "response.output_text.delta", {"type": "response.output_text.delta", "delta": ""}, set()),
    (
        "resp-args",
        "response.function_call_arguments.delta",
        {"type": "response.function_call_arguments.delta", "delta": '{"a"'},
        {C},
    ),
    ("resp-completed", "response.completed", {"type": "response.completed", "response": {}}, {T, N}),
    ("resp-incomplete", "response.incomplete", {"type": "response.incomplete", "response": {}}, {T, N}),
    ("resp-failed", "response.failed", {"type": "response.failed", "response": {"error": {"message": "x"}}}, {T, E}),
    ("resp-error", "error", {"type": "error", "code": "server_error", "message": "boom"}, {T, E}),
    # Anthropic Messages
    (
        "anth-message-start",
        "message_start",
        {"type": "message_start", "message": {"type": "message", "content": [], "stop_reason": None}},
        set(),
    ),
    ("anth-ping", "ping", {"type": "ping"}, set()),
    (
        "anth-text-start",
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        set(),
    ),
    (
        "anth-tool-start",
        "content_block_start",
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "input": {}}},
        {C},
    ),
    (
        "anth-text-delta",
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}},
        {C},
    ),
    (
        "anth-empty-json-delta",
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": ""}},
        set(),
    ),
    (
        "anth-json-delta",
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": '{"a'}},
        {C},
    ),
    (
        "anth-thinking-delta",
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "so"}},
        {C},
    ),
    (
        "anth-signature-delta",
        "content_block_delta",
        {"type": "content_block_delta", "delta": {"type": "signature_delta", "signature": "abc"}},
        set(),
    ),
    (
        "anth-message-delta-end-turn",
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}},
        {T, N},
    ),
    (
        "anth-message-delta-other",
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": "overloaded"}},
        {T},
    ),
    ("anth-top-level-stop-reason", "message", {"stop_reason": "max_tokens"}, {T, N}),
    ("anth-message-stop", "message_stop", {"type": "message_stop"}, {T, N}),
    ("anth-message-stop-by-name", "message_stop", {}, {T, N}),
    ("anth-error", "error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, {T, E}),
    # Gemini
    ("gem-text", "message", gemini([{"text": "Hi"}]), {C}),
    ("gem-empty-text", "message", gemini([{"text": ""}]), set()),
    ("gem-function-call", "message", gemini([{"functionCall": {"name": "f", "args": {}}}]), {C}),
    ("gem-thought", "message", gemini([{"text": "hmm", "thought": True}]), {C}),
    ("gem-stop-with-text", "message", gemini([{"text": "!"}], "STOP"), {C, T, N}),
    ("gem-stop-empty", "message", gemini([], "STOP"), {T, N}),
    ("gem-max-tokens", "message", gemini([], "MAX_TOKENS"), {T, N}),
    ("gem-other", "message", gemini([], "OTHER"), {T}),
    ("gem-prompt-blocked", "message", {"promptFeedback": {"blockReason": "SAFETY"}}, {T, N}),
    # Not JSON / not an object
    ("plain-text", "message", "hello", set()),
    ("json-list", "message", [1, 2], set()),
]


def _flags(kind: Any) -> set[str]:
    return {name for name, on in [(C, kind.content), (T, kind.terminal), (N, kind.natural_stop), (E, kind.error)] if on}


@pytest.mark.parametrize(
    ("event", "payload", "expected"),
    [case[1:] for case in CLASSIFICATION],
    ids=[case[0] for case in CLASSIFICATION],
)
def test_classification(event: str, payload: Any, expected: set[str]) -> None:
    assert _flags(classify(event, payload)) == expected
    data = payload if isinstance(payload, str) else json.dumps(payload)
    assert _flags(classify_data(event, data)) == expected


def test_done_is_terminal_but_not_natural() -> None:
    assert _flags(classify_data("message", "[DONE]")) == {T}
    assert _flags(classify_data("message", " [DONE] ")) == {T}


def test_error_event_name_with_non_json_data() -> None:
    kind = classify_data("error", "upstream exploded")
    assert kind.error and kind.terminal and not kind.content and kind.message


def test_invalid_json_data_is_nothing() -> None:
    assert _flags(classify_data("message", '{"choices": [')) == set()


def test_text_extraction() -> None:
    assert classify("message", chat(content="Hi")).text == "Hi"
    assert classify("message", chat(reasoning_content="hmm")).text == ""
    assert classify("message", gemini([{"text": "a"}, {"text": "think", "thought": True}, {"text": "b"}])).text == "ab"


# -- tracker ------------------------------------------------------------------------------------


def frames(*events: tuple[str, Any]) -> bytes:
    out = b""
    for name, payload in events:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        out += (f"event: {name}\n" if name != "message" else "").encode() + f"data: {data}\n\n".encode()
    return out


M = "message"
TRACKER_CASES = [
    (
        "oai-success",
        frames((M, chat(role="assistant")), (M, chat(content="Hi")), (M, chat_finish("stop")), (M, "[DONE]")),
        False,
    ),
    ("oai-no-terminal", frames((M, chat(role="assistant")), (M, chat(content="Hi"))), True),
    ("oai-role-then-done", frames((M, chat(role="assistant")), (M, "[DONE]")), True),
    ("oai-empty-natural-stop", frames((M, chat(role="assistant")), (M, chat_finish("stop")), (M, "[DONE]")), False),
    ("oai-empty-abort", frames((M, chat(role="assistant")), (M, chat_finish("abort")), (M, "[DONE]")), True),
    ("oai-content-then-abort", frames((M, chat(content="x")), (M, chat_finish("abort"))), False),
    ("oai-error", frames((M, chat(role="assistant")), ("error", {"error": {"message": "boom"}})), False),
    ("empty-stream", b"", True),
    ("only-comments", b": ping\n\n: ping\n\n", True),
    (
        "anthropic-success",
        frames(
            ("message_start", {"type": "message_start", "message": {"stop_reason": None}}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
            ("message_stop", {"type": "message_stop"}),
        ),
        False,
    ),
    (
        "anthropic-empty-end-turn",
        frames(
            ("message_start", {"type": "message_start", "message": {"stop_reason": None}}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
            ("message_stop", {"type": "message_stop"}),
        ),
        False,
    ),
    (
        "anthropic-cut-off",
        frames(
            ("message_start", {"type": "message_start", "message": {"stop_reason": None}}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}),
        ),
        True,
    ),
    (
        "responses-success",
        frames(
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"}),
            ("response.completed", {"type": "response.completed", "response": {}}),
        ),
        False,
    ),
    ("gemini-success", frames((M, gemini([{"text": "Hi"}])), (M, gemini([{"text": "!"}], "STOP"))), False),
    ("gemini-no-finish", frames((M, gemini([{"text": "Hi"}]))), True),
]


@pytest.mark.parametrize(("raw", "starved"), [c[1:] for c in TRACKER_CASES], ids=[c[0] for c in TRACKER_CASES])
def test_tracker_starvation(raw: bytes, starved: bool) -> None:
    tracker = SSETracker()
    for i in range(0, len(raw), 5):
        tracker.feed(raw[i : i + 5])
    assert tracker.starved is starved


def test_tracker_flags_and_text() -> None:
    tracker = SSETracker(keep_text=True)
    tracker.feed(frames((M, chat(role="assistant"))))
    assert not tracker.saw_content and not tracker.saw_terminal and tracker.starved
    tracker.feed(frames((M, chat(content="Hel")), (M, chat(content="lo"))))
    assert tracker.saw_content and not tracker.saw_terminal
    tracker.feed(frames((M, chat_finish("stop")), (M, "[DONE]")))
    assert tracker.saw_terminal and tracker.saw_natural_stop and not tracker.starved
    assert tracker.text == "Hello"


def test_tracker_error_is_terminal_not_content() -> None:
    tracker = SSETracker()
    tracker.feed(frames(("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})))
    assert tracker.saw_error and tracker.saw_terminal and not tracker.saw_content
    assert tracker.error_message == "Overloaded"
    assert not tracker.starved


def test_oversized_event_stops_the_judging() -> None:
    tracker = SSETracker(limit=200)
    tracker.feed(frames((M, chat(content="Hi"))))
    assert tracker.judged and tracker.starved
    tracker.feed(b"data: " + b"x" * 300 + b"\n\n")
    assert tracker.saw_oversized and not tracker.judged
    assert not tracker.starved  # output too large to read is output: never a broken stream


def ev(kind: str, **fields: Any) -> tuple[str, Any]:
    return kind, {"type": kind, **fields}


# Streams in formats the guard does not judge: any event is output, whatever follows.
UNJUDGED = {
    "transcription": frames(ev("transcript.text.delta", delta="Hel"), ev("transcript.text.done", text="Hello")),
    "transcription-data-only": frames((M, {"type": "transcript.text.delta", "delta": "Hi"})),
    "image": frames(
        ev("image_generation.partial_image", b64_json="AAAA", partial_image_index=0),
        ev("image_generation.completed", b64_json="AAAA"),
    ),
    "speech": frames(ev("speech.audio.delta", audio="AAAA"), ev("speech.audio.done", usage={})),
    "custom": frames(("tick", {"n": 1}), ("tick", {"n": 2})),
    "plain-text": frames((M, "hello")),
    # The first event fixes the format: a later chat-like event does not make it judged.
    "custom-then-chat-like": frames(("tick", {"n": 1}), (M, chat(role="assistant"))),
    "only-first-event": frames(ev("transcript.text.delta", delta="")),
}


@pytest.mark.parametrize("raw", list(UNJUDGED.values()), ids=list(UNJUDGED))
def test_unrecognised_formats_are_output(raw: bytes) -> None:
    tracker = SSETracker()
    for i in range(0, len(raw), 3):
        tracker.feed(raw[i : i + 3])
    assert tracker.format is None and not tracker.judged
    assert not tracker.starved


EVENTLESS = {
    "empty": b"",
    "comments": b": ping\n\n",
    "done-only": frames((M, "[DONE]")),
    "ping-only": frames(("ping", {"type": "ping"})),
    "unfinished-first-event": b'data: {"type": "transcript.text.delta", "delta": "Hi"}\n',
}


@pytest.mark.parametrize("raw", list(EVENTLESS.values()), ids=list(EVENTLESS))
def test_eventless_streams_are_starved_in_any_format(raw: bytes) -> None:
    tracker = SSETracker()
    tracker.feed(raw)
    assert tracker.starved


@pytest.mark.parametrize(
    ("event", "payload", "name"),
    [
        ("message", chat(role="assistant"), "openai-chat"),
        ("message", {"choices": [], "usage": {}}, "openai-chat"),
        ("response.created", {"type": "response.created", "response": {}}, "openai-responses"),
        ("message", {"object": "response", "status": "completed"}, "openai-responses"),
        ("message_start", {"type": "message_start", "message": {}}, "anthropic-messages"),
        ("message", {"type": "message", "content": []}, "anthropic-messages"),
        ("message", gemini([{"text": "Hi"}]), "gemini"),
        ("message", {"usageMetadata": {"totalTokenCount": 3}}, "gemini"),
        ("transcript.text.delta", {"type": "transcript.text.delta", "delta": "x"}, None),
        ("message", {"type": "image_generation.partial_image"}, None),
        ("message", {"type": "speech.audio.delta", "audio": ""}, None),
        ("message", {"anything": 1}, None),
        ("message", "not json", None),
    ],
)
def test_detect_format(event: str, payload: Any, name: str | None) -> None:
    fmt = detect_format(event, payload)
    assert (fmt.name if fmt is not None else None) == name
    assert [f.name for f in FORMATS] == ["openai-chat", "openai-responses", "anthropic-messages", "gemini"]


def test_a_ping_does_not_fix_the_format() -> None:
    tracker = SSETracker()
    tracker.feed(frames(("ping", {"type": "ping"}), (M, chat(role="assistant"))))
    assert tracker.format is not None and tracker.format.name == "openai-chat"
    assert tracker.starved  # judged: no content, no terminal


# -- events skipped after content -------------------------------------------------------------
#
# Once a stream has shown content, an event that cannot be terminal or an error is not parsed
# (``StreamFormat.inert``). A tracker with ``keep_text=True`` parses every event: it is the reference.

CONTENT_PREFIXES = {
    "openai-chat": frames((M, chat(role="assistant")), (M, chat(content="Hi"))),
    "openai-responses": frames(("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"})),
    "anthropic-messages": frames(
        ("message_start", {"type": "message_start", "message": {"stop_reason": None}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}),
    ),
    "gemini": frames((M, gemini([{"text": "Hi"}]))),
}

# Events written as the text a hostile or unusual upstream may send: what only the parse can read.
TRICKY_EVENTS = {
    "escaped-finish-key": b'data: {"choices":[{"delta":{},"finish_\\u0072eason":"stop"}]}\n\n',
    "spaced-finish": b'data: {"choices":[{"delta":{},"finish_reason" : "stop"}]}\n\n',
    "finish-then-null-duplicate": b'data: {"choices":[{"finish_reason":"stop","finish_reason":null}]}\n\n',
    "null-then-finish-duplicate": b'data: {"choices":[{"finish_reason":null,"finish_reason":"stop"}]}\n\n',
    "finish-in-content": b'data: {"choices":[{"delta":{"content":"finish_reason"},"finish_reason":null}]}\n\n',
    "error-in-content": b'data: {"choices":[{"delta":{"content":"no error"},"finish_reason":null}]}\n\n',
    "escaped-error-key": b'data: {"\\u0065rror":{"message":"boom"}}\n\n',
    "error-type": b'data: {"type":"error","message":"boom"}\n\n',
    "error-name-plain-data": b"event: error\ndata: {}\n\n",
    "done": b"data: [DONE]\n\n",
    "done-spaced": b"data:  [DONE] \n\n",
    "leading-space-finish": b'data:  {"choices":[{"finish_reason":"stop"}]}\n\n',
    "stop-by-name": b"event: message_stop\ndata: {}\n\n",
    "stop-reason": b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}\n\n',
    "responses-completed": b'data: {"type":"response.completed","response":{}}\n\n',
    "responses-object": b'data: {"object":"response","status":"completed","output":[]}\n\n',
    "gemini-finish": b'data: {"candidates":[{"content":{"parts":[]},"finishReason":"STOP"}]}\n\n',
    "gemini-blocked": b'data: {"promptFeedback":{"blockReason":"SAFETY"}}\n\n',
    "large-plain": b'data: {"choices":[{"delta":{"content":"' + b"x" * 20000 + b'"},"finish_reason":null}]}\n\n',
    "costly": b"data: [" + b"{}," * 30000 + b"{}]\n\n",
    "not-json": b"data: {not json\n\n",
    "ping": b'event: ping\ndata: {"type": "ping"}\n\n',
}


def _verdict(tracker: SSETracker) -> tuple[object, ...]:
    return (
        tracker.starved,
        tracker.judged,
        tracker.saw_terminal,
        tracker.saw_natural_stop,
        tracker.saw_error,
        tracker.error_message,
        tracker.events,
    )


def _both(raw: bytes) -> tuple[SSETracker, SSETracker]:
    fast, reference = SSETracker(), SSETracker(keep_text=True)
    for tracker in (fast, reference):
        for i in range(0, len(raw), 7):
            tracker.feed(raw[i : i + 7])
    return fast, reference


TAILS = {
    **{name: frames((event, payload)) for name, event, payload, _ in CLASSIFICATION},
    **TRICKY_EVENTS,
}


@pytest.mark.parametrize("prefix", list(CONTENT_PREFIXES))
@pytest.mark.parametrize("tail", list(TAILS))
def test_skipping_events_after_content_never_changes_the_verdict(prefix: str, tail: str) -> None:
    """Every classified event and every tricky spelling, after content in every format: the tracker
    that skips what cannot be terminal judges exactly as the one that parses everything."""
    raw = CONTENT_PREFIXES[prefix] + TAILS[tail]
    fast, reference = _both(raw)
    assert fast.format is not None and fast.format.name == prefix
    assert fast.saw_content
    assert _verdict(fast) == _verdict(reference)
    # And again with an inert event after it (the verdict may already be settled by then).
    fast, reference = _both(raw + CONTENT_PREFIXES[prefix])
    assert _verdict(fast) == _verdict(reference)


def test_terminals_hidden_from_a_byte_scan_are_still_found() -> None:
    raw = CONTENT_PREFIXES["openai-chat"] + TRICKY_EVENTS["escaped-finish-key"]
    fast, _ = _both(raw)
    assert fast.saw_terminal and fast.saw_natural_stop and not fast.starved
    fast, _ = _both(CONTENT_PREFIXES["openai-chat"] + TRICKY_EVENTS["null-then-finish-duplicate"])
    assert fast.saw_terminal and not fast.starved
    fast, _ = _both(CONTENT_PREFIXES["openai-chat"] + TRICKY_EVENTS["escaped-error-key"])
    assert fast.saw_error and fast.error_message == "boom"


STREAM_TAILS: dict[str, tuple[list[tuple[str, Any]], list[tuple[str, Any]]]] = {
    "openai-chat": (
        [(M, chat(content=f" word{n}")) for n in range(10)] + [(M, {"choices": [], "usage": {"total_tokens": 3}})],
        [(M, chat_finish("stop")), (M, "[DONE]")],
    ),
    "openai-responses": (
        [("response.output_text.delta", {"type": "response.output_text.delta", "delta": f" w{n}"}) for n in range(10)]
        + [("response.output_text.done", {"type": "response.output_text.done", "text": "all"})],
        [("response.completed", {"type": "response.completed", "response": {"status": "completed"}})],
    ),
    "anthropic-messages": (
        [
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": f" w{n}"}})
            for n in range(10)
        ]
        + [("content_block_stop", {"type": "content_block_stop", "index": 0})],
        [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
            ("message_stop", {"type": "message_stop"}),
        ],
    ),
    "gemini": (
        [(M, gemini([{"text": f" w{n}"}])) for n in range(10)] + [(M, {"usageMetadata": {"totalTokenCount": 3}})],
        [(M, gemini([{"text": "!"}], "STOP"))],
    ),
}


@pytest.mark.parametrize("name", list(STREAM_TAILS))
def test_events_after_content_are_not_parsed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The events of a stream between its first content and its end are not parsed, in every format:
    only those up to the first content and the terminal ones are."""
    from asgi_lifetime.gateway import _sse

    parsed: list[str] = []
    real = _sse._payload

    def counting(data: str) -> Any:
        parsed.append(data)
        return real(data)

    monkeypatch.setattr(_sse, "_payload", counting)
    middle, end = STREAM_TAILS[name]
    tracker = SSETracker()
    tracker.feed(CONTENT_PREFIXES[name])
    before = len(parsed)
    tracker.feed(frames(*middle))
    assert len(parsed) == before, "an event that cannot end the stream was parsed"
    tracker.feed(frames(*end))
    assert not tracker.starved and tracker.saw_terminal
    reference = SSETracker(keep_text=True)
    reference.feed(CONTENT_PREFIXES[name] + frames(*middle) + frames(*end))
    assert _verdict(tracker) == _verdict(reference)
