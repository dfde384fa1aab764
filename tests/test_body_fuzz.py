"""Property test of decoding: random gzip / zlib / raw-deflate streams, random trailing data,
random chunking and random truncation. ``read_body`` always terminates, with the right body or
a clear error (``MalformedBody`` code ``malformed_encoding``, or ``BodyTooLarge``), and never
holds more than its limits allow.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message

from asgi_lifetime._body import read_body
from asgi_lifetime._exceptions import BodyTooLarge, MalformedBody

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KINDS = {
    "gzip": ("gzip", 16 + zlib.MAX_WBITS),
    "zlib": ("deflate", zlib.MAX_WBITS),
    "raw": ("deflate", -zlib.MAX_WBITS),
}


def compress(data: bytes, wbits: int, level: int) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, wbits)
    return compressor.compress(data) + compressor.flush()


@dataclass
class Case:
    encoding: str
    wire: bytes
    max_bytes: int
    expected: bytes | None  # None: the stream is invalid (truncated or followed by other data)
    chunks: list[bytes]


def reference(wire: bytes, encoding: str) -> bytes | None:
    """One-shot zlib as the oracle: the body, or None if the wire is not exactly one stream (or
    for gzip, a series of members). Raw vs zlib deflate is told by the header, as documented."""
    if not wire:
        return b""  # an empty body with a Content-Encoding is empty
    out: list[bytes] = []
    data = wire
    while True:
        if encoding == "gzip":
            wbits = 16 + zlib.MAX_WBITS
        else:
            wbits = zlib.MAX_WBITS if data[0] & 0x0F == 8 and data[0] >> 4 <= 7 else -zlib.MAX_WBITS
        decompressor = zlib.decompressobj(wbits)
        try:
            out.append(decompressor.decompress(data))
        except zlib.error:
            return None
        if not decompressor.eof:
            return None
        data = decompressor.unused_data
        if not data:
            return b"".join(out)
        if encoding != "gzip" or data[0] != 0x1F:
            return None


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(sorted(KINDS)))
    encoding, wbits = KINDS[kind]
    # Compressible data, some of it decoding far past one 256 KiB inflate step.
    contents = draw(
        st.lists(
            st.builds(lambda unit, times: unit * times, st.binary(min_size=1, max_size=32), st.integers(0, 40_000)),
            min_size=1,
            max_size=3 if kind == "gzip" else 1,  # only gzip allows several members
        )
    )
    level = draw(st.sampled_from([0, 1, 6, 9]))
    wire = b"".join(compress(content, wbits, level) for content in contents)
    assert reference(wire, encoding) == b"".join(contents)
    how = draw(st.sampled_from(["intact", "trailing", "truncated", "both"]))
    if how in ("truncated", "both"):
        wire = wire[: draw(st.integers(0, len(wire)))]
    if how in ("trailing", "both") and wire:
        wire += draw(
            st.binary(min_size=1, max_size=64)
            | st.sampled_from([bytes(300 * 1024), b"\x1f\x8b\x08\x00", b"\x1f", zlib.compress(b"x")])
        )
    expected = reference(wire, encoding)
    max_bytes = draw(st.sampled_from([len(b"".join(contents)), 2 * 1024 * 1024, 100 * 1024]))
    max_bytes = max(max_bytes, len(wire))  # the wire limit is not what this test is about
    sizes = draw(st.lists(st.integers(1, 70_000), min_size=1, max_size=20))
    chunks: list[bytes] = []
    offset = index = 0
    while offset < len(wire):
        size = sizes[index % len(sizes)]
        chunks.append(wire[offset : offset + size])
        offset += size
        index += 1
    return Case(encoding=encoding, wire=wire, max_bytes=max_bytes, expected=expected, chunks=chunks)


class Script:
    def __init__(self, chunks: list[bytes]) -> None:
        self.messages: list[Message] = [
            {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
            for index, chunk in enumerate(chunks)
        ] or [{"type": "http.request", "body": b"", "more_body": False}]
        self.calls = 0

    async def __call__(self) -> Message:
        assert self.calls < len(self.messages), "read past the end of the body"
        self.calls += 1
        return self.messages[self.calls - 1]


@pytest.mark.anyio
@FUZZ
@given(case=cases())
async def test_decoding_always_ends_with_the_body_or_a_clear_error(case: Case) -> None:
    reserved: list[int] = []

    async def reserve(total: int) -> None:
        reserved.append(total)

    with anyio.fail_after(30):
        try:
            body = await read_body(
                Script(case.chunks), max_bytes=case.max_bytes, content_encoding=case.encoding, on_progress=reserve
            )
        except BodyTooLarge:
            assert case.expected is None or len(case.expected) > case.max_bytes
        except MalformedBody as exc:
            assert exc.code == "malformed_encoding", exc.code
            assert case.expected is None, "a valid stream was refused"
        else:
            assert case.expected is not None, "an invalid stream was accepted"
            assert body == case.expected
            assert len(body) <= case.max_bytes
    assert all(total <= case.max_bytes for total in reserved)


def test_the_oracle_agrees_with_gzip() -> None:
    """The oracle's notion of a valid series of members is the gzip module's; trailing junk is not valid."""
    wire = gzip.compress(b"a", mtime=0) + gzip.compress(b"", mtime=0) + gzip.compress(b"bc", mtime=0)
    assert gzip.decompress(wire) == reference(wire, "gzip") == b"abc"
    assert reference(wire + b"junk", "gzip") is None
    assert reference(wire[:-1], "gzip") is None
    assert reference(zlib.compress(b"a") + b"\x00", "deflate") is None
