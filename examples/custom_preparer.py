"""Custom preparers and a custom context-overflow refold for the gateway.

Run:  python examples/custom_preparer.py     (offline: a built-in demo upstream on loopback)

Preparers run after the body was fingerprinted, on the parsed body; an unchanged body is
forwarded as the received bytes. The refold runs only when the upstream says the context is
too long, and it (with the parsed body it closes over) is released as soon as the retries are
over, before the answer streams.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import httpx

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import Conversation, Draft, create_app
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread

MODEL_ALIASES = {"fast": "demo-small", "smart": "demo-large"}


def map_model_alias(draft: Draft) -> None:
    """Clients ask for "fast" or "smart"; the upstream knows real model names."""
    model = draft.body.get("model")
    if model in MODEL_ALIASES:
        draft.body["model"] = MODEL_ALIASES[model]
        draft.mark_changed()
        draft.headers["x-model-alias"] = model


def inject_house_rules(draft: Draft) -> None:
    """Put a system prompt first, once."""
    messages = draft.body.get("messages")
    if isinstance(messages, list) and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": "Answer briefly."})
        draft.mark_changed()


def keep_task_and_recent_turns(conversation: Conversation) -> Callable[[int | None], bytes | None]:
    """On overflow keep the system prompt, the first user message (the task) and the last
    turns, and say how many were left out. Each further overflow keeps fewer turns."""
    keep = 8

    def refold(window: int | None) -> bytes | None:
        nonlocal keep
        items: list[Any] = conversation.items
        head = [m for m in items[:2] if m.get("role") in ("system", "user")]
        tail = items[len(head) :][-keep:]
        dropped = len(items) - len(head) - len(tail)
        if dropped <= 0 or keep < 1:
            return None  # nothing left to drop: the client gets the upstream's error as it was
        note = {"role": "user", "content": f"[{dropped} earlier messages omitted to fit the context window]"}
        keep //= 2
        return conversation.replace([*head, note, *tail])

    return refold


def main() -> int:
    upstream_app = create_demo_upstream(tokens_per_second=500)
    with serve_in_thread(upstream_app) as upstream:
        app = create_app(
            LifetimeSettings(upstream_url=(upstream,)),
            preparers=[map_model_alias, inject_house_rules],
            refold_factory=keep_task_and_recent_turns,
        )
        roles = ("user", "assistant")
        turns = [{"role": roles[i % 2], "content": f"turn {i} " + "x" * 2000} for i in range(60)]
        chat = {"model": "fast", "messages": turns, "max_tokens": 8}
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            # The demo upstream answers 400 context_length_exceeded to bodies over 40 KB.
            response = client.post("/v1/chat/completions", json=chat, headers={"x-demo-behaviour": "overflow=40000"})
            stats = client.get("/lifetime/stats").json()
        print("status:", response.status_code)
        print("upstream saw a body of", upstream_app.state.stats.last_body_size, "bytes (the client sent ~125 KB)")
        print("refolded:", stats["refolded"], "retained input bytes now:", stats["retained_input_bytes"])
        return 0 if response.status_code == 200 and stats["refolded"] >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
