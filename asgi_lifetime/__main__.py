"""``python -m asgi_lifetime``: the ``asgi-lifetime`` command."""

from ._cli import main

if __name__ == "__main__":  # uvicorn's spawned workers import this module as __mp_main__
    raise SystemExit(main())
