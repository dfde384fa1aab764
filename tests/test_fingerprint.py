from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import random
from collections.abc import Iterator
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
# text_comparable against the reference: the walk before it was split for complexity (radon
# scored it 26), kept verbatim. The data tables (conversation keys, text and opaque types) are
# the module's own: this pins the walk's control flow, not the choice of types.

_REF_DONE = object()
_REF_CHILD_KEYS = ("content", "output", "parts")


def _reference_text_comparable(parsed: Any) -> bool:
    if not isinstance(parsed, dict):
        return False
    for key in _fingerprint._CONVERSATION_KEYS:
        if key in parsed:
            stack: list[Any] = [parsed[key]]
            break
    else:
        return False
    if "system" in parsed:
        stack.append(parsed["system"])

    seen: set[int] = set()
    lists: list[Iterator[Any]] = []
    while stack or lists:
        if stack:
            node = stack.pop()
        else:
            node = next(lists[-1], _REF_DONE)
            if node is _REF_DONE:
                lists.pop()
                continue
        if node is None or isinstance(node, str):
            continue
        if isinstance(node, list):
            if id(node) not in seen:
                seen.add(id(node))
                lists.append(iter(node))
            continue
        if not isinstance(node, dict):
            return False
        if id(node) in seen:
            continue
        seen.add(id(node))
        if "type" in node:
            part_type = node["type"]
            if not isinstance(part_type, str) or part_type not in _fingerprint._TEXT_TYPES:
                return False
            if part_type in _fingerprint._OPAQUE_TYPES:
                continue
        if node.get("audio") is not None:
            return False
        for child_key in _REF_CHILD_KEYS:
            if child_key in node:
                stack.append(node[child_key])
                break
        else:
            if not (isinstance(node.get("text"), str) or isinstance(node.get("tool_calls"), list)):
                return False
    return True


_ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "model", "function"])
_WORDS = st.text(max_size=6)
# Mostly what is comparable (one_of draws its branches evenly): the verdict then often turns on
# a single node, which is what tells two walks apart.
_SCALARS = st.one_of(_WORDS, _WORDS, _WORDS, st.none(), st.none(), st.booleans() | st.integers() | st.floats())
# Every text type, the media and reasoning types of each provider, and types that are not strings.
_ANY_TYPE = (
    st.sampled_from(
        sorted(_fingerprint._TEXT_TYPES)
        + ["function", "image_url", "input_audio", "file", "image", "document", "thinking", "redacted_thinking"]
        + ["input_image", "input_file", "reasoning", "ephemeral", ""]
    )
    | st.none()
    | st.integers(-1, 2)
    | st.booleans()
    | st.just(["text"])
    | st.just({"type": "text"})
)
_OPENAI_TOOL_CALL = st.fixed_dictionaries(
    {
        "id": _WORDS,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": _WORDS, "arguments": _WORDS}),
    }
)


def _shapes(children: st.SearchStrategy[Any], *, other: bool = True) -> st.SearchStrategy[Any]:
    """Messages, parts and items of each provider, whose walked fields hold ``children``.

    Without ``other``: only the shapes that carry text, as they usually come (each is comparable
    when its children are). With it, also media, reasoning, a text or tool call of the wrong
    type, and objects with any of the keys the walk reads.
    """
    # OpenAI chat
    openai_text = st.fixed_dictionaries({"type": st.just("text"), "text": _WORDS})
    openai_message = st.fixed_dictionaries(
        {"role": _ROLES, "content": st.none() | _WORDS | st.lists(openai_text | children, max_size=3) | children},
        optional={"name": _WORDS, "tool_call_id": _WORDS, "audio": st.none()},
    )
    openai_tool_calls = st.fixed_dictionaries(
        {"role": st.just("assistant"), "tool_calls": st.lists(_OPENAI_TOOL_CALL, max_size=2)},
        optional={"content": st.none(), "audio": st.none()},
    )
    # Anthropic
    anthropic_text = st.fixed_dictionaries(
        {"type": st.just("text"), "text": _WORDS}, optional={"cache_control": st.just({"type": "ephemeral"})}
    )
    tool_use = st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": _WORDS, "name": _WORDS, "input": children | _SCALARS}
    )
    tool_result = st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": _WORDS, "content": _WORDS | st.lists(children, max_size=3)},
        optional={"is_error": st.booleans()},
    )
    anthropic_message = st.fixed_dictionaries(
        {"role": _ROLES, "content": _WORDS | st.lists(anthropic_text | tool_use | tool_result | children, max_size=3)}
    )
    # Gemini
    gemini_text = st.fixed_dictionaries({"text": _WORDS}, optional={"thought": st.booleans()})
    gemini_content = st.fixed_dictionaries(
        {"parts": st.lists(gemini_text | children, max_size=3)}, optional={"role": _ROLES}
    )
    # OpenAI Responses
    responses_text = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": _WORDS})
    responses_message = st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": _ROLES,
            "content": _WORDS | st.lists(responses_text | children, max_size=3),
        }
    )
    function_call = st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": _WORDS, "arguments": _WORDS | children}
    )
    function_call_output = st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _WORDS, "output": _WORDS | children}
    )
    textual = [
        openai_message,
        openai_tool_calls,
        openai_text,
        anthropic_message,
        anthropic_text,
        tool_use,
        tool_result,
        gemini_content,
        gemini_text,
        responses_message,
        responses_text,
        function_call,
        function_call_output,
        st.lists(children, max_size=4),
    ]
    if not other:
        return st.one_of(textual)
    fixed = st.sampled_from(
        [
            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
            {"type": "file", "file": {"file_id": "f"}},
            {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
            {"type": "image", "source": {"type": "base64", "data": "AA"}},
            {"type": "document", "source": {"type": "text", "data": "AA"}},
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "redacted_thinking", "data": "AA"},
            {"type": "tool_result", "tool_use_id": "t"},
            {"inlineData": {"mimeType": "image/png", "data": "AA"}},
            {"type": "input_image", "image_url": "https://x/a.png"},
            {"type": "input_file", "file_id": "f"},
            {"type": "reasoning", "summary": []},
        ]
    )
    gemini_calls = st.fixed_dictionaries({"functionCall": st.fixed_dictionaries({"name": _WORDS, "args": children})})
    gemini_calls |= st.fixed_dictionaries(
        {"functionResponse": st.fixed_dictionaries({"name": _WORDS, "response": children})}
    )
    text_of_any = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]), "text": children})
    walked = {key: children for key in ("content", "output", "parts", "text", "tool_calls", "role")}
    any_keys = st.fixed_dictionaries({}, optional=walked | {"type": _ANY_TYPE, "audio": children})
    return st.one_of(*textual, fixed | gemini_calls | text_of_any | any_keys)


# Anything at all, and what is mostly text (the verdict then often turns on one node, which is
# what tells two walks apart).
_NODES = st.recursive(_SCALARS, _shapes, max_leaves=25)
_TEXTUAL = st.recursive(_WORDS | st.none(), functools.partial(_shapes, other=False), max_leaves=15)
# One-node changes: each value the walk tells apart.
_POINTS = st.one_of(
    st.none(),
    _WORDS,
    st.integers(),
    st.booleans(),
    st.floats(),
    st.just([]),
    st.just({}),
    st.just({"id": "audio_1"}),
    st.builds(lambda part_type: {"type": part_type}, _ANY_TYPE),
    _ANY_TYPE,
)


_WALKED_KEYS = ("audio", "type", "content", "output", "parts", "text", "tool_calls", "system")


@st.composite
def _conversations(draw: st.DrawFn, nodes: st.SearchStrategy[Any]) -> Any:
    """A conversation, usually a list, some of whose elements may appear again (the same object: shared)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(nodes)
    items = draw(st.lists(nodes, max_size=4))
    for _ in range(draw(st.integers(0, 2)) if items else 0):
        items.insert(draw(st.integers(0, len(items))), items[draw(st.integers(0, len(items) - 1))])
    return items


def _bodies(nodes: st.SearchStrategy[Any], *, conversation: bool = False) -> st.SearchStrategy[Any]:
    """A body with each conversation key (the others may come too); unless ``conversation``, also
    one that may have none, and values that are not objects."""
    conversations = _conversations(nodes)
    top_level = {"messages": conversations, "input": conversations, "contents": conversations}
    top_level |= {"system": conversations, "systemInstruction": nodes, "model": _WORDS}
    with_one = [
        st.fixed_dictionaries({key: conversations}, optional={k: v for k, v in top_level.items() if k != key})
        for key in ("messages", "input", "contents")
    ]
    return st.one_of(with_one if conversation else [*with_one, st.fixed_dictionaries({}, optional=top_level), nodes])


def _containers(value: Any) -> list[Any]:
    """The objects and lists in ``value``, each once."""
    found: dict[int, Any] = {}
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)) and id(node) not in found:
            found[id(node)] = node
            stack.extend(node.values() if isinstance(node, dict) else node)
    return list(found.values())


@st.composite
def _twisted(draw: st.DrawFn) -> Any:
    """A textual conversation with one or two changes anywhere: a list gains an element, an object
    gains, changes or loses up to three of the keys the walk reads."""
    body = copy.deepcopy(draw(_bodies(_TEXTUAL, conversation=True)))  # strategies' constants stay unchanged
    containers = _containers(body)
    lists: list[list[Any]] = [container for container in containers if isinstance(container, list)]
    objects: list[dict[str, Any]] = [container for container in containers if isinstance(container, dict)]
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()) and lists:
            items = draw(st.sampled_from(lists))
            items.insert(draw(st.integers(0, len(items))), copy.deepcopy(draw(_POINTS | _TEXTUAL)))
            continue
        obj = draw(st.sampled_from(objects))
        for key in draw(st.lists(st.sampled_from(_WALKED_KEYS), min_size=1, max_size=3, unique=True)):
            if key in obj and draw(st.booleans()):
                del obj[key]
            else:
                obj[key] = copy.deepcopy(draw(_POINTS | _TEXTUAL))
    return body


REFERENCE_BODIES = st.one_of(_twisted(), _twisted(), _bodies(_NODES))


@settings(max_examples=500, deadline=None)
@given(parsed=REFERENCE_BODIES)
def test_verdict_matches_reference(parsed: Any) -> None:
    assert text_comparable(parsed) is _reference_text_comparable(parsed)
    if isinstance(parsed, dict):
        # Its conversation under each conversation key, without the other keys (the roots differ).
        conversation = next((parsed[key] for key in ("messages", "input", "contents") if key in parsed), None)
        system = {"system": parsed["system"]} if "system" in parsed else {}
        for key in ("messages", "input", "contents"):
            variant = {key: conversation, **system}
            assert text_comparable(variant) is _reference_text_comparable(variant)


@pytest.mark.parametrize(("raw", "expected"), CORPUS)
def test_verdict_matches_reference_on_corpus(raw: bytes, expected: bool) -> None:
    try:
        parsed = _json.loads(raw)
    except _json.JSONDecodeFailure:
        return
    assert text_comparable(parsed) is _reference_text_comparable(parsed) is expected


_ABSENT = object()
# Per key the walk reads on an object: absent, values it accepts, values it rejects.
_OBJECT_KEYS: dict[str, list[Any]] = {
    "type": [_ABSENT, "text", "tool_use", "function_call_output", "image", None, ["text"]],
    "audio": [_ABSENT, None, {"id": "audio_1"}],
    "content": [_ABSENT, "x", 1],
    "output": [_ABSENT, "x", 1],
    "parts": [_ABSENT, "x", 1],
    "text": [_ABSENT, "x", 1],
    "tool_calls": [_ABSENT, [], "x"],
}


def test_verdict_matches_reference_on_every_object_shape() -> None:
    """Every combination of the keys the walk reads on an object, in each place an object is walked."""
    for values in itertools.product(*_OBJECT_KEYS.values()):
        obj = {key: value for key, value in zip(_OBJECT_KEYS, values, strict=True) if value is not _ABSENT}
        for parsed in (
            {"messages": [obj]},
            {"input": obj},
            {"contents": [{"parts": [obj]}]},
            {"messages": [], "system": obj},
        ):
            assert text_comparable(parsed) is _reference_text_comparable(parsed), parsed


def _shared_and_cyclic() -> list[Any]:
    text = {"type": "text", "text": "x"}
    image = {"type": "image", "source": {}}
    shared: list[Any] = [text, text]
    cyclic_list: list[Any] = ["x"]
    cyclic_list.append(cyclic_list)
    self_content: dict[str, Any] = {"role": "user"}
    self_content["content"] = self_content
    self_list: dict[str, Any] = {"role": "user", "content": []}
    self_list["content"].append(self_list)
    mutual_a: dict[str, Any] = {"role": "user"}
    mutual_b: dict[str, Any] = {"role": "assistant", "content": mutual_a}
    mutual_a["parts"] = [mutual_b]
    return [
        {"messages": [{"content": shared}, {"content": shared}]},
        {"messages": [{"content": [text, image]}, {"content": [text]}]},
        {"messages": cyclic_list},
        {"messages": [self_content]},
        {"messages": [self_list]},
        {"contents": [mutual_a], "system": mutual_b},
        {"messages": shared, "system": shared},
        {"messages": [image], "system": [image]},
        {"messages": [text, text, image]},
        {"messages": [{"content": shared}, {"content": shared}, {"content": image}]},
        {"messages": [{"content": [text]}], "system": [text, image]},
        {"input": [{"type": "function_call_output", "output": shared}]},
    ]


@pytest.mark.parametrize("parsed", _shared_and_cyclic())
def test_verdict_matches_reference_on_shared_and_cyclic_structures(parsed: Any) -> None:
    assert text_comparable(parsed) is _reference_text_comparable(parsed)


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
