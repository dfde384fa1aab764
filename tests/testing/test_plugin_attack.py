"""The pytest plugin used as a user enables it (docs/testing.md): in ``conftest.py`` or with
``-p``, in a session with tests that use the fixture and tests that do not, and misused.

Each generated test runs on asyncio and on trio (the header's ``anyio_backend``).
"""

from __future__ import annotations

import pytest

from .test_plugin import HEADER, PLUGIN, importable, runpytest  # noqa: F401 (importable: autouse)

KEEPS_IN_A_CONTEXTVAR = """
import contextvars
from starlette.requests import Request
from starlette.responses import StreamingResponse

CURRENT = contextvars.ContextVar("current_body")


def keeps_in_a_contextvar():
    async def chat(request: Request):
        CURRENT.set(await apps.read(request))
        return StreamingResponse(apps.answer("hello"), media_type="text/event-stream")

    return apps.starlette_app(chat)


async def test_the_app_lets_go_of_the_request(lifetime_probe: LifetimeProbe) -> None:
    await lifetime_probe(keeps_in_a_contextvar())
"""


def test_enabled_in_a_conftest_the_failure_names_the_holder(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["asgi_lifetime.testing.plugin"]\n')
    pytester.makepyfile(test_user_app=HEADER + KEEPS_IN_A_CONTEXTVAR)
    result = runpytest(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    output = result.stdout.str().partition("short test summary info")[0]
    assert output.count("[ContextVar 'current_body']: bytes, 4.0 MiB") >= 2, output
    assert "Traceback" not in output


def test_a_body_factory_keeping_the_tests_own_copy_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_user_app=HEADER
        + """
from asgi_lifetime.testing import chat_completion_body


async def test_the_app_lets_go_of_the_request(lifetime_probe: LifetimeProbe) -> None:
    sent = []

    def factory(marker: str, size: int) -> bytes:
        sent.append(chat_completion_body(marker, size))
        return sent[-1]

    await lifetime_probe(apps.well_behaved(), body_factory=factory)
    assert len(sent) == 1
"""
    )
    runpytest(pytester, *PLUGIN).assert_outcomes(passed=2)


def test_a_sync_test_that_does_not_await_the_probe_fails(pytester: pytest.Pytester) -> None:
    # Without ``await`` the probe never runs: the test must not pass as if the app were checked.
    pytester.makepyfile(
        test_user_app="""
from tests.testing import apps


def test_forgot_to_await(lifetime_probe) -> None:
    lifetime_probe(apps.keeps_in_cache())
"""
    )
    result = runpytest(pytester, *PLUGIN, "-W", "error")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*lifetime_probe(...) was not awaited: the probe did not run*"])


def test_a_session_whose_tests_do_not_use_the_fixture_is_not_touched(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
import sys

import pytest


def test_sync() -> None:
    assert "fastapi" not in sys.modules  # the plugin imports no web framework of its own


@pytest.mark.parametrize("n", range(50))
def test_many(n: int) -> None:
    assert n >= 0
"""
    )
    result = runpytest(pytester, *PLUGIN, "-W", "error")
    result.assert_outcomes(passed=51)
