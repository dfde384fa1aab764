"""The parse working set by body shape (section 11): what the gateway runs to judge a body, and what
that allocates, for realistic and hostile shapes of one size.

For each shape: the lazy look (``_lazy.shape``: a verdict, or None where it cannot vouch for the
body within its budget) and its tracemalloc peak; the full parse's estimate (``_parse.parse_cost``,
the figure the gateway charges and refuses by) and, where the estimate is within ``parse_limit`` so
the gateway would run it, the parse's own tracemalloc peak. A body past the limit is never parsed:
forwarded as received when nothing needs its parse, refused (413 ``body_too_complex``) when a
preparer or the app does. Peaks are of the working set, the body itself not counted.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable
from typing import Any

from asgi_lifetime import _json, _lazy, _parse
from benchmarks.bodies import make_body

__all__ = ["SHAPES", "measure"]

MiB = 1024 * 1024


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _fill(size: int, item: Callable[[int], Any], envelope: Callable[[list[Any]], Any]) -> bytes:
    """``envelope(items)`` with as many ``item(i)`` as make about ``size`` bytes."""
    one = len(_dumps(item(0))) + 1
    return _dumps(envelope([item(i) for i in range(max(1, size // one))]))


def _tokens(size: int) -> bytes:
    # Pre-tokenized embeddings input, as the OpenAI SDK sends it: rows of 5-digit token ids.
    rng = random.Random(0)
    return _fill(
        size,
        lambda _: [rng.randrange(10_000, 100_000) for _ in range(512)],
        lambda rows: {"model": "text-embedding-3-small", "input": rows},
    )


def _short_messages(size: int) -> bytes:
    text = "Done. The tests pass; next I run the linter."  # 44 characters
    return _fill(
        size,
        lambda i: {"role": ("user", "assistant")[i % 2], "content": text},
        lambda messages: {"model": "demo", "messages": messages},
    )


def _letter_blocks(size: int) -> bytes:
    # One user message of one-letter text blocks, as the Anthropic SDK test of the suite sends.
    return _fill(
        size,
        lambda _: {"type": "text", "text": "a"},
        lambda blocks: {"model": "demo", "messages": [{"role": "user", "content": blocks}]},
    )


def _empty_objects(size: int) -> bytes:
    return _fill(size, lambda _: {}, lambda items: {"model": "demo", "messages": items})


SHAPES: dict[str, Callable[[int], bytes]] = {
    "many-turn text": lambda size: make_body("turns", size),
    "image": lambda size: make_body("image", size),
    "token ids (embeddings input)": _tokens,
    "short messages (44 characters)": _short_messages,
    "one-letter text blocks": _letter_blocks,
    "empty objects": _empty_objects,
}


def _peak(run: Callable[[], Any]) -> tuple[int, Any]:
    """tracemalloc's peak while ``run()`` runs, above what was allocated before; and its result."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = run()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()


def measure(name: str, size: int) -> dict[str, Any]:
    """One row of section 11 for the shape ``name`` at about ``size`` bytes."""
    raw = SHAPES[name](size)
    look_peak, found = _peak(lambda: _lazy.shape(raw))
    estimate = _parse.parse_cost(raw)
    parsed = len(raw) + estimate <= _parse.parse_limit(len(raw))
    parse_peak = None
    if parsed:
        parse_peak, value = _peak(lambda: _json.loads(raw))
        del value
    return {
        "shape": name,
        "size": len(raw),
        "verdict": None if found is None else found.text_comparable,
        "look_peak": look_peak,
        "estimate": estimate,
        "parse_peak": parse_peak,
        "parse_ratio": _parse.PARSE_RATIO,
    }
