"""The one place JSON is parsed and serialized, so the codec can be swapped in one spot."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSONDecodeFailure", "dumps", "loads"]


class JSONDecodeFailure(ValueError):
    """The bytes are not a JSON document this package will parse (bad syntax, bad UTF-8, too deep)."""


def loads(raw: bytes) -> Any:
    """Parse a JSON document from UTF-8 bytes.

    Raises ``JSONDecodeFailure`` for invalid JSON, invalid UTF-8 and nesting deep enough
    to exhaust the recursion limit (hostile input must not crash the caller).
    """
    try:
        # Decode explicitly: json.loads(bytes) would also accept UTF-16/32 by sniffing.
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise JSONDecodeFailure(f"request body is not valid JSON: {type(exc).__name__}") from None


def dumps(value: Any) -> bytes:
    """Serialize compactly to UTF-8 bytes."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
