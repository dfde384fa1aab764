"""Test helpers for gateways built on asgi_lifetime: a scriptable OpenAI-compatible upstream
and a real uvicorn server on a loopback port.

```python
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread

with serve_in_thread(create_demo_upstream()) as upstream_url:
    ...  # point the gateway at upstream_url; fault behaviours via the x-demo-behaviour header
```
"""

try:
    from ._serve import serve_in_thread
    from ._upstream import DemoStats, create_demo_upstream, parse_behaviour
except ModuleNotFoundError as _exc:
    # A core-only install: name the extra that brings the server, not the module that missed it.
    if (_exc.name or "").partition(".")[0] != "uvicorn":
        raise
    raise ModuleNotFoundError(
        "asgi_lifetime.testing needs 'uvicorn', which is not installed: pip install 'asgi-lifetime[cli]'",
        name="uvicorn",
    ) from None

__all__ = ["DemoStats", "create_demo_upstream", "parse_behaviour", "serve_in_thread"]
