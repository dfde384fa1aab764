"""Public objects defined in private modules carry their public path."""

from __future__ import annotations

import typing
from typing import Any

__all__ = ["publish"]


def publish(module: str, *objects: Any) -> None:
    """Set ``__module__`` of ``objects`` to ``module``, where users import them from.

    Reprs, tracebacks, pickles and the API reference then show ``asgi_lifetime.X`` rather than
    ``asgi_lifetime._private.X``. A class's string annotations (``from __future__ import
    annotations``) are resolved first: ``typing.get_type_hints`` looks names up in the module
    ``__module__`` names, which does not import what the annotations mention.
    """
    for obj in objects:
        if isinstance(obj, type) and "__annotations__" in vars(obj):
            obj.__annotations__ = typing.get_type_hints(obj, include_extras=True)
        obj.__module__ = module
