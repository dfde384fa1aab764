"""uvicorn's h11 protocol with the idle rule of ``_idle.HeadDeadline``: what ``asgi-lifetime serve --http h11``
runs. Imported by uvicorn only (``uvicorn.Config(http="asgi_lifetime._cli._h11:H11Protocol")``).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11Protocol

from ._idle import HeadDeadline

__all__ = ["H11Protocol"]

_OWING = (h11.SEND_RESPONSE, h11.SEND_BODY)  # the server's states while a request's answer is due


class H11Protocol(HeadDeadline, _UvicornH11Protocol):
    """``H11Protocol`` that closes a connection whose next request head is not complete in time."""

    def handle_events(self) -> None:
        super().handle_events()
        # h11 moves the server's state out of IDLE once a request's whole head has been parsed, and to DONE
        # once its answer has ended. Not the client's state: after an answer sent before the body was read
        # (a 404, a 405), the rest of that body keeps it out of IDLE while no request is in progress.
        if self.conn.our_state in _OWING:
            self.head_complete()
        elif self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            self.body_after_answer()  # answered early, the client still sending that request's body
