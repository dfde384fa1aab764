"""The ``asgi-lifetime`` command. Its dependencies are an extra: without it, say how to get it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .._extras import missing_extra

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when the ``cli`` extra is missing)."""
    try:
        from ._main import main as run
    except ModuleNotFoundError as exc:
        error = missing_extra(exc, "cli", "the asgi-lifetime command")
        if error is None:
            raise
        print(error, file=sys.stderr)
        return 1
    return run(argv)
