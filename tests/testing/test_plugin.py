"""The pytest plugin as users enable it: ``-p asgi_lifetime.testing.plugin``, in a pytester run.

A test using the ``lifetime_probe`` fixture fails when the app still holds the request's body
while the response streams, and the failure names the holder; a well-behaved app passes. The
apps are those of ``apps.py``; each generated test runs on asyncio and on trio.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PLUGIN = ("-p", "asgi_lifetime.testing.plugin", "-p", "no:cacheprovider")
ROOT = Path(__file__).resolve().parents[2]  # where ``tests.testing.apps`` is imported from
HEADER = """
import pytest

from asgi_lifetime.testing import LifetimeProbe
from tests.testing import apps


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(autouse=True)
def cleared():
    yield
    apps.CACHE.clear()


pytestmark = pytest.mark.anyio
"""


def run(pytester: pytest.Pytester, app: str, *options: str) -> pytest.RunResult:
    pytester.makepyfile(
        test_user_app=HEADER
        + f"""

async def test_the_app_lets_go_of_the_request(lifetime_probe: LifetimeProbe) -> None:
    await lifetime_probe({app}{"".join(", " + option for option in options)})
"""
    )
    return runpytest(pytester, *PLUGIN)


def runpytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # In a process of its own: an in-process run restores sys.modules after each run, and the next
    # one's fresh FastAPI and pydantic modules would meet the classes of the first.
    return pytester.runpytest_subprocess(*args)


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize(
    ("app", "names"),
    [
        pytest.param(
            "apps.keeps_body()",
            [
                "  - async generator tests.testing.apps.keeps_body.<locals>.chat.<locals>.stream local 'body': "
                "bytes, 4.0 MiB",
                "  - coroutine starlette.routing.request_response.<locals>.app local 'request' → Request._body: "
                "bytes, 4.0 MiB",
            ],
            id="a-body-in-a-local",
        ),
        pytest.param(
            "apps.keeps_parsed()",
            [
                "  - async generator tests.testing.apps.keeps_parsed.<locals>.chat.<locals>.stream "
                "local 'data'['messages'][*]['content']: 256 str objects, 4.0 MiB",
                "local 'request' → Request._json['messages'][*]['content']: 256 str objects, 4.0 MiB",
            ],
            id="a-parse",
        ),
        pytest.param("apps.keeps_in_state()", ["['state']['body']: bytes, 4.0 MiB"], id="request-state"),
        pytest.param("apps.keeps_in_cache()", ["  - module tests.testing.apps.CACHE['last']: bytes"], id="a-global"),
        pytest.param(
            "apps.fastapi_app()",
            ["  - coroutine fastapi.routing.request_response.<locals>.app local 'request' → Request._body: bytes"],
            id="fastapi",
        ),
    ],
)
def test_a_test_of_an_app_that_keeps_the_body_fails_naming_the_holder(
    pytester: pytest.Pytester, app: str, names: list[str]
) -> None:
    result = run(pytester, app)
    result.assert_outcomes(failed=2)
    # The failure sections only: the short summary repeats the message, whole under CI=true (pytest
    # truncates it to the terminal width elsewhere).
    output = result.stdout.str().partition("short test summary info")[0]
    assert (
        output.count(
            "POST /v1/chat/completions (a 4.0 MiB body in 64.0 KiB chunks): the body was still reachable "
            "while the response (200) streamed, "
        )
        == 2
    ), output
    for name in names:
        assert output.count(name) == 2, (name, output)  # asyncio and trio
    assert "Traceback" not in output  # the message says it all (pytrace=False)


@pytest.mark.parametrize("app", ["apps.well_behaved()", "apps.lifetime_app()"])
def test_a_test_of_a_well_behaved_app_passes(pytester: pytest.Pytester, app: str) -> None:
    run(pytester, app).assert_outcomes(passed=2)


def test_options_reach_the_probe(pytester: pytest.Pytester) -> None:
    result = run(pytester, "apps.keeps_in_cache()", "body_size=100_000", "allow=['CACHE']")
    result.assert_outcomes(passed=2)


def test_a_probe_error_is_raised_as_it_is(pytester: pytest.Pytester) -> None:
    result = run(pytester, "apps.well_behaved()", "path='/elsewhere'")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*ProbeError: the app answered 404 without streaming*"])


def test_without_the_plugin_there_is_no_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user_app=HEADER + "\n\nasync def test_x(lifetime_probe):\n    pass\n")
    result = runpytest(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*fixture 'lifetime_probe' not found*"])
