"""The ``asgi-lifetime`` command. Its dependencies are an extra: without it, say how to get it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["EXTRA_MODULES", "install_hint", "main"]

EXTRA_MODULES = {
    "cli": frozenset({"uvicorn", "httpx", "httpcore", "h11", "prometheus_client"}),
    "demo": frozenset({"rich", "psutil"}),
}
"""Which extra brings which top-level module (pyproject.toml's optional dependencies)."""


def install_hint(exc: ModuleNotFoundError, extra: str) -> str | None:
    """The message for a module that ``extra`` would have installed, or ``None`` for any other."""
    missing = (exc.name or "").partition(".")[0]
    if missing not in EXTRA_MODULES[extra]:
        return None
    return (
        f"asgi-lifetime: this command needs {missing!r}, which is not installed.\n"
        f"Install the {extra!r} extra: pip install 'asgi-lifetime[{extra}]'"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when the ``cli`` extra is missing)."""
    try:
        from ._main import main as run
    except ModuleNotFoundError as exc:
        hint = install_hint(exc, "cli")
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 1
    return run(argv)
