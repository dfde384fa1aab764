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

import itertools
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from starlette.types import ASGIApp

from ._probe import LifetimeProbe, RetentionReport, probe_retention

__all__ = ["lifetime_probe"]

_calls = itertools.count()  # keys of the calls not awaited yet


@pytest.fixture
def lifetime_probe() -> Iterator[LifetimeProbe]:
    """``probe_retention`` that fails the test when anything held the body mid-stream.

    ``await lifetime_probe(app, **options)`` takes ``probe_retention``'s options and returns its
    ``RetentionReport``; the failure message names each holder. A ``ProbeError`` (the app did not
    stream, raised, or was too slow) is raised as it is. A call that is never awaited (a test that
    is not async) is an error at teardown: the probe did not run.
    """
    unawaited: dict[int, Coroutine[Any, Any, RetentionReport]] = {}

    async def run(key: int, app: ASGIApp, options: dict[str, Any]) -> RetentionReport:
        unawaited.pop(key, None)
        report = await probe_retention(app, **options)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    def probe(app: ASGIApp, **options: Any) -> Coroutine[Any, Any, RetentionReport]:
        key = next(_calls)
        call = unawaited[key] = run(key, app, options)
        return call

    yield probe
    for call in unawaited.values():
        call.close()  # no "never awaited" warning on top of the error
    if unawaited:
        pytest.fail(
            f"lifetime_probe(...) was not awaited: the probe did not run ({len(unawaited)} call(s)); "
            "await it in an async test (pytest.mark.anyio, pytest-asyncio or pytest-trio)",
            pytrace=False,
        )
