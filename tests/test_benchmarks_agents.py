"""The many-agents benchmark's conversations (benchmarks/agents.py): every body an agent sends is a
valid chat request, distinct per agent, and one turn longer than the last."""

from __future__ import annotations

import json
import random

from benchmarks.agents import _in_flight, _Request, _turn, conversation_parts


def test_agent_bodies_are_valid_distinct_and_grow_by_one_turn() -> None:
    head, middle = conversation_parts(256 * 1024, 7)
    shared = json.loads(head + middle + b"]}")
    bodies: dict[int, list[dict[str, object]]] = {}
    for agent in (0, 1):
        rng, turns = random.Random(agent), b""
        for turn in (1, 2, 3):
            turns += _turn(rng, agent, turn)
            body = json.loads(b"".join((head, f"[agent {agent}] ".encode(), middle, turns, b"]}")))
            assert body["max_tokens"] == 7 and body["stream"] is True
            assert body["messages"][0]["content"].startswith(f"You are a coding agent. [agent {agent}] ")
            assert body["messages"][1 : -3 * turn] == shared["messages"][1:]  # the shared history, unchanged
            assert [m["role"] for m in body["messages"][-3:]] == ["user", "assistant", "tool"]
            assert len(body["messages"]) == len(shared["messages"]) + 3 * turn
        bodies[agent] = body["messages"]
    assert bodies[0] != bodies[1]


def test_in_flight_counts_sent_and_unanswered_requests() -> None:
    requests = [_Request(0.0, 1.0, 5.0, 10, True), _Request(2.0, 2.5, 3.0, 10, True)]
    times = [0.5, 2.2, 2.7, 4.0, 6.0]
    assert _in_flight(requests, times) == [1, 2, 2, 1, 0]
    assert _in_flight(requests, times, until_first_byte=True) == [1, 1, 0, 0, 0]
