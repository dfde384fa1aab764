"""A message spliced into a large received body without copying it (``Spliced``).

A ``@without_parse`` preparer's messages go into the received bytes where the conversation array
is. Above one send slice the outbound body is a ``Spliced`` body: views into the received bytes and
the serialized additions, sent (and written to disk) part by part. Joining them cost one copy of the
body, as much time as reading it (64 MiB: a third of the gateway's time to first byte) and twice the
body at once. Checked here: ``Spliced`` reads and compares as the bytes it stands for; ``prepare``
allocates none of the body; the gateway sends it whole, re-issues it from memory with the same
bytes, and refolds or renames roles from it (the one reader that joins it).
"""

from __future__ import annotations

import array
import json
import tracemalloc
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_lifetime import MiB
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._lazy import DeferredParse, shape
from asgi_lifetime._resources import RequestResources
from asgi_lifetime.gateway import Spliced
from asgi_lifetime.gateway._prepare import prepare
from asgi_lifetime.gateway._spill import SLICE

from .._asgi import Connection
from .test_spill import (
    ANSWER,
    BODY,
    PREPARERS,
    SSE,
    Answer,
    Recording,
    assert_sent_as,
    in_process,
    requesting,
    until,
)

PATH = "/v1/chat/completions"


def joined(parts: list[bytes]) -> bytes:
    return b"".join(parts)


@st.composite
def spliced_parts(draw: st.DrawFn) -> list[bytes | memoryview]:
    """Parts as ``_splice`` makes them: some are views into a larger buffer, some are bytes, some empty."""
    parts: list[bytes | memoryview] = []
    for data in draw(st.lists(st.binary(max_size=40), max_size=8)):
        if draw(st.booleans()):
            padded = b"<" + data + b">"
            parts.append(memoryview(padded)[1:-1])
        else:
            parts.append(data)
    return parts


@settings(max_examples=300, deadline=None)
@given(parts=spliced_parts(), offset=st.integers(0, 400), size=st.integers(0, 400))
def test_spliced_reads_as_the_bytes_it_stands_for(parts: list[bytes | memoryview], offset: int, size: int) -> None:
    whole = b"".join(parts)
    body = Spliced(parts)
    assert len(body) == len(whole) and bytes(body) == whole
    assert body.read(offset, size) == whole[offset : offset + size]
    assert isinstance(body.read(offset, size), bytes)


@settings(max_examples=300, deadline=None)
@given(parts=spliced_parts(), other=st.binary(max_size=80), flip=st.integers(0, 400))
def test_spliced_compares_as_the_bytes_it_stands_for(parts: list[bytes | memoryview], other: bytes, flip: int) -> None:
    whole = b"".join(parts)
    body = Spliced(parts)
    for same in (whole, bytearray(whole), memoryview(whole), Spliced([whole])):
        assert body == same and same == body
    assert (body == other) == (whole == other) and (other == body) == (whole == other)
    if whole:
        changed = bytearray(whole)
        changed[flip % len(whole)] ^= 1
        assert body != bytes(changed)
    assert body != whole + b"x" and body != "text"


def test_a_view_of_another_format_counts_its_bytes() -> None:
    words = array.array("I", [1, 2, 3])  # 3 items, 12 bytes
    body = Spliced([b"[", memoryview(words), b"]"])
    assert len(body) == 14 and bytes(body) == b"[" + words.tobytes() + b"]"
    assert body.read(1, 12) == words.tobytes()


def test_spliced_is_not_hashable() -> None:
    # Equal to bytes that hash otherwise: a set or dict key would break its contract.
    with pytest.raises(TypeError):
        hash(Spliced([b"a"]))


def large_conversation(size: int) -> bytes:
    turn = "word " * 2000
    messages = [
        {"role": "user" if n % 2 == 0 else "assistant", "content": f"{n} {turn}"} for n in range(size // 10_000)
    ]
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


@pytest.mark.anyio
async def test_prepare_splices_a_large_body_without_a_copy() -> None:
    raw = large_conversation(4 * MiB)
    expected = json.loads(raw)
    expected["messages"].insert(0, {"role": "system", "content": "spliced"})
    fp = fingerprint(raw)
    found = shape(raw)
    assert found is not None

    async def charge(total: int) -> None:
        pass

    async with RequestResources() as resources:
        tracemalloc.start()
        try:
            prepared = await prepare(
                raw,
                DeferredParse(found, charge),
                preparers=PREPARERS["spliced"],
                fingerprint=fp,
                session_id=None,
                method="POST",
                path=PATH,
                headers=[],
                resources=resources,
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Before: the joined body, one copy of the received bytes (4 MiB) in the trace.
        assert peak < len(raw) // 8, peak
        body = prepared.body
        assert isinstance(body, Spliced)
        assert len(body) > SLICE and json.loads(bytes(body)) == expected
        assert body.parts[0].obj is raw  # type: ignore[union-attr]  # a view of the received bytes


@pytest.mark.anyio
async def test_a_spliced_body_is_reissued_from_memory_with_the_same_bytes(tmp_path: Any) -> None:
    first = Answer(None, b"")  # ends with no event: starved, re-issued from the retained body
    upstream = Recording([first, Answer(None, ANSWER)])
    client = Connection(BODY)
    async with in_process(upstream, tmp_path, change="spliced", retain_outbound="memory") as app:
        async with requesting(app, client):
            await until(lambda: len(upstream.bodies) == 2)
            await client.ended.wait()
            client.hang_up.set()
        assert app.state.lifetime.stats().idle
    assert upstream.bodies[0] == upstream.bodies[1]
    assert_sent_as("spliced", upstream.bodies[0])
    assert bytes(client.received) == ANSWER


@pytest.mark.anyio
@pytest.mark.parametrize("rejection", ["overflow", "role"])
async def test_a_spliced_body_is_refolded_or_renamed_from_its_parts(rejection: str, tmp_path: Any) -> None:
    bodies: list[bytes] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        bodies.append(await request.aread())
        if len(bodies) > 1:
            return httpx.Response(200, headers=SSE, content=ANSWER)
        if rejection == "overflow":
            message = "This model's maximum context length is 4096 tokens. However, you requested more."
            error = {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}
        else:
            error = {"message": "Unexpected role 'system'", "type": "invalid_request_error"}
        return httpx.Response(400, json={"error": error})

    client = Connection(BODY)
    async with in_process(httpx.MockTransport(upstream), tmp_path, change="spliced", max_attempts=2) as app:
        async with requesting(app, client):
            await client.ended.wait()
            client.hang_up.set()
        assert app.state.lifetime.stats().idle
    assert client.status == 200 and bytes(client.received) == ANSWER
    assert len(bodies) == 2
    assert_sent_as("spliced", bodies[0])
    sent, again = json.loads(bodies[0]), json.loads(bodies[1])
    if rejection == "overflow":
        assert len(bodies[1]) < len(bodies[0]) and again["messages"][0] == sent["messages"][0]
    else:
        assert again["messages"][0]["role"] != "system"
        assert again["messages"][0]["content"] == "spliced" and again["messages"][1:] == sent["messages"][1:]
