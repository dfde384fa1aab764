"""uvicorn's h11 protocol with the idle rule of ``_idle.HeadDeadline``: what ``asgi-lifetime serve --http h11``
runs. Imported by uvicorn only (``uvicorn.Config(http="asgi_lifetime._cli._h11:H11Protocol")``).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11Protocol

from ._idle import HeadDeadline

__all__ = ["H11Protocol"]


class H11Protocol(HeadDeadline, _UvicornH11Protocol):
    """``H11Protocol`` that closes a connection whose next request head is not complete in time."""

    def handle_events(self) -> None:
        super().handle_events()
        # h11 leaves the client's state IDLE until a request's whole head has been parsed.
        if self.conn.their_state is not h11.IDLE:
            self.head_complete()
