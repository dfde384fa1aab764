"""The benchmark suite runs end to end on a tiny size (``--smoke``): 1 MiB, one shape, no plots.

The full suite (``python -m benchmarks.run``, about 20 minutes) is not part of the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for peak RSS"),
    pytest.mark.slow,  # a subprocess running the benchmark suite: CI runs it in its own step (-m slow)
]


def test_smoke_run_writes_the_report(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    page = (tmp_path / "benchmarks.md").read_text()
    for heading in (
        "## Targets",
        "## 1. Memory",
        "## 2. Steady state",
        "## 3. Overhead",
        "## 4. Time to first byte",
        "## 5. Fingerprint cost",
        "## 6. JSON codec",
        "## 7. Overload",
        "## 9. The session book",
        "## 10. Many agents",
    ):
        assert heading in page
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    assert results["mode"] == "smoke"
    record = results["memory"]["grid"][0]
    assert record["size"] > 1024 * 1024 - 65536 and record["peak_prepare"] > 0
    assert all(entry["errors"] == 0 and entry["requests"] > 0 for entry in results["overhead"]["table"].values())
    assert all(row["errors"] == 0 and row["median_rps"] > 0 for row in results["sessions"]["table"].values())
    assert not list(tmp_path.glob("*.png"))  # --smoke draws no plots
    for overload_round in results["overload"]["rounds"]:
        for key, runs in overload_round["runs"].items():
            for rate, run in runs.items():
                # Short and on a busy machine: no latency claim, but every request was answered.
                assert run["sent"] > 0 and run["timeouts"] == 0 and run["errors"] == 0, (key, rate, run)
                assert run["shed_retry_after"] == run["shed"]
    agents = results["agents"]
    assert {run["gateway"] for run in agents["runs"]} == {"gw_disk", "ordinary"}
    for run in agents["runs"]:
        # Every agent's every turn answered in full (200, the stream ended with [DONE]); figures present.
        assert run["requests"] > 0 and run["errors"] == 0, run["failures"]
        assert run["median_in_flight"] > 0 and run["held_per_request"] is not None
        assert run["samples"] and run["peak"] >= run["median_steady"]
