"""uvicorn's httptools protocol, without trailer fields: what ``asgi-lifetime serve`` runs when httptools is installed.

llhttp reports the trailer fields after a chunked body through the same callback as the header
fields, and uvicorn's ``HttpToolsProtocol`` appends them to the request's ``scope["headers"]``,
often before the app has looked at it (the whole request came in one read). The gateway would
then forward fields it never judged (a second ``Authorization``, another session id, a second
``Content-Type``). h11 drops trailer fields; so does this protocol. It also keeps the idle rule of
``_idle.HeadDeadline``. Imported by uvicorn only
(``uvicorn.Config(http="asgi_lifetime._cli._httptools:HttpToolsProtocol")``).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHttpToolsProtocol

from ._idle import HeadDeadline

__all__ = ["HttpToolsProtocol"]


class HttpToolsProtocol(HeadDeadline, _UvicornHttpToolsProtocol):
    """``HttpToolsProtocol`` that ignores the fields after the header block (chunked trailers) and closes a
    connection whose next request head is not complete in time."""

    _in_trailers = False

    def on_message_begin(self) -> None:
        self._in_trailers = False
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_trailers:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_trailers = True
        self.head_complete()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.cycle.response_complete:  # answered early, the client still sending that request's body
            self.body_after_answer()
        super().on_body(body)
