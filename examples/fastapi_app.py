"""The drop-in: LifetimeMiddleware in an existing FastAPI app.

Serve it:      uvicorn examples.fastapi_app:app
Try it here:   python examples/fastapi_app.py   (starts it on a loopback port, sends a few
               requests through it, prints what the middleware saw, and exits; no network)
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request

from asgi_lifetime import LifetimeMiddleware, LifetimeSettings, MiB

app = FastAPI()
app.add_middleware(
    LifetimeMiddleware,
    settings=LifetimeSettings(paths=("/v1/",), max_body_bytes=32 * MiB, max_inflight=16, admission_timeout=5),
)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> dict[str, Any]:
    body = await request.json()  # unchanged FastAPI code: the middleware replays the body once
    fp = request.state.lifetime.fingerprint  # scalars only: wire hash, verdict, size
    return {
        "object": "chat.completion",
        "model": body.get("model"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "fingerprint": {"wire_hash": fp.wire_hash, "text_comparable": fp.text_comparable, "size": fp.size},
    }


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as client:
            turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 4096} for i in range(2048)]
            conversation = {"model": "demo", "messages": turns}
            print(f"POST a {len(json.dumps(conversation)) / MiB:.1f} MiB text conversation")
            print("  ->", client.post("/v1/chat/completions", json=conversation).json()["fingerprint"])

            image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}
            print("POST a multimodal request")
            print("  ->", client.post("/v1/chat/completions", json={"model": "demo", "messages": [image]}).json())

            print("POST 40 MiB (over the 32 MiB limit)")
            too_big = client.post("/v1/chat/completions", content=b"x" * (40 * MiB))
            print("  ->", too_big.status_code, too_big.json()["error"])
        stats = app.state.lifetime.stats()
        print("live counters afterwards:", stats.as_dict())
        return 0 if stats.idle else 1
    finally:
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
