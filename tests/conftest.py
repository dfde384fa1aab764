from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _loggers() -> list[logging.Logger]:
    return [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Every logger as it was before the test, and one the test created as a new one is. ``serve`` in process
    (``uvicorn.Config()``) applies its logging setup to the whole process: httpx's loggers stop propagating (a
    later test's ``caplog`` misses them) and write to a handler on the test's captured, by then closed,
    stderr; a logger its setup creates (``asgi_lifetime``, first named there) kept its handler, and every
    later record went to it (held by pytest's capture: test_attack_weeks' heap grew 3 KB a request)."""
    saved = {
        each: (each.level, each.propagate, each.disabled, each.handlers[:], each.filters[:]) for each in _loggers()
    }
    yield
    for each in _loggers():
        level, propagate, disabled, handlers, filters = saved.get(each, (logging.NOTSET, True, False, [], []))
        each.setLevel(level)
        each.propagate, each.disabled = propagate, disabled
        each.handlers[:], each.filters[:] = handlers, filters
