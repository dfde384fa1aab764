"""Fingerprints of request bodies, taken from the bytes as received and from the first parse.

The gateway fingerprints a body once, before anything can mutate it (model rewrites,
injected system prompts, provider translation), and hands only the resulting scalars to
post-forward bookkeeping, never the raw body::

    raw = await read_body(receive)              # after content-encoding decode
    parsed = _json.loads(raw)                   # the one parse
    fp = fingerprint(raw, parsed=parsed)        # before any mutation
    parsed["model"] = route(parsed["model"])    # mutate freely: fp does not change

``fingerprint`` never raises for bad input: a body that is not JSON is simply not
text comparable.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from blake3 import blake3

from . import _json

_DONE: Final = object()  # the end of a list being walked
_END: Final = object()  # the end of the whole walk
_ENDLESS: Final = itertools.repeat(_END)  # under every walk's lists; it keeps no state, so one serves all

__all__ = ["Fingerprint", "UNPARSED", "fingerprint", "text_comparable", "wire_hash"]

# Inputs of at least this size are hashed with blake3's multithreading (max_threads=AUTO).
# Measured on the 2-core target (median of 101 interleaved runs, three passes): below 1 MiB
# AUTO loses (0.3x-1.0x), from 1 to 4 MiB it is a coin flip (0.66x-1.6x, it depends on what
# the other core is doing), from 8 MiB on it wins every pass (1.4x-1.6x; 1.3x-1.8x at 16 MiB,
# 1.5x-2.0x at 64 MiB).
_MULTITHREAD_THRESHOLD: Final = 8 * 1024 * 1024

_HEX_DIGITS: Final = frozenset("0123456789abcdef")


class _Unparsed(enum.Enum):
    UNPARSED = enum.auto()

    def __repr__(self) -> str:
        return "UNPARSED"


UNPARSED: Final = _Unparsed.UNPARSED
"""Default of ``fingerprint(parsed=...)``: parse ``raw`` here. (``None`` cannot mean that: it is JSON ``null``.)"""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What bookkeeping may know about a request body, fixed at the moment it was received.

    >>> fp = fingerprint(b'{"messages": [{"role": "user", "content": "hi"}]}')
    >>> fp.text_comparable, fp.size
    (True, 49)
    """

    wire_hash: str
    """blake3 hex digest (64 lowercase hex characters) of the body bytes as received."""
    text_comparable: bool
    """Whether the conversation is plain text a later request can be compared against textually."""
    size: int
    """``len(raw)``."""


def wire_hash(raw: bytes) -> str:
    """blake3 hex digest of ``raw``, multithreaded from ``_MULTITHREAD_THRESHOLD`` bytes on."""
    if len(raw) >= _MULTITHREAD_THRESHOLD:
        return blake3(raw, max_threads=blake3.AUTO).hexdigest()
    return blake3(raw).hexdigest()


_wire_hash: Final = wire_hash  # fingerprint()'s keyword argument shadows the function's name


def fingerprint(raw: bytes, *, parsed: Any = UNPARSED, wire_hash: str | None = None) -> Fingerprint:
    """Fingerprint ``raw``, the body bytes after content-encoding decode.

    ``parsed``: the result of the caller's own ``_json.loads(raw)``, taken before any
    mutation, so the body is not parsed twice. Omitted: ``raw`` is parsed here, and a
    body that does not parse is not text comparable (this never raises for bad input).

    ``wire_hash``: the hex digest of ``raw`` from a blake3 hasher the caller fed while
    reading, so memory is not hashed twice. It is trusted to be the digest of ``raw``.
    """
    if wire_hash is None:
        digest = _wire_hash(raw)
    elif len(wire_hash) == 64 and _HEX_DIGITS.issuperset(wire_hash):
        digest = wire_hash
    else:
        raise ValueError(f"wire_hash must be a 64-character lowercase hex blake3 digest, got {wire_hash!r}")
    if parsed is UNPARSED:
        try:
            parsed = _json.loads(raw)
        except _json.JSONDecodeFailure:
            return Fingerprint(wire_hash=digest, text_comparable=False, size=len(raw))
    return Fingerprint(wire_hash=digest, text_comparable=text_comparable(parsed), size=len(raw))


# Conversation keys, in priority order: OpenAI chat and Anthropic, OpenAI Responses, Gemini.
_CONVERSATION_KEYS: Final = ("messages", "input", "contents")
# Part types that carry text (or a tool call / result of text); any other type is media,
# a file, a thinking block... and makes the body not comparable.
_TEXT_TYPES: Final = frozenset(
    {
        "message",
        "text",
        "input_text",
        "output_text",
        "tool_use",
        "tool_result",
        "function_call",
        "function_call_output",
    }
)
# Tool calls: comparable without looking inside; their arguments are the tool's own JSON,
# where a "type" key means nothing to us.
_OPAQUE_TYPES: Final = frozenset({"tool_use", "function_call"})
# The keys of an object the walk reads (``_lazy._Node`` holds only these of an object it looks into).
_NODE_KEYS: Final = frozenset({"type", "audio", "content", "output", "parts", "text", "tool_calls"})
_LEAVES: Final = (str, type(None))  # comparable as they stand


def text_comparable(parsed: Any) -> bool:
    """Whether the first parse of a body is a plain-text conversation.

    The walk covers the conversation (``messages``, else ``input``, else ``contents``) and
    a top-level ``system``. ``null`` and strings are comparable, a list when all of its
    elements are; numbers and booleans are not. An object is not comparable when its
    ``type`` is not a text type or it has a non-null ``audio``; ``tool_use`` and
    ``function_call`` objects are comparable as they stand; otherwise the verdict is that
    of the first of ``content``, ``output``, ``parts`` present, and failing those the
    object needs a string ``text`` or a list ``tool_calls``.

    How real shapes land:

    - OpenAI chat ``{"role": "user", "content": "hi"}``, and ``content`` as a list of
      ``{"type": "text"}`` parts: comparable. ``image_url``, ``input_audio``, ``file``
      parts: not.
    - OpenAI assistant tool call ``{"role": "assistant", "content": null, "tool_calls":
      [...]}``: ``content`` is present and null, so comparable; the ``tool_calls``
      elements (``"type": "function"``) are never visited. Without a ``content`` key the
      ``tool_calls`` list makes it comparable. Assistant audio (``"audio": {"id": ...}``):
      not. Tool results ``{"role": "tool", "content": "..."}``: comparable.
    - Anthropic ``content`` blocks ``text``, ``tool_use`` (its ``input`` is not visited),
      ``tool_result`` (its ``content`` is walked: text is comparable, an image is not);
      ``image``, ``document``, ``thinking``, ``redacted_thinking``: not. ``system`` as a
      string or a list of ``text`` blocks: comparable (``cache_control`` is not visited).
    - OpenAI Responses: ``input`` as a string, or items with ``input_text`` /
      ``output_text`` parts, ``function_call`` (``arguments`` not visited),
      ``function_call_output`` (its ``output`` is walked): comparable; ``input_image``,
      ``input_file``, ``reasoning``: not.
    - Gemini ``contents[].parts[]``: ``{"text": ...}`` is comparable; ``inlineData``,
      ``fileData``, ``functionCall``, ``functionResponse`` parts have no ``text``: not.
      ``systemInstruction`` is not walked.
    - Not an object, or none of the conversation keys (``{}``, a JSON array or scalar):
      not comparable. An empty conversation (``"messages": []``) is vacuously comparable.

    The walk is iterative (no recursion limit to hit), visits each container once (so a
    cyclic or heavily shared Python structure cannot make it loop or blow up), stops at
    the first non-comparable node, looks keys up by name (key order does not matter), and
    never raises.
    """
    if not isinstance(parsed, dict):
        return False
    for key in _CONVERSATION_KEYS:
        if key in parsed:
            seen: set[int] = set()  # one for both: what the system and the conversation share is walked once
            return _comparable(parsed[key], seen) and ("system" not in parsed or _comparable(parsed["system"], seen))
    return False


def judge(node: Any) -> bool:
    """``text_comparable``'s verdict on one value of a conversation (a message, a part, a list of them)."""
    return _comparable(node, set())


def _comparable(node: Any, seen: set[int]) -> bool:
    """``text_comparable``'s walk from ``node``, past the containers in ``seen`` (it adds those it enters)."""
    # Lists are walked through iterators, never copied: the walk's own memory follows the
    # depth of the conversation, not its length. The bottom one is endless: the walk is over
    # when it yields _END.
    lists: list[Iterator[Any]] = [_ENDLESS]
    while node is not _END:
        # An object has at most one child to walk (the first of content, output, parts): it is
        # followed here, in place, until the chain ends in a leaf, a list or a verdict.
        while True:
            if isinstance(node, _LEAVES):
                break
            if not isinstance(node, (list, dict)):
                return False  # numbers, booleans
            if id(node) in seen:
                break
            seen.add(id(node))
            if isinstance(node, list):
                lists.append(iter(node))
                break
            if "type" in node:
                # A present type must be a text type; null or a non-string counts as "set"
                # (and is not hashed: a list there must not raise).
                part_type = node["type"]
                if not isinstance(part_type, str) or part_type not in _TEXT_TYPES:
                    return False
                if part_type in _OPAQUE_TYPES:
                    break
            if node.get("audio") is not None:
                return False
            if "content" in node:
                node = node["content"]
            elif "output" in node:
                node = node["output"]
            elif "parts" in node:
                node = node["parts"]
            elif isinstance(node.get("text"), str) or isinstance(node.get("tool_calls"), list):
                break
            else:
                return False
        node = next(lists[-1], _DONE)
        while node is _DONE:
            lists.pop()
            node = next(lists[-1], _DONE)
    return True
