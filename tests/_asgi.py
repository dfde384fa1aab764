"""Raw ASGI drivers shared by the middleware's and the gateway's tests: the test is the server.

The transport-level paths (disconnects, cancellation, a body arriving in chunks while the answer
streams) are easier to produce exactly without an HTTP client in between::

    connection = Connection(body, marker=b"data: ")
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, json_scope(body, "/v1/chat/completions"), connection.receive, connection.send)
        await connection.marked.wait()  # the answer is streaming
        connection.hang_up.set()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.types import Message, Receive, Scope

from asgi_lifetime import MiB


def http_scope(path: str = "/v1/echo", headers: list[tuple[bytes, bytes]] | None = None, **extra: Any) -> Scope:
    """A POST's HTTP scope; ``extra`` adds keys (``state``, ``app``)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers or [],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
        **extra,
    }


def json_scope(body: bytes, path: str = "/v1/x", *headers: tuple[bytes, bytes], **extra: Any) -> Scope:
    """The scope of a JSON POST of ``body`` (its Content-Type and Content-Length), with ``headers`` after."""
    framing = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return http_scope(path, [*framing, *headers], **extra)


def receiving(messages: list[Message], then_block: bool = True) -> Receive:
    """A client that sends ``messages``, then stays (its next receive() waits forever) or disconnects."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then_block:
            await anyio.sleep_forever()
        return {"type": "http.disconnect"}

    return receive


def body_receive(body: bytes) -> Receive:
    """A client that sends ``body`` in one message, then stays."""
    return receiving([{"type": "http.request", "body": body, "more_body": False}])


class Recorder:
    """A ``send`` that records the messages of the response."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        for message in self.messages:
            if message["type"] == "http.response.start":
                return int(message["status"])
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


@dataclass
class Connection:
    """The server side of one ASGI connection: feeds ``body`` in ``chunk``-sized messages, then keeps the
    connection open until ``hang_up``; records the response (``marked`` once its body holds ``marker``)."""

    body: bytes
    chunk: int = MiB
    marker: bytes | None = None
    offset: int = 0
    hang_up: anyio.Event = field(default_factory=anyio.Event)
    marked: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)
    status: int = 0
    received: bytearray = field(default_factory=bytearray)

    async def receive(self) -> Message:
        if self.offset < len(self.body):
            part = self.body[self.offset : self.offset + self.chunk]
            self.offset += len(part)
            return {"type": "http.request", "body": part, "more_body": self.offset < len(self.body)}
        await self.hang_up.wait()  # the body is complete; the connection stays open
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        self.received += message.get("body", b"")
        if self.marker is not None and self.marker in self.received:
            self.marked.set()
        if not message.get("more_body", False):
            self.ended.set()
