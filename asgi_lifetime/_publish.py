"""Public objects defined in private modules carry their public path."""

from __future__ import annotations

import types
import typing
from typing import Any

__all__ = ["publish"]


def publish(namespace: dict[str, Any]) -> None:
    """Set ``__module__`` of the classes and functions a public module lists in ``__all__``.

    Reprs, tracebacks, pickles and the API reference then show ``asgi_lifetime.X`` rather than
    ``asgi_lifetime._private.X``. A class's string annotations (``from __future__ import
    annotations``) are resolved first: ``typing.get_type_hints`` looks names up in the module
    ``__module__`` names, which does not import what the annotations mention.
    """
    for name in namespace["__all__"]:
        obj = namespace[name]
        if isinstance(obj, type):
            if "__annotations__" in vars(obj):
                obj.__annotations__ = typing.get_type_hints(obj, include_extras=True)
        elif not isinstance(obj, types.FunctionType):
            continue  # constants, type aliases: no module of their own
        obj.__module__ = namespace["__name__"]
