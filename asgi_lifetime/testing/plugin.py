"""pytest plugin: the ``lifetime_probe`` fixture checks that an app lets go of a request's body
while it streams the response.

Enable it in a ``conftest.py`` (or with ``pytest -p asgi_lifetime.testing.plugin``)::

    pytest_plugins = ["asgi_lifetime.testing.plugin"]

then, in an async test (``pytest.mark.anyio``, pytest-asyncio or pytest-trio)::

    from asgi_lifetime.testing import LifetimeProbe

    async def test_chat_lets_go_of_the_request(lifetime_probe: LifetimeProbe) -> None:
        await lifetime_probe(app, path="/v1/chat/completions")

The plugin is not registered automatically when the package is installed: a test suite opts in.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.types import ASGIApp

from ._probe import LifetimeProbe, RetentionReport, probe_retention

__all__ = ["lifetime_probe"]


@pytest.fixture
def lifetime_probe() -> LifetimeProbe:
    """``probe_retention`` that fails the test when anything held the body mid-stream.

    ``await lifetime_probe(app, **options)`` takes ``probe_retention``'s options and returns its
    ``RetentionReport``; the failure message names each holder. A ``ProbeError`` (the app did not
    stream, raised, or was too slow) is raised as it is.
    """

    async def probe(app: ASGIApp, **options: Any) -> RetentionReport:
        report = await probe_retention(app, **options)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    return probe
