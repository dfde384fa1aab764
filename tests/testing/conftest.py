from __future__ import annotations

# The plugin's fixture, as a suite that enables the plugin gets it; pytester runs the plugin as
# users enable it (``-p asgi_lifetime.testing.plugin``).
from asgi_lifetime.testing.plugin import lifetime_probe  # noqa: F401

pytest_plugins = ["pytester"]
