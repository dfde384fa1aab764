"""Issue 9 as it was found: the official openai SDK through the gateway, over real sockets.

The gateway (``create_app`` under uvicorn) is in front of the raw upstream of
``test_relay_events.py``, which writes exact event streams and then cuts, ends or stalls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from ..reliability.test_faults import Stack, running
from .test_relay_events import STREAMS, RawUpstream, Script, cut_offset, image_tool_stream, raw_upstream, render


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[Stack, RawUpstream]]:
    with raw_upstream() as upstream, running(upstream_url=upstream.url) as stack:
        yield stack, upstream


# -- the official openai SDK over real sockets (how issue 9 was found) ----------------------------


@contextlib.asynccontextmanager
async def sdk(stack: Stack) -> AsyncIterator[Any]:
    openai = _openai()
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="test", max_retries=0, timeout=10) as client:
        yield client


def _openai() -> Any:
    # Imported when a test runs, not when this module is collected: importing the SDK makes
    # tests/test_release.py's traced-memory check fail (seen, not explained), and this module
    # runs after it.
    import openai

    return openai


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["reset", "incomplete", "stall"])
async def test_sdk_chat_stream_cut_mid_event_raises_the_gateways_error(
    gateway: tuple[Stack, RawUpstream], kind: str
) -> None:
    # Before: the half event, completed by the gateway's newline, made the SDK fail to decode JSON.
    stack, upstream = gateway
    events, _ = STREAMS["chat"]
    raw = render(events)
    key = upstream.add(Script(raw[: cut_offset(events, 2, "mid-line", b"\n")], kind))
    chunks: list[Any] = []
    async with sdk(stack) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, extra_headers={"x-script": key}
        )
        openai = _openai()
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                chunks.append(chunk)
    assert not isinstance(info.value, openai.APIConnectionError)
    assert "upstream" in info.value.message
    assert [chunk.choices[0].delta.content for chunk in chunks] == ["", "Hello there"]
    assert upstream.hits[key] == 1


@pytest.mark.anyio
async def test_sdk_streamed_transcription_is_read_once(gateway: tuple[Stack, RawUpstream]) -> None:
    stack, upstream = gateway
    events, _ = STREAMS["transcription"]
    key = upstream.add(Script(render(events), "end"))
    async with sdk(stack) as client:
        stream = await client.audio.transcriptions.create(
            file=("a.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav"),
            model="gpt-4o-transcribe",
            stream=True,
            extra_headers={"x-script": key},
        )
        kinds = [event.type async for event in stream]
    assert kinds == ["transcript.text.delta", "transcript.text.delta", "transcript.text.done"]
    assert upstream.hits[key] == 1


@pytest.mark.anyio
async def test_sdk_streamed_image_generation_is_read_once(gateway: tuple[Stack, RawUpstream]) -> None:
    stack, upstream = gateway
    events, _ = STREAMS["image"]
    key = upstream.add(Script(render(events), "end"))
    async with sdk(stack) as client:
        stream = await client.images.generate(
            model="gpt-image-1", prompt="a dot", stream=True, partial_images=2, extra_headers={"x-script": key}
        )
        kinds = [event.type async for event in stream]
    assert kinds == ["image_generation.partial_image", "image_generation.partial_image", "image_generation.completed"]
    assert upstream.hits[key] == 1


@pytest.mark.anyio
async def test_sdk_responses_stream_with_a_large_image_is_read_once(gateway: tuple[Stack, RawUpstream]) -> None:
    # Before: re-issued for the >1 MiB event; the SDK raised "Duplicate response output index 0".
    stack, upstream = gateway
    key = upstream.add(Script(render(image_tool_stream(1536 * 1024)), "end", pieces=40))
    async with sdk(stack) as client:
        async with client.responses.stream(
            model="m", input="a dot", tools=[{"type": "image_generation"}], extra_headers={"x-script": key}
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert final.status == "completed"
    assert upstream.hits[key] == 1
