from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from asgi_lifetime import MiB
from asgi_lifetime._cli._demo import STREAMING, _Conversation, _RichDisplay, _Watch, main
from asgi_lifetime.gateway._upstream import AttemptEvent

from .test_cli import run_cli


def test_the_short_demo_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--size-mib", "2", "--tokens", "20", "--plain"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if prefix in line)

    assert "fingerprint: wire " in out and "text comparable: yes" in out
    assert "prepare: preparer injected a system prompt" in out
    assert "retry: attempt 1 answered 503" in out
    assert "refold: attempt 2 answered 400 (context overflow" in out
    assert "RELEASED: retries settled after 3 attempts (status 200)" in out
    assert "gateway retained input 0 B" in out  # at the release, taken on the gateway's thread
    assert first("fingerprint:") < first("retry:") < first("refold:") < first("RELEASED") < first("first token")
    assert "first token (input already released)" in out
    assert "stream complete: 20 tokens, [DONE]" in out
    for row in ("before sending", "peak, sending and preparing", "peak, streaming", "after (idle, gc.collect)"):
        assert row in out
    assert "process RSS" in out and "gateway retained input" in out
    assert "1 retry, 1 refold" in out and "gateway after idle" in out
    assert lines[-1] == "result: OK"


def test_the_demo_without_faults_takes_one_attempt(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--size-mib", "0.5", "--tokens", "5", "--plain", "--no-faults", "--retain-outbound"]) == 0
    out = capsys.readouterr().out
    assert "retry:" not in out and "refold:" not in out
    assert "RELEASED: retries settled after 1 attempt (status 200)" in out
    assert "RETAIN_OUTBOUND=memory" in out and "result: OK" in out


def test_the_demo_command_in_a_real_process(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "demo", "--size-mib", "1", "--tokens", "10", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RELEASED" in done.stdout and done.stdout.rstrip().endswith("result: OK")  # plain: stdout is a pipe
    assert "\x1b[" not in done.stdout


@pytest.mark.parametrize("argv", [["--size-mib", "0"], ["--size-mib", "nan"], ["--tokens", "0"], ["--tokens", "5000"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--plain"]) == 2
    assert capsys.readouterr().err.startswith("asgi-lifetime demo: ")


@pytest.mark.parametrize("size", [2 * 1024, 100 * 1024, 1 * MiB, 5 * MiB])
def test_the_conversation_is_valid_json_of_about_the_size(size: int) -> None:
    conversation = _Conversation(size, tokens=7)
    body = b"".join(conversation.pieces())
    assert len(body) == conversation.size <= size + 2048
    assert conversation.size >= size * 0.9 or size < 8 * 1024
    doc = json.loads(body)
    assert doc["stream"] is True and doc["max_tokens"] == 7
    roles = [m["role"] for m in doc["messages"]]
    assert roles[-1] == "user" and roles.count("user") == conversation.turns >= 3
    assert b"".join(conversation.pieces()) == body  # deterministic: the dry run measured this body


def test_the_live_display_renders() -> None:
    watch = _Watch(total=4 * MiB, tokens=50)
    watch.sent, watch.tokens, watch.retained_now, watch.phase = 4 * MiB, 20, 0, STREAMING
    watch.on_attempt(AttemptEvent("retry", 1, 503, "status 503", 0.1))
    watch.on_attempt(AttemptEvent("settled", 2, 200, "status 200"))
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    display = _RichDisplay(watch, console=console)
    display.flush()
    console.print(display._render())
    lines, ok = watch.summary(retain_outbound=False)
    display.summary(lines)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "upload" in text and "input held" in text and "RELEASED" in text and "retry" in text
    assert not ok and "result: FAILED" in text
