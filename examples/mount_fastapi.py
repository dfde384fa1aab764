"""The gateway mounted under /llm in an existing FastAPI app, next to the app's own routes.

Run:  python examples/mount_fastapi.py      (offline: a built-in demo upstream on loopback)
Serve your own: build `settings` with your upstream and run `uvicorn examples.mount_fastapi:app`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread


def build_app(upstream_url: str) -> FastAPI:
    gateway = create_app(LifetimeSettings(upstream_url=(upstream_url,)))

    # Starlette does not run a mounted app's lifespan: run the gateway's inside the host's,
    # so its upstream connections are closed (and graceful draining works) at shutdown.
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with gateway.router.lifespan_context(gateway):
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    # /llm/v1/chat/completions is forwarded to {upstream_url}/v1/chat/completions.
    app.mount("/llm", gateway)
    return app


def main() -> int:
    with serve_in_thread(create_demo_upstream(tokens_per_second=200)) as upstream:
        with serve_in_thread(build_app(upstream)) as base, httpx.Client(base_url=base, timeout=30) as client:
            print("GET /hello ->", client.get("/hello").json())
            chat = {"model": "demo", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12}
            answer = client.post("/llm/v1/chat/completions", json=chat).json()
            print("POST /llm/v1/chat/completions ->", answer["choices"][0]["message"]["content"])
            stats = client.get("/llm/lifetime/stats").json()
            print("gateway stats:", {k: stats[k] for k in ("admitted", "completed", "inflight_requests")})
            return 0 if stats["completed"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
