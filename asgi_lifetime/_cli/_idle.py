"""The rule ``asgi-lifetime serve``'s HTTP/1.1 protocols add to uvicorn's: a connection without a request in
progress must complete the next request head within ``--timeout-keep-alive`` seconds (at least one), counted
from the moment it is accepted or its last answer ends; else it is closed.

uvicorn arms its keep-alive timer only once an answer has ended, and the next byte received cancels it for
good: a connection that never sent a byte, or sent its head a byte at a time (slowloris), was held open for
ever, with its file descriptor, until the process could accept no one. ``HeadDeadline`` keeps a timer of its
own beside uvicorn's, which it leaves alone: armed when the connection is made and whenever uvicorn arms its
keep-alive timer, cancelled only by a complete request head (``head_complete``, which each protocol calls
where its parser reports one) or by the connection's end. After an answer sent before its request's body was
read, each piece of that body arms it again (``body_after_answer``), up to ``LINGER_SECONDS`` after the answer.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

__all__ = ["HeadDeadline"]

# ``--timeout-keep-alive 0`` turns keep-alive off (uvicorn closes a connection as its answer ends); a new
# connection still needs a moment to send its first head, so the rule never gives less than this.
MIN_HEAD_SECONDS = 1.0
# An answer sent before its request's body was read (a 404, a 405): the client may still be sending that body,
# and most (httpx, the SDKs on it) read the answer only once it is sent; a connection closed under them reads
# as a reset, not as the answer. Each piece of that body gives the connection the rule's time again, for at
# most this long after the answer, as nginx's ``lingering_time`` (30 s by default) bounds the same drain.
LINGER_SECONDS = 30.0


class HeadDeadline:
    """Mixin for uvicorn's ``H11Protocol`` and ``HttpToolsProtocol``, listed before them among the bases."""

    loop: asyncio.AbstractEventLoop
    timeout_keep_alive: int
    timeout_keep_alive_task: asyncio.TimerHandle | None
    timeout_keep_alive_handler: Callable[[], None]  # uvicorn's: closes the connection unless it is closing
    _head_deadline: asyncio.TimerHandle | None = None
    _answered_at = -math.inf  # loop time the last answer ended

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.timeout_keep_alive_task is not None:  # uvicorn found no next request: the connection is idle
            self._answered_at = self.loop.time()
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # type: ignore[misc]
        self.head_complete()  # after: uvicorn's h11 protocol parses what is left as it goes

    def head_complete(self) -> None:
        """A request head is complete (or the connection gone): the request bounds the connection now."""
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def body_after_answer(self) -> None:
        """A piece of the answered request's body came (each protocol calls it where its parser reports one):
        the client is still sending, within ``LINGER_SECONDS`` of the answer."""
        left = self._answered_at + LINGER_SECONDS - self.loop.time()
        if left > 0:
            self._arm(left)

    def _arm(self, at_most: float = math.inf) -> None:
        self.head_complete()
        seconds = min(max(self.timeout_keep_alive, MIN_HEAD_SECONDS), at_most)
        self._head_deadline = self.loop.call_later(seconds, self.timeout_keep_alive_handler)
