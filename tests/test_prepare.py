from __future__ import annotations

import json
import weakref
from typing import Any

import anyio
import pytest

from asgi_lifetime import _json
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._prepare import Draft, Prepared, Preparer, prepare
from asgi_lifetime._scope import RequestScope
from asgi_lifetime._stats import Counters

pytestmark = pytest.mark.anyio

RAW = b'{"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}'
HEADERS = [("content-type", "application/json"), ("x-trace", "1")]


class Message(dict[str, Any]):
    """A dict that can be weakly referenced, to watch the parsed graph die."""


async def run(
    preparers: list[Preparer], raw: bytes = RAW, parsed: Any = None, scope: RequestScope | None = None
) -> Prepared:
    parsed = _json.loads(raw) if parsed is None else parsed
    return await prepare(
        raw,
        parsed,
        preparers=preparers,
        fingerprint=fingerprint(raw, parsed=parsed),
        session_id="s1",
        method="POST",
        path="/v1/chat/completions?stream=true",
        headers=HEADERS,
        scope=scope or RequestScope(Counters()),
    )


async def test_unchanged_body_is_the_raw_bytes_themselves() -> None:
    seen: list[Draft] = []
    prepared = await run([seen.append])
    assert prepared.body is RAW
    assert prepared.method == "POST"
    assert prepared.path == "/v1/chat/completions?stream=true"
    assert prepared.headers == HEADERS
    assert prepared.refold is not None and prepared.remap_role is not None
    assert seen[0].session_id == "s1" and seen[0].path == "/v1/chat/completions?stream=true"
    assert seen[0].fingerprint == fingerprint(RAW)  # taken before preparers ran


async def test_assigning_the_body_serializes_once() -> None:
    def route(draft: Draft) -> None:
        draft.body = {**draft.body, "model": "gpt-4.1-mini"}

    prepared = await run([route])
    assert prepared.body == _json.dumps({"model": "gpt-4.1-mini", "messages": [{"role": "user", "content": "hi"}]})


async def test_in_place_change_needs_mark_changed() -> None:
    def forgetful(draft: Draft) -> None:
        draft.body["model"] = "other"

    def careful(draft: Draft) -> None:
        draft.body["model"] = "other"
        draft.mark_changed()

    assert (await run([forgetful])).body is RAW
    changed = await run([careful])
    assert changed.body is not None and json.loads(changed.body)["model"] == "other"


async def test_async_preparers_run_in_order() -> None:
    order: list[str] = []

    async def first(draft: Draft) -> None:
        await anyio.lowlevel.checkpoint()
        order.append("first")
        draft.body["messages"].insert(0, {"role": "system", "content": "be brief"})
        draft.mark_changed()

    def second(draft: Draft) -> None:
        order.append("second")
        assert draft.body["messages"][0]["role"] == "system"

    prepared = await run([first, second])
    assert order == ["first", "second"]
    assert prepared.body is not None and json.loads(prepared.body)["messages"][0]["content"] == "be brief"


async def test_preparer_headers_are_added_and_replace_same_name() -> None:
    def headers(draft: Draft) -> None:
        draft.headers["X-Trace"] = "2"
        draft.headers["x-routed"] = "yes"

    prepared = await run([headers])
    assert prepared.headers == [("content-type", "application/json"), ("X-Trace", "2"), ("x-routed", "yes")]
    assert prepared.body is RAW  # headers alone do not re-serialize


async def test_add_resource_registers_with_the_request_scope() -> None:
    counters = Counters()
    scope = RequestScope(counters)
    released: list[str] = []
    kept: list[Draft] = []

    def fork(draft: Draft) -> None:
        draft.add_resource(lambda: released.append("fork"))
        kept.append(draft)

    await run([fork], scope=scope)
    assert counters.live_resources == 1
    await scope.aclose()
    assert counters.live_resources == 0
    assert released == ["fork"]
    # The draft is closed once prepare returns: it holds nothing and registers nothing.
    assert kept[0].body is None
    with pytest.raises(RuntimeError, match="draft is closed"):
        kept[0].add_resource(lambda: None)


async def test_a_failing_preparer_closes_the_draft() -> None:
    kept: list[Draft] = []

    def boom(draft: Draft) -> None:
        kept.append(draft)
        raise ValueError("bad preparer")

    with pytest.raises(ValueError, match="bad preparer"):
        await run([boom])
    assert kept[0].body is None


async def test_not_a_conversation_has_no_refold_or_remap() -> None:
    raw = b'{"model": "text-embedding-3-small", "input": "a string"}'
    prepared = await run([], raw=raw)
    assert prepared.body is raw
    assert prepared.refold is None and prepared.remap_role is None


async def test_the_closures_are_the_only_holders_of_the_parsed_graph() -> None:
    message = Message(role="user", content="hi")
    parsed = {"model": "m", "messages": [Message(role="system", content="s"), message]}
    first_graph = weakref.ref(message)
    replaced: list[weakref.ref[Message]] = []

    def rewrite(draft: Draft) -> None:
        new = Message(role="user", content="rewritten")
        replaced.append(weakref.ref(new))
        draft.body = {"model": "m", "messages": [new]}

    prepared = await run([rewrite], parsed=parsed)
    del parsed, message
    assert first_graph() is None  # replaced by the preparer and held by nobody
    assert replaced[0]() is not None  # the refold closure needs the final graph
    assert prepared.refold is not None
    refold = weakref.ref(prepared.refold)
    prepared.settle(retain_outbound=True)
    assert refold() is None
    assert replaced[0]() is None
    assert prepared.body is not None


def test_settle_is_idempotent_and_release_body() -> None:
    prepared = Prepared(method="POST", path="/", headers=[], body=b"x", refold=lambda w: None)
    prepared.settle(retain_outbound=True)
    assert prepared.settled and prepared.refold is None and prepared.body == b"x"
    prepared.settle(retain_outbound=False)
    prepared.settle(retain_outbound=False)
    assert prepared.body is None
    again = Prepared(method="POST", path="/", headers=[], body=b"x")
    again.release_body()
    assert again.body is None
    assert "released" in repr(again)
