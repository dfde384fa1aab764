"""Every example runs offline and does what its docstring says (each returns 0 on success)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["fastapi_app", "mount_fastapi", "two_backends", "custom_preparer"])
def test_example_runs(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert module.main() == 0
    finally:
        del sys.modules[spec.name]
    assert capsys.readouterr().out.strip()
