"""The ``asgi-lifetime`` command (also ``python -m asgi_lifetime``): serve, settings, demo.

::

    asgi-lifetime serve --upstream https://api.example.com --host 0.0.0.0 --workers 4
    asgi-lifetime settings --max-body-bytes 32MiB     # what would run, and where each value comes from
    asgi-lifetime settings --format markdown          # the reference table in docs/operators.md
    asgi-lifetime demo --size-mib 8

Every setting in ``SETTINGS`` is also a flag. ``serve`` validates the effective settings once
(flag > environment > .env file > default), exports them as ``ASGI_LIFETIME_*`` variables and
runs uvicorn with the factory ``serve_app`` (``asgi_lifetime.gateway:create_app`` on those variables
alone), so one worker and N workers build their app the same way: from the environment. With N workers and no
``PROMETHEUS_MULTIPROC_DIR`` it creates a private one (removed at exit), so ``/metrics`` and
``/lifetime/stats`` report every worker whichever one answers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import inspect
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import fields
from types import FrameType
from typing import Any, NoReturn

import uvicorn
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG
from uvicorn.supervisors import Multiprocess, multiprocess

from .. import __version__
from .._extras import missing_extra
from .._settings import (
    SETTINGS,
    GiB,
    KiB,
    LifetimeSettings,
    MiB,
    SettingSpec,
    _parse_bool,
    _parse_float,
    _parse_int,
    _parse_list,
    _parse_size,
    collect_environ,
    redact_url,
)
from ..gateway._auth import holds_credential, is_loopback, open_beyond_loopback
from ..gateway._metrics import MULTIPROC_DIR_ENV, multiproc_directory_problem
from ..gateway._shutdown import request_shutdown

__all__ = [
    "build_parser",
    "event_loop",
    "export_environ",
    "flag_values",
    "format_value",
    "http_protocol",
    "is_loopback",
    "main",
    "redact_url",
    "refusal",
    "resolve_settings",
    "serve_app",
    "server_config",
    "settings_markdown",
    "settings_report",
]

logger = logging.getLogger(__name__)

PROG = "asgi-lifetime"
# The gateway built from the settings serve exported, and only from them (see serve_app).
GATEWAY_FACTORY = "asgi_lifetime._cli._main:serve_app"
COMMAND_LINE = "command line"
DEFAULT = "default"
# After SHUTDOWN_GRACE the gateway ends the streams itself; this is uvicorn's hard backstop beyond that.
SHUTDOWN_BACKSTOP = 5.0
# uvicorn's httptools protocol without trailer fields (_httptools.py): what ``--http httptools`` runs.
HTTPTOOLS_PROTOCOL = "asgi_lifetime._cli._httptools:HttpToolsProtocol"
# uvicorn's h11 protocol: what ``--http h11`` runs. Both close a connection that has not completed its next
# request head within --timeout-keep-alive (_idle.py).
H11_PROTOCOL = "asgi_lifetime._cli._h11:H11Protocol"
HTTP_CHOICES = ("auto", "httptools", "h11")
LOOP_CHOICES = ("auto", "uvloop", "asyncio")

_DESCRIPTION = """\
An LLM API gateway that keeps each request's input only as long as it is needed:
the body is read once, fingerprinted, prepared and forwarded, and released the
moment upstream retries settle, before the answer streams."""

_EPILOG = """\
examples:
  asgi-lifetime serve --upstream https://api.example.com --host 0.0.0.0 --workers 4
  asgi-lifetime serve --upstream http://10.0.0.5:8000 --upstream http://10.0.0.6:8000
  asgi-lifetime serve                  # no upstream: a loudly announced DEMO upstream on loopback
  asgi-lifetime settings --env-file prod.env
  asgi-lifetime settings --format markdown
  asgi-lifetime demo                   # 64 MiB through the gateway, offline, no API key

Every setting is a flag, an ASGI_LIFETIME_* environment variable and a .env line;
precedence: flag > environment > .env file > default. Reference: docs/operators.md."""

_SERVE_EPILOG = """\
With UPSTREAM_API_KEY set, clients must present one of GATEWAY_KEYS; without
GATEWAY_KEYS the gateway only starts on a loopback host, and so without
UPSTREAM_API_KEY beside GATEWAY_KEYS (the keys would not be checked). Without an upstream it
serves a built-in DEMO upstream (lorem ipsum, not a real model).
SIGTERM: keep accepting for DRAIN_DELAY seconds while /healthz answers 503
"draining" and new requests get 503 with Retry-After, then stop listening; streams
in flight get SHUTDOWN_GRACE more seconds, then exit 0. SIGINT skips DRAIN_DELAY."""


class CommandError(Exception):
    """A problem the operator must fix; printed as one line, exit status 2."""


# ---------------------------------------------------------------------------
# Settings: flags, sources, validation, export
# ---------------------------------------------------------------------------

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(LifetimeSettings)}


def _flag(name: str) -> str:
    """The setting's flag; UPSTREAM_URL's is ``--upstream`` (``--upstream-url`` also works)."""
    return "--upstream" if name == "upstream_url" else "--" + name.replace("_", "-")


def _metavar(spec: SettingSpec) -> str:
    if spec.secret:
        return "KEY,KEY" if spec.parse is _parse_list else "KEY"
    if spec.parse is _parse_size:
        return "SIZE"
    if spec.parse is _parse_int:
        return "N"
    if spec.parse is _parse_float:
        return "SECONDS"  # every float setting is a duration
    if spec.parse is _parse_bool:
        return "BOOL"
    if spec.parse is _parse_list:
        return "A,B"
    return "TEXT"


def format_value(spec: SettingSpec, value: Any) -> str:
    """A value as an operator would write it (``64MiB``, ``30``, ``true``, ``a,b``); secrets masked."""
    if spec.secret:
        return "***" if value else "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if spec.name == "session_store" and isinstance(value, str):
        return redact_url(value)  # a Redis URL may carry a password
    if spec.parse is _parse_size and isinstance(value, int):
        for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if value >= size and value % size == 0:
                return f"{value // size}{unit}"
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        items = [redact_url(v) for v in value] if spec.name == "upstream_url" else list(value)
        return ",".join(items) if items else "(none)"
    return "(unset)" if value is None else str(value)


def _env_text(value: Any) -> str:
    """A validated value as text its parser reads back to the same value (secrets included)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """``--upstream`` and one flag per setting, generated from ``SETTINGS`` (values parsed later)."""
    parser.add_argument(
        "--env-file",
        metavar="PATH",
        help="read ASGI_LIFETIME_* lines from this file (default: ./.env if it exists)",
    )
    group = parser.add_argument_group(
        "settings",
        "Each flag overrides its ASGI_LIFETIME_* variable.\nPrecedence: flag > environment > .env file > default.",
    )
    for name, spec in SETTINGS.items():
        default = format_value(spec, _DEFAULTS[name])
        help_text = f"{spec.help} [{spec.env}; default {default}]"
        if spec.secret:
            help_text += " Prefer the environment: a command line is visible to other local users."
        if spec.parse is _parse_list:
            # Repeats as --upstream does: a repeated --paths or --gateway-keys kept only the last value.
            help_text += " May repeat."
        if name == "upstream_url":
            group.add_argument(
                _flag(name),
                "--upstream-url",
                dest=name,
                action="append",
                metavar="URL",
                help=f"{spec.help} May repeat. [{spec.env}; default: none, a DEMO upstream is served]",
            )
            continue
        action = "append" if spec.parse is _parse_list else "store"
        group.add_argument(
            _flag(name), dest=name, action=action, metavar=_metavar(spec), help=help_text.replace("%", "%%")
        )


def flag_values(args: argparse.Namespace) -> dict[str, str]:
    """The settings given as flags, as raw text by setting name (repeated ``--upstream`` joined)."""
    values: dict[str, str] = {}
    for name in SETTINGS:
        raw = getattr(args, name, None)
        if raw is None:
            continue
        values[name] = ",".join(raw) if isinstance(raw, list) else str(raw)
    return values


def resolve_settings(
    flags: Mapping[str, str], environ: Mapping[str, str], *, env_file: str | None
) -> tuple[LifetimeSettings, dict[str, str]]:
    """The effective settings and each one's source (flag > environment > env file > default).

    ``env_file``: a path that must exist, or ``None`` for ``./.env`` if it exists. Any invalid
    value raises ``CommandError`` naming the setting and where it came from.
    """
    if env_file is not None and not os.path.exists(env_file):
        raise CommandError(f"--env-file {env_file}: no such file")
    if env_file is not None and os.path.isdir(env_file):
        raise CommandError(f"--env-file {env_file}: is a directory")
    try:
        found = collect_environ(environ, env_file=env_file if env_file is not None else ".env")
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    raw = {name: text for name, (text, _) in found.items()}
    sources = {name: source for name, (_, source) in found.items()}
    for name, text in flags.items():
        raw[name] = text
        sources[name] = COMMAND_LINE
    try:
        settings = LifetimeSettings.from_mapping(raw)
    except ValueError as exc:
        raise CommandError(_with_source(str(exc), sources)) from None
    return settings, {name: sources.get(name, DEFAULT) for name in SETTINGS}


def _with_source(message: str, sources: Mapping[str, str]) -> str:
    """Say where the offending value came from, so the operator knows what to edit."""
    for name, spec in SETTINGS.items():
        if message.startswith(spec.env + "="):
            source = sources.get(name, DEFAULT)
            where = f"set by {_flag(name)}" if source == COMMAND_LINE else f"from the {source}"
            return f"{message} ({where})" if source != DEFAULT else message
    return message


def export_environ(settings: LifetimeSettings, environ: MutableMapping[str, str]) -> None:
    """Write every setting as ``ASGI_LIFETIME_<NAME>``, for ``create_app()`` in the worker processes."""
    for name, spec in SETTINGS.items():
        # The workers split the user info off again when they build their settings.
        value = settings.upstream_urls_with_userinfo() if name == "upstream_url" else getattr(settings, name)
        environ[spec.env] = _env_text(value)


def refusal(settings: LifetimeSettings, host: str) -> str | None:
    """Why the gateway must not start on ``host`` with these settings, or ``None``: keys that leave
    the port open (``open_beyond_loopback``) are only acceptable on a loopback address."""
    gap = None if is_loopback(host) else open_beyond_loopback(settings)
    if gap is None:
        return None
    fix = "set GATEWAY_KEYS" if holds_credential(settings) else "set UPSTREAM_API_KEY, unset GATEWAY_KEYS,"
    return f"refusing to serve on {host}: {gap}; {fix} or bind a loopback --host"


# ---------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------


def settings_report(settings: LifetimeSettings, sources: Mapping[str, str]) -> str:
    """One line per setting: ENV name, value (secrets masked), source."""
    rows = [(spec.env, format_value(spec, _shown(settings, name)), sources[name]) for name, spec in SETTINGS.items()]
    name_width = max(len(env) for env, _, _ in rows)
    value_width = min(40, max(len(value) for _, value, _ in rows))
    return "\n".join(f"{env:<{name_width}}  {value:<{value_width}}  {source}" for env, value, source in rows)


def _shown(settings: LifetimeSettings, name: str) -> Any:
    return settings.shown_upstream_urls() if name == "upstream_url" else getattr(settings, name)


def settings_markdown() -> str:
    """The settings reference table (name, environment variable, default, description)."""
    lines = ["| Setting | Environment variable | Default | Description |", "|---|---|---|---|"]
    for name, spec in SETTINGS.items():
        default = format_value(spec, _DEFAULTS[name])
        description = (spec.help + (" Secret: masked in every report." if spec.secret else "")).replace("|", "\\|")
        lines.append(f"| `{_flag(name)}` | `{spec.env}` | `{default}` | {description} |")
    return "\n".join(lines)


def _cmd_settings(args: argparse.Namespace) -> int:
    if args.format == "markdown":
        print(settings_markdown())
        return 0
    settings, sources = resolve_settings(flag_values(args), os.environ, env_file=args.env_file)
    print(settings_report(settings, sources))
    return 0


# ---------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the gateway to drain the moment a stop signal arrives.

    On SIGTERM it keeps listening for ``DRAIN_DELAY`` seconds first: load balancers see
    ``/healthz`` answer 503 ``draining`` and new requests get 503 with ``Retry-After``, while
    in-flight streams go on. Then uvicorn stops listening and shuts down as usual. SIGINT (an
    interactive stop) and a second SIGTERM skip the delay.
    """

    def __init__(self, config: uvicorn.Config, *, drain_delay: float | None = None) -> None:
        super().__init__(config)
        self.drain_delay = _drain_delay_from_environ() if drain_delay is None else drain_delay
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_delay > 0 and self._drain_until is None and not self.should_exit:
            request_shutdown(stop_listening_in=self.drain_delay)
            self._drain_until = time.monotonic() + self.drain_delay
            logger.warning("SIGTERM: draining for %gs before the server stops listening", self.drain_delay)
            return  # on_tick stops the server when the delay is over
        request_shutdown()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and time.monotonic() >= self._drain_until:
            self.should_exit = True
        return await super().on_tick(counter)


def _drain_delay_from_environ() -> float:
    """``DRAIN_DELAY`` as ``serve`` exported it (worker processes build their server from the environment)."""
    raw = os.environ.get(SETTINGS["drain_delay"].env)
    return LifetimeSettings.from_mapping({"drain_delay": raw}).drain_delay if raw else _DEFAULTS["drain_delay"]


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging setup, plus the package's loggers (its access log is the only one).

    uvicorn's access log is off (it writes query strings, where keys travel: ``?key=...``), and the
    query of its WebSocket handshake lines is masked.
    httpx and httpcore log every upstream request URL at INFO/DEBUG: WARNING and up only.
    """
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["asgi_lifetime"] = {"handlers": ["default"], "level": LOG_LEVELS[level], "propagate": False}
    # uvicorn logs each WebSocket handshake (the gateway refuses them all) with its query, on uvicorn.error.
    config.setdefault("filters", {})["no_websocket_query"] = {"()": f"{__name__}._NoWebSocketQuery"}
    config["loggers"]["uvicorn.error"].setdefault("filters", []).append("no_websocket_query")
    for name in ("httpx", "httpcore"):
        config["loggers"][name] = {"handlers": ["default"], "level": "WARNING", "propagate": False}
    return config


class _NoWebSocketQuery(logging.Filter):
    """Masks the query of the path in uvicorn's ``"WebSocket <path>"`` handshake lines (Gemini Live
    clients send ``?key=...``); the access log is off for the same reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(record.msg, str) and '"WebSocket %s"' in record.msg and isinstance(args, tuple) and len(args) > 1:
            path = args[1]
            if isinstance(path, str):
                record.args = (args[0], redact_url(path), *args[2:])
        return True


class _WorkerProcess(multiprocess.Process):
    """A uvicorn worker process that runs ``_GracefulServer``."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = _GracefulServer(config=self.config)
        return self._server


def _run_workers(config: uvicorn.Config) -> None:
    """Run N workers as ``uvicorn.run`` does: one bound socket, the Multiprocess supervisor."""
    sock = config.bind_socket()
    try:
        if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn before the target-less supervisor
            supervisor: Any = Multiprocess
            supervisor(config, target=_GracefulServer(config=config).run, sockets=[sock]).run()
            return
        # Current uvicorn builds each worker's server in multiprocess.Process.server; the
        # supervisor (this process only) must create our subclass, also for restarted workers.
        original = multiprocess.Process
        setattr(multiprocess, "Process", _WorkerProcess)  # noqa: B010 - a class attribute assignment mypy refuses
        try:
            Multiprocess(config, sockets=[sock]).run()
        finally:
            setattr(multiprocess, "Process", original)  # noqa: B010
    finally:
        sock.close()


def _stopped(signum: int, frame: FrameType | None) -> NoReturn:
    # uvicorn re-raises the stop signal once it has shut down gracefully; that is a clean exit.
    raise SystemExit(0)


class _ThreadFilter(logging.Filter):
    """Drops the records logged from one thread."""

    def __init__(self, thread_name: str) -> None:
        super().__init__()
        self.thread_name = thread_name

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != self.thread_name


@contextlib.contextmanager
def _demo_upstream_if_needed(settings: LifetimeSettings) -> Iterator[LifetimeSettings]:
    if settings.upstream_url:
        yield settings
        return
    from ..testing._serve import serve_in_thread
    from ..testing._upstream import create_demo_upstream

    with serve_in_thread(create_demo_upstream(tokens_per_second=50.0), shutdown_timeout=5.0) as url:
        # uvicorn's loggers are process-wide: without this, the demo's access log reads like the gateway's.
        quiet = _ThreadFilter(f"asgi-lifetime-serve-{url.rsplit(':', 1)[1]}")
        for name in ("uvicorn.access", "uvicorn.error"):
            logging.getLogger(name).addFilter(quiet)
        banner = f"no upstream configured: serving the built-in DEMO upstream at {url} — not a real model"
        hint = "Answers are lorem ipsum. Forward to a real model with --upstream URL (or ASGI_LIFETIME_UPSTREAM_URL)."
        width = max(len(banner), len(hint)) + 4
        rule = "!" * width
        print(f"{rule}\n! {banner:<{width - 4}} !\n! {hint:<{width - 4}} !\n{rule}", file=sys.stderr, flush=True)
        yield settings.replace(upstream_url=(url,))


@contextlib.contextmanager
def _shared_directory(workers: int) -> Iterator[None]:
    """N workers: the directory where they share metrics and stats, unless the operator named one.

    Set before the workers start (prometheus_client picks its storage at import, in each worker).
    One the operator named is tried here, once: each worker would fail on it at startup, and be
    restarted by uvicorn's supervisor, for ever.
    """
    named = os.environ.get(MULTIPROC_DIR_ENV)
    if named:
        problem = multiproc_directory_problem(named)
        if problem is not None:
            raise CommandError(problem)
    if workers < 2 or named:
        yield
        return
    directory = tempfile.mkdtemp(prefix="asgi-lifetime-workers-")
    os.environ[MULTIPROC_DIR_ENV] = directory
    try:
        yield
    finally:
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def http_protocol(choice: str) -> str:
    """uvicorn's ``http`` for ``--http``: ``auto`` is httptools when installed (the ``cli`` extra brings it),
    else h11. httptools runs as ``HTTPTOOLS_PROTOCOL``, which drops trailer fields as h11 does; h11 as
    ``H11_PROTOCOL``. Both give a connection ``--timeout-keep-alive`` seconds to complete each request head."""
    if choice == "auto":
        choice = "httptools" if _installed("httptools") else "h11"
    if choice == "h11":
        return H11_PROTOCOL
    if not _installed("httptools"):
        raise CommandError("--http httptools: httptools is not installed; pip install 'asgi-lifetime[cli]'")
    return HTTPTOOLS_PROTOCOL


def event_loop(choice: str) -> str:
    """uvicorn's ``loop`` for ``--loop``: ``auto`` is uvloop when installed (uvicorn picks it), else asyncio."""
    if choice == "uvloop" and not _installed("uvloop"):
        raise CommandError("--loop uvloop: uvloop is not installed; pip install 'asgi-lifetime[cli]' (not on Windows)")
    return choice


def server_config(args: argparse.Namespace, settings: LifetimeSettings) -> uvicorn.Config:
    """The uvicorn configuration ``serve`` runs: the gateway factory, the server flags, the effective settings."""
    return uvicorn.Config(
        GATEWAY_FACTORY,
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        http=http_protocol(args.http),
        loop=event_loop(args.loop),
        log_level=args.log_level,
        log_config=_log_config(args.log_level),
        access_log=False,  # the gateway's own access log (asgi_lifetime.access) never writes queries
        proxy_headers=args.proxy_headers,
        forwarded_allow_ips=args.forwarded_allow_ips,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace + SHUTDOWN_BACKSTOP),
        lifespan="on",
    )


def serve_app() -> Any:
    """The app each ``serve`` worker runs: the gateway built from the settings ``serve`` exported, and only
    from them. ``create_app()`` would read ``./.env`` as well, which ``--env-file`` replaced: a stray line
    there (a typo, a bad byte) failed every worker's start after ``serve`` had accepted the settings."""
    from ..gateway import create_app

    return create_app(LifetimeSettings.from_environ(env_file=None))


def _cmd_serve(args: argparse.Namespace) -> int:
    settings, sources = resolve_settings(flag_values(args), os.environ, env_file=args.env_file)
    if not settings.upstream_url and sources["upstream_url"] != DEFAULT:
        # ``--upstream "$URL"`` or ``UPSTREAM_URL=${URL}`` with URL unset: the DEMO upstream would answer
        # every client with lorem ipsum and 200s.
        where = "--upstream" if sources["upstream_url"] == COMMAND_LINE else f"from the {sources['upstream_url']}"
        raise CommandError(
            f"{SETTINGS['upstream_url'].env} is empty ({where}): name an upstream, or leave it unset for the "
            "DEMO upstream"
        )
    problem = refusal(settings, args.host)
    if problem:
        raise CommandError(problem)
    if args.workers < 1:
        raise CommandError(f"--workers={args.workers} is invalid: must be at least 1")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stopped)
    try:
        with _demo_upstream_if_needed(settings) as effective, _shared_directory(args.workers):
            export_environ(effective, os.environ)
            config = server_config(args, effective)
            upstreams = ", ".join(effective.shown_upstream_urls())
            paths = ", ".join(effective.paths)
            workers = f"{args.workers} worker{'s' if args.workers != 1 else ''}"
            print(f"{PROG} {__version__}: forwarding {paths} to {upstreams} ({workers})", file=sys.stderr, flush=True)
            if args.workers > 1:
                _run_workers(config)
                return 0
            server = _GracefulServer(config)
            server.run()
            return 0 if server.started else 3
    except KeyboardInterrupt:  # SIGINT re-raised after a graceful shutdown
        return 0


# ---------------------------------------------------------------------------
# Parser and entry point
# ---------------------------------------------------------------------------


def _port(text: str) -> int:
    """``--port``: 0-65535. getaddrinfo takes 99999 as 34463 (modulo 65536): the server would listen there."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0-65535)")
    return port


def _host(text: str) -> str:
    """``--host``: not empty. ``--host "$HOST"`` with HOST unset listened on every address."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty host listens on every address; name one (0.0.0.0 for that)")
    return text


def _non_negative_int(text: str) -> int:
    """``--timeout-keep-alive``: a negative one closed every idle connection at once."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be a whole number of seconds, 0 or greater")
    return value


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    commands.required = True

    serve = commands.add_parser(
        "serve",
        help="run the gateway under uvicorn",
        description="Run the gateway (asgi_lifetime.gateway:create_app) under uvicorn.",
        epilog=_SERVE_EPILOG,
        formatter_class=formatter,
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", type=_host, default="127.0.0.1", help="address to bind (default %(default)s)")
    server.add_argument("--port", type=_port, default=8080, help="port to bind (default %(default)s)")
    server.add_argument("--workers", type=int, default=1, help="worker processes (default %(default)s)")
    server.add_argument(
        "--http",
        default="auto",
        choices=HTTP_CHOICES,
        help="uvicorn's HTTP/1.1 parser; auto: httptools when installed (the cli extra), else h11 "
        "(default %(default)s)",
    )
    server.add_argument(
        "--loop",
        default="auto",
        choices=LOOP_CHOICES,
        help="event loop; auto: uvloop when installed (the cli extra, not on Windows), else asyncio "
        "(default %(default)s)",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn log level (default %(default)s)",
    )
    server.add_argument(
        "--proxy-headers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trust X-Forwarded-For/-Proto from --forwarded-allow-ips (default on)",
    )
    server.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help="comma-separated proxy addresses or networks trusted for proxy headers "
        "(default: $FORWARDED_ALLOW_IPS or 127.0.0.1)",
    )
    server.add_argument(
        "--timeout-keep-alive",
        type=_non_negative_int,
        default=5,
        metavar="SECONDS",
        help="close idle client connections after this long; behind a load balancer, set it above "
        "the balancer's idle timeout (default %(default)s)",
    )
    add_setting_flags(serve)
    serve.set_defaults(handler=_cmd_serve)

    report = commands.add_parser(
        "settings",
        help="show the effective settings and where each comes from",
        description="Print the effective settings: ENV name, value (secrets masked), source.",
        formatter_class=formatter,
    )
    report.add_argument(
        "--format",
        choices=["text", "markdown"],
        default="text",
        help="text: effective values and sources; markdown: the reference table of every setting",
    )
    add_setting_flags(report)
    report.set_defaults(handler=_cmd_settings)

    demo_help = "send a large request through the gateway to a DEMO upstream, offline"
    try:
        from . import _demo
    except ModuleNotFoundError as exc:
        error = missing_extra(exc, "demo", "asgi-lifetime demo")
        if error is None:
            raise
        hint = str(error)
        # The other commands work without the demo's display; ``demo`` says what to install.
        demo = commands.add_parser("demo", help=demo_help, add_help=False)
        demo.add_argument("rest", nargs=argparse.REMAINDER)
        demo.set_defaults(handler=lambda args: _fail(hint))
        return parser
    demo = commands.add_parser("demo", help=demo_help, description=_demo.DESCRIPTION, formatter_class=formatter)
    _demo.add_arguments(demo)
    demo.set_defaults(handler=_demo.run)
    return parser


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a configuration problem)."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except CommandError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return status
