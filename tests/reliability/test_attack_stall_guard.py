"""The stall guard run by the request's ``ClientWatch``, attacked by someone who did not write it.

The watch wakes for keep-alives and stall checks, and cancels the relay's read scope once a read has
waited ``STALL_TIMEOUT``. Attacks: a keep-alive the client does not take while the upstream stalls
(the watch busy sending it), drips just under the timeout, a burst then silence, silence after the
headers, a stalled JSON body, keep-alive intervals around the timeout, a deaf watch (``receive()``
failed), many streams stalling at their own times, the Gemini dialect.
"""

from __future__ import annotations

import time

import anyio
import pytest
from starlette.types import Message

from asgi_lifetime.gateway._sse import KEEPALIVE, KEEPALIVE_LINE

from ..gateway.test_relay import ROLE, SSE_HEADERS, Client, Upstream, run, upstream_response

STALL = 0.3


class _Silent(Upstream):
    """``Upstream`` whose close is an event (the gateway hung up on it)."""

    def __init__(self, *items: bytes | float | Exception) -> None:
        super().__init__(*items)
        self.hung_up = anyio.Event()

    async def aclose(self) -> None:
        await super().aclose()
        self.hung_up.set()


class _NotReading(Client):
    """A client whose window is full once it has its first bytes: a later body send (the watch's
    keep-alive, the relay's error event) blocks until the upstream is hung up on, or 5 s."""

    def __init__(self, upstream: _Silent) -> None:
        super().__init__()
        self.upstream = upstream
        self.blocked_at: float | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and self.body and message["body"] in (KEEPALIVE, KEEPALIVE_LINE):
            self.blocked_at = time.monotonic()
            with anyio.move_on_after(5):
                await self.upstream.hung_up.wait()
        await super().send(message)


@pytest.mark.anyio
@pytest.mark.parametrize("keepalive_interval", [0.05, STALL / 2])
async def test_a_keepalive_the_client_does_not_take_does_not_hold_off_the_stall(keepalive_interval: float) -> None:
    # The watch sends the keep-alives and guards stalls: while it waited on a client that takes nothing,
    # nothing cut the stalled read, and the upstream was held until the client read or left (before
    # the watch guarded stalls, the read's own deadline hung up on it after STALL_TIMEOUT).
    stream = _Silent(ROLE, 30.0)
    client = _NotReading(stream)
    started = time.monotonic()
    result = await run(
        upstream_response(stream, headers=SSE_HEADERS),
        client,
        stall_timeout=STALL,
        keepalive_interval=keepalive_interval,
    )
    assert client.blocked_at is not None, "no keep-alive was sent: the test did not test"
    assert result.outcome == "stalled"
    assert stream.closed
    elapsed = time.monotonic() - started
    assert STALL <= elapsed < 3 * STALL, elapsed
    assert client.error_event()["code"] == "upstream_stalled"
