"""The version is written once, in ``asgi_lifetime/__init__.py``; the build reads it from there."""

from __future__ import annotations

from importlib.metadata import version

import asgi_lifetime


def test_version_is_the_installed_distributions() -> None:
    assert asgi_lifetime.__version__ == version("asgi-lifetime")
