from __future__ import annotations

import json
import weakref
from typing import Any

import anyio
import pytest

from asgi_lifetime import _json
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._resources import RequestResources
from asgi_lifetime._stats import Counters
from asgi_lifetime.gateway._prepare import Draft, Prepared, Preparer, prepare
from asgi_lifetime.gateway._refold import Conversation, Refold

from .._spy import spy_parse as spy_on

pytestmark = pytest.mark.anyio

RAW = b'{"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}'
HEADERS = [("content-type", "application/json"), ("x-trace", "1")]


class Message(dict[str, Any]):
    """A dict that can be weakly referenced, to watch the parsed graph die."""


async def run(
    preparers: list[Preparer],
    raw: bytes = RAW,
    parsed: Any = None,
    resources: RequestResources | None = None,
    **options: Any,
) -> Prepared:
    """``prepare`` of ``raw`` (parsed here unless given) as session s1's chat request; ``options``
    replace any other argument."""
    parsed = _json.loads(raw) if parsed is None else parsed
    arguments: dict[str, Any] = {
        "preparers": preparers,
        "fingerprint": fingerprint(raw, parsed=parsed),
        "session_id": "s1",
        "method": "POST",
        "path": "/v1/chat/completions?stream=true",
        "headers": HEADERS,
        "resources": resources or RequestResources(Counters()),
    }
    return await prepare(raw, parsed, **{**arguments, **options})


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
    assert changed.body is not None and json.loads(bytes(changed.body))["model"] == "other"


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
    assert prepared.body is not None and json.loads(bytes(prepared.body))["messages"][0]["content"] == "be brief"


async def test_preparer_headers_are_added_and_replace_same_name() -> None:
    def headers(draft: Draft) -> None:
        draft.headers["X-Trace"] = "2"
        draft.headers["x-routed"] = "yes"

    prepared = await run([headers])
    assert prepared.headers == [("content-type", "application/json"), ("X-Trace", "2"), ("x-routed", "yes")]
    assert prepared.body is RAW  # headers alone do not re-serialize


async def test_add_resource_registers_with_the_request_scope() -> None:
    counters = Counters()
    scope = RequestResources(counters)
    released: list[str] = []
    kept: list[Draft] = []

    def fork(draft: Draft) -> None:
        draft.add_resource(lambda: released.append("fork"))
        kept.append(draft)

    await run([fork], resources=scope)
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


async def test_no_parse_outlives_prepare_and_the_closures_work_from_the_outbound_body() -> None:
    message = Message(role="user", content="hi")
    parsed = {"model": "m", "messages": [Message(role="system", content="s"), message]}
    first_graph = weakref.ref(message)
    replaced: list[weakref.ref[Message]] = []

    def rewrite(draft: Draft) -> None:
        new = Message(role="user", content="rewritten " + "x" * 100)
        replaced.append(weakref.ref(new))
        draft.body = {
            "model": "m",
            "messages": [Message(role="developer", content="d"), new, Message(role="user", content="q")],
        }

    prepared = await run([rewrite], parsed=parsed)
    del parsed, message
    assert first_graph() is None  # replaced by the preparer and held by nobody
    assert replaced[0]() is None  # serialized and dropped: the closures do not need the graph
    assert prepared.body is not None
    assert json.loads(bytes(prepared.body))["messages"][1]["content"].startswith("rewritten")
    assert prepared.refold is not None and prepared.remap_role is not None
    # The closures re-parse the current outbound body and keep nothing: no cell holds a parse.
    for closure in (prepared.refold, prepared.remap_role):
        assert closure.__closure__ is not None
        assert all(not isinstance(cell.cell_contents, dict | list) for cell in closure.__closure__)
    renamed = prepared.remap_role("developer", "system")
    assert renamed is not None and json.loads(renamed)["messages"][0]["role"] == "system"
    assert prepared.remap_role("tool", "user") is None
    prepared.body = renamed  # what the upstream does with an accepted new body
    refolded = prepared.refold(None)
    assert refolded is not None
    assert json.loads(refolded)["messages"] == [
        {"role": "system", "content": "d"},  # a refold continues from the renamed body
        {"role": "user", "content": "q"},
    ]
    refold = weakref.ref(prepared.refold)
    prepared.settle(retain_outbound=True)
    assert refold() is None
    assert prepared.body is not None


async def test_unchanged_body_closures_do_not_keep_the_parse() -> None:
    message = Message(role="user", content="hi")
    parsed = {"model": "m", "messages": [Message(role="system", content="s"), message]}
    graph = weakref.ref(message)
    raw = _json.dumps(parsed)
    prepared = await run([], raw=raw, parsed=parsed)
    del parsed, message
    assert prepared.body is raw
    assert graph() is None
    assert prepared.remap_role is not None
    renamed = prepared.remap_role("system", "developer")
    assert renamed is not None and json.loads(renamed)["messages"][0] == {"role": "developer", "content": "s"}


async def test_a_custom_refold_factory_gets_the_final_parse_until_settle() -> None:
    seen: list[Conversation] = []

    def factory(conversation: Conversation) -> Refold:
        seen.append(conversation)
        return lambda window: conversation.replace(conversation.items[-1:])

    def add(draft: Draft) -> None:
        draft.body["messages"].append(Message(role="user", content="more"))
        draft.mark_changed()

    scope = RequestResources(Counters())
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    parsed = _json.loads(raw)
    prepared = await run([add], raw, parsed, scope, session_id=None, path="/", headers=[], refold_factory=factory)
    del parsed
    added = weakref.ref(seen[0].items[-1])
    assert len(seen[0].items) == 2  # serialized without emptying: the custom closure sees the whole parse
    assert prepared.body == _json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]}
    )
    assert prepared.refold is not None and prepared.remap_role is not None
    assert prepared.refold(None) == b'{"model":"m","messages":[{"role":"user","content":"more"}]}'
    seen.clear()
    prepared.settle(retain_outbound=True)
    assert added() is None


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


# ---------------------------------------------------------------------------------------------
# A body whose parse was deferred (the middleware's handoff_parsed="on_demand")

LARGE = _json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "some words " * 1000}, {"role": "assistant", "content": "ok é"}] * 20,
        "stream": True,
    }
)


def deferred(raw: bytes, charged: list[int] | None = None) -> Any:
    from asgi_lifetime._lazy import DeferredParse, shape

    found = shape(raw)
    assert found is not None

    async def charge(total: int) -> None:
        (charged if charged is not None else []).append(total)

    return DeferredParse(found, charge)


def spy_parse(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Count full parses (``_parse.parse_body``, what ``DeferredParse.parse`` runs)."""
    from asgi_lifetime import _lazy

    return spy_on(monkeypatch, _lazy)


async def test_deferred_without_preparers_is_forwarded_unparsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parses = spy_parse(monkeypatch)
    prepared = await run([], raw=LARGE, parsed=deferred(LARGE))
    assert prepared.body is LARGE
    assert parses == []
    assert prepared.refold is not None and prepared.remap_role is not None
    renamed = prepared.remap_role("assistant", "model")  # the closures re-parse the outbound body
    assert renamed is not None and json.loads(renamed)["messages"][1]["role"] == "model"


@pytest.mark.parametrize("spelling", ["compact", "newline", "empty", "empty, spaced", "spaced", "escaped", "twice"])
async def test_a_without_parse_preparer_splices_into_the_received_bytes(
    monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """Into the bytes as received when the array can be located; where the key is written so that
    it cannot (whitespace before the colon, escapes), the body is parsed and serialized instead."""
    from asgi_lifetime.gateway import without_parse

    doc = json.loads(LARGE)
    if spelling.startswith("empty"):
        doc["messages"] = []
        doc["pad"] = "x" * 100_000
    raw = _json.dumps(doc) + (b"\n" if spelling == "newline" else b"")
    if spelling == "empty, spaced":
        raw = raw.replace(b'"messages":[]', b'"messages":[ \n]')
    elif spelling == "spaced":
        raw = raw.replace(b'"messages":', b'"messages" : ')
    elif spelling == "escaped":
        raw = raw.replace(b'"messages":', b'"\\u006dessages":')
    elif spelling == "twice":  # the last one counts: the first, a copy, stays as it was
        raw = raw.replace(b'{"model":"m",', b'{"model":"m","messages":' + _json.dumps(doc["messages"]) + b",")
    parses = spy_parse(monkeypatch)

    @without_parse
    def inject(draft: Draft) -> None:
        assert draft.conversation is not None and draft.conversation.key == "messages"
        draft.conversation.prepend({"role": "system", "content": "second"})
        draft.conversation.prepend({"role": "system", "content": "first"})
        draft.conversation.append({"role": "user", "content": "last"})
        draft.headers["x-injected"] = "1"

    prepared = await run([inject], raw=raw, parsed=deferred(raw))
    assert prepared.body is not None
    expected = dict(doc)
    expected["messages"] = [
        {"role": "system", "content": "first"},
        {"role": "system", "content": "second"},
        *doc["messages"],
        {"role": "user", "content": "last"},
    ]
    assert json.loads(bytes(prepared.body)) == expected
    if spelling in ("spaced", "escaped"):
        assert parses == [raw]
    else:
        assert parses == []
        at = raw.rindex(b'"messages":') + len(b'"messages":[')
        assert bytes(prepared.body).startswith(raw[:at])  # the rest as received, not re-serialized
    assert ("x-injected", "1") in prepared.headers


async def test_a_preparer_that_reads_the_body_gets_the_parse_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Existing preparers keep working: the parse is built (charged) before the first that may read it,
    with what earlier ``without_parse`` preparers added."""
    from asgi_lifetime.gateway import without_parse

    parses = spy_parse(monkeypatch)
    charged: list[int] = []

    @without_parse
    def inject(draft: Draft) -> None:
        assert draft.conversation is not None
        draft.conversation.prepend({"role": "system", "content": "policy"})

    def route(draft: Draft) -> None:
        assert draft.body["messages"][0] == {"role": "system", "content": "policy"}
        draft.body["model"] = "other"
        draft.mark_changed()

    prepared = await run([inject, route], raw=LARGE, parsed=deferred(LARGE, charged))
    assert parses == [LARGE] and charged and charged[-1] > len(LARGE)  # the parse was charged
    assert prepared.body is not None
    body = json.loads(bytes(prepared.body))
    assert body["model"] == "other" and body["messages"][0]["content"] == "policy"
    assert len(body["messages"]) == 41


async def test_without_parse_reading_the_body_is_an_error() -> None:
    from asgi_lifetime.gateway import without_parse

    @without_parse
    def liar(draft: Draft) -> None:
        draft.body["model"] = "x"

    with pytest.raises(RuntimeError, match="without_parse"):
        await run([liar], raw=LARGE, parsed=deferred(LARGE))


async def test_the_conversation_view_of_a_parsed_body_changes_the_parse() -> None:
    def inject(draft: Draft) -> None:
        assert draft.conversation is not None
        draft.conversation.prepend({"role": "system", "content": "policy"})

    prepared = await run([inject])
    assert prepared.body is not None
    assert json.loads(bytes(prepared.body))["messages"] == [
        {"role": "system", "content": "policy"},
        {"role": "user", "content": "hi"},
    ]


async def test_a_custom_refold_factory_gets_the_deferred_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    parses = spy_parse(monkeypatch)
    seen: list[Conversation] = []

    def factory(conversation: Conversation) -> Refold:
        seen.append(conversation)
        return lambda window: None

    prepared = await prepare(
        LARGE,
        deferred(LARGE),
        preparers=[],
        fingerprint=fingerprint(LARGE),
        session_id=None,
        method="POST",
        path="/v1/chat/completions",
        headers=HEADERS,
        resources=RequestResources(Counters()),
        refold_factory=factory,
    )
    assert parses == [LARGE] and prepared.body is LARGE
    assert seen and seen[0].key == "messages" and len(seen[0].items) == 40


@pytest.mark.parametrize(("size", "emptied"), [(1024, False), (64 * 1024, True)])
async def test_a_changed_body_is_serialized_emptying_its_conversation_only_from_64_kib(
    size: int, emptied: bool
) -> None:
    """From 64 KiB received the conversation is emptied as it is written (the parse shrinks while the new
    body grows); a smaller body is serialized in one go (the same bytes, a third of the CPU)."""
    kept: list[list[Any]] = []

    def prepend(draft: Draft) -> None:
        messages = draft.body["messages"]
        messages.insert(0, {"role": "system", "content": "s"})
        draft.mark_changed()
        kept.append(messages)  # what a preparer holds on to sees how the body was serialized

    filler = "x" * size
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": filler}]}).encode()
    prepared = await run([prepend], raw=raw)
    assert prepared.body is not None and json.loads(bytes(prepared.body))["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": filler},
    ]
    assert (kept[0] == []) is emptied
