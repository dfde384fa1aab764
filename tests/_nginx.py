"""A real nginx (the Debian package) on loopback, configured from ``examples/deploy/nginx.conf``.

The example is an http-context file for ``conf.d``; here it is wrapped in a minimal main
configuration whose paths all live in a temporary directory, with the replicas' addresses and
the listening port replaced by loopback ones (``loopback_site``)::

    with nginx_server(tmp_path, loopback_site(EXAMPLE.read_text(), listen=port, gateways=[p1, p2])) as proxy:
        httpx.get(proxy.base + "/healthz")

``require_binary`` (tests/_servers.py) is the rule every test needing a system binary follows: under ``CI=true`` a
missing binary fails the test; elsewhere the test is skipped with an install hint.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._servers import require_binary

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "deploy" / "nginx.conf"
UPSTREAM_BLOCK = re.compile(r"(upstream\s+asgi_lifetime\s*\{)(.*?)(\n\})", re.DOTALL)
SERVER_LINE = re.compile(r"^(\s*server\s+)\S+:\d+", re.MULTILINE)
LISTEN_LINE = re.compile(r"^(\s*listen\s+)\d+\s*;", re.MULTILINE)
_START_TIMEOUT = 10.0


def loopback_site(text: str, *, listen: int, gateways: Sequence[int]) -> str:
    """The example's site with its replicas at ``127.0.0.1:<gateways>`` and listening on ``listen``.

    The example must have exactly as many ``server`` lines in its upstream block as ``gateways``.
    """
    block = UPSTREAM_BLOCK.search(text)
    assert block is not None, "no `upstream asgi_lifetime { ... }` block in the example"
    servers = SERVER_LINE.findall(block.group(2))
    assert len(servers) == len(gateways), f"the example has {len(servers)} replicas, the test {len(gateways)}"
    ports = iter(gateways)
    body = SERVER_LINE.sub(lambda m: f"{m.group(1)}127.0.0.1:{next(ports)}", block.group(2))
    text = text[: block.start(2)] + body + text[block.end(2) :]
    text, listens = LISTEN_LINE.subn(lambda m: f"{m.group(1)}127.0.0.1:{listen};", text)
    assert listens == 1, "the example must have one `listen PORT;`"
    return text


def main_config(prefix: Path, site: str, *, http_extra: str = "") -> Path:
    """Write ``nginx.conf`` (and the site) under ``prefix``: every path nginx writes is inside it."""
    (prefix / "site.conf").write_text(site)
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # As root, nginx's workers would switch to `nobody`, which cannot enter pytest's 0700 directories.
    user = "user root;\n" if os.geteuid() == 0 else ""
    config = prefix / "nginx.conf"
    config.write_text(
        f"{user}worker_processes 1;\nevents {{ worker_connections 1024; }}\n"
        f"http {{\n{temp}\n    access_log off;\n{http_extra}\n    include {prefix / 'site.conf'};\n}}\n"
    )
    return config


def _command(binary: str, prefix: Path, config: Path, *, test: bool = False) -> list[str]:
    directives = f"daemon off; pid {prefix / 'nginx.pid'}; error_log stderr;"
    return [binary, *(["-t"] if test else []), "-p", str(prefix), "-c", str(config), "-g", directives]


def check_config(prefix: Path, site: str) -> subprocess.CompletedProcess[str]:
    """``nginx -t`` on the site wrapped in the test's main configuration."""
    binary = require_binary("nginx", "nginx-light")
    config = main_config(prefix, site)
    return subprocess.run(_command(binary, prefix, config, test=True), capture_output=True, text=True, timeout=30)


@dataclass
class NginxServer:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def nginx_server(prefix: Path, site: str, *, port: int, http_extra: str = "") -> Iterator[NginxServer]:
    """nginx in the foreground with ``site``, until it accepts connections on ``port``; stopped on exit."""
    binary = require_binary("nginx", "nginx-light")
    prefix.mkdir(parents=True, exist_ok=True)
    config = main_config(prefix, site, http_extra=http_extra)
    log = (prefix / "nginx.log").open("wb")
    process = subprocess.Popen(_command(binary, prefix, config), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            assert process.poll() is None, (prefix / "nginx.log").read_text()
            # A connection, not a request: a request would reach the replicas, and one refused
            # there marks it failed for fail_timeout.
            with socket.socket() as probe:
                probe.settimeout(1)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not start listening in time"
            time.sleep(0.05)
        yield NginxServer(process, port)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # fast shutdown of the master and its worker
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()
