"""No function above cyclomatic complexity 20 outside the demo, as radon counts it.

Starlette's most complex function scores 20: so should ours. Past that, a function does too
many things to read, or to test branch by branch. ``_demo.py`` (the terminal display of
``asgi-lifetime demo``) is exempt. Methods and closures count as functions of their own; the
walk covers subpackages too.
"""

from __future__ import annotations

from pathlib import Path

from radon.complexity import add_inner_blocks, cc_visit
from radon.visitors import Function

import asgi_lifetime

CEILING = 20
PACKAGE = Path(asgi_lifetime.__file__).parent
EXEMPT = frozenset({"_demo.py"})


def scores(path: Path) -> list[tuple[str, int]]:
    """Every function, method and closure in ``path``: its name (``Class.method``, ``outer.inner``) and score."""
    blocks = add_inner_blocks(cc_visit(path.read_text(encoding="utf-8")))
    return [(block.fullname, block.complexity) for block in blocks if isinstance(block, Function)]


def test_the_count_sees_functions_methods_and_closures() -> None:
    names = {name for path in PACKAGE.rglob("*.py") for name, _ in scores(path)}
    assert {"text_comparable", "LifetimeMiddleware.__call__", "default_refold.refold"} <= names


def test_no_function_above_the_ceiling() -> None:
    above = [
        f"{path.relative_to(PACKAGE.parent)}: {name} scores {score}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in EXEMPT
        for name, score in scores(path)
        if score > CEILING
    ]
    assert not above, f"cyclomatic complexity above {CEILING} (radon cc -s):\n" + "\n".join(above)
