from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Every logger as it was before the test. ``serve`` in process (``uvicorn.Config()``) applies its logging
    setup to the whole process: httpx's loggers stop propagating (a later test's ``caplog`` misses them) and
    write to a handler on the test's captured, by then closed, stderr."""
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    saved = [(each, each.level, each.propagate, each.disabled, each.handlers[:], each.filters[:]) for each in loggers]
    yield
    for each, level, propagate, disabled, handlers, filters in saved:
        each.setLevel(level)
        each.propagate, each.disabled = propagate, disabled
        each.handlers[:], each.filters[:] = handlers, filters
