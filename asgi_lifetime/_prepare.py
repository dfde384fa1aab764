"""Stage prepare: preparers shape the outbound request, after the body was fingerprinted.

``prepare`` hands each preparer a ``Draft`` (the parsed body, extra headers), then builds
the ``Prepared`` holder that the forward stage sends from. The parsed graph survives
``prepare`` only inside the refold / role-remap closures, and ``Prepared.settle`` drops
those once upstream retries are over, so no request input outlives the retries except,
optionally, the outbound body::

    fp = fingerprint(raw, parsed=parsed)
    prepared = await prepare(raw, parsed, preparers=[route_model], fingerprint=fp, session_id=sid,
                             method="POST", path="/v1/chat/completions", headers=outbound, scope=scope)
    del raw, parsed                     # the caller's own references go too
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import _json
from ._fingerprint import Fingerprint
from ._refold import Conversation, Refold, RemapRole, default_refold, default_remap_role
from ._scope import RequestScope

__all__ = ["Draft", "Prepared", "Preparer", "prepare"]


class Draft:
    """What a preparer sees of a request and may change.

    Assigning ``draft.body`` marks the body changed; after changing it in place, call
    ``mark_changed()``. An unchanged body is forwarded byte for byte as received.

    ```python
    def route_model(draft: Draft) -> None:
        draft.body["model"] = "gpt-4.1-mini"
        draft.mark_changed()
        draft.headers["x-routed"] = "1"
    ```
    """

    __slots__ = ("_body", "_changed", "_scope", "headers", "fingerprint", "session_id", "path")

    def __init__(
        self, body: Any, *, fingerprint: Fingerprint, session_id: str | None, path: str, scope: RequestScope
    ) -> None:
        self._body = body
        self._changed = False
        self._scope: RequestScope | None = scope
        self.headers: dict[str, str] = {}
        self.fingerprint = fingerprint
        self.session_id = session_id
        self.path = path

    @property
    def body(self) -> Any:
        """The parsed JSON body (mutable)."""
        return self._body

    @body.setter
    def body(self, value: Any) -> None:
        self._body = value
        self._changed = True

    @property
    def changed(self) -> bool:
        return self._changed

    def mark_changed(self) -> None:
        """Declare an in-place change to ``body``, so it is serialized again."""
        self._changed = True

    def add_resource(self, release: Callable[[], object]) -> None:
        """Register ``release`` (sync, or returning an awaitable) to run when the request settles."""
        if self._scope is None:
            raise RuntimeError("the draft is closed: register resources while the preparer runs")
        self._scope.add(release)

    def _close(self) -> Any:
        """Take the body out: a preparer that kept a reference to the draft keeps nothing."""
        body, self._body, self._scope = self._body, None, None
        return body


Preparer = Callable[[Draft], Awaitable[None] | None]
"""A sync or async callable that may change a ``Draft``."""


class Prepared:
    """A request's outbound state: the holder the forward stage reads from, cleared at release points.

    ``refold`` and ``remap_role`` are the only holders of the parsed body once ``prepare``
    returned; ``settle()`` drops them (and, unless the outbound body is retained, the body).
    """

    __slots__ = ("method", "path", "headers", "body", "refold", "remap_role", "_settled")

    def __init__(
        self,
        *,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        refold: Refold | None = None,
        remap_role: RemapRole | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.refold = refold
        self.remap_role = remap_role
        self._settled = False

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, *, retain_outbound: bool) -> None:
        """Retries are over: drop the refold and remap closures, and the body unless retained. Idempotent."""
        self._settled = True
        self.refold = None
        self.remap_role = None
        if not retain_outbound:
            self.body = None

    def release_body(self) -> None:
        """Drop the outbound body (e.g. once a retained body is no longer needed)."""
        self.body = None

    def __repr__(self) -> str:
        size = "released" if self.body is None else f"{len(self.body)} bytes"
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
    scope: RequestScope,
    refold_factory: Callable[[Conversation], Refold] = default_refold,
    remap_factory: Callable[[Conversation], RemapRole] = default_remap_role,
) -> Prepared:
    """Run ``preparers`` in order on a draft of the request and build its ``Prepared`` holder.

    ``raw`` is the body as received, ``parsed`` its first parse (taken before any change).
    If no preparer changed the body, ``Prepared.body`` is ``raw`` itself; otherwise the
    body is serialized once, after this function dropped its reference to ``raw`` (pass the
    only one, and the received body is freed before the new one is built). ``refold`` and
    ``remap_role`` are set for chat-shaped bodies (a ``messages``, ``input`` or ``contents``
    list) and capture the final parsed body.
    """
    draft = Draft(parsed, fingerprint=fingerprint, session_id=session_id, path=path, scope=scope)
    del parsed  # the draft is its one holder here: a replaced body can be freed while preparers run
    try:
        for preparer in preparers:
            result = preparer(draft)
            if inspect.isawaitable(result):
                await result
    except BaseException:
        draft._close()
        raise
    changed, extra = draft.changed, dict(draft.headers)
    graph = draft._close()
    if changed:
        # The received body is not sent: let it go before the new one is built, so the two never
        # coexist (the gateway hands over its only reference to it).
        del raw
        body = _json.dumps(graph)
    else:
        body = raw
    conversation = Conversation.of(graph)
    return Prepared(
        method=method,
        path=path,
        headers=_merge_headers(headers, extra),
        body=body,
        refold=refold_factory(conversation) if conversation is not None else None,
        remap_role=remap_factory(conversation) if conversation is not None else None,
    )
