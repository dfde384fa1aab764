"""Install and import what you use: the core needs anyio, blake3, msgspec and starlette only.

Each check runs in a fresh interpreter (this one has imported everything already).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap

import pytest

from asgi_lifetime._extras import EXTRA_MODULES

EXTRAS = ("httpx", "httpcore", "h11", "aiohttp", "yarl", "prometheus_client", "rich", "psutil", "uvicorn", "redis")

# Run first in the child: record every process-wide hook the package registers from then on
# (the standard library registers some of its own when first imported: random, threading).
HOOKS = """
import atexit, os, signal, sys, threading
hooks = []
def spy(name, real):
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.partition(".")[0] == "asgi_lifetime":
            hooks.append(f"{caller}: {name}")
        return real(*args, **kwargs)
    return wrapper
os.register_at_fork = spy("os.register_at_fork", os.register_at_fork)
atexit.register = spy("atexit.register", atexit.register)
signal.signal = spy("signal.signal", signal.signal)
sys.addaudithook = spy("sys.addaudithook", sys.addaudithook)
excepthooks = (sys.excepthook, threading.excepthook)
"""

# Makes the extras' modules unimportable, as in an environment that installed the core only.
BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRAS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )


def child_report(code: str) -> dict[str, object]:
    result = run(HOOKS + textwrap.dedent(code))
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("module", ["asgi_lifetime", "asgi_lifetime.gateway", "asgi_lifetime.testing"])
def test_importing_registers_no_process_hooks(module: str) -> None:
    report = child_report(f"""
        import json, sys, threading
        import {module}
        print(json.dumps({{"hooks": hooks, "excepthooks": (sys.excepthook, threading.excepthook) == excepthooks}}))
    """)
    assert report == {"hooks": [], "excepthooks": True}


def test_the_core_imports_none_of_the_extras() -> None:
    report = child_report(f"""
        import json, sys
        import asgi_lifetime
        print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in {EXTRAS!r})))
    """)
    assert report == []  # type: ignore[comparison-overlap]


def test_the_gateway_imports_redis_only_to_use_it() -> None:
    report = child_report("""
        import json, sys
        import asgi_lifetime.gateway
        from asgi_lifetime import LifetimeSettings
        from asgi_lifetime.gateway import create_app
        create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",)))
        print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] == "redis")))
    """)
    assert report == []  # type: ignore[comparison-overlap]


def test_the_gateway_imports_aiohttp_only_where_it_sends() -> None:
    """Building the app imports no aiohttp (a tenth of a second): choosing the transport in an
    asyncio loop does."""
    report = child_report("""
        import json, sys, anyio
        from asgi_lifetime import LifetimeSettings
        from asgi_lifetime.gateway import create_app
        app = create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",)))
        before = "aiohttp" in sys.modules
        async def start():
            async with app.router.lifespan_context(app):
                return app.state.upstream.transport_name
        name = anyio.run(start)
        print(json.dumps([before, name, "aiohttp" in sys.modules]))
    """)
    assert report == [False, "aiohttp", True]  # type: ignore[comparison-overlap]


def test_without_aiohttp_auto_sends_with_httpcore_and_aiohttp_says_what_to_install() -> None:
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(("aiohttp",)))
        + """
import anyio
from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
app = create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",)))
async def start():
    async with app.router.lifespan_context(app):
        return app.state.upstream.transport_name
print(anyio.run(start))
try:
    create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",), upstream_transport="aiohttp"))
except ValueError as exc:
    print(exc)
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no warning for falling back
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "httpcore"
    assert "UPSTREAM_TRANSPORT=aiohttp needs aiohttp: pip install 'asgi-lifetime[gateway]'" in lines[1]


def test_a_redis_session_store_without_the_redis_extra_says_what_to_install() -> None:
    blocked = ("redis",)
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(blocked))
        + """
from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
try:
    create_app(LifetimeSettings(upstream_url=("http://127.0.0.1:9",), session_store="redis://u:pw@127.0.0.1:6379/0"))
except ModuleNotFoundError as exc:
    print(exc)
"""
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'asgi-lifetime[redis]'" in result.stdout
    assert "pw" not in result.stdout


def test_the_middleware_works_without_the_extras() -> None:
    # A Starlette app behind the middleware, called over ASGI, with every extra unimportable.
    result = run(
        BLOCK
        + """
import anyio
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from asgi_lifetime import LifetimeMiddleware, LifetimeSettings

async def endpoint(request):
    lifetime = request.state.lifetime
    return PlainTextResponse(f"{lifetime.fingerprint.size} {lifetime.fingerprint.text_comparable}")

app = LifetimeMiddleware(Starlette(routes=[Route("/v1/x", endpoint, methods=["POST"])]), settings=LifetimeSettings())

async def main():
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    sent = []
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": "/v1/x", "raw_path": b"/v1/x", "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("t", 80), "client": ("c", 1), "asgi": {"version": "3.0"}}
    await app(scope, receive, send)
    print(sent[0]["status"], len(body), sent[1]["body"].decode())

anyio.run(main)
"""
    )
    assert result.returncode == 0, result.stderr
    status, size, answer = result.stdout.split(maxsplit=2)
    assert (status, answer.split()) == ("200", [size, "True"])  # fingerprinted: size and verdict


@pytest.mark.parametrize(
    ("blocked", "argv", "extra"),
    [
        (EXTRAS, ["serve"], "cli"),
        (EXTRAS, ["settings"], "cli"),
        (("rich", "psutil"), ["demo"], "demo"),
    ],
)
def test_the_command_without_its_extra_says_what_to_install(
    blocked: tuple[str, ...], argv: list[str], extra: str
) -> None:
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(blocked))
        + f"""
from asgi_lifetime._cli import main
raise SystemExit(main({argv!r}))
"""
    )
    assert result.returncode == 1, result.stderr
    assert f"pip install 'asgi-lifetime[{extra}]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_command_without_the_demo_extra_still_reports_settings() -> None:
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(("rich", "psutil")))
        + """
from asgi_lifetime._cli import main
raise SystemExit(main(["settings"]))
"""
    )
    assert result.returncode == 0, result.stderr
    assert "MAX_BODY_BYTES" in result.stdout


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("asgi_lifetime.gateway", EXTRAS, "gateway"),
        ("asgi_lifetime.gateway", ("prometheus_client",), "gateway"),
        ("asgi_lifetime.gateway", ("httpcore", "h11"), "gateway"),
    ],
)
def test_importing_a_part_without_its_extra_says_what_to_install(
    module: str, blocked: tuple[str, ...], extra: str
) -> None:
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(blocked))
        + f"""
try:
    import {module}
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
    print(exc.__suppress_context__)
"""
    )
    assert result.returncode == 0, result.stderr
    name, message, suppressed = result.stdout.strip().splitlines()
    assert name in blocked
    assert message.startswith(f"{module} needs {name!r}")
    assert message.endswith(f"pip install 'asgi-lifetime[{extra}]'")
    assert suppressed == "True"  # the deep import chain is not shown


def test_the_retention_probe_and_its_plugin_run_on_the_core() -> None:
    # docs/testing.md's probe needs anyio and starlette only: a core install (a project served by
    # hypercorn, say, without uvicorn) runs it; the helpers that need a client or a server say
    # what to install when they are used.
    result = run(
        BLOCK
        + """
import anyio
import asgi_lifetime.testing.plugin
from asgi_lifetime.testing import ProbeError, probe_retention

async def app(scope, receive, send):
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\\n\\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

print(anyio.run(probe_retention, app).holders)
for name in ("wait_idle", "serve_in_thread"):
    try:
        getattr(asgi_lifetime.testing, name)
    except ModuleNotFoundError as exc:
        print(exc.name, exc, exc.__suppress_context__, sep="|")
"""
    )
    assert result.returncode == 0, result.stderr
    held, idle, serve = result.stdout.strip().splitlines()
    assert held == "()"
    hint = "which is not installed: pip install 'asgi-lifetime[cli]'"
    assert idle == f"httpx|asgi_lifetime.testing.wait_idle needs 'httpx', {hint}|True"
    assert serve.startswith("uvicorn|asgi_lifetime.testing.serve_in_thread needs 'uvicorn'")


def test_a_missing_module_outside_the_extras_is_not_blamed_on_them() -> None:
    # Only the gateway extra's own modules get the install hint: any other missing module is raised as it is.
    result = run(
        BLOCK.replace(repr(EXTRAS), repr(("blake3",)))
        + """
try:
    import asgi_lifetime.gateway
except ModuleNotFoundError as exc:
    print(exc.name, "pip install" in str(exc))
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["blake3", "False"]


def test_a_misspelt_testing_helper_is_a_type_error() -> None:
    # asgi_lifetime.testing imports its server and client helpers when first used (a module
    # __getattr__); type checkers see them declared, and not the __getattr__ that would make any
    # other name Any: a typo is an error in the user's mypy run, not a crash in their test.
    from mypy import api

    code = "import asgi_lifetime.testing as t\nt.wait_idle\nt.wait_idel\n"
    stdout, _, status = api.run(["--strict", "--no-incremental", "--config-file=", "-c", code])
    assert status == 1, stdout
    assert '<string>:3: error: Module has no attribute "wait_idel"; maybe "wait_idle"?' in stdout


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~;\s(]", requirement, maxsplit=1)[0]).lower()


def _extra_distributions(extra: str) -> set[str]:
    """The distributions the installed package's ``extra`` requires (the build writes an extra's own
    extras out in its metadata: ``cli`` lists the gateway's too)."""
    marker = re.compile(rf"""extra\s*==\s*['"]{extra}['"]""")
    return {
        _name(requirement)
        for requirement in importlib.metadata.requires("asgi-lifetime") or []
        if marker.search(requirement)
    }


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_each_extra_brings_the_modules_its_install_hint_names(extra: str) -> None:
    # A module named in EXTRA_MODULES that the extra does not install would send a user to install
    # an extra that does not help.
    providers = importlib.metadata.packages_distributions()
    required = _extra_distributions(extra)
    for module in EXTRA_MODULES[extra]:
        brought_by = {_name(name) for name in providers.get(module, [])}
        direct = brought_by & required
        through = {
            name
            for name in required
            for dependency in importlib.metadata.requires(name) or []
            if _name(dependency) in brought_by
        }
        assert direct or through, f"{module} is not installed by the {extra!r} extra"
