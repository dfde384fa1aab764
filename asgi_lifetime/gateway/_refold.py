"""Second chances for a rejected request: a smaller body after a context overflow, a role rename.

``match_overflow`` and ``match_rejected_role`` recognise the upstream errors (OpenAI,
Anthropic, vLLM, Gemini wording); ``default_refold`` and ``default_remap_role`` build the
bodies to send instead. Both builders work on one shared ``Conversation``, the outbound
graph as it currently is, so a refold after a role rename keeps the rename::

    conversation = Conversation.of(parsed)           # {"messages": [...]} etc., or None
    refold = default_refold(conversation)
    remap = default_remap_role(conversation)
    body = remap("developer", "system")              # new bytes, or None if nothing changed
    body = refold(128_000)                           # smaller bytes, or None: nothing left to drop

The builders never mutate the graph they were given (an attempt may still be sending the
previous body); they build new lists and a new top-level object each time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from .. import _json

__all__ = [
    "Conversation",
    "OverflowMatch",
    "Refold",
    "RemapRole",
    "default_refold",
    "default_remap_role",
    "match_overflow",
    "match_rejected_role",
]

Refold = Callable[[int | None], bytes | None]
"""Given the stated context window in tokens (or ``None``), a smaller body, or ``None`` to give up."""
RemapRole = Callable[[str, str], bytes | None]
"""Rename role ``a`` to ``b``; the new body, or ``None`` if no message had role ``a``."""

# Conversation keys, in priority order: OpenAI chat and Anthropic, OpenAI Responses, Gemini.
_CONVERSATION_KEYS: Final = ("messages", "input", "contents")
# Instructions are never dropped, wherever they stand.
_PINNED_ROLES: Final = frozenset({"system", "developer"})
_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool", "function", "model"})
# Refold targets: 90% of a stated window leaves room for the estimate's error; without a
# window, each call shrinks the body by about a quarter.
_WINDOW_FILL: Final = 0.9
_SHRINK: Final = 0.75
_BYTES_PER_TOKEN: Final = 4


def _compiled(*patterns: str) -> tuple[re.Pattern[str], ...]:
    """A table of patterns, compiled once."""
    return tuple(re.compile(p) for p in patterns)


_N = r"(\d[\d,_]*)"
# Each pattern alone identifies a context overflow; a group, when present, is the window.
_OVERFLOW_PATTERNS: Final = _compiled(
    r"context_length_exceeded",
    rf"maximum context length is {_N} tokens",
    rf"prompt is too long(?:: [\d,_]+ tokens > {_N} maximum)?",
    r"input is too long",
    rf"exceeds the context window(?: of {_N} tokens)?",
    rf"longer than the maximum model length of {_N}",  # vLLM: decoder prompt
    rf"input token count \([\d,_]+\) exceeds the maximum number of tokens allowed \({_N}\)",  # Gemini
    rf"too large for model with {_N} maximum context length",  # Mistral
    r"exceeds the available context size",  # llama.cpp
)
# "limit of N tokens" also phrases output-token limits, which a smaller input cannot fix.
_LIMIT_PATTERN: Final = re.compile(rf"limit of {_N} tokens")
_OUTPUT_LIMIT: Final = re.compile(r"max_(?:completion_)?tokens|output tokens|completion tokens")

_R = r"['\"`]?([a-z_]+)['\"`]?"
_ROLE_PATTERNS: Final = _compiled(
    rf"unexpected role[:\s]+{_R}",
    rf"(?:invalid|unknown|unsupported) role[:\s]+{_R}",
    rf"role {_R} is not (?:supported|allowed|valid)",
    rf"\b{_R} role (?:is )?not (?:supported|allowed)",
    rf"does not support (?:the )?{_R} role",
    # OpenAI-style enum error on messages[].role: "Invalid value: 'developer'. Supported
    # values are: 'system', 'assistant', 'user', ..." (the list must name 'user').
    rf"invalid value: {_R}\. supported values are:[^.]*'user'",
)


@dataclass(frozen=True, slots=True)
class OverflowMatch:
    """An upstream error recognised as a context overflow."""

    window: int | None
    """The context window the error states, in tokens, if it states one."""


def _error_text(body: bytes) -> str:
    """The strings of a JSON error body (or the body as text), lowercased, for matching."""
    try:
        doc = _json.loads(body)
    except _json.JSONDecodeFailure:  # not JSON, or truncated at the error body limit
        return body.decode("utf-8", "replace").lower()
    strings: list[str] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            strings.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return "\n".join(strings).lower()


def _number(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


def match_overflow(status: int, body: bytes) -> OverflowMatch | None:
    """Whether a 400 or 413 says the request exceeds the model's context window.

    >>> match_overflow(400, b'{"error": {"message": "prompt is too long: 210000 tokens > 200000 maximum"}}')
    OverflowMatch(window=200000)
    """
    if status not in (400, 413):
        return None
    text = _error_text(body)
    matched = False
    window: int | None = None
    for pattern in _OVERFLOW_PATTERNS:
        found = pattern.search(text)
        if found is not None:
            matched = True
            if window is None and found.lastindex:
                window = _number(found.group(1))
    limit = _LIMIT_PATTERN.search(text)
    if limit is not None and (matched or not _OUTPUT_LIMIT.search(text)):
        matched = True
        window = window if window is not None else _number(limit.group(1))
    return OverflowMatch(window=window) if matched else None


def match_rejected_role(status: int, body: bytes) -> str | None:
    """The role a 400 says the upstream does not accept (``"developer"``, ``"system"``...), if any.

    >>> match_rejected_role(400, b'{"message": "System role not supported"}')
    'system'
    """
    if status != 400:
        return None
    text = _error_text(body)
    for pattern in _ROLE_PATTERNS:
        for found in pattern.finditer(text):
            if found.group(1) in _ROLES:
                return found.group(1)
    return None


class Conversation:
    """The current outbound graph of a request, shared by its refold and remap closures.

    Holding the graph here (and nowhere else) is what lets ``Prepared.settle`` release it:
    dropping the closures drops the conversation, and with it the parsed input. (With the
    default factories, ``prepare`` keeps no conversation at all: its closures build one from
    a fresh parse of the outbound body on each call and drop it on return.)
    """

    __slots__ = ("doc", "key")

    def __init__(self, doc: dict[str, Any], key: str) -> None:
        self.doc = doc
        self.key = key

    @classmethod
    def of(cls, parsed: Any) -> Conversation | None:
        """Wrap a body with a ``messages``, ``input`` or ``contents`` list; ``None`` for anything else."""
        if isinstance(parsed, Conversation):
            return parsed
        if isinstance(parsed, dict):
            for key in _CONVERSATION_KEYS:
                if isinstance(parsed.get(key), list):
                    return cls(parsed, key)
        return None

    @property
    def items(self) -> list[Any]:
        items: list[Any] = self.doc[self.key]
        return items

    def replace(self, items: list[Any]) -> bytes:
        """Make ``items`` the conversation (in a new top-level object) and serialize it."""
        doc = dict(self.doc)
        doc[self.key] = items
        self.doc = doc
        return _json.dumps(doc)


def _is_pinned(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") in _PINNED_ROLES


def _blocks(item: dict[str, Any]) -> list[Any]:
    blocks: list[Any] = []
    for key in ("content", "parts"):
        value = item.get(key)
        if isinstance(value, list):
            blocks.extend(value)
    return blocks


def _is_turn_start(item: Any) -> bool:
    """A user message that opens a turn (not one that carries tool results)."""
    if not isinstance(item, dict) or item.get("role") != "user" or item.get("type", "message") != "message":
        return False
    return not any(
        isinstance(block, dict)
        and (block.get("type") == "tool_result" or "functionResponse" in block or "function_response" in block)
        for block in _blocks(item)
    )


def _call_ids(item: Any) -> list[str]:
    """Ids tying a tool call to its result: OpenAI chat, Anthropic, Responses and Gemini shapes."""
    if not isinstance(item, dict):
        return []
    candidates: list[Any] = [item.get("tool_call_id"), item.get("call_id")]
    calls = item.get("tool_calls")
    if isinstance(calls, list):
        candidates.extend(call.get("id") for call in calls if isinstance(call, dict))
    for block in _blocks(item):
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_use":
            candidates.append(block.get("id"))
        elif block.get("type") == "tool_result":
            candidates.append(block.get("tool_use_id"))
        for key in ("functionCall", "functionResponse", "function_call", "function_response"):
            call = block.get(key)
            if isinstance(call, dict):
                candidates.append(call.get("id"))
    return [c for c in candidates if isinstance(c, str) and c]


def _open_calls(items: list[Any]) -> list[int]:
    """Per index ``k`` up to ``len(items)``: how many tool calls are issued before ``k`` and answered at or after it."""
    spans: dict[str, tuple[int, int]] = {}
    for i, item in enumerate(items):
        for call_id in _call_ids(item):
            first, _ = spans.get(call_id, (i, i))
            spans[call_id] = (first, i)
    open_calls = [0] * (len(items) + 1)
    for first, last in spans.values():
        open_calls[first + 1] += 1
        open_calls[last + 1] -= 1
    for k in range(1, len(open_calls)):
        open_calls[k] += open_calls[k - 1]
    return open_calls


def _choose_cut(items: list[Any], sizes: list[int], total: int, target: float) -> int | None:
    """The index to drop non-pinned items before: the first turn boundary that fits ``target``.

    Cuts fall only on turn starts, never past the last one (the last user turn is kept
    whole) and never between a tool call and its result. If no cut fits, the deepest one
    (the body may still be too large: the next overflow shrinks further). ``None`` when
    no cut drops anything.
    """
    pinned = [_is_pinned(item) for item in items]
    starts = [i for i, item in enumerate(items) if not pinned[i] and _is_turn_start(item)]
    droppable = next((i for i, p in enumerate(pinned) if not p), None)
    if not starts or droppable is None:
        return None
    open_calls = _open_calls(items)
    cuts = [k for k in starts if k > droppable and not open_calls[k]]
    if not cuts:
        return None
    remaining = total
    position = 0
    for cut in cuts:
        remaining -= sum(sizes[i] for i in range(position, cut) if not pinned[i])
        position = cut
        if remaining <= target:
            return cut
    return cuts[-1]


def default_refold(parsed: Any) -> Refold:
    """A refold for a chat-shaped body (or ``Conversation``): drop the oldest turns until it fits.

    Size is estimated as serialized length / 4 tokens. With a stated window the target is
    90% of it, without one each call shrinks by about 25%. System and developer messages
    and the last user turn are always kept, tool calls stay with their results, and at
    least one turn is dropped per call. Each call continues from the previous result.
    """
    conversation = Conversation.of(parsed)

    def refold(window: int | None) -> bytes | None:
        if conversation is None:
            return None
        items = conversation.items
        sizes = [len(_json.dumps(item)) + 1 for item in items]  # + 1 for the comma
        total = len(_json.dumps({**conversation.doc, conversation.key: []})) + sum(sizes)
        target = window * _WINDOW_FILL * _BYTES_PER_TOKEN if window is not None else total * _SHRINK
        cut = _choose_cut(items, sizes, total, target)
        if cut is None:
            return None
        return conversation.replace([item for i, item in enumerate(items) if i >= cut or _is_pinned(item)])

    return refold


def default_remap_role(parsed: Any) -> RemapRole:
    """A role rename for a chat-shaped body (or ``Conversation``): every message with role ``a`` gets ``b``."""
    conversation = Conversation.of(parsed)

    def remap_role(a: str, b: str) -> bytes | None:
        if conversation is None:
            return None
        renamed = False
        items: list[Any] = []
        for item in conversation.items:
            if isinstance(item, dict) and item.get("role") == a:
                item = {**item, "role": b}
                renamed = True
            items.append(item)
        return conversation.replace(items) if renamed else None

    return remap_role
