"""A hostile upstream on a plain loopback socket: it answers each request with scripted raw bytes.

Every request is recorded (method, target, headers, body) before it is answered, so a test can
check that the upstream saw each request exactly once, and on which connection::

    def answer(request: RawRequest) -> Script:
        return [b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok"]

    with raw_upstream(answer) as upstream:
        ...  # point a gateway at upstream.url
        assert [r.target for r in upstream.requests] == ["/v1/a"]
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .._servers import threaded_server

# A script step: bytes are written; CLOSE hangs up; HOLD waits (bounded) until the peer hangs up;
# a callable is called (it may block on an event) and what it returns is written.
CLOSE = "close"
HOLD = "hold"
Script = list[bytes | str | Callable[[], bytes]]
_HOLD_LIMIT = 30.0


@dataclass
class RawRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    connection: int  # which accepted connection (0, 1, ...) carried it
    raw_head: bytes = b""  # the request line and header lines as received


@dataclass
class RawUpstream:
    url: str = ""
    requests: list[RawRequest] = field(default_factory=list)
    connections: int = 0
    held: threading.Event = field(default_factory=threading.Event)  # a HOLD step is waiting
    released: threading.Event = field(default_factory=threading.Event)  # its peer hung up
    holding: int = 0  # HOLD steps waiting now
    releases: int = 0  # HOLD steps whose peer hung up
    hung_up: set[int] = field(default_factory=set)  # connections the peer closed between requests

    def targets(self) -> list[str]:
        return [r.target for r in self.requests]


def _read_request(sock: socket.socket, buffer: bytearray) -> tuple[RawRequest | None, bytearray]:
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            return None, buffer
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        data = sock.recv(65536)
        if not data:
            return None, bytearray()
        body += data
    request = RawRequest(method, target, headers, bytes(body[:length]), -1, raw_head=head)
    return request, bytearray(body[length:])


@contextlib.contextmanager
def raw_upstream(answer: Callable[[RawRequest], Script]) -> Iterator[RawUpstream]:
    upstream = RawUpstream()
    stop = threading.Event()
    lock = threading.Lock()

    def serve(sock: socket.socket, number: int) -> None:
        with lock:
            upstream.connections += 1
        buffer = bytearray()
        with sock:
            sock.settimeout(_HOLD_LIMIT)
            try:
                while not stop.is_set():
                    request, buffer = _read_request(sock, buffer)
                    if request is None:
                        with lock:
                            upstream.hung_up.add(number)
                        return
                    request.connection = number
                    with lock:
                        upstream.requests.append(request)
                    for step in answer(request):
                        if step == CLOSE:
                            return
                        if step == HOLD:
                            with lock:
                                upstream.holding += 1
                            upstream.held.set()
                            while sock.recv(65536):
                                pass
                            with lock:
                                upstream.holding -= 1
                                upstream.releases += 1
                            upstream.released.set()
                            return
                        if callable(step):
                            step = step()
                        assert isinstance(step, bytes)
                        sock.sendall(step)
            except OSError:
                return

    with threaded_server(serve, name="raw-upstream", join=_HOLD_LIMIT + 5) as url:
        upstream.url = url
        try:
            yield upstream
        finally:
            stop.set()


def response(
    status: int, body: bytes = b"", *, headers: tuple[tuple[str, str], ...] = (), length: bool = True
) -> bytes:
    """Raw response bytes; ``length`` adds a Content-Length matching ``body``."""
    lines = [f"HTTP/1.1 {status} X"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes, *, size: int = 16) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
