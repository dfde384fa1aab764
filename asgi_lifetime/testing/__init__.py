"""Test helpers for gateways built on asgi_lifetime: a scriptable OpenAI-compatible upstream
and a real uvicorn server on a loopback port.

```python
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread

with serve_in_thread(create_demo_upstream()) as upstream_url:
    ...  # point the gateway at upstream_url; fault behaviours via the x-demo-behaviour header
```
"""

from ._serve import serve_in_thread
from ._upstream import DemoStats, create_demo_upstream, parse_behaviour

__all__ = ["DemoStats", "create_demo_upstream", "parse_behaviour", "serve_in_thread"]
