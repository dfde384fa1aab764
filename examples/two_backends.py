"""Two backends with session affinity: each conversation sticks to one upstream.

Run:  python examples/two_backends.py      (offline: two demo upstreams on loopback)

The equivalent standalone configuration is
    ASGI_LIFETIME_UPSTREAM_URL=http://10.0.0.1:8000,http://10.0.0.2:8000 asgi-lifetime serve
A request carrying `x-session-id` goes to the same upstream every time (rendezvous hashing,
so adding or removing one upstream moves only its share of sessions); requests without a
session id go to the upstream with the fewest requests in flight.
"""

from __future__ import annotations

import sys
from collections import Counter

import httpx

from asgi_lifetime import LifetimeSettings
from asgi_lifetime.gateway import create_app
from asgi_lifetime.testing import create_demo_upstream, serve_in_thread


def main() -> int:
    a, b = create_demo_upstream(tokens_per_second=500), create_demo_upstream(tokens_per_second=500)
    with serve_in_thread(a) as url_a, serve_in_thread(b) as url_b:
        gateway = create_app(LifetimeSettings(upstream_url=(url_a, url_b)))
        with serve_in_thread(gateway) as base, httpx.Client(base_url=base, timeout=30) as client:
            served: dict[str, Counter[str]] = {}
            for turn in range(3):
                for session in ("alice", "bob", "carol", "dave"):
                    before = (a.state.stats.requests, b.state.stats.requests)
                    chat = {"model": "demo", "messages": [{"role": "user", "content": f"turn {turn}"}], "max_tokens": 4}
                    client.post("/v1/chat/completions", json=chat, headers={"x-session-id": session}).raise_for_status()
                    which = url_a if a.state.stats.requests > before[0] else url_b
                    served.setdefault(session, Counter())[which] += 1
            for session, counts in served.items():
                print(f"session {session}: served by {dict(counts)}")
            return 0 if all(len(counts) == 1 for counts in served.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
