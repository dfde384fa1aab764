"""Keep-alives in a stream that carries ``id`` fields, attacked by a hostile upstream, end to end; the
parser's in-memory width of a line.

The gateway (``create_app``) under uvicorn and hypercorn in front of a raw-socket upstream. The client's
bytes are read as the openai SDK reads them (its ``SSEDecoder``, that dispatches an event at every blank
line once it holds a last event id): the events must be the upstream's, none empty and none added.

Found here: a keep-alive between an upstream's \r and its \n (a CRLF split between reads) made the \n an
empty line, an empty event for the SDK (JSONDecodeError); an ``id`` line too large for the guard's parser
left the keep-alives with their blank line; ``max(text)`` per non-ASCII line cost ~10x the line's decode.
"""

from __future__ import annotations

import threading

import anyio
import pytest
from openai._streaming import SSEDecoder

from asgi_lifetime.gateway._sse import SSEParser, _width

from ..gateway._raw_upstream import raw_upstream
from .test_attack_sse_fast_path import (
    CHAT_END,
    CHAT_FIRST,
    CHAT_MORE,
    END_OF_BODY,
    SERVERS,
    _after,
    _chunked,
    _fetch,
    _scripted,
    _Watching,
    gateway,
    openai_chat,
)
from .test_attack_upstream import SSE_HEAD, chunk
from .test_faults import assert_idle


def sdk_events(body: bytes) -> list[tuple[str | None, str, str | None]]:
    """The events the openai SDK's decoder reads from ``body``: (event, data, id)."""
    return [(sse.event, sse.data, sse.id) for sse in SSEDecoder().iter_bytes(iter([body]))]


def crlf(event: bytes) -> bytes:
    return event.replace(b"\n", b"\r\n")


# -- a keep-alive after a lone \r ------------------------------------------------------------------------

# An upstream with CRLF line ends whose event's last CRLF is split between two reads: the relay releases
# the event at its \r (a whole event), a keep-alive goes while the upstream is silent, then the upstream's
# \n arrives. The client's line ended at the \r; after the keep-alive's line that \n is an empty line of
# its own. Without an id it dispatches nothing; once the client holds an id it is an empty event.
FIRST = crlf(b"id: 1\n" + CHAT_FIRST)  # ends \r\n\r\n
REST = _chunked([b"\n", crlf(CHAT_MORE), crlf(CHAT_END)]) + END_OF_BODY


def _after_cr(got: bytes) -> bool:
    """A keep-alive came after the first event's final \\r."""
    return b": keep-alive" in got.partition(FIRST[:-1])[2]


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
async def test_a_keepalive_after_a_lone_cr_adds_no_event(server: str) -> None:
    go = threading.Event()
    with (
        raw_upstream(_scripted(SSE_HEAD, chunk(FIRST[:-1]), _after(go, REST))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        status, got = await _fetch(url, on_piece=lambda body: go.set() if _after_cr(body) else None)
        await assert_idle(app, url)
    assert status == 200 and _after_cr(got)
    sent = FIRST + crlf(CHAT_MORE + CHAT_END)
    assert sdk_events(got) == sdk_events(sent)
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("server", SERVERS)
def test_the_openai_sdk_reads_a_crlf_stream_with_ids_through_a_keepalive_after_a_cr(server: str) -> None:
    go = threading.Event()

    def seen(body: bytes) -> None:
        if _after_cr(body):
            go.set()

    with (
        raw_upstream(_scripted(SSE_HEAD, chunk(FIRST[:-1]), _after(go, REST))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        text, _ = openai_chat(url, transport=_Watching(seen))
        anyio.run(assert_idle, app, url)
    assert text == "Hello"
    assert len(upstream.requests) == 1


# -- an id field the guard's parser does not keep ---------------------------------------------------------

# The guard's parser ignores a field line over its limit, in bytes on the wire or in memory (one character
# past Latin-1 makes every character of the line take 2 bytes): an ``id`` line so is relayed, and the
# client keeps it. The keep-alive must still be a comment line only.
WIDE_ID = "id: " + "a" * (600 * 1024) + "\u20ac"  # 600 KiB on the wire, 1.2 MiB in memory
LONG_ID = "id: " + "a" * (1024 * 1024 + 1)  # over the limit on the wire
IDS = {"wide": WIDE_ID.encode(), "long": LONG_ID.encode()}


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("name", list(IDS))
async def test_an_id_too_large_for_the_guard_still_makes_keepalives_comment_lines(server: str, name: str) -> None:
    go = threading.Event()
    first = IDS[name] + b"\n" + CHAT_FIRST

    def on_piece(body: bytes) -> None:
        if b": keep-alive" in body[len(first) - 2 :]:
            go.set()  # a keep-alive came after the event with the id: the upstream goes on

    rest = _chunked([CHAT_MORE, CHAT_END]) + END_OF_BODY
    with (
        raw_upstream(_scripted(SSE_HEAD, chunk(first), _after(go, rest))) as upstream,
        gateway(upstream.url, server, keepalive_interval=0.05, stall_timeout=10.0) as (url, app),
    ):
        status, got = await _fetch(url, on_piece=on_piece)
        await assert_idle(app, url)
    assert status == 200 and b": keep-alive\n" in got[len(first) :]
    assert sdk_events(got) == sdk_events(first + CHAT_MORE + CHAT_END)
    assert len(upstream.requests) == 1


def test_the_guard_parser_notes_an_id_too_large_to_keep() -> None:
    for line in (WIDE_ID, LONG_ID):
        parser = SSEParser()
        assert not parser.carried_id
        parser.feed(line.encode() + b"\n")
        assert parser.last_event_id is None and parser.carried_id  # not kept, but the client holds one


# -- the in-memory width of a line, read off the str's size ----------------------------------------------

# ``_width`` reads CPython's bytes a character from the str's size (``max(text)`` walked every character:
# ~1.7 ms for a 20,000-character CJK line against 0.09 ms now, on every line of a non-English stream).


def _scanned(text: str) -> int:
    widest = ord(max(text)) if text else 0
    return 1 if widest < 0x100 else 2 if widest < 0x10000 else 4


WIDTH_CASES = [
    "data: h\u00e9llo",
    "\u00ff" * 2,
    "data: " + "\u4f60" * 20000,
    "data: " + "a" * 60000 + "\U0001f600",
    "\U0010ffff" * 3,
    "\u0100\u00e9",
    b"data: ab\xff\xfe".decode("utf-8", "replace"),  # U+FFFD: 2 bytes a character
    "data: \ud800x".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
]


@pytest.mark.parametrize("text", WIDTH_CASES, ids=range(len(WIDTH_CASES)))
def test_the_width_read_off_the_str_is_the_widest_characters(text: str) -> None:
    assert _width(text) == _scanned(text)
    assert _width(text[1:] + "\u00e9") == _scanned(text[1:] + "\u00e9")


@pytest.mark.parametrize("width", [2, 4])
def test_a_data_line_at_exactly_the_limit_in_memory_is_kept_one_more_is_not(width: int) -> None:
    wide = "\u0100" if width == 2 else "\U0001f600"
    limit = 4096
    for extra, oversized in ((0, False), (1, True)):
        text = "data: " + "a" * (limit // width - 7 + extra) + wide  # the whole line's characters x width
        events = SSEParser(limit=limit).feed(text.encode() + b"\n\n")
        assert [event.oversized for event in events] == [oversized]
        assert events[0].data == ("" if oversized else text[6:])
