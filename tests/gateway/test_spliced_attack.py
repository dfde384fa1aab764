"""Attacks on ``Spliced`` bodies (messages spliced into the received bytes, not copied) tried after it landed.

- Many added messages: each was a part of its own (a comma another), so a preparer adding 20,000
  messages made every 1 MiB send slice walk 40,000 parts (64 MiB with 50,000: 1.2 s of the event
  loop per attempt). Fixed: each side's additions are one part.
- Held, and checked here: under uvicorn, to a raw socket upstream over aiohttp and httpcore, bodies
  whose spliced form is just below, at and above one slice and at slice multiples, a splice point
  straddling a slice boundary (the first and the last slice), an empty conversation (``[]`` and
  ``[ \\n ]``), prepend and append together, non-ASCII and escaped text, gzip-encoded requests:
  the Content-Length is the bytes the upstream gets, they parse to the expected document, and
  every request reuses the one pooled connection. In process on asyncio and trio, a context
  overflow on a spliced body is refolded from it and re-sent on the same connection.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import anyio
import httpx
import pytest

from asgi_lifetime import LifetimeSettings, MiB, _json
from asgi_lifetime._fingerprint import fingerprint
from asgi_lifetime._lazy import DeferredParse, shape
from asgi_lifetime._resources import RequestResources
from asgi_lifetime.gateway import Spliced, create_app
from asgi_lifetime.gateway._prepare import Draft, prepare, without_parse
from asgi_lifetime.gateway._spill import SLICE
from asgi_lifetime.testing import wait_idle
from asgi_lifetime.testing._serve import serve_in_thread

from .._asgi import Connection
from ._raw_upstream import RawRequest, Script, raw_upstream, response
from .test_spill import scope_for

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
FIRST = {"role": "system", "content": 'é☃\u2028 "q" \\ spliced'}
LAST = {"role": "user", "content": "last ✓"}
JSON = (("content-type", "application/json"),)
OK = response(200, b'{"ok":1}', headers=JSON)


@without_parse
def around(draft: Draft) -> None:
    assert draft.conversation is not None
    draft.conversation.prepend(FIRST)
    draft.conversation.append(LAST)


def chat(messages: str, *, before: int = 0, after: int = 0) -> bytes:
    """A chat body: a ``before``-long field, the conversation (JSON text), an ``after``-long field."""
    return ('{"meta":"' + "m" * before + '","messages":' + messages + ',"tail":"' + "t" * after + '"}').encode()


def spliced_to(size: int, *, before: int = 0, after: int = 0) -> bytes:
    """A one-message chat body that is ``size`` bytes once ``around`` spliced its two messages in."""

    def body(pad: int) -> bytes:
        return chat(json.dumps([{"role": "user", "content": "ü" + "x" * pad}]), before=before, after=after)

    added = len(_json.dumps(FIRST)) + len(_json.dumps(LAST)) + 2  # and a comma each
    return body(size - len(body(0)) - added)


def expected(raw: bytes) -> Any:
    doc = json.loads(raw)
    doc["messages"] = [FIRST, *doc["messages"], LAST]
    return doc


BODIES = [
    *(spliced_to(size) for size in (SLICE - 1, SLICE, SLICE + 1, 2 * SLICE, 2 * SLICE + 1, 3 * SLICE - 1)),
    spliced_to(3 * SLICE, before=SLICE - 20),  # the first message straddles the first slice's end
    spliced_to(3 * SLICE, after=SLICE - 20),  # the last one straddles the last slice's start
    chat("[]", before=2 * SLICE),
    chat("[ \n ]", before=2 * SLICE),
]


@pytest.mark.parametrize("transport", ["aiohttp", "httpcore"])
async def test_a_spliced_body_arrives_whole_over_a_reused_connection(anyio_backend: str, transport: str) -> None:
    def answer(request: RawRequest) -> Script:
        return [OK]

    with raw_upstream(answer) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url,), upstream_transport=transport)
        app = create_app(settings, preparers=[around])
        with serve_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for n, raw in enumerate(BODIES):
                    headers = {"content-type": "application/json"}
                    if n % 2:  # the splice views the decoded body
                        headers["content-encoding"] = "gzip"
                    sent = await client.post(PATH, content=gzip.compress(raw) if n % 2 else raw, headers=headers)
                    assert sent.status_code == 200, sent.text
            await wait_idle(app)
    assert upstream.connections == 1 and len(upstream.requests) == len(BODIES)
    for raw, got in zip(BODIES, upstream.requests, strict=True):
        assert int(got.headers["content-length"]) == len(got.body)
        assert json.loads(got.body) == expected(raw)
    assert len(upstream.requests[2].body) == SLICE + 1 and len(upstream.requests[6].body) == 3 * SLICE


OVERFLOW = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 4096 tokens. However, you requested more.",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
).encode()


@pytest.mark.parametrize("transport", ["auto", "httpcore"])
async def test_a_spliced_body_is_refolded_after_an_overflow_on_the_same_connection(transport: str) -> None:
    def answer(request: RawRequest) -> Script:
        return [response(400, OVERFLOW, headers=JSON) if len(upstream.requests) == 1 else OK]

    turns = [{"role": "user" if n % 2 == 0 else "assistant", "content": f"{n} " + "z" * 16000} for n in range(200)]
    raw = chat(json.dumps(turns))
    client = Connection(raw)
    with raw_upstream(answer) as upstream:
        settings = LifetimeSettings(upstream_url=(upstream.url,), upstream_transport=transport, max_attempts=3)
        app = create_app(settings, preparers=[around])
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(app, scope_for(raw), client.receive, client.send)
                    await client.ended.wait()
                    client.hang_up.set()
            await wait_idle(app)
        finally:
            await app.state.upstream.aclose()
    assert client.status == 200 and bytes(client.received) == b'{"ok":1}'
    first, second = upstream.requests
    assert len(first.body) > 3 * MiB and json.loads(first.body) == expected(raw)
    again = json.loads(second.body)
    assert len(second.body) < len(first.body) and again["messages"][0] == FIRST
    for got in (first, second):
        assert int(got.headers["content-length"]) == len(got.body)
    assert upstream.connections == 1


async def test_many_added_messages_make_few_parts() -> None:
    # Each added message was a part of its own (and a comma another): a preparer adding 20,000
    # messages made every send slice walk 40,000 parts. Each side's additions are one part now.
    many = [{"role": "user", "content": f"m{n}"} for n in range(20_000)]

    @without_parse
    def add(draft: Draft) -> None:
        assert draft.conversation is not None
        for item in many:
            draft.conversation.prepend(item)
            draft.conversation.append(item)

    async def charge(total: int) -> None:
        pass

    raw = spliced_to(2 * SLICE)
    found = shape(raw)
    assert found is not None
    async with RequestResources() as resources:
        prepared = await prepare(
            raw,
            DeferredParse(found, charge),
            preparers=[add],
            fingerprint=fingerprint(raw),
            session_id=None,
            method="POST",
            path=PATH,
            headers=[],
            resources=resources,
        )
    body = prepared.body
    assert isinstance(body, Spliced) and len(body.parts) <= 7
    doc = json.loads(raw)
    doc["messages"] = [*reversed(many), *doc["messages"], *many]
    assert json.loads(bytes(body)) == doc
    assert body.read(0, len(body)) == bytes(body)
