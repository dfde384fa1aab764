from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_lifetime import _fingerprint, _json
from asgi_lifetime._fingerprint import UNPARSED, Fingerprint, fingerprint, text_comparable, wire_hash


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def pattern(length: int) -> bytes:
    """The official BLAKE3 test-vector input: 0, 1, ..., 250, 0, 1, ... repeated."""
    return bytes(i % 251 for i in range(length))


# ---------------------------------------------------------------------------------------------
# wire_hash


# From BLAKE3-team/BLAKE3 test_vectors/test_vectors.json: the first 32 bytes of the "hash"
# extended output for each input_len.
OFFICIAL_VECTORS = [
    (0, "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"),
    (1, "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213"),
    (1023, "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11"),
    (1024, "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7"),
    (1025, "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444"),
    (2048, "e776b6028c7cd22a4d0ba182a8bf62205d2ef576467e838ed6f2529b85fba24a"),
    (4097, "9b4052b38f1c5fc8b1f9ff7ac7b27cd242487b3d890d15c96a1c25b8aa0fb995"),
    (8193, "bab6c09cb8ce8cf459261398d2e7aef35700bf488116ceb94a36d0f5f1b7bc3b"),
    (102400, "bc3e3d41a1146b069abffad3c0d44860cf664390afce4d9661f7902e7943e085"),
]


@pytest.mark.parametrize(("length", "expected"), OFFICIAL_VECTORS, ids=[f"len{n}" for n, _ in OFFICIAL_VECTORS])
def test_wire_hash_official_vectors(length: int, expected: str) -> None:
    assert wire_hash(pattern(length)) == expected


def test_wire_hash_abc() -> None:
    # Not in the official file, but the value every independent BLAKE3 implementation quotes.
    assert wire_hash(b"abc") == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"


def test_wire_hash_multithreaded_matches_single_threaded() -> None:
    raw = pattern(_fingerprint._MULTITHREAD_THRESHOLD + 12345)
    single = blake3(raw).hexdigest()
    assert blake3(raw, max_threads=blake3.AUTO).hexdigest() == single
    assert wire_hash(raw) == single
    incremental = blake3()
    for start in range(0, len(raw), 65536):
        incremental.update(raw[start : start + 65536])
    assert incremental.hexdigest() == single


def test_wire_hash_uses_threads_only_above_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def spy(data: bytes, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return blake3(data, **kwargs)

    monkeypatch.setattr(_fingerprint, "blake3", spy)
    monkeypatch.setattr(_fingerprint, "_MULTITHREAD_THRESHOLD", 100)
    spy.AUTO = blake3.AUTO  # type: ignore[attr-defined]
    wire_hash(b"x" * 99)
    wire_hash(b"x" * 100)
    assert calls == [{}, {"max_threads": blake3.AUTO}]


# ---------------------------------------------------------------------------------------------
# The verdict corpus: real-shaped bodies, as bytes, through fingerprint(raw).text_comparable

OPENAI_TOOL_CALL = {
    "id": "call_abc123",
    "type": "function",
    "function": {"name": "render", "arguments": '{"type": "image", "url": "https://example.com/a.png"}'},
}

CORPUS = [
    # OpenAI chat completions
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hi."},
                ],
            }
        ),
        True,
        id="openai-chat-text",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}],
                    }
                ],
            }
        ),
        True,
        id="openai-chat-multipart-text",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this image?"},
                            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "low"}},
                        ],
                    }
                ],
            }
        ),
        False,
        id="openai-chat-image_url",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o-audio-preview",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
                    }
                ],
            }
        ),
        False,
        id="openai-chat-input_audio",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "file",
                                "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,"},
                            },
                            {"type": "text", "text": "Summarize."},
                        ],
                    }
                ],
            }
        ),
        False,
        id="openai-chat-file",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o-audio-preview",
                "messages": [
                    {"role": "user", "content": "Say hi"},
                    {"role": "assistant", "content": None, "audio": {"id": "audio_abc123"}},
                    {"role": "user", "content": "Again"},
                ],
            }
        ),
        False,
        id="openai-chat-assistant-audio",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello", "audio": None},
                ],
            }
        ),
        True,
        id="openai-chat-assistant-audio-null",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {"role": "user", "content": "Draw a cat"},
                    {"role": "assistant", "content": None, "tool_calls": [OPENAI_TOOL_CALL]},
                    {"role": "tool", "tool_call_id": "call_abc123", "content": '{"type": "image", "ok": true}'},
                    {"role": "assistant", "content": "Done."},
                ],
                "tools": [{"type": "function", "function": {"name": "render", "parameters": {"type": "object"}}}],
            }
        ),
        True,
        id="openai-chat-tool_calls-args-with-type-and-tool-result",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {"role": "user", "content": "Draw a cat"},
                    {"role": "assistant", "tool_calls": [OPENAI_TOOL_CALL]},
                ],
            }
        ),
        True,
        id="openai-chat-tool_calls-without-content-key",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4o",
                "messages": [
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "42"}]},
                ],
            }
        ),
        True,
        id="openai-chat-tool-result-parts",
    ),
    pytest.param(
        body({"model": "gpt-4o", "messages": [{"role": "assistant", "refusal": "I can't help with that."}]}),
        False,
        id="openai-chat-refusal-only",
    ),
    # Anthropic messages
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [{"role": "user", "content": "Hello, Claude"}],
            }
        ),
        True,
        id="anthropic-text",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "system": "You are a pirate.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Ahoy"}]}],
            }
        ),
        True,
        id="anthropic-system-string",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "system": [
                    {"type": "text", "text": "You are a pirate."},
                    {"type": "text", "text": "<long document>", "cache_control": {"type": "ephemeral"}},
                ],
                "messages": [{"role": "user", "content": "Ahoy"}],
            }
        ),
        True,
        id="anthropic-system-list-text-blocks",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "system": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iV"}}],
                "messages": [{"role": "user", "content": "Ahoy"}],
            }
        ),
        False,
        id="anthropic-system-list-with-image",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQSkZJRg=="},
                            },
                            {"type": "text", "text": "Describe this image."},
                        ],
                    }
                ],
            }
        ),
        False,
        id="anthropic-image",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
                            },
                            {"type": "text", "text": "Summarize."},
                        ],
                    }
                ],
            }
        ),
        False,
        id="anthropic-document",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [
                    {"role": "user", "content": "Show me a picture"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Rendering."},
                            {
                                "type": "tool_use",
                                "id": "toolu_01",
                                "name": "render",
                                "input": {"type": "image", "blocks": [{"type": "document"}]},
                            },
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "rendered"}],
                    },
                ],
            }
        ),
        True,
        id="anthropic-tool_use-input-with-type-and-tool_result",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_01",
                                "content": [{"type": "text", "text": "15 degrees"}],
                            }
                        ],
                    }
                ],
            }
        ),
        True,
        id="anthropic-tool_result-text-blocks",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_01",
                                "content": [
                                    {
                                        "type": "image",
                                        "source": {"type": "base64", "media_type": "image/png", "data": ""},
                                    }
                                ],
                            }
                        ],
                    }
                ],
            }
        ),
        False,
        id="anthropic-tool_result-with-image",
    ),
    pytest.param(
        body(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 2048,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [
                    {"role": "user", "content": "Why?"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "Let me think...", "signature": "EqQB"},
                            {"type": "text", "text": "Because."},
                        ],
                    },
                    {"role": "user", "content": "Why not?"},
                ],
            }
        ),
        False,
        id="anthropic-thinking",
    ),
    # OpenAI Responses
    pytest.param(body({"model": "gpt-4.1", "input": "Tell me a joke."}), True, id="responses-input-string"),
    pytest.param(
        body(
            {
                "model": "gpt-4.1",
                "instructions": "Be brief.",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                    {"role": "user", "content": "And?"},
                ],
            }
        ),
        True,
        id="responses-input_text-output_text",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4.1",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": "https://example.com/x.png"},
                        ],
                    }
                ],
            }
        ),
        False,
        id="responses-input_image",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4.1",
                "input": [
                    {"role": "user", "content": "Draw a cat"},
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "render",
                        "arguments": '{"type": "image"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": '{"type": "image", "ok": true}'},
                ],
            }
        ),
        True,
        id="responses-function_call-and-output",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4.1",
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"type": "image", "n": 1}},
                ],
            }
        ),
        True,
        id="responses-function_call-object-arguments-with-type",
    ),
    pytest.param(
        body(
            {
                "model": "gpt-4.1",
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "call_1",
                        "output": [{"type": "input_image", "image_url": "https://example.com/x.png"}],
                    }
                ],
            }
        ),
        False,
        id="responses-function_call_output-with-image",
    ),
    # Gemini
    pytest.param(
        body(
            {
                "contents": [
                    {"role": "user", "parts": [{"text": "Hello"}, {"text": "there"}]},
                    {"role": "model", "parts": [{"text": "Hi!"}]},
                ],
                "generationConfig": {"temperature": 0.2},
            }
        ),
        True,
        id="gemini-text-parts",
    ),
    pytest.param(
        body(
            {
                "contents": [
                    {
                        "role": "user",
                        "parts": [
                            {"text": "What is this?"},
                            {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
                        ],
                    }
                ]
            }
        ),
        False,
        id="gemini-inlineData",
    ),
    # Not conversations / not JSON
    pytest.param(b"this is not json", False, id="non-json"),
    pytest.param(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', False, id="invalid-utf8"),
    pytest.param(b'{"messages": [', False, id="truncated-json"),
    pytest.param(b"", False, id="empty-body"),
    pytest.param(b'[{"role": "user", "content": "hi"}]', False, id="json-array"),
    pytest.param(b"{}", False, id="empty-object"),
    pytest.param(b'"hello"', False, id="json-scalar-string"),
    pytest.param(b"42", False, id="json-scalar-number"),
    pytest.param(b"null", False, id="json-null"),
    pytest.param(body({"model": "gpt-4o", "prompt": "Once upon a time"}), False, id="legacy-completions-prompt"),
    pytest.param(body({"model": "gpt-4o", "messages": []}), True, id="empty-conversation"),
    pytest.param(body({"messages": [{"role": "user", "content": 42}]}), False, id="number-content"),
    pytest.param(body({"messages": [{"role": "user", "content": True}]}), False, id="boolean-content"),
    pytest.param(
        body({"messages": [{"role": "user", "content": [{"type": None, "text": "x"}]}]}), False, id="type-null"
    ),
    pytest.param(body({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}), False, id="type-unhashable"),
    pytest.param(
        b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b'"x"' + b"]" * 100_000 + b"}]}",
        False,  # too deep to parse: _json.loads fails, so not comparable
        id="deep-nesting-100000-lists",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), CORPUS)
def test_verdict_corpus(raw: bytes, expected: bool) -> None:
    fp = fingerprint(raw)
    assert fp.text_comparable is expected
    assert fp.size == len(raw)
    assert fp.wire_hash == blake3(raw).hexdigest()


@pytest.mark.parametrize(("raw", "expected"), CORPUS)
def test_verdict_independent_of_key_order(raw: bytes, expected: bool) -> None:
    try:
        parsed = _json.loads(raw)
    except _json.JSONDecodeFailure:
        return
    rng = random.Random(raw)
    assert text_comparable(_shuffled(parsed, rng)) is expected
    assert text_comparable(parsed) is expected


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# text_comparable on hostile or odd parsed values


def _nested_lists(depth: int, leaf: Any) -> list[Any]:
    node: list[Any] = [leaf]
    for _ in range(depth - 1):
        node = [node]
    return node


@pytest.mark.parametrize(("leaf", "expected"), [("x", True), (None, True), (1, False), ({"type": "image"}, False)])
def test_deeply_nested_parsed_value_does_not_recurse(leaf: Any, expected: bool) -> None:
    parsed = {"messages": [{"role": "user", "content": _nested_lists(100_000, leaf)}]}
    assert text_comparable(parsed) is expected


def test_deeply_nested_content_objects() -> None:
    node: dict[str, Any] = {"content": "leaf"}
    for _ in range(100_000):
        node = {"content": [node]}
    assert text_comparable({"messages": [node]}) is True


def test_cyclic_structure_terminates() -> None:
    loop: list[Any] = ["x"]
    loop.append(loop)
    assert text_comparable({"messages": loop}) is True


def test_shared_substructure_is_visited_once() -> None:
    # 2**60 leaves as a tree; fine because each container is visited once.
    node: list[Any] = ["x"]
    for _ in range(60):
        node = [node, node]
    assert text_comparable({"messages": node}) is True


@pytest.mark.parametrize(
    ("parsed", "expected"),
    [
        pytest.param({"input": "x", "contents": 1}, True, id="input-before-contents"),
        pytest.param({"messages": "x", "input": 1}, True, id="messages-before-input"),
        pytest.param({"messages": None}, True, id="messages-null"),
        pytest.param({"system": "only a system prompt"}, False, id="system-without-conversation"),
        pytest.param({"messages": [], "system": 7}, False, id="system-walked-too"),
        pytest.param({"messages": [{"content": "x", "output": 1}]}, True, id="content-before-output"),
        pytest.param({"messages": [{"output": "x", "parts": 1}]}, True, id="output-before-parts"),
        pytest.param({"messages": [{"parts": [{"text": "x"}], "text": 1}]}, True, id="parts-before-text"),
        pytest.param({"messages": [{"role": "user"}]}, False, id="no-content-no-text"),
        pytest.param({"messages": [{"text": 3}]}, False, id="text-not-string"),
        pytest.param({"messages": [{"tool_calls": {}}]}, False, id="tool_calls-not-list"),
        pytest.param({"messages": [{"type": "tool_use", "audio": "x"}]}, True, id="tool_use-is-opaque"),
        pytest.param({"messages": [{"type": "text", "text": "x", "audio": {"data": ""}}]}, False, id="audio-on-part"),
        pytest.param({"messages": [1.5]}, False, id="float-element"),
        pytest.param({"messages": [("tuple",)]}, False, id="non-json-python-value"),
    ],
)
def test_text_comparable_rules(parsed: Any, expected: bool) -> None:
    assert text_comparable(parsed) is expected


_KEYS = st.sampled_from(
    ["messages", "input", "contents", "system", "content", "output", "parts", "text", "tool_calls", "type", "audio"]
)
_TYPES = st.sampled_from(["text", "tool_use", "function_call", "image", "input_text", "message"])
_TEXT = st.text(st.characters(codec="utf-8"), max_size=3)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT | _TYPES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_KEYS | _TEXT, children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_never_raises_and_is_deterministic(parsed: Any) -> None:
    verdict = text_comparable(parsed)
    assert isinstance(verdict, bool)
    assert text_comparable(copy.deepcopy(parsed)) is verdict
    assert text_comparable(_shuffled(parsed, random.Random(0))) is verdict
    raw = _json.dumps(parsed)
    assert fingerprint(raw).text_comparable is verdict


# ---------------------------------------------------------------------------------------------
# fingerprint(): parity, caller-supplied parse and hash, the dataclass


def test_mutation_after_fingerprint_changes_nothing() -> None:
    raw = body({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    parsed = _json.loads(raw)
    before = fingerprint(raw, parsed=parsed)
    assert before == fingerprint(raw)
    assert before.text_comparable is True

    parsed["model"] = "gpt-4o-mini"
    parsed["messages"].append(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
    )
    assert text_comparable(parsed) is False  # the mutated body would have another verdict...
    assert before == Fingerprint(wire_hash=wire_hash(raw), text_comparable=True, size=len(raw))  # ...but fp is fixed
    assert before == fingerprint(raw)


def test_parity_with_own_parse_over_corpus() -> None:
    for param in CORPUS:
        raw = param.values[0]
        assert isinstance(raw, bytes)
        try:
            parsed = _json.loads(raw)
        except _json.JSONDecodeFailure:
            continue
        assert fingerprint(raw, parsed=parsed) == fingerprint(raw)


def test_supplied_parse_is_used_without_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(raw: bytes) -> Any:
        raise AssertionError("fingerprint parsed the body again")

    monkeypatch.setattr(_json, "loads", fail)
    raw = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert fingerprint(raw, parsed={"messages": [{"role": "user", "content": "hi"}]}).text_comparable is True
    # The supplied parse is authoritative, including JSON null and values that disagree with raw.
    assert fingerprint(raw, parsed=None).text_comparable is False
    assert fingerprint(b"not json", parsed={"input": "x"}).text_comparable is True
    with pytest.raises(AssertionError, match="parsed the body again"):
        fingerprint(raw)  # the patch is live: without parsed=, fingerprint does parse


def test_unparsed_sentinel_means_parse_here() -> None:
    raw = b'{"input": "x"}'
    assert fingerprint(raw, parsed=UNPARSED) == fingerprint(raw)
    assert repr(UNPARSED) == "UNPARSED"


def test_supplied_wire_hash_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = b'{"input": "x"}'
    hasher = blake3()
    hasher.update(raw[:5])
    hasher.update(raw[5:])
    h = hasher.hexdigest()

    def fail(data: bytes, **kwargs: Any) -> Any:
        raise AssertionError("fingerprint hashed the body again")

    monkeypatch.setattr(_fingerprint, "blake3", fail)
    with pytest.raises(AssertionError, match="hashed the body again"):
        fingerprint(raw)
    assert fingerprint(raw, wire_hash=h).wire_hash == h
    # Trusted as given: a caller's digest of the wire bytes is not recomputed.
    other = "0" * 64
    assert fingerprint(raw, wire_hash=other).wire_hash == other


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65])
def test_malformed_wire_hash_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="wire_hash"):
        fingerprint(b"{}", wire_hash=bad)


def test_fingerprint_is_frozen_and_slotted() -> None:
    fp = fingerprint(b'{"input": "x"}')
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp.text_comparable = False  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        fp.extra = 1  # type: ignore[attr-defined]
    assert not hasattr(fp, "__dict__")
    assert Fingerprint.__slots__ == ("wire_hash", "text_comparable", "size")
    assert hash(fp) == hash(fingerprint(b'{"input": "x"}'))


@pytest.mark.parametrize("raw", [b"", b"{}", b"x" * 1000, "é".encode() * 10, pattern(70_000)])
def test_size_is_len_raw(raw: bytes) -> None:
    assert fingerprint(raw).size == len(raw)


def test_exports() -> None:
    assert sorted(_fingerprint.__all__) == _fingerprint.__all__
    for name in _fingerprint.__all__:
        assert hasattr(_fingerprint, name)
