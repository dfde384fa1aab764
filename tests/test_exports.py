"""The public API is what ``asgi_lifetime.__all__`` says, and nothing public is left out of it."""

from __future__ import annotations

import types

import asgi_lifetime
import asgi_lifetime.gateway
import asgi_lifetime.testing


def test_all_is_sorted_and_every_name_exists() -> None:
    assert asgi_lifetime.__all__ == sorted(asgi_lifetime.__all__)
    for name in asgi_lifetime.__all__:
        assert hasattr(asgi_lifetime, name), name


def test_every_public_name_is_exported() -> None:
    public = {
        name
        for name, value in vars(asgi_lifetime).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= set(asgi_lifetime.__all__)


def test_public_classes_and_functions_are_defined_in_the_package() -> None:
    for name in asgi_lifetime.__all__:
        value = getattr(asgi_lifetime, name)
        if isinstance(value, (type, types.FunctionType)):
            assert value.__module__.startswith("asgi_lifetime"), (name, value.__module__)


def test_submodule_apis() -> None:
    assert asgi_lifetime.gateway.__all__ == ["create_app"]
    assert set(asgi_lifetime.testing.__all__) == {
        "DemoStats",
        "Holder",
        "LifetimeProbe",
        "ProbeError",
        "RetentionReport",
        "assert_idle",
        "chat_completion_body",
        "create_demo_upstream",
        "held",
        "parse_behaviour",
        "probe_retention",
        "serve_in_thread",
        "wait_idle",
    }
    assert asgi_lifetime.testing.__all__ == sorted(asgi_lifetime.testing.__all__)
    for name in asgi_lifetime.testing.__all__:  # reprs and the API reference show the public path
        assert getattr(asgi_lifetime.testing, name).__module__ == "asgi_lifetime.testing", name
