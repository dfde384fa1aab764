"""A ``@without_parse`` preparer's message, spliced into hostile bodies, end to end: the gateway under
uvicorn in front of a recording upstream; what the upstream got means the received body with the
message first in the conversation the full parse keeps (the last of duplicate keys), nothing else."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from asgi_lifetime import _lazy

from ..reliability.test_faults import PATH, assert_idle
from .test_parse_e2e import JSON, Recorder, gateway, policy

pytestmark = pytest.mark.anyio

PAD = b'"pad":"' + b"x" * 70_000 + b'"'
HI = b'[{"role":"user","content":"hi"}]'
POLICY = {"role": "system", "content": "policy"}

BODIES = {
    # A key ending in an escaped quote holds ``"messages":[...]`` verbatim; the real key is written so
    # that the search for that marker skips it. The message went into the fake key's array.
    "fake key after a spaced real one": b"{" + PAD + b',"messages" :' + HI + b',"x\\"messages":' + HI + b"}",
    "fake key after an escaped real one": b"{" + PAD + b',"m\\u0065ssages":' + HI + b',"x\\"messages":' + HI + b"}",
    "fake input key": b'{"model":"m",' + PAD + b',"input" :' + HI + b',"x\\"input":' + HI + b"}",
    "spaced after the colon": b'{"model": "m", ' + PAD + b', "messages": ' + HI + b"}",
    "list then string": b'{"messages":' + HI + b"," + PAD + b',"messages":"x","input":' + HI + b"}",
    "string then list": b'{"messages":"x",' + PAD + b',"messages":' + HI + b"}",
    "twice": b'{"messages":[{"role":"user","content":"first"}],' + PAD + b',"messages":' + HI + b"}",
    "nested first": b'{"o":{"messages":[]},' + PAD + b',"messages":' + HI + b"}",
    "lookalike in a string": b'{"c":"\\\\\\"messages\\":[]",' + PAD + b',"messages":' + HI + b"}",
    "empty, spaced": b"{" + PAD + b',"messages":[ \n ] }\n',
    "escaped key last": b'{"messages":[],' + PAD + b',"m\\u0065ssages":' + HI + b"}",
}


def expected(raw: bytes) -> Any:
    doc = json.loads(raw)
    for key in ("messages", "input", "contents"):
        if isinstance(doc.get(key), list):
            doc[key].insert(0, POLICY)
            break
    return doc


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
async def test_the_spliced_message_lands_where_the_parse_reads_the_conversation(encoding: str) -> None:
    upstream = Recorder()
    with gateway(upstream, preparers=[policy]) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for name, raw in BODIES.items():
                assert len(raw) > _lazy._SMALL and _lazy.shape(raw) is not None, name  # the lazy look answers
                content = gzip.compress(raw) if encoding == "gzip" else raw
                headers = {**JSON, "content-encoding": encoding} if encoding == "gzip" else JSON
                response = await client.post(PATH, content=content, headers=headers)
                assert response.status_code == 200, (name, response.text)
                assert json.loads(upstream.bodies[-1]) == expected(raw), name
        assert len(upstream.bodies) == len(BODIES)
        await assert_idle(app, url)
