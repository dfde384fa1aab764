"""A minimal HTTP/1.1 keep-alive client for the driver, on anyio streams.

The driver shares two cores with the servers it measures, so the load generator must be
cheap: no header models, no decoding, no pool. It sends one request at a time per
``Connection`` and times the first response byte, the first body byte and the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
from anyio.abc import SocketStream

__all__ = ["Connection", "Result"]

_SEND_CHUNK = 1024 * 1024
_TAIL = 64  # bytes of the response body kept in Result.tail


@dataclass(slots=True)
class Result:
    status: int
    started: float  # time.monotonic() when the request was about to be written
    first_byte: float  # first byte of the response (status line)
    first_body_byte: float  # first byte of the response body
    ended: float
    body_bytes: int
    tail: bytes = b""  # the last bytes of the response body (a stream that ended well ends with [DONE])

    @property
    def ttfb(self) -> float:
        return self.first_byte - self.started

    @property
    def latency(self) -> float:
        return self.ended - self.started


class Connection:
    """One keep-alive connection to ``url`` (``http://host:port``)."""

    def __init__(self, url: str) -> None:
        host, port = url.rsplit("/", 1)[-1].split(":")
        self.host, self.port = host, int(port)
        self._stream: SocketStream | None = None
        self._buf = bytearray()

    async def __aenter__(self) -> Connection:
        self._stream = await anyio.connect_tcp(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stream is not None:
            await self._stream.aclose()

    async def _fill(self) -> None:
        assert self._stream is not None
        self._buf += await self._stream.receive(262144)

    async def _read_until(self, marker: bytes) -> bytes:
        while (index := self._buf.find(marker)) < 0:
            await self._fill()
        data = bytes(self._buf[:index])
        del self._buf[: index + len(marker)]
        return data

    async def _skip(self, n: int, keep: int = 0) -> bytes:
        """Drop the next ``n`` bytes; return the last ``keep`` of them."""
        while len(self._buf) < n:
            await self._fill()
        kept = bytes(self._buf[max(0, n - keep) : n]) if keep else b""
        del self._buf[:n]
        return kept

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Result:
        assert self._stream is not None
        head = [
            f"POST {path} HTTP/1.1",
            f"host: {self.host}:{self.port}",
            "content-type: application/json",
            f"content-length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        started = time.monotonic()
        view = memoryview(body)
        await self._stream.send(("\r\n".join(head) + "\r\n\r\n").encode() + bytes(view[:_SEND_CHUNK]))
        for offset in range(_SEND_CHUNK, len(body), _SEND_CHUNK):
            await self._stream.send(view[offset : offset + _SEND_CHUNK])  # type: ignore[arg-type]
        view.release()

        if not self._buf:
            await self._fill()
        first_byte = time.monotonic()
        status_line = await self._read_until(b"\r\n")
        status = int(status_line.split()[1])
        raw_headers = await self._read_until(b"\r\n\r\n")
        fields = {}
        for line in raw_headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        first_body_byte = 0.0
        total = 0
        tail = b""
        if fields.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self._read_until(b"\r\n")
                    break
                if not first_body_byte:
                    first_body_byte = time.monotonic()
                tail = (tail + await self._skip(size, _TAIL))[-_TAIL:]
                await self._skip(2)
                total += size
        else:
            length = int(fields.get(b"content-length", b"0"))
            if length:
                first_body_byte = time.monotonic()
            tail = await self._skip(length, _TAIL)
            total = length
        ended = time.monotonic()
        return Result(status, started, first_byte, first_body_byte or ended, ended, total, tail)
