"""Stage prepare: preparers shape the outbound request, after the body was fingerprinted.

``prepare`` hands each preparer a ``Draft`` (the parsed body, extra headers), then builds
the ``Prepared`` holder that the forward stage sends from. The parsed graph does not
survive ``prepare``: a changed body is serialized while its conversation list is emptied
item by item (``_json.dumps_consuming``), and the default refold / role-remap closures
re-parse the outbound body (``Prepared.body``) on the rare rejection that needs them,
keeping nothing between calls. ``Prepared.settle`` drops the closures once upstream
retries are over, so no request input outlives the retries except, optionally, the
outbound body. (A custom ``refold_factory`` or ``remap_factory`` is handed a
``Conversation`` of the parse, as before: then the closures keep the parse alive until
retries settle, and a changed body is serialized without emptying it.)::

    fp = fingerprint(raw, parsed=parsed)
    prepared = await prepare(raw, parsed, preparers=[route_model], fingerprint=fp, session_id=sid,
                             method="POST", path="/v1/chat/completions", headers=outbound, resources=resources)
    del raw, parsed                     # the caller's own references go too
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

from .. import _json
from .._fingerprint import Fingerprint
from .._lazy import DeferredParse
from .._parse import too_costly
from .._resources import RequestResources
from ._memory import TRIM_THRESHOLD, trim_after_large_request
from ._refold import Conversation, Refold, RemapRole, default_refold, default_remap_role
from ._retry import Retry
from ._spill import SLICE, SpilledBody  # at run time: typing.get_type_hints resolves Prepared.spill_to's hints

__all__ = ["ConversationView", "Draft", "Prepared", "Preparer", "Spliced", "prepare", "without_parse"]

_INSIDE: Final = re.compile(rb"[ \t\n\r]*")
"""The whitespace after an array's ``[``: if it reaches the ``]``, the array is empty."""
_TRIM_EVERY: Final = TRIM_THRESHOLD
"""While a large changed body is serialized, give the freed parse back to the OS this often (bytes written)."""
_CONSUME_FROM: Final = 64 * 1024
"""A changed body from this size (received) is serialized emptying its conversation as it goes
(``_json.dumps_consuming``). Below it the parse and the new body together take a few hundred KiB at
most, so emptying saves no memory worth its cost: ``_json.dumps`` writes the same bytes in a third
of the time (most requests are small)."""


class Draft:
    """What a preparer sees of a request and may change.

    Assigning ``draft.body`` marks the body changed; after changing it in place, call
    ``mark_changed()``. An unchanged body is forwarded byte for byte as received. The body
    belongs to the request: when it changed, its conversation list (``messages``,
    ``input`` or ``contents``) is emptied while it is serialized, so a preparer that wants
    to keep that list after it returns keeps a copy.

    ```python
    def route_model(draft: Draft) -> None:
        draft.body["model"] = "gpt-4.1-mini"
        draft.mark_changed()
        draft.headers["x-routed"] = "1"
    ```

    ``draft.conversation`` adds messages without reading the body; a preparer that uses only it
    (and the headers) is declared ``@without_parse``: then, if no other preparer reads
    ``draft.body``, the body is never parsed and the new messages are spliced into the bytes
    as received.
    """

    __slots__ = ("_body", "_changed", "_resources", "_first", "_last", "headers", "fingerprint", "session_id", "path")

    def __init__(
        self, body: Any, *, fingerprint: Fingerprint, session_id: str | None, path: str, resources: RequestResources
    ) -> None:
        self._body = body
        self._changed = False
        self._resources: RequestResources | None = resources
        self._first: list[Any] = []  # what the conversation gains before and after its items,
        self._last: list[Any] = []  # while the body is not parsed (a DeferredParse)
        self.headers: dict[str, str] = {}
        self.fingerprint = fingerprint
        self.session_id = session_id
        self.path = path

    @property
    def body(self) -> Any:
        """The parsed JSON body (mutable)."""
        if isinstance(self._body, DeferredParse):
            raise RuntimeError("a preparer declared @without_parse read draft.body: remove the declaration")
        return self._body

    @body.setter
    def body(self, value: Any) -> None:
        self._body = value
        self._first, self._last = [], []  # what was added to the body it replaces goes with it
        self._changed = True

    @property
    def conversation(self) -> ConversationView | None:
        """The body's ``messages``, ``input`` or ``contents`` array, to extend; None if it has none."""
        body = self._body
        if isinstance(body, DeferredParse):
            key = body.conversation
        else:
            found = Conversation.of(body)
            key = found.key if found is not None else None
        return ConversationView(self, key) if key is not None else None

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        """Declare an in-place change to ``body``, so it is serialized again."""
        self._changed = True

    def add_resource(self, release: Callable[[], object]) -> None:
        """Register ``release`` (sync, or returning an awaitable) to run when the request settles."""
        if self._resources is None:
            raise RuntimeError("the draft is closed: register resources while the preparer runs")
        self._resources.add(release)

    def _close(self) -> Any:
        """Take the body out: a preparer that kept a reference to the draft keeps nothing."""
        body, self._body, self._resources = self._body, None, None
        return body

    def _needs_parse(self, preparer: Preparer) -> bool:
        """Whether the parse must exist before ``preparer`` runs: materialised on demand, for the first
        preparer that may read it, or for any when nobody looked into the body (whether it has a
        conversation to add to is unknown: a preparer must not skip its messages on a body shaped to
        be too costly to parse)."""
        body = self._body
        return isinstance(body, DeferredParse) and (not body.shaped or not is_without_parse(preparer))

    async def _parse(self, raw: bytes) -> None:
        """Build the parse the body was deferred from (charged, bounded), with the messages added so far."""
        deferred = self._body
        if not isinstance(deferred, DeferredParse):
            return
        self._body = await _parsed_with(deferred, raw, self._first, self._last)
        self._first, self._last = [], []


class ConversationView:
    """A request's conversation (``draft.conversation``), to add messages to without parsing the body.

    ```python
    @without_parse
    def add_policy(draft: Draft) -> None:
        if draft.conversation is not None:
            draft.conversation.prepend({"role": "system", "content": "Be brief."})
    ```
    """

    __slots__ = ("_draft", "key")

    def __init__(self, draft: Draft, key: str) -> None:
        self._draft = draft
        self.key = key
        """``messages``, ``input`` or ``contents``."""

    def prepend(self, item: Any) -> None:
        """Insert ``item`` before the first message (the last prepended comes first)."""
        self._add(item, first=True)

    def append(self, item: Any) -> None:
        """Add ``item`` after the last message."""
        self._add(item, first=False)

    def _add(self, item: Any, *, first: bool) -> None:
        draft = self._draft
        if draft._resources is None:
            raise RuntimeError("the draft is closed: change the conversation while the preparer runs")
        if isinstance(draft._body, DeferredParse):
            if first:
                draft._first.insert(0, item)
            else:
                draft._last.append(item)
        elif first:
            draft._body[self.key].insert(0, item)
        else:
            draft._body[self.key].append(item)
        draft._changed = True


Preparer = Callable[[Draft], Awaitable[None] | None]
"""A sync or async callable that may change a ``Draft``."""

P = TypeVar("P", bound=Preparer)
_WITHOUT_PARSE: Final = "__asgi_lifetime_without_parse__"


def is_without_parse(preparer: Preparer) -> bool:
    """Whether ``preparer`` was declared ``without_parse``."""
    return bool(getattr(preparer, _WITHOUT_PARSE, False))


def without_parse(preparer: P) -> P:
    """Declare that ``preparer`` does not read ``draft.body`` (only ``draft.conversation``, the headers
    and the request's facts), so the body need not be parsed for it."""
    setattr(preparer, _WITHOUT_PARSE, True)
    return preparer


class Spliced:
    """An outbound body made of the received one and the items a preparer added, without copying the
    received bytes: ``parts``, in order, are views into them and the serialized additions.

    Sent (and written to disk) part by part; ``bytes(spliced)`` joins them, for the rare reader that
    needs one piece (a refold parses the body). Compares equal to the bytes it stands for.
    """

    __slots__ = ("parts", "_size")

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        # Views as bytes: a view of another format counts items, not bytes (its Content-Length would lie).
        self.parts: tuple[bytes | memoryview, ...] = tuple(
            part.cast("B") if isinstance(part, memoryview) else part for part in parts
        )
        self._size = sum(len(part) for part in self.parts)

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Spliced):
            other = bytes(other)
        if not isinstance(other, bytes | bytearray | memoryview):
            return NotImplemented
        view = memoryview(other).cast("B")
        if len(view) != self._size:
            return False
        start = 0
        for part in self.parts:
            if view[start : start + len(part)] != part:
                return False
            start += len(part)
        return True

    __hash__ = None  # type: ignore[assignment]  # equal to bytes, which hash differently

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (fewer at the end), as one new bytes object."""
        pieces: list[bytes | memoryview] = []
        start = 0
        end = offset + size
        for part in self.parts:
            stop = start + len(part)
            if stop > offset and start < end:
                pieces.append(memoryview(part)[max(offset - start, 0) : min(end, stop) - start])
            start = stop
        return b"".join(pieces)

    def __repr__(self) -> str:
        return f"<Spliced {self._size} bytes in {len(self.parts)} parts>"


class Prepared:
    """A request's outbound state: the holder the forward stage reads from, cleared at release points.

    ``refold`` and ``remap_role`` build a new body from the current one on a rejection (the
    default ones re-parse ``body``; custom factories' closures may hold the parse);
    ``settle()`` drops them (and, unless the outbound body is retained, the body). ``body`` is
    bytes, or a ``Spliced`` body (the received bytes with added items, not copied). A retained
    body may then move to disk (``spill_to``, ``RETAIN_OUTBOUND=disk``): ``body`` is None and
    ``spilled`` holds it; ``has_body`` and ``body_size`` answer for either place. ``attempts``
    counts the times it was sent upstream (retries and a re-issue included), and ``upstream`` is the
    base URL of the last of them (None until one is made), for bookkeeping. ``retry`` is where the
    retry policy stood after the last of them (numbers and URLs only): a re-issue is one more attempt
    under it.
    """

    __slots__ = (
        "method",
        "path",
        "headers",
        "body",
        "spilled",
        "refold",
        "remap_role",
        "attempts",
        "upstream",
        "retry",
        "_settled",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | Spliced | None,
        refold: Refold | None = None,
        remap_role: RemapRole | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.spilled: SpilledBody | None = None
        self.refold = refold
        self.remap_role = remap_role
        self.attempts = 0
        self.upstream: str | None = None
        self.retry: Retry | None = None
        self._settled = False

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def has_body(self) -> bool:
        """An outbound body is held, in memory (``body``) or on disk (``spilled``)."""
        return self.body is not None or self.spilled is not None

    @property
    def body_size(self) -> int:
        """The outbound body's length, wherever it is held (0 without one)."""
        if self.body is not None:
            return len(self.body)
        return self.spilled.size if self.spilled is not None else 0

    def settle(self, *, retain_outbound: bool) -> None:
        """Retries are over: drop the refold and remap closures, and the body unless retained. Idempotent."""
        self._settled = True
        self.refold = None
        self.remap_role = None
        if not retain_outbound:
            self.release_body()

    def spill_to(self, spilled: SpilledBody) -> None:
        """The retained body now lives in ``spilled`` (a copy of it on disk): drop the one in memory."""
        if not self._settled:
            raise RuntimeError("only a settled request's body moves to disk: retries may still change it")
        self.spilled = spilled
        self.body = None

    def release_body(self) -> None:
        """Drop the outbound body, and close its file if it was on disk (e.g. once a retained body is
        no longer needed). Idempotent."""
        self.body = None
        spilled, self.spilled = self.spilled, None
        if spilled is not None:
            spilled.close()

    def __repr__(self) -> str:
        if self.body is not None:
            size = f"{len(self.body)} bytes"
        elif self.spilled is not None:
            size = f"{self.spilled.size} bytes on disk"
        else:
            size = "released"
        return f"<Prepared {self.method} {self.path} body={size} settled={self._settled}>"


def _merge_headers(headers: Sequence[tuple[str, str]], extra: dict[str, str]) -> list[tuple[str, str]]:
    """``headers`` with the draft's extra headers added; an extra header replaces one of the same name."""
    replaced = {name.lower() for name in extra}
    return [(k, v) for k, v in headers if k.lower() not in replaced] + list(extra.items())


async def prepare(
    raw: bytes,
    parsed: Any,
    *,
    preparers: Sequence[Preparer],
    fingerprint: Fingerprint,
    session_id: str | None,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    resources: RequestResources,
    refold_factory: Callable[[Conversation], Refold] = default_refold,
    remap_factory: Callable[[Conversation], RemapRole] = default_remap_role,
    malloc_trim: bool = True,
) -> Prepared:
    """Run ``preparers`` in order on a draft of the request and build its ``Prepared`` holder.

    ``raw`` is the body as received, ``parsed`` its first parse (taken before any change).
    If no preparer changed the body, ``Prepared.body`` is ``raw`` itself; otherwise the
    body is serialized once, after this function dropped its reference to ``raw`` (pass the
    only one, and the received body is freed before the new one is built), emptying the
    conversation list as it goes. ``refold`` and ``remap_role`` are set for chat-shaped
    bodies (a ``messages``, ``input`` or ``contents`` list); the default ones re-parse
    ``Prepared.body`` when called and hold no parse. Custom factories are given a
    ``Conversation`` of the final parse instead, which their closures then keep alive
    until ``Prepared.settle()``. ``malloc_trim`` is the ``MALLOC_TRIM`` setting: whether the
    freed parse goes back to the OS while a large changed body is serialized.

    ``parsed`` may be a ``DeferredParse`` (the middleware's ``handoff_parsed="on_demand"``): the
    parse is then built here, charged and bounded, only if a preparer or a custom factory needs it.
    """
    custom = refold_factory is not default_refold or remap_factory is not default_remap_role
    draft = Draft(parsed, fingerprint=fingerprint, session_id=session_id, path=path, resources=resources)
    del parsed  # the draft is its one holder here: a replaced body can be freed while preparers run
    try:
        for preparer in preparers:
            if draft._needs_parse(preparer):
                await draft._parse(raw)
            result = preparer(draft)
            if inspect.isawaitable(result):
                await result
        if custom:
            await draft._parse(raw)  # a custom factory gets the parse
    except BaseException:
        draft._close()
        raise
    changed, extra, first, last = draft.changed, dict(draft.headers), draft._first, draft._last
    graph = draft._close()
    if isinstance(graph, DeferredParse):
        # Nobody read the body: forward it as received, with the added messages spliced in.
        body = await _forwarded_unparsed(raw, graph, first, last)
        if body is not None:
            del raw
            return _unchanged(
                body, graph.conversation, method=method, path=path, headers=_merge_headers(headers, extra)
            )
        # Where to splice could not be told without the parse (a key written with whitespace or
        # escapes): build it (charged, bounded), with the added messages, and serialize it below.
        graph = await _parsed_with(graph, raw, first, last)
    conversation = Conversation.of(graph)
    if conversation is not None and (refold_factory is not default_refold or remap_factory is not default_remap_role):
        # A custom factory gets the parse (and keeps it until retries settle): serialize it intact.
        if changed:
            del raw
            body = _json.dumps(graph)
        else:
            body = raw
        return Prepared(
            method=method,
            path=path,
            headers=_merge_headers(headers, extra),
            body=body,
            refold=refold_factory(conversation),
            remap_role=remap_factory(conversation),
        )
    key = conversation.key if conversation is not None else None
    del conversation
    if changed:
        # The received body is not sent: let it go before the new one is built, so the two never
        # coexist (the gateway hands over its only reference to it).
        size = len(raw)
        del raw
        if key is None or size < _CONSUME_FROM:
            body = _json.dumps(graph)
        else:
            # The conversation is dropped item by item as it is written: the parse shrinks as the body grows.
            body = _json.dumps_consuming(
                graph,
                key,
                every=_TRIM_EVERY if malloc_trim and size >= TRIM_THRESHOLD else 0,
                progress=functools.partial(trim_after_large_request, TRIM_THRESHOLD, enabled=malloc_trim),
            )
    else:
        body = raw
    del graph  # nothing below needs the parse: the closures re-parse the outbound body
    prepared = Prepared(method=method, path=path, headers=_merge_headers(headers, extra), body=body)
    if key is not None:
        prepared.refold, prepared.remap_role = _from_outbound(prepared)
    return prepared


def _unchanged(
    body: bytes | Spliced, conversation: str | None, *, method: str, path: str, headers: Sequence[tuple[str, str]]
) -> Prepared:
    """The ``Prepared`` of a body nobody parsed: refold and role remap work from the outbound body."""
    prepared = Prepared(method=method, path=path, headers=list(headers), body=body)
    if conversation is not None:
        prepared.refold, prepared.remap_role = _from_outbound(prepared)
    return prepared


async def _forwarded_unparsed(
    raw: bytes, deferred: DeferredParse, first: list[Any], last: list[Any]
) -> bytes | Spliced | None:
    """The body to forward without its parse: as received, or with ``first`` and ``last`` spliced into
    its conversation; None when where to splice cannot be told without the parse."""
    if not (first or last):
        return raw
    span = await deferred.locate(raw)
    return _splice(raw, span, first, last) if span is not None else None


async def _parsed_with(deferred: DeferredParse, raw: bytes, first: list[Any], last: list[Any]) -> Any:
    """The parse of ``raw`` with ``first`` and ``last`` added to its conversation."""
    parsed = await deferred.parse(raw)
    if not (first or last):
        return parsed
    items = parsed[deferred.conversation]
    items[:0] = first
    items.extend(last)
    return parsed


def _splice(raw: bytes, span: tuple[int, int], first: list[Any], last: list[Any]) -> bytes | Spliced:
    """``raw`` with ``first`` and ``last`` serialized into the array at ``raw[span[0]:span[1]]``.

    Not copied: a ``Spliced`` body of views into ``raw`` (a copy of a 64 MiB body cost as much time
    as reading it, and held it twice). A body that is sent in one slice anyway is joined.
    """
    start, end = span
    view = memoryview(raw)
    # The added items of each side are one part (their copy is small): a part each would make
    # every send slice walk thousands of parts when a preparer adds thousands of messages.
    middle: list[bytes | memoryview] = [b",".join([_json.dumps(item) for item in first])] if first else []
    inside = _INSIDE.match(raw, start + 1)  # "[ \t\n\r]*" always matches
    if inside is not None and inside.end() < end - 1:  # not "[]" nor "[ ]": its items, as received
        middle.append(view[start + 1 : end - 1])
    if last:
        middle.append(b",".join([_json.dumps(item) for item in last]))
    parts: list[bytes | memoryview] = [view[: start + 1]]
    for n, piece in enumerate(middle):
        if n:
            parts.append(b",")
        parts.append(piece)
    parts.append(view[end - 1 :])
    del middle, view
    spliced = Spliced(parts)
    return bytes(spliced) if len(spliced) <= SLICE else spliced


def _from_outbound(prepared: Prepared) -> tuple[Refold, RemapRole]:
    """``default_refold`` / ``default_remap_role`` over ``prepared.body`` as it is when they are called.

    Each call parses the current outbound body (after a refold or a rename, the upstream
    made the new body current, so the next call continues from it) and keeps nothing of the
    parse; a body whose parse would exceed ``_parse.parse_limit`` is not parsed (the call gives
    up). The holder is referenced weakly: it owns these closures, no cycle keeps its body.
    """
    holder = weakref.ref(prepared)

    def current() -> Any:
        owner = holder()
        body = owner.body if owner is not None else None
        if isinstance(body, Spliced):
            body = bytes(body)  # the parse needs one piece; gone again when this call returns
        if body is None or too_costly(body):
            # A body nobody parsed (the lazy look bounds its own walk, not the parse: nesting in
            # every message parses to 40x) is not parsed here either: the rejection goes to the client.
            return None
        return _json.loads(body)

    def refold(window: int | None) -> bytes | None:
        return default_refold(current())(window)

    def remap_role(a: str, b: str) -> bytes | None:
        return default_remap_role(current())(a, b)

    return refold, remap_role
