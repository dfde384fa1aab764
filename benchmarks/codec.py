"""JSON codecs on one body, in a fresh process so peaks are the codec's own.

``python -m benchmarks.codec CODEC BODY_FILE`` prints one JSON line: seconds and peak RSS
above the process's RSS with the body loaded, for ``loads``, for ``dumps`` of the parsed
body with a system message inserted, and for ``malloc_trim(0)`` once both are freed.
Peaks come from the kernel's high-water mark (``VmHWM``, reset through ``clear_refs``).
CODEC: ``stdlib`` (what ``_json`` used before), ``orjson``, ``msgspec`` or ``asgi_lifetime``
(``asgi_lifetime._json``, whatever it is now).
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 1024 * 1024


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def codec(name: str) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    if name == "stdlib":
        return (
            lambda raw: json.loads(raw.decode("utf-8")),
            lambda value: json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(),
        )
    if name == "orjson":
        import orjson

        return orjson.loads, orjson.dumps
    if name == "msgspec":
        import msgspec

        return msgspec.json.Decoder().decode, msgspec.json.Encoder().encode
    if name == "asgi_lifetime":
        from asgi_lifetime import _json

        return _json.loads, _json.dumps
    raise SystemExit(f"unknown codec {name!r}")


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    loads, dumps = codec(name)
    with open(path, "rb") as f:
        raw = f.read()
    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    parsed = loads(raw)
    loads_s = time.perf_counter() - started
    loads_peak = _status("VmHWM") - base
    graph = _status("VmRSS") - base
    parsed["messages"].insert(0, {"role": "system", "content": "You are a helpful assistant."})
    _reset_peak()
    started = time.perf_counter()
    out = dumps(parsed)
    dumps_s = time.perf_counter() - started
    dumps_peak = _status("VmHWM") - base
    graph_after = _status("VmRSS") - base - len(out)
    del parsed, out
    gc.collect()
    freed = _status("VmRSS") - base
    started = time.perf_counter()
    ctypes.CDLL(None).malloc_trim(0)
    trim_s = time.perf_counter() - started
    trimmed = _status("VmRSS") - base
    print(
        json.dumps(
            {
                "codec": name,
                "size": len(raw),
                "loads_s": loads_s,
                "loads_peak": loads_peak,
                "graph": graph,
                "dumps_s": dumps_s,
                "dumps_peak": dumps_peak,
                "graph_after_dumps": graph_after,
                "freed_rss": freed,
                "trim_s": trim_s,
                "trimmed_rss": trimmed,
            }
        )
    )


if __name__ == "__main__":
    main()
