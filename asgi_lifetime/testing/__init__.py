"""Test helpers for apps and gateways built on asgi_lifetime, and for any ASGI app's request lifetime.

- ``wait_idle`` / ``assert_idle`` / ``held``: nothing left held (in-flight requests and bytes,
  retained input, live resources, pinned sessions, upstream requests), against an app object or
  a served gateway's base URL.
- ``create_demo_upstream``: a scriptable OpenAI-compatible upstream (faults by the
  ``x-demo-behaviour`` header), and ``serve_in_thread`` to run any app under uvicorn on a
  loopback port.
- ``probe_retention``: does an app (Starlette, FastAPI, any ASGI 3 app) still hold a request's
  body while its response streams? The pytest plugin ``asgi_lifetime.testing.plugin`` wraps it
  in the ``lifetime_probe`` fixture.

```python
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread, wait_idle

with serve_in_thread(create_demo_upstream()) as upstream_url:
    ...  # point the gateway at upstream_url; fault behaviours via the x-demo-behaviour header
    await wait_idle(gateway)
```
"""

try:
    from ._idle import assert_idle, held, wait_idle
    from ._probe import (
        Holder,
        LifetimeProbe,
        ProbeError,
        RetentionReport,
        chat_completion_body,
        probe_retention,
    )
    from ._serve import serve_in_thread
    from ._upstream import DemoStats, create_demo_upstream, parse_behaviour
except ModuleNotFoundError as _exc:
    # A core-only install: name the extra that brings the server and the client, not the module that missed.
    if (_exc.name or "").partition(".")[0] not in ("uvicorn", "httpx", "httpcore", "h11"):
        raise
    raise ModuleNotFoundError(
        f"asgi_lifetime.testing needs {_exc.name!r}, which is not installed: pip install 'asgi-lifetime[cli]'",
        name=_exc.name,
    ) from None

from .._publish import publish as _publish

__all__ = [
    "DemoStats",
    "Holder",
    "LifetimeProbe",
    "ProbeError",
    "RetentionReport",
    "assert_idle",
    "chat_completion_body",
    "create_demo_upstream",
    "held",
    "parse_behaviour",
    "probe_retention",
    "serve_in_thread",
    "wait_idle",
]

# Reprs, tracebacks, pickles and the API reference show the public path, not the private module.
_publish(globals())
