"""``examples/deploy/``: nginx accepts the configuration, and the numbers that must agree do.

The nginx file goes through ``nginx -t`` (replicas' addresses replaced by loopback ones). The
compose file and the Kubernetes manifests are checked for the invariants docs/deploy.md states:
routing by session with consistent hashing, readiness on ``/healthz``, a kill timeout above the
drain (preStop + ``DRAIN_DELAY`` + ``SHUTDOWN_GRACE`` + uvicorn's backstop), a memory limit
derived from ``MAX_INFLIGHT_BYTES``, body limits and timeouts in line with the gateway's. The
YAML checks need PyYAML (installed with the docs extra); without it they are skipped, and the
text checks below them still run.
"""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import yaml

from asgi_lifetime import LifetimeSettings, MiB
from asgi_lifetime._cli._main import SHUTDOWN_BACKSTOP
from asgi_lifetime._settings import ENV_PREFIX, SETTINGS, _parse_size
from asgi_lifetime.gateway import create_app
from tests._nginx import EXAMPLE, UPSTREAM_BLOCK, check_config, loopback_site, nginx_server
from tests._servers import free_port, served, threaded_server

DEPLOY = EXAMPLE.parent
NGINX = EXAMPLE.read_text()
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
# Settings the examples use that another branch adds; checked like the others once they exist.
PENDING = {"session_store"} - set(SETTINGS)
DEFAULTS = LifetimeSettings()


def memory_limit_mib(workers: int, max_inflight_bytes: int) -> float:
    """The rule written next to the limits: supervisor + workers x (baseline + 1.25 x input budget)."""
    return 64 + workers * (64 + 1.25 * max_inflight_bytes / MiB)


def nginx_directive(name: str, text: str = NGINX) -> list[str]:
    return re.findall(rf"^\s*{name}\s+([^;]+);", text, re.MULTILINE)


def nginx_seconds(value: str) -> float:
    found = re.fullmatch(r"(\d+)(ms|s|m)?", value.strip())
    assert found, value
    return int(found.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[found.group(2)]


def nginx_size(value: str) -> int:
    found = re.fullmatch(r"(\d+)([kmg])?", value.strip().lower())
    assert found, value
    return int(found.group(1)) * {"k": 1024, "m": MiB, "g": 1024 * MiB, None: 1}[found.group(2)]


def settings_from(env: dict[str, Any]) -> LifetimeSettings:
    """Validate the ``ASGI_LIFETIME_*`` variables of an example as the gateway would at start."""
    # A key without a value (compose: taken from the shell or .env, else unset) is left to the operator too.
    names = {
        key[len(ENV_PREFIX) :].lower(): str(value)
        for key, value in env.items()
        if key.startswith(ENV_PREFIX) and value is not None
    }
    unknown = set(names) - set(SETTINGS) - PENDING
    assert not unknown, f"not settings: {unknown}"
    # ${VAR:-} interpolations are left to the operator; an empty value means the default.
    known = {name: value for name, value in names.items() if name in SETTINGS and "${" not in value and value}
    return LifetimeSettings.from_mapping(known)


# --- nginx ------------------------------------------------------------------------------------


def test_nginx_example_passes_nginx_t(tmp_path: Path) -> None:
    site = loopback_site(NGINX, listen=free_port(), gateways=[free_port(), free_port()])
    result = check_config(tmp_path, site)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_example_routes_by_session_and_streams_both_ways() -> None:
    block = UPSTREAM_BLOCK.search(NGINX)
    assert block is not None
    header = DEFAULTS.session_header.replace("-", "_")
    assert nginx_directive("hash", block.group(2)) == [f"$http_{header} consistent"]
    assert nginx_directive("proxy_buffering") == ["off"]  # SSE relayed as it comes
    assert nginx_directive("proxy_request_buffering") == ["off"]  # the body streamed to the gateway
    assert nginx_directive("proxy_http_version") == ["1.1"]
    # Only connection failures are retried elsewhere: a POST already sent is never re-sent.
    (retry,) = nginx_directive("proxy_next_upstream")
    assert "non_idempotent" not in retry.split() and "error" in retry.split()
    # Silence between two reads: longer than the gateway's wait for upstream headers and its keep-alives.
    (read_timeout,) = nginx_directive("proxy_read_timeout")
    assert nginx_seconds(read_timeout) > max(DEFAULTS.headers_timeout, DEFAULTS.keepalive_interval)
    # The gateway's own 413 (JSON) wins below nginx's limit.
    (body,) = nginx_directive("client_max_body_size")
    assert nginx_size(body) > DEFAULTS.max_body_bytes


def test_the_replicas_keep_connections_longer_than_nginx_does() -> None:
    (timeout,) = nginx_directive("keepalive_timeout", UPSTREAM_BLOCK.search(NGINX).group(2))  # type: ignore[union-attr]
    compose = COMPOSE.read_text()
    keep_alive = re.search(r"--timeout-keep-alive[ =](\d+)", compose)
    assert keep_alive and int(keep_alive.group(1)) > nginx_seconds(timeout)


# --- compose and Kubernetes, as text (no PyYAML needed) ---------------------------------------


def test_k8s_and_compose_invariants_in_text() -> None:
    deployment = (K8S / "deployment.yaml").read_text()
    config = (K8S / "configmap.yaml").read_text()
    grace = re.search(r'ASGI_LIFETIME_SHUTDOWN_GRACE:\s*"(\d+)"', config)
    drain = re.search(r'ASGI_LIFETIME_DRAIN_DELAY:\s*"(\d+)"', config)
    period = re.search(r"terminationGracePeriodSeconds:\s*(\d+)", deployment)
    sleep = re.search(r'preStop:\s*\n(?:.*\n)*?\s*command:\s*\["sleep",\s*"(\d+)"\]', deployment)
    assert grace and drain and period and sleep
    assert int(period.group(1)) > int(sleep.group(1)) + int(drain.group(1)) + int(grace.group(1)) + SHUTDOWN_BACKSTOP
    assert re.search(r"readinessProbe:\s*\n\s*httpGet:\s*\n\s*path:\s*/healthz", deployment)
    compose = COMPOSE.read_text()
    stop = re.search(r"stop_grace_period:\s*(\d+)s", compose)
    compose_grace = re.search(r'ASGI_LIFETIME_SHUTDOWN_GRACE:\s*"(\d+)"', compose)
    compose_drain = re.search(r'ASGI_LIFETIME_DRAIN_DELAY:\s*"(\d+)"', compose)
    assert stop and compose_grace and compose_drain
    assert int(stop.group(1)) > int(compose_drain.group(1)) + int(compose_grace.group(1)) + SHUTDOWN_BACKSTOP
    assert "ASGI_LIFETIME_SESSION_STORE: redis://redis:6379/0" in compose


# --- compose and Kubernetes, parsed ------------------------------------------------------------


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_compose_file() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"gateway-1", "gateway-2", "redis", "nginx"}
    # nginx's upstream servers are the gateway services, on the port they serve.
    block = UPSTREAM_BLOCK.search(NGINX)
    assert block is not None
    servers = sorted(s.split()[0] for s in nginx_directive("server", block.group(2)))
    gateways = sorted(name for name in services if name.startswith("gateway-"))
    assert servers == [f"{name}:8080" for name in gateways]
    assert any(volume.startswith("./nginx.conf:/etc/nginx/conf.d/") for volume in services["nginx"]["volumes"])
    for name in gateways:
        gateway = services[name]
        assert gateway["environment"]["ASGI_LIFETIME_SESSION_STORE"] == "redis://redis:6379/0"
        command = gateway["command"].split()
        assert command[0] == "serve" and "--port" in command and command[command.index("--port") + 1] == "8080"
        workers = int(command[command.index("--workers") + 1])
        settings = settings_from(gateway["environment"])
        assert nginx_size(nginx_directive("client_max_body_size")[0]) > settings.max_body_bytes
        stop = nginx_seconds(gateway["stop_grace_period"])
        assert stop > settings.drain_delay + settings.shutdown_grace + SHUTDOWN_BACKSTOP
        assert (
            _parse_size(gateway["mem_limit"].replace("m", "MiB"))
            == memory_limit_mib(workers, settings.max_inflight_bytes) * MiB
        )
        assert "redis" in gateway["depends_on"]


def manifests(yaml: Any) -> dict[str, dict[str, Any]]:
    found = {doc["kind"]: doc for path in sorted(K8S.glob("*.yaml")) for doc in load_all(path)}
    assert set(found) == {"ConfigMap", "Deployment", "Service", "Ingress"}
    return found


def test_kubernetes_manifests() -> None:
    docs = manifests(yaml)
    config = docs["ConfigMap"]["data"]
    settings = settings_from(config)
    pod = docs["Deployment"]["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert docs["Deployment"]["metadata"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert {"configMapRef": {"name": docs["ConfigMap"]["metadata"]["name"]}} in container["envFrom"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"][1:])
    assert container["args"][0] == "serve"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}

    # Ready while /healthz says so (503 from SIGTERM on), on the port the gateway serves.
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and port[probe["port"]] == int(args["port"])
    assert "livenessProbe" not in container  # /healthz answers 503 while draining, by design

    # The kill timeout covers preStop, the drain and the grace.
    (command, seconds) = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command == "sleep"
    drain = int(seconds) + settings.drain_delay + settings.shutdown_grace + SHUTDOWN_BACKSTOP
    assert spec["terminationGracePeriodSeconds"] > drain

    # Memory from MAX_INFLIGHT_BYTES (per worker) and the workers.
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    assert int(limit.removesuffix("Mi")) == memory_limit_mib(int(args["workers"]), settings.max_inflight_bytes)
    # The shared metrics/stats directory of serve --workers N needs a writable /tmp.
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    assert args["timeout-keep-alive"] and int(args["timeout-keep-alive"]) > 60  # ingress-nginx keeps 60 s

    service = docs["Service"]["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    (target,) = (p["targetPort"] for p in service["ports"])
    assert target in port

    annotations = docs["Ingress"]["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "upstream-hash-by"] == f"$http_{settings.session_header.replace('-', '_')}"
    assert annotations[prefix + "proxy-buffering"] == annotations[prefix + "proxy-request-buffering"] == "off"
    assert nginx_size(annotations[prefix + "proxy-body-size"]) > settings.max_body_bytes
    assert int(annotations[prefix + "proxy-read-timeout"]) > settings.headers_timeout
    backend = docs["Ingress"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == docs["Service"]["metadata"]["name"]


# --- an nginx that buffers (its default) ----------------------------------------------------------


def _slow_stream(sock: socket.socket, first_seen: threading.Event, released: list[bool]) -> None:
    """An upstream that sends one event, then waits (up to 10 s) for the client to have it before the rest."""
    with sock:
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
        body = head.partition(b"\r\n\r\n")[2]
        while len(body) < length:
            body += sock.recv(65536)
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices":[{"index":0,"delta":{"content":"first"}}]}\n\n'
        sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        released.append(first_seen.wait(10))
        done = b"data: [DONE]\n\n"
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def test_an_nginx_that_buffers_and_compresses_relays_each_event_as_it_comes(tmp_path: Path) -> None:
    """An nginx as many sites have it: answers buffered (its default, ``proxy_buffering on``) and
    compressed (``gzip`` with event streams among its types). In buffered mode nginx's gzip holds
    events until its buffer fills: the client got the first event only when the stream ended (its
    10 s here). The gateway's SSE answers carry ``X-Accel-Buffering: no``: nginx then passes (and
    flushes) each read as it comes."""
    first_seen = threading.Event()
    released: list[bool] = []
    with (
        threaded_server(lambda sock, _: _slow_stream(sock, first_seen, released)) as upstream,
        served(create_app(LifetimeSettings(upstream_url=(upstream,))), "uvicorn-h11") as gateway,
    ):
        port = free_port()
        site = (
            f"server {{ listen 127.0.0.1:{port};\n"
            f"  location / {{ proxy_pass {gateway}; proxy_http_version 1.1; proxy_read_timeout 30s; }} }}\n"
        )
        compressing = "gzip on; gzip_types text/event-stream;"
        with (
            nginx_server(tmp_path / "nginx", site, port=port, http_extra=compressing) as proxy,
            httpx.Client(timeout=30) as client,
        ):
            payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            with client.stream("POST", proxy.base + "/v1/chat/completions", json=payload) as response:
                assert response.status_code == 200
                assert "x-accel-buffering" not in response.headers  # nginx acts on it and keeps it
                lines = response.iter_lines()
                assert (
                    next(line for line in lines if line)
                    == 'data: {"choices":[{"index":0,"delta":{"content":"first"}}]}'
                )
                first_seen.set()
                assert "data: [DONE]" in list(lines)
    # The upstream went on because the client had the first event, not because its 10 s ran out.
    assert released == [True]
