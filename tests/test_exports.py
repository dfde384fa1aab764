"""The public API, pinned: each public module's names, and the public path in every repr.

Adding or removing a public name is a decision: this test changes with it, and so does the
CHANGELOG (as httpx's ``test_exported_members`` does).
"""

from __future__ import annotations

import types
import typing

import pytest

import asgi_lifetime
import asgi_lifetime.gateway
import asgi_lifetime.testing

ROOT = [
    "AdmissionRejected",
    "AuthenticationError",
    "BodyAborted",
    "BodyIdleTimeout",
    "BodyTimeout",
    "BodyTooComplex",
    "BodyTooLarge",
    "Fingerprint",
    "GiB",
    "KiB",
    "Lifetime",
    "LifetimeError",
    "LifetimeMiddleware",
    "LifetimeSettings",
    "LifetimeStats",
    "MalformedBody",
    "MiB",
    "RequestError",
    "RequestLifetime",
    "RequestResources",
    "Resource",
    "UNPARSED",
    "UnsupportedEncoding",
    "UpstreamError",
    "UpstreamStalled",
    "UpstreamStarved",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "__version__",
    "fingerprint",
    "text_comparable",
    "wire_hash",
]
GATEWAY = [
    "AccessLog",
    "AttemptEvent",
    "Bookkeeper",
    "Conversation",
    "ConversationView",
    "Draft",
    "GatewayAuth",
    "GatewayMetrics",
    "Outcome",
    "Prepared",
    "Preparer",
    "RedisSessionBook",
    "Refold",
    "RemapRole",
    "SessionBook",
    "SessionEntry",
    "Spliced",
    "UpstreamClient",
    "create_app",
    "default_refold",
    "default_remap_role",
    "without_parse",
]
TESTING = [
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
]
MODULES = [(asgi_lifetime, ROOT), (asgi_lifetime.gateway, GATEWAY), (asgi_lifetime.testing, TESTING)]


@pytest.mark.parametrize(("module", "names"), MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_exported_members(module: types.ModuleType, names: list[str]) -> None:
    assert module.__all__ == names
    for name in names:
        assert hasattr(module, name), name


@pytest.mark.parametrize(("module", "names"), MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_nothing_public_is_left_out(module: types.ModuleType, names: list[str]) -> None:
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= set(names)


@pytest.mark.parametrize(("module", "names"), MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_reprs_show_the_public_path(module: types.ModuleType, names: list[str]) -> None:
    for name in names:
        value = getattr(module, name)
        if isinstance(value, (type, types.FunctionType)):
            assert value.__module__ == module.__name__, (name, value.__module__)
            assert getattr(module, value.__qualname__) is value  # pickle finds it where the repr says


def test_a_public_exception_pickles_by_its_public_path() -> None:
    import pickle

    error = asgi_lifetime.BodyTooLarge(limit=10)
    assert repr(type(error)) == "<class 'asgi_lifetime.BodyTooLarge'>"
    assert type(pickle.loads(pickle.dumps(error))) is asgi_lifetime.BodyTooLarge


@pytest.mark.parametrize(("module", "names"), MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_type_hints_resolve_from_the_public_path(module: types.ModuleType, names: list[str]) -> None:
    # get_type_hints looks a class's string annotations up in sys.modules[cls.__module__]: with the
    # public path there, they must have been resolved (FastAPI, pydantic and dataclass tools call it).
    for name in names:
        value = getattr(module, name)
        if isinstance(value, type):
            typing.get_type_hints(value)
            for attribute, method in vars(value).items():
                if isinstance(method, types.FunctionType) and (attribute == "__init__" or attribute[0] != "_"):
                    typing.get_type_hints(method)
        elif isinstance(value, types.FunctionType):
            typing.get_type_hints(value)
