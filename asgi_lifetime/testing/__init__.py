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

import importlib as _importlib
import typing as _typing

from .._extras import missing_extra as _missing_extra
from .._publish import publish as _publish
from ._probe import (
    Holder,
    LifetimeProbe,
    ProbeError,
    RetentionReport,
    chat_completion_body,
    probe_retention,
)

if _typing.TYPE_CHECKING:
    from ._idle import assert_idle, held, wait_idle
    from ._serve import serve_in_thread
    from ._upstream import DemoStats, create_demo_upstream, parse_behaviour

# The retention probe (and its pytest plugin) needs the core only; these need a client or a server
# (httpx, uvicorn), imported when first used, so a core install can run the probe.
_WITH_CLI = {
    "assert_idle": "_idle",
    "held": "_idle",
    "wait_idle": "_idle",
    "serve_in_thread": "_serve",
    "DemoStats": "_upstream",
    "create_demo_upstream": "_upstream",
    "parse_behaviour": "_upstream",
}


if not _typing.TYPE_CHECKING:  # type checkers see the imports above: a misspelt name is an error, not Any

    def __getattr__(name: str) -> _typing.Any:
        module_name = _WITH_CLI.get(name)
        if module_name is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:
            module = _importlib.import_module(f"{__name__}.{module_name}")
        except ModuleNotFoundError as exc:
            # A core-only install: name the extra that brings the server and the client, not the module that missed.
            error = _missing_extra(exc, "cli", f"{__name__}.{name}")
            if error is None:
                raise
            raise error from None
        value = getattr(module, name)
        _publish({"__name__": __name__, "__all__": [name], name: value})
        globals()[name] = value
        return value


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
_publish({**globals(), "__all__": [n for n in __all__ if n not in _WITH_CLI]})
