"""Property-based tests (hypothesis) of the body reader and the text-comparability verdict.

``read_body`` against arbitrary ASGI message scripts: any chunking (empty chunks included,
``body`` / ``more_body`` keys left out) reassembles the body exactly; nothing after the
message with ``more_body=False`` is ever read; an ``http.disconnect`` anywhere before the end
raises ``BodyAborted`` and an unexpected message type ``MalformedBody``; a wrong
Content-Length or a body over the limit is refused; gzip split anywhere decodes back.

``text_comparable`` on arbitrary JSON: never raises, is deterministic and does not depend
on key order; plain-text conversations are comparable and one media part anywhere makes
them not.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from starlette.types import Message

from asgi_lifetime._body import read_body
from asgi_lifetime._exceptions import BodyAborted, BodyTooLarge, MalformedBody
from asgi_lifetime._fingerprint import fingerprint, text_comparable

# Modest and without deadlines: these run on two backends inside a time-bounded suite.
FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MANY = settings(max_examples=200, deadline=None)

LIMIT = 1 << 20
BODIES = st.binary(max_size=4096)
# What a client (or a confused server) might send after the end of the body: never to be read.
AFTER_END: list[Message] = [
    {"type": "http.request", "body": b"NOT PART OF THE BODY", "more_body": False},
    {"type": "http.disconnect"},
]


# --- read_body -------------------------------------------------------------------------------------


@dataclass
class Script:
    """A scripted ASGI ``receive``; counts the calls so a test can see where reading stopped."""

    messages: list[Message]
    calls: int = 0
    extra: list[Message] = field(default_factory=lambda: list(AFTER_END))

    async def __call__(self) -> Message:
        self.calls += 1
        script = self.messages + self.extra
        assert self.calls <= len(script), "read past every message there is"
        return dict(script[self.calls - 1])


@st.composite
def chunked(draw: st.DrawFn, data: st.SearchStrategy[bytes] = BODIES) -> tuple[bytes, list[Message]]:
    """A body and ``http.request`` messages carrying it: cut anywhere, with empty messages mixed in,
    and ``body`` / ``more_body`` left out where the ASGI defaults (b"", False) allow."""
    body = draw(data)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=8)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    messages: list[Message] = []
    for piece in pieces:
        for _ in range(draw(st.integers(0, 2))):
            messages.append({"type": "http.request", "body": b"", "more_body": True})
        message: Message = {"type": "http.request", "more_body": True}
        if piece or draw(st.booleans()):
            message["body"] = piece
        messages.append(message)
    last = messages[-1]
    if draw(st.booleans()):
        last["more_body"] = False
    else:
        del last["more_body"]
    return body, messages


@pytest.mark.anyio
@FEW
@given(script=chunked(), declare=st.booleans(), hashed=st.booleans())
async def test_any_chunking_reassembles_the_body(
    script: tuple[bytes, list[Message]], declare: bool, hashed: bool
) -> None:
    body, messages = script
    receive = Script(messages)
    hasher = blake3() if hashed else None
    result = await read_body(receive, max_bytes=LIMIT, expected_length=len(body) if declare else None, hasher=hasher)
    assert result == body
    assert receive.calls == len(messages)  # nothing after more_body=False was read
    if hasher is not None:
        assert hasher.hexdigest() == blake3(body).hexdigest()


@pytest.mark.anyio
@FEW
@given(script=chunked(), data=st.data())
async def test_disconnect_anywhere_before_the_end_aborts(
    script: tuple[bytes, list[Message]], data: st.DataObject
) -> None:
    _, messages = script
    at = data.draw(st.integers(0, len(messages) - 1), label="disconnect before message")
    receive = Script([*messages[:at], {"type": "http.disconnect"}, *messages[at:]])
    with pytest.raises(BodyAborted):
        await read_body(receive, max_bytes=LIMIT)
    assert receive.calls == at + 1


@pytest.mark.anyio
@FEW
@given(
    script=chunked(),
    data=st.data(),
    kind=st.sampled_from(["http.response.start", "http.response.body", "lifespan.startup", "websocket.connect", ""]),
)
async def test_unexpected_message_anywhere_is_malformed(
    script: tuple[bytes, list[Message]], data: st.DataObject, kind: str
) -> None:
    _, messages = script
    at = data.draw(st.integers(0, len(messages) - 1), label="unexpected message before message")
    receive = Script([*messages[:at], {"type": kind, "body": b"x"}, *messages[at:]])
    with pytest.raises(MalformedBody) as caught:
        await read_body(receive, max_bytes=LIMIT)
    assert caught.value.code == "unexpected_message"
    assert receive.calls == at + 1


@pytest.mark.anyio
@FEW
@given(script=chunked(), delta=st.integers(-100, 100).filter(bool))
async def test_wrong_content_length_is_refused(script: tuple[bytes, list[Message]], delta: int) -> None:
    body, messages = script
    declared = len(body) + delta
    assume(declared >= 0)
    with pytest.raises(MalformedBody) as caught:
        await read_body(Script(messages), max_bytes=LIMIT, expected_length=declared)
    assert caught.value.code == "content_length_mismatch"


@pytest.mark.anyio
@FEW
@given(script=chunked(), limit=st.integers(0, 5000))
async def test_the_limit_holds_for_any_chunking(script: tuple[bytes, list[Message]], limit: int) -> None:
    body, messages = script
    if len(body) > limit:
        with pytest.raises(BodyTooLarge):
            await read_body(Script(messages), max_bytes=limit)
    else:
        assert await read_body(Script(messages), max_bytes=limit) == body


@st.composite
def gzipped(draw: st.DrawFn) -> tuple[bytes, list[Message]]:
    original = draw(st.binary(max_size=4096) | st.text(max_size=2000).map(str.encode))
    _, messages = draw(chunked(st.just(gzip.compress(original, mtime=0))))
    return original, messages


@pytest.mark.anyio
@FEW
@given(script=gzipped())
async def test_gzip_split_anywhere_decodes(script: tuple[bytes, list[Message]]) -> None:
    original, messages = script
    receive = Script(messages)
    assert await read_body(receive, max_bytes=LIMIT, content_encoding="gzip") == original
    assert receive.calls == len(messages)


# --- text_comparable -------------------------------------------------------------------------------

_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
_KEYS = st.sampled_from(
    ["messages", "input", "contents", "system", "content", "output", "parts", "text", "tool_calls", "type", "audio"]
) | st.text(max_size=5)
_TYPE_VALUES = st.sampled_from(["text", "image", "image_url", "tool_use", "tool_result", "input_text", "thinking"])
ANY_JSON = st.recursive(
    _LEAVES | _TYPE_VALUES,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(_KEYS, children, max_size=5),
    max_leaves=40,
)


def reorder(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: reorder(item, rng) for key, item in items}
    if isinstance(value, list):
        return [reorder(item, rng) for item in value]
    return value


@MANY
@given(value=ANY_JSON, rng=st.randoms(use_true_random=False))
def test_verdict_never_raises_is_deterministic_and_ignores_key_order(value: Any, rng: random.Random) -> None:
    verdict = text_comparable(value)
    assert isinstance(verdict, bool)
    assert text_comparable(value) is verdict
    assert text_comparable(copy.deepcopy(value)) is verdict
    assert text_comparable(reorder(value, rng)) is verdict
    assert text_comparable({"messages": value}) is text_comparable({"messages": reorder(value, rng)})
    raw = json.dumps(reorder(value, rng)).encode()
    assert fingerprint(raw).text_comparable is verdict


@MANY
@given(raw=st.binary(max_size=512))
def test_fingerprint_never_raises_on_any_bytes(raw: bytes) -> None:
    fp = fingerprint(raw)
    assert fp.size == len(raw) and len(fp.wire_hash) == 64
    assert isinstance(fp.text_comparable, bool)


_TEXT_PART = st.builds(lambda text: {"type": "text", "text": text}, st.text(max_size=20))
_CONTENT = st.none() | st.text(max_size=20) | st.lists(_TEXT_PART, max_size=3)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]), "content": _CONTENT}
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, max_size=6)},
    optional={"model": st.text(max_size=10), "stream": st.booleans(), "temperature": st.floats(0, 2)},
)
MEDIA = st.sampled_from(
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
    ]
)


@MANY
@given(body=CHAT, rng=st.randoms(use_true_random=False))
def test_plain_text_conversations_are_comparable(body: dict[str, Any], rng: random.Random) -> None:
    assert text_comparable(body) is True
    assert text_comparable(reorder(body, rng)) is True


@MANY
@given(body=CHAT.filter(lambda b: b["messages"]), media=MEDIA, data=st.data())
def test_one_media_part_anywhere_makes_it_not_comparable(
    body: dict[str, Any], media: dict[str, Any], data: st.DataObject
) -> None:
    message = data.draw(st.sampled_from(body["messages"]), label="message given the media part")
    content = message["content"]
    parts = content if isinstance(content, list) else ([] if content is None else [{"type": "text", "text": content}])
    at = data.draw(st.integers(0, len(parts)), label="position")
    message["content"] = [*parts[:at], media, *parts[at:]]
    assert text_comparable(body) is False


def test_verdict_on_deep_and_cyclic_structures_terminates() -> None:
    deep: Any = "leaf"
    for _ in range(200_000):
        deep = [deep]
    assert text_comparable({"messages": deep}) is True  # a walk that recursed would have overflowed
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    assert text_comparable({"messages": cyclic}) is True
    node: dict[str, Any] = {"type": "text", "text": "x"}
    node["content"] = node
    assert isinstance(text_comparable({"messages": [node]}), bool)
