from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from asgi_lifetime.gateway._refold import (
    Conversation,
    OverflowMatch,
    default_refold,
    default_remap_role,
    match_overflow,
    match_rejected_role,
)


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


OVERFLOWS = [
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens. However, your messages "
                    "resulted in 9123 tokens. Please reduce the length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ),
        8192,
        id="openai-chat",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "Your input exceeds the context window of this model. Please adjust your input and "
                    "try again.",
                    "type": "invalid_request_error",
                    "param": "input",
                    "code": "context_length_exceeded",
                }
            }
        ),
        None,
        id="openai-responses",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "Input tokens exceed the configured limit of 272,000 tokens. Your messages resulted "
                    "in 301,233 tokens. Please reduce the length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ),
        272000,
        id="openai-configured-limit",
    ),
    pytest.param(
        400,
        j({"error": {"message": "Input tokens exceed the configured limit of 128000 tokens.", "code": None}}),
        128000,
        id="limit-of-n-tokens-alone",
    ),
    pytest.param(
        400,
        j(
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "prompt is too long: 208310 tokens > 200000 maximum",
                },
                "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy",
            }
        ),
        200000,
        id="anthropic",
    ),
    pytest.param(400, j({"message": "Input is too long for requested model."}), None, id="anthropic-bedrock"),
    pytest.param(
        413,
        j({"type": "error", "error": {"type": "invalid_request_error", "message": "Prompt is too long"}}),
        None,
        id="413-prompt-too-long",
    ),
    pytest.param(
        400,
        j(
            {
                "object": "error",
                "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
                "(4000 in the messages, 1000 in the completion). Please reduce the length of the messages or "
                "completion.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        ),
        4096,
        id="vllm-classic",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096. "
                    "Make sure that `max_model_len` is no smaller than the number of text tokens.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
        ),
        4096,
        id="vllm-decoder-prompt",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum "
                    "context length is 4096 tokens and your request has 3500 input tokens (1000 > 4096 - 3500).",
                    "type": "BadRequestError",
                    "code": 400,
                }
            }
        ),
        4096,
        id="vllm-max-tokens-and-input",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "code": 400,
                    "message": "The input token count (1200000) exceeds the maximum number of tokens allowed "
                    "(1048576).",
                    "status": "INVALID_ARGUMENT",
                }
            }
        ),
        1048576,
        id="gemini",
    ),
    pytest.param(
        400,
        j(
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                }
            }
        ),
        None,
        id="llama-cpp",
    ),
    pytest.param(
        400,
        j(
            {
                "object": "error",
                "message": "Prompt contains 40000 tokens and 0 draft tokens, too large for model with 32768 maximum "
                "context length",
                "type": "invalid_request_error",
            }
        ),
        32768,
        id="mistral",
    ),
    pytest.param(
        400,
        b'{"error":{"message":"This model\'s maximum context length is 16385 tokens. However, your mess',
        16385,
        id="truncated-at-error-body-limit",
    ),
    pytest.param(413, b"prompt is too long: 9000 tokens > 8000 maximum", 8000, id="plain-text"),
]

NOT_OVERFLOWS = [
    pytest.param(
        400,
        j(
            {
                "error": {
                    "message": "Invalid value for 'temperature': must be between 0 and 2.",
                    "type": "invalid_request_error",
                    "param": "temperature",
                    "code": "invalid_value",
                }
            }
        ),
        id="bad-parameter",
    ),
    pytest.param(
        400,
        j(
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens for "
                    "claude-sonnet-4",
                },
            }
        ),
        id="anthropic-max-tokens",
    ),
    pytest.param(
        400,
        j({"error": {"message": "max_completion_tokens exceeds the limit of 16384 tokens for this model"}}),
        id="output-token-limit",
    ),
    pytest.param(
        413,
        j(
            {
                "error": {
                    "message": "Request too large for model `llama3-70b-8192` in organization `org_01` service tier "
                    "`on_demand` on tokens per minute (TPM): Limit 6000, Requested 8077, please reduce your message "
                    "size and try again.",
                    "type": "tokens",
                    "code": "rate_limit_exceeded",
                }
            }
        ),
        id="groq-tpm",
    ),
    pytest.param(
        413,
        j(
            {
                "type": "error",
                "error": {
                    "type": "request_too_large",
                    "message": "Request exceeds the maximum allowed number of bytes.",
                },
            }
        ),
        id="anthropic-bytes",
    ),
    pytest.param(413, b"<html><head><title>413 Request Entity Too Large</title></head></html>", id="nginx"),
    pytest.param(400, j({"error": {"message": "Unexpected role 'developer'"}}), id="role-error"),
    pytest.param(400, b"", id="empty"),
    pytest.param(
        429,
        j({"error": {"message": "maximum context length is 8192 tokens", "code": "context_length_exceeded"}}),
        id="wrong-status-429",
    ),
    pytest.param(500, b"prompt is too long: 9000 tokens > 8000 maximum", id="wrong-status-500"),
]


@pytest.mark.parametrize(("status", "body", "window"), OVERFLOWS)
def test_match_overflow(status: int, body: bytes, window: int | None) -> None:
    assert match_overflow(status, body) == OverflowMatch(window=window)


@pytest.mark.parametrize(("status", "body"), NOT_OVERFLOWS)
def test_match_overflow_rejects(status: int, body: bytes) -> None:
    assert match_overflow(status, body) is None


@pytest.mark.parametrize(
    ("body", "role"),
    [
        pytest.param(
            j({"object": "error", "message": "Unexpected role 'developer'", "type": "BadRequestError", "code": 400}),
            "developer",
            id="unexpected-role",
        ),
        pytest.param(
            j({"error": {"message": "developer role is not supported", "code": 400}}), "developer", id="is-not"
        ),
        pytest.param(
            j(
                {
                    "error": {
                        "message": "Invalid value: 'developer'. Supported values are: 'system', 'assistant', 'user', "
                        "'function', and 'tool'.",
                        "type": "invalid_request_error",
                        "param": "messages[0].role",
                        "code": "invalid_value",
                    }
                }
            ),
            "developer",
            id="openai-enum",
        ),
        pytest.param(
            j({"object": "error", "message": "System role not supported", "type": "BadRequestError", "code": 400}),
            "system",
            id="gemma-template",
        ),
        pytest.param(j({"error": {"message": "This model does not support the 'developer' role."}}), "developer"),
        pytest.param(j({"detail": "Invalid role: developer"}), "developer", id="invalid-role"),
        pytest.param(b"role 'system' is not supported by this model", "system", id="plain-text"),
    ],
)
def test_match_rejected_role(body: bytes, role: str) -> None:
    assert match_rejected_role(400, body) == role


@pytest.mark.parametrize(
    ("status", "body"),
    [
        pytest.param(400, j({"error": {"message": "Invalid value: 'fast'. Supported values are: 'auto', 'none'."}})),
        pytest.param(400, j({"error": {"message": "Invalid value for 'temperature': must be between 0 and 2."}})),
        pytest.param(400, j({"error": {"message": "Unexpected role 'banana'"}}), id="unknown-role-name"),
        pytest.param(400, j({"message": "This role not supported here"}), id="not-a-role-name"),
        pytest.param(422, j({"error": {"message": "Unexpected role 'developer'"}}), id="wrong-status"),
        pytest.param(400, b"", id="empty"),
    ],
)
def test_match_rejected_role_rejects(status: int, body: bytes) -> None:
    assert match_rejected_role(status, body) is None


# --- refold -----------------------------------------------------------------------------------

FILLER = "lorem ipsum dolor sit amet " * 20  # ~540 characters per turn


def chat() -> dict[str, Any]:
    """OpenAI chat: a system prompt, five turns (one with a tool call) and a last user turn."""
    return {
        "model": "gpt-4.1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "turn 1 " + FILLER},
            {"role": "assistant", "content": "answer 1 " + FILLER},
            {"role": "user", "content": "turn 2 " + FILLER},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "result a " + FILLER},
            {"role": "assistant", "content": "answer 2 " + FILLER},
            {"role": "developer", "content": "mid-conversation instruction"},
            {"role": "user", "content": "turn 3 " + FILLER},
            {"role": "assistant", "content": "answer 3 " + FILLER},
            {"role": "user", "content": "turn 4 " + FILLER},
            {"role": "assistant", "content": "answer 4 " + FILLER},
            {"role": "user", "content": "last question"},
        ],
    }


def texts(body: bytes, key: str = "messages") -> list[str]:
    out = []
    for item in json.loads(body)[key]:
        content = item.get("content") or item.get("parts") or item.get("output") or item.get("type")
        out.append(json.dumps(content)[:20])
    return out


def assert_calls_paired(items: list[dict[str, Any]]) -> None:
    calls = {c["id"] for m in items for c in m.get("tool_calls") or []}
    results = {m["tool_call_id"] for m in items if m.get("role") == "tool"}
    assert calls == results


def test_refold_without_window_drops_oldest_turns_by_a_quarter_each_time() -> None:
    parsed = chat()
    original = copy.deepcopy(parsed)
    refold = default_refold(parsed)
    previous = len(json.dumps(parsed, separators=(",", ":")))
    seen = []
    while (body := refold(None)) is not None:
        assert len(body) <= previous * 0.75 + 1
        previous = len(body)
        messages = json.loads(body)["messages"]
        seen.append(messages)
        assert messages[0] == {"role": "system", "content": "be brief"}
        assert {"role": "developer", "content": "mid-conversation instruction"} in messages
        assert messages[-1] == {"role": "user", "content": "last question"}
        assert_calls_paired(messages)
        assert messages[1]["role"] in ("user", "developer")  # a cut falls on a turn start
    assert len(seen) >= 2
    # Each call continued from the previous result: the conversation only ever got shorter.
    assert [len(m) for m in seen] == sorted((len(m) for m in seen), reverse=True)
    assert [m["role"] for m in seen[-1]] == ["system", "developer", "user"]
    assert parsed == original  # the caller's graph was never mutated


def test_refold_with_window_targets_ninety_percent_and_drops_no_more_than_needed() -> None:
    parsed = chat()
    size = len(json.dumps(parsed, separators=(",", ":")))
    window = int(size / 4 * 0.7)  # somewhat smaller than the body
    body = default_refold(parsed)(window)
    assert body is not None
    assert len(body) / 4 <= window * 0.9
    messages = json.loads(body)["messages"]
    assert messages[-1]["content"] == "last question"
    assert any("turn 3" in (m.get("content") or "") for m in messages)  # did not drop everything
    assert_calls_paired(messages)


def test_refold_drops_at_least_one_turn_even_when_the_estimate_fits() -> None:
    body = default_refold(chat())(1_000_000)
    assert body is not None
    assert "turn 1" not in body.decode() and "turn 2" in body.decode()


def test_refold_gives_up_when_only_the_last_turn_is_left() -> None:
    parsed = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "only " + FILLER}]}
    assert default_refold(parsed)(10) is None
    agent_loop = {
        "messages": [
            {"role": "user", "content": "do it"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": FILLER},
        ]
    }
    assert default_refold(agent_loop)(None) is None


def test_refold_takes_the_deepest_cut_when_none_fits_the_window() -> None:
    refold = default_refold(chat())
    body = refold(1)  # no cut brings the body down to 1 token: the last turn is kept anyway
    assert body is not None
    messages = json.loads(body)["messages"]
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "mid-conversation instruction"},
        {"role": "user", "content": "last question"},
    ]
    assert refold(1) is None  # the next call continues from there: nothing is left to drop


@pytest.mark.parametrize(
    "items",
    [
        pytest.param([], id="empty"),
        pytest.param([{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}], id="only-pinned"),
        pytest.param([{"role": "assistant", "content": FILLER}, {"role": "tool", "content": "r"}], id="no-user"),
        pytest.param(
            [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": FILLER}]},
            ],
            id="anthropic-tool-result-carrier",
        ),
        pytest.param(
            [
                {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"r": FILLER}}}]},
            ],
            id="gemini-function-response-carrier",
        ),
        pytest.param(
            [{"role": "user", "type": "function_call_output", "call_id": "c", "output": FILLER}],
            id="user-item-not-a-message",
        ),
        pytest.param([FILLER, 1, None], id="not-objects"),
    ],
)
def test_refold_gives_up_without_a_turn_start(items: list[Any]) -> None:
    assert default_refold({"messages": items})(None) is None
    assert default_refold({"messages": items})(1) is None


def test_refold_never_cuts_between_a_call_and_its_result() -> None:
    # A result that (oddly) arrives after the next user message ties the two turns together.
    parsed = {
        "messages": [
            {"role": "user", "content": "turn 1 " + FILLER},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]},
            {"role": "user", "content": "turn 2 " + FILLER},
            {"role": "tool", "tool_call_id": "c1", "content": "late result"},
            {"role": "user", "content": "turn 3"},
        ]
    }
    body = default_refold(parsed)(None)
    assert body is not None
    assert json.loads(body)["messages"] == [{"role": "user", "content": "turn 3"}]


def test_refold_anthropic_keeps_tool_use_with_tool_result() -> None:
    parsed = {
        "model": "claude-sonnet-4",
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "turn 1 " + FILLER},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": FILLER}]},
            {"role": "assistant", "content": [{"type": "text", "text": "answer 1"}]},
            {"role": "user", "content": [{"type": "text", "text": "turn 2 " + FILLER}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "r2"}]},
            {"role": "assistant", "content": "answer 2"},
            {"role": "user", "content": "last question"},
        ],
    }
    first = default_refold(parsed)(None)
    assert first is not None
    doc = json.loads(first)
    assert doc["system"] == "be brief"
    messages = doc["messages"]
    # The tool_result carrier is a user message but not a turn start: the cut came after it.
    assert messages[0]["content"][0]["text"].startswith("turn 2")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]


def test_refold_responses_input_keeps_function_call_pairs() -> None:
    parsed = {
        "model": "gpt-5",
        "input": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "turn 1 " + FILLER}]},
            {"type": "function_call", "call_id": "fc_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "fc_1", "output": FILLER},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "turn 2"}]},
            {"type": "function_call", "call_id": "fc_2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "fc_2", "output": "r2"},
            {"role": "user", "content": "last question"},
        ],
    }
    body = default_refold(parsed)(None)
    assert body is not None
    items = json.loads(body)["input"]
    assert items[0] == {"role": "developer", "content": "be brief"}
    call_ids = [i["call_id"] for i in items if i.get("type") == "function_call"]
    output_ids = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    assert call_ids == output_ids
    assert items[-1] == {"role": "user", "content": "last question"}
    assert "turn 1" not in body.decode()


def test_refold_gemini_contents() -> None:
    parsed = {
        "systemInstruction": {"parts": [{"text": "be brief"}]},
        "contents": [
            {"role": "user", "parts": [{"text": "turn 1 " + FILLER}]},
            {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"r": FILLER}}}]},
            {"role": "model", "parts": [{"text": "answer 1"}]},
            {"role": "user", "parts": [{"text": "turn 2"}]},
            {"role": "model", "parts": [{"text": "answer 2"}]},
            {"role": "user", "parts": [{"text": "last question"}]},
        ],
    }
    body = default_refold(parsed)(None)
    assert body is not None
    doc = json.loads(body)
    assert doc["systemInstruction"] == {"parts": [{"text": "be brief"}]}
    assert [c["parts"][0].get("text") for c in doc["contents"]] == ["turn 2", "answer 2", "last question"]


def test_refold_of_a_body_that_is_not_a_conversation() -> None:
    assert default_refold({"prompt": "hi"})(100) is None
    assert default_refold([1, 2])(None) is None
    assert default_refold({"input": "a plain string"})(None) is None
    assert Conversation.of({"messages": "nope"}) is None


def test_remap_role_renames_and_is_shared_with_refold() -> None:
    parsed = chat()
    original = copy.deepcopy(parsed)
    conversation = Conversation.of(parsed)
    assert conversation is not None
    remap, refold = default_remap_role(conversation), default_refold(conversation)
    body = remap("developer", "system")
    assert body is not None
    roles = [m["role"] for m in json.loads(body)["messages"]]
    assert "developer" not in roles and roles.count("system") == 2
    assert remap("developer", "system") is None  # nothing left to rename
    refolded = refold(None)
    assert refolded is not None
    assert "developer" not in [m["role"] for m in json.loads(refolded)["messages"]]  # the rename survived
    assert parsed == original


def test_remap_role_without_the_role() -> None:
    assert default_remap_role({"messages": [{"role": "user", "content": "x"}]})("developer", "system") is None
    assert default_remap_role({"prompt": "x"})("developer", "system") is None
