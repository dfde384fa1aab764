"""Request bodies for the benchmarks: three shapes of OpenAI chat requests, at a chosen size.

- ``turns``: an agent conversation, many text turns (user prompts, assistant tool calls,
  tool results of 1-16 KiB), text comparable; the text is ASCII except in a quarter of
  the messages, which hold one of é ’ — λ (as LLM output often does; CPython then stores
  the whole string at 2 bytes per character for the last three);
- ``huge_text``: one user message holding one huge ASCII string;
- ``image``: a short text part and one large base64 ``image_url`` (not text comparable).

Bodies are deterministic (seeded) and built to within a few KiB of the asked size.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

__all__ = ["SHAPES", "make_body", "small_body"]

MiB = 1024 * 1024
SHAPES = ("turns", "huge_text", "image")

# A quarter of the messages get one non-ASCII character: é (Latin-1), or one of ’ — λ, outside
# Latin-1, which makes CPython store the whole string at 2 bytes per character.
_WIDE = ("é", "’", "—", "λ")
_WORDS = (
    "the request body of an agent grows with every turn and tool result while the answer streams for minutes "
    'def main ( ) : return None if x else y # comment "quoted" path/to/file.py line 42 error: value\n'
    "\tindented { } [ ] , ; = + - * / < > & | ! ? ' ` ~ @ $ % ^ 0 1 2 3 4 5 6 7 8 9"
).split(" ")


def _pool(rng: random.Random, size: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(size // 5)]
    text = " ".join(words)
    return (text * (size // max(1, len(text)) + 1))[:size]


def _dumps(doc: Any) -> bytes:
    # As httpx's ``json=`` (and so the OpenAI SDK) sends it: compact, UTF-8, not ASCII-escaped.
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _maybe_wide(rng: random.Random, text: str) -> str:
    if rng.random() >= 0.25:
        return text
    at = rng.randrange(len(text))
    return text[:at] + rng.choice(_WIDE) + text[at + 1 :]


def _envelope(messages: list[Any], max_tokens: int) -> dict[str, Any]:
    return {"model": "demo", "stream": True, "max_tokens": max_tokens, "messages": messages}


def _turns(size: int, max_tokens: int, rng: random.Random) -> bytes:
    pool = _pool(rng, 2 * MiB)
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent. " + pool[:2000]}]
    total = 2200
    turn = 0
    while total < size:
        turn += 1
        n = rng.randint(100, 2000)
        start = rng.randrange(len(pool) - n)
        messages.append({"role": "user", "content": _maybe_wide(rng, pool[start : start + n])})
        call_id = f"call_{turn:06d}"
        arguments = json.dumps({"path": f"src/module_{turn}.py", "start": turn})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": arguments}}
                ],
            }
        )
        m = min(rng.randint(1024, 16 * 1024), max(64, size - total))
        start = rng.randrange(len(pool) - m)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _maybe_wide(rng, pool[start : start + m])})
        total += n + m + 260
    return _dumps(_envelope(messages, max_tokens))


def _huge_text(size: int, max_tokens: int, rng: random.Random) -> bytes:
    pool = _pool(rng, 4 * MiB)
    # JSON escaping of the pool's quotes, tabs and newlines adds a little: aim slightly lower.
    n = int((size - 200) / 1.02)
    text = (pool * (n // len(pool) + 1))[:n]
    return _dumps(_envelope([{"role": "user", "content": text}], max_tokens))


def _image(size: int, max_tokens: int, rng: random.Random) -> bytes:
    raw = rng.randbytes(max(0, (size - 400) * 3 // 4))
    url = "data:image/png;base64," + base64.b64encode(raw).decode("ascii")
    content = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return _dumps(_envelope([{"role": "user", "content": content}], max_tokens))


def make_body(shape: str, size: int, *, max_tokens: int = 40, seed: int = 0) -> bytes:
    """A chat request body of about ``size`` bytes in ``shape`` (one of ``SHAPES``)."""
    builders = {"turns": _turns, "huge_text": _huge_text, "image": _image}
    if shape not in builders:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    build = builders[shape]
    body = build(size, max_tokens, random.Random(f"{seed}:{shape}:{size}"))
    if abs(len(body) - size) > size // 100:  # JSON escaping is hard to predict: correct once
        body = build(size * size // len(body), max_tokens, random.Random(f"{seed}:{shape}:{size}"))
    return body


def small_body(*, size: int = 1024, max_tokens: int = 16) -> bytes:
    """A ~``size``-byte streamed chat request (the overhead benchmark's request)."""
    head = _dumps(_envelope([{"role": "user", "content": ""}], max_tokens))
    return _dumps(_envelope([{"role": "user", "content": "x" * max(0, size - len(head))}], max_tokens))
