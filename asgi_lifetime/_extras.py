"""What each extra installs, and the error for a module one of them would have brought.

A core install (``pip install asgi-lifetime``) runs the middleware only; the gateway, the command and
the demo need extras (pyproject.toml's optional dependencies, which ``test_package`` holds this table
to). Where their import fails, the error names the extra to install, not the module deep in the import
chain that missed; any other missing module is not blamed on an extra.
"""

from __future__ import annotations

__all__ = ["EXTRA_MODULES", "missing_extra"]

_GATEWAY = frozenset({"httpx", "httpcore", "h11", "prometheus_client"})

EXTRA_MODULES: dict[str, frozenset[str]] = {
    "gateway": _GATEWAY,
    "cli": _GATEWAY | {"uvicorn"},
    "demo": frozenset({"rich", "psutil"}),
}
"""The top-level modules each extra brings that its code imports unconditionally (aiohttp, httptools
and uvloop are optional even with their extra: their absence is a fallback, not an error)."""


def missing_extra(exc: ModuleNotFoundError, extra: str, needs: str) -> ModuleNotFoundError | None:
    """``exc`` said as "``needs`` needs M, which is not installed: pip install 'asgi-lifetime[extra]'",
    or ``None`` if the missing module is not one ``extra`` brings (then ``exc`` is the error).

    Raise it ``from None``: the import chain that missed says nothing the message does not.
    """
    missing = (exc.name or "").partition(".")[0]
    if missing not in EXTRA_MODULES[extra]:
        return None
    return ModuleNotFoundError(
        f"{needs} needs {missing!r}, which is not installed: pip install 'asgi-lifetime[{extra}]'", name=missing
    )
