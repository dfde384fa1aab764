"""A spy on the full JSON parse, shared by the middleware's and the preparers' tests."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def spy_parse(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[bytes]:
    """Record every full parse (``_parse.parse_body``) that ``module`` runs, patched where it is looked
    up; the parse itself still runs."""
    parses: list[bytes] = []
    real = module.parse_body

    async def counting(raw: bytes, **kwargs: Any) -> Any:
        parses.append(raw)
        return await real(raw, **kwargs)

    monkeypatch.setattr(module, "parse_body", counting)
    return parses
