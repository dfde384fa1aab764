"""Who still holds the request's input: a search of the heap for a marker, naming the holders.

The probe (``_probe.py``) sends a body in which every chunk carries a random marker, and calls
``find_holders`` while the app is suspended in the middle of its streamed response. Nothing
else runs on the event loop meanwhile: the search is synchronous.

1. **Find.** ``gc.get_objects()`` lists every container the collector tracks. ``str`` and
   ``bytes`` are not tracked, nor are the tuples and dicts that hold only such atoms (CPython
   untracks them), so each tracked object's referents are read, descending into untracked
   containers. A coroutine's (generator's) referents are its frame's locals, so the locals of
   every suspended coroutine are read too; other threads' running frames are read through
   ``f_locals``. Buffers that are no referent (``io.BytesIO``, a ``memoryview`` of something
   else than bytes, ``array``) are read by content.
2. **Name.** From each holder, referrers are climbed (one ``gc.get_referrers`` scan per level)
   up to the nearest object a reader recognises: a suspended coroutine or generator (its local),
   a frame kept by a traceback, a module (a global), a class, a function (a free variable),
   another thread's frame, or the app under test. The path down is written as Python would
   reach it: ``coroutine m.f local 'request' → Request._json['messages'][0]['content']``.
3. **Leave out the probe.** The objects the probe names as its own, the search's own (created
   after the snapshot) and the current thread's stack (the test awaiting the probe) are neither
   holders nor referrers. A holder whose every climb ends there is not the app's.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import gc
import inspect
import io
import itertools
import re
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

__all__ = ["Found", "Group", "find_holders", "group"]

_GENERATORS = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)
_KIND = {
    types.CoroutineType: "coroutine",
    types.GeneratorType: "generator",
    types.AsyncGeneratorType: "async generator",
}
# Untracked objects that hold no other object: skipped without a call.
_ATOMS = frozenset({int, float, bool, complex, type(None), type(Ellipsis), type(NotImplemented), types.CodeType})
# Containers, known not to be buffers (any other type is asked once whether it is one).
_HAVE_GC = 1 << 14  # Py_TPFLAGS_HAVE_GC: the type's objects may refer to others
_CONTAINERS = frozenset({dict, list, tuple, set, frozenset, type, types.FunctionType, types.CellType})
_CHUNK = 64  # holders passed over at once when nothing in them can hold the needle
_MARKED = frozenset({str, bytes})  # read by ``may_hold`` itself
_MAX_LEVELS = 32  # referrer levels climbed from a holder
_BATCH = 256  # up to this many objects, referrers are found by gc.get_referrers (its cost: heap x objects)
_MAX_FRONTIER = 8 * _BATCH  # objects climbed from, per level
_CLIMB_SECONDS, _CLIMB_FACTOR = 5.0, 4.0  # the climb's time: at least this, or this many times the search's
_MAX_HOLDERS = 4 * _BATCH  # distinct holders named; the others are counted by type
_MAX_ROUTES = 4  # paths named to one holder
_DETOUR = 2  # how much longer than the shortest another path to a holder may be
_INDEX = re.compile(r"\[\d+\]| ×\d+")
# Objects at least this long are also searched for the needle's base64 and hex forms: a kept
# encoded copy of the input (an audit log, a signature's input) that matters is a large one.
_ENCODED_MIN = 512


@dataclass(frozen=True)
class Found:
    """One reference to a piece of input: how it is reached, what it is, its size in bytes."""

    path: str
    kind: str
    leaf: int  # id() of the object holding input, to count each object once
    size: int


@dataclass(frozen=True)
class _Hit:
    holder: object  # a tracked object (or another thread's local) with a reference down to the leaf
    via: tuple[object, ...]  # the untracked containers between the holder and the leaf
    leaf: object


def find_holders(
    needle: str, *, own: Iterable[object] = (), own_code: Iterable[types.CodeType] = (), app: object = None
) -> list[Found]:
    """Every reference path, from something recognisable, to an object whose content has ``needle``.

    ``own``: the caller's objects, and ``own_code``: the code of its suspended coroutines (neither
    searched nor climbed through). ``app``: named "the app" when a path starts there. The
    ``needle`` object itself is no finding.
    """
    gc.collect()
    enabled = gc.isenabled()
    # No collection while ids are compared: every object looked at stays referenced meanwhile.
    gc.disable()
    try:
        search = _Search(needle, own=own, own_code=frozenset(own_code), app=app)
        started = time.monotonic()
        hits = search.scan()
        # Naming may cost a few times the search itself, never more: a deep structure over a large
        # heap would take minutes of climbing.
        search.deadline = time.monotonic() + max(_CLIMB_SECONDS, _CLIMB_FACTOR * (time.monotonic() - started))
        return search.name(hits) if hits else []
    finally:
        if enabled:
            gc.enable()


class _Search:
    def __init__(self, needle: str, *, own: Iterable[object], own_code: frozenset[types.CodeType], app: object) -> None:
        self.needle = needle
        self.needle_bytes = needle.encode("utf-8")
        self.encoded = _encodings(needle)
        self.encoded_bytes = tuple(form.encode("ascii") for form in self.encoded)
        self.readers: dict[type, Callable[[object], bool | None]] = {}
        self.truncated = False  # the climb stopped before every path was followed
        self.deadline = float("inf")  # when the climb stops (``find_holders`` sets it)
        self.owned_roots: set[int] = set()  # functions only the probe or the test hold (``disown``)
        self.app = app
        self.objects = gc.get_objects()
        self.plain: set[type] = set()  # types decided to have no content of their own (``may_hold``)
        stack = list(_current_stack())
        self.skip = {id(obj) for obj in own} | {id(frame) for frame in stack}
        # A function frame's ``f_locals`` dict (kept on the frame up to Python 3.12, once asked for)
        # refers to the test's locals as the frame does; a module's frame has its globals there.
        self.skip |= {id(frame.f_locals) for frame in stack if frame.f_code.co_flags & inspect.CO_OPTIMIZED}
        on_stack = {id(frame) for frame in stack}
        self.generator_frames: set[int] = set()
        for obj in self.objects:
            if type(obj) in _GENERATORS:
                frame = _frame_of(obj)
                if frame is not None:
                    self.generator_frames.add(id(frame))
                    if id(frame) in on_stack or frame.f_code in own_code:
                        self.skip.add(id(obj))  # running (the probe, the test awaiting it), or the probe's
        # The locals of the current thread's frames (pytest's, the test's): what only they hold
        # is the test's, not the app's.
        self.stack_locals = {id(value) for frame in stack for value in _locals(frame).values()}
        self.threads = _thread_frames()
        self.thread_locals: dict[int, str] = {}
        for label, frame in self.threads:
            for name, value in _locals(frame).items():
                self.thread_locals.setdefault(id(value), f"{label} local {name!r}")
        self.module_dicts = {
            id(vars(module)): str(getattr(module, "__name__", name))
            for name, module in list(sys.modules.items())
            if isinstance(module, types.ModuleType)
        }

    # --- 1. find -------------------------------------------------------------------------------

    def scan(self) -> list[_Hit]:
        # Holders are read a chunk at a time: ``may_hold`` passes over, in few calls, a chunk in
        # which reading each object would find nothing; the others are read one by one.
        hits: list[_Hit] = []
        objects = self.objects
        for start in range(0, len(objects), _CHUNK):
            chunk = objects[start : start + _CHUNK]
            if self.may_hold(chunk):
                self.read_chunk(chunk, hits)
        self.scan_threads(hits)
        return hits

    def may_hold(self, chunk: list[object]) -> bool:
        """False when no holder in ``chunk`` has content of its own, and the str and bytes among
        their referents (through untracked containers, as ``read_chunk`` descends) have neither
        the needle nor, long ones, an encoded form. True is no finding: the chunk is then read."""
        plain = self.plain
        if not plain.issuperset(map(type, chunk)):
            return True  # a type with content (a BytesIO...), or one not decided yet
        refs = gc.get_referents(*chunk)
        while refs:
            loose = list(itertools.filterfalse(gc.is_tracked, refs))  # a tracked one is a holder in its turn
            kinds = set(map(type, loose)) - _ATOMS
            if not plain.issuperset(kinds - _MARKED):
                return True  # an untracked object with content (a bytearray...), or of a type not decided yet
            for kind in _MARKED & kinds:
                # Joined by a character that is in no needle or encoded form, a match is within one
                # piece; an encoded form found in a short piece only makes the chunk read.
                pieces = [ref for ref in loose if type(ref) is kind]
                if self.has(
                    "\0".join(cast(list[str], pieces)) if kind is str else b"\0".join(cast(list[bytes], pieces))
                ):
                    return True
            refs = gc.get_referents(*[ref for ref in loose if type(ref) in plain])
        return False

    def read_chunk(self, chunk: list[object], hits: list[_Hit]) -> None:
        # The hot loop (every referent of every tracked object): str and bytes are tested inline;
        # a tracked referent is skipped, as it is searched in its turn as a holder.
        marks: dict[type, str | bytes] = {str: self.needle, bytes: self.needle_bytes}
        holds, skip, encoded_in, least = self.holds, self.skip, self.encoded_in, _ENCODED_MIN
        get_referents, is_tracked, atoms, readers = gc.get_referents, gc.is_tracked, _ATOMS, self.readers
        for holder in chunk:
            if id(holder) in skip:
                continue
            if holds(holder):  # a tracked object with content: a BytesIO, a memoryview...
                hits.append(_Hit(holder, (), holder))
                if isinstance(holder, io.BytesIO):
                    continue  # its buffer, a referent on Python 3.12+, is what was just found
            for ref in get_referents(holder):
                kind = type(ref)
                mark = marks.get(kind)  # exactly str or bytes (the needle itself is no finding)
                if mark is not None:
                    if (mark in ref or (len(ref) >= least and encoded_in(ref))) and ref is not mark:
                        hits.append(_Hit(holder, (), ref))
                elif kind not in atoms and not is_tracked(ref):
                    found = (readers.get(kind) or holds)(ref)
                    if found:
                        hits.append(_Hit(holder, (), ref))
                    elif found is None:
                        self.descend(holder, ref, hits)

    def scan_threads(self, hits: list[_Hit]) -> None:
        """Other threads' running frames: their locals are no referents of anything tracked."""
        for _, frame in self.threads:
            for value in _locals(frame).values():
                found = self.holds(value)
                if found:
                    hits.append(_Hit(value, (), value))
                elif found is None and not gc.is_tracked(value):
                    self.descend(value, value, hits)

    def descend(self, holder: object, container: object, hits: list[_Hit]) -> None:
        """Search untracked containers (tuples and dicts of atoms), iteratively: JSON nests deep."""
        stack: list[tuple[object, tuple[object, ...]]] = [(container, () if container is holder else (container,))]
        while stack:
            obj, via = stack.pop()
            for ref in gc.get_referents(obj):
                if gc.is_tracked(ref):
                    continue  # searched as a holder
                found = self.holds(ref)
                if found:
                    hits.append(_Hit(holder, via, ref))
                elif found is None:
                    stack.append((ref, (*via, ref)))

    def holds(self, obj: object) -> bool | None:
        """Whether ``obj`` has the needle in its content; None for a container (look inside)."""
        kind = type(obj)  # not isinstance(): a proxy's __class__ may run code, or raise
        if kind in _ATOMS:
            return False
        read = self.readers.get(kind)
        if read is None:
            read = self.readers[kind] = self.reader(kind, obj)
            if read is _container or read is _nothing:
                self.plain.add(kind)
        return read(obj)

    def reader(self, kind: type, example: object) -> Callable[[object], bool | None]:
        """How to read the content of objects of type ``kind`` (decided once per type)."""
        needle, needle_bytes, has = self.needle, self.needle_bytes, self.has
        if issubclass(kind, str):
            return lambda obj: obj is not needle and has(str.__str__(cast(str, obj)))  # a subclass: its exact text
        if issubclass(kind, bytes):
            return lambda obj: obj is not needle_bytes and has(_content(obj))
        if issubclass(kind, bytearray):
            return lambda obj: has(_content(obj))
        if issubclass(kind, memoryview):
            # A view of bytes is found through the bytes it holds (its managed buffer's referent).
            return lambda obj: not _views_bytes(obj) and has(_content(obj))
        if issubclass(kind, io.BytesIO):
            return lambda obj: has(_content(obj))
        if issubclass(kind, io.StringIO):
            return lambda obj: has(_text(obj))
        if kind not in _CONTAINERS and _is_buffer(example):  # array, mmap, a numpy array, a ctypes buffer...
            return lambda obj: has(_content(obj))
        if not kind.__flags__ & _HAVE_GC:
            return _nothing  # no referents: an atom of another type
        return _container

    def has(self, content: str | bytes | bytearray) -> bool:
        """Whether ``content`` (a str, bytes or bytearray, not a subclass) has the needle, or a large
        one its base64 or hex form."""
        if isinstance(content, str):
            return self.needle in content or (len(content) >= _ENCODED_MIN and self.encoded_in(content))
        return self.needle_bytes in content or (len(content) >= _ENCODED_MIN and self.encoded_in(content))

    def encoded_in(self, content: str | bytes | bytearray) -> bool:
        forms: tuple[str | bytes, ...] = self.encoded if isinstance(content, str) else self.encoded_bytes
        return any(form in content for form in forms)  # type: ignore[operator]

    # --- 2. name -------------------------------------------------------------------------------

    def name(self, hits: list[_Hit]) -> list[Found]:
        holders: dict[int, object] = {}
        for hit in sorted(hits, key=lambda hit: -_size(hit.leaf)):
            if len(holders) < _MAX_HOLDERS or id(hit.holder) in holders:
                holders[id(hit.holder)] = hit.holder
        ups, own_ends = self.climb(list(holders.values()))
        routes = {key: self.routes(holder, ups, own_ends) for key, holder in holders.items()}
        found: list[Found] = []
        for hit in hits:
            size = _size(hit.leaf)
            if id(hit.holder) not in routes:
                label = f"{_type_name(hit.holder)} objects beyond the first {_MAX_HOLDERS} holders (not named)"
                found.append(Found(label, _kind(hit.leaf), id(hit.leaf), size))
                continue
            for label, nodes in routes[id(hit.holder)]:  # none: held only by the probe or the test
                chain = [*nodes, *hit.via] + ([] if hit.leaf is hit.holder else [hit.leaf])
                found.append(Found(label + self.render(chain), _kind(hit.leaf), id(hit.leaf), size))
        return found

    def climb(self, start: list[object]) -> tuple[dict[int, list[object]], set[int]]:
        """Referrers, level by level: ``ups[id(x)]`` lists what refers to x; ``own_ends`` the
        objects that the probe's objects or the current stack refer to."""
        snapshot = {id(obj) for obj in self.objects}  # what existed when the search began
        ups: dict[int, list[object]] = {}
        own_ends = {id(obj) for obj in start if id(obj) in self.stack_locals}
        seen = {id(obj) for obj in start}
        frontier = [obj for obj in start if self.root(obj) is None] + self.disown(start, snapshot)
        for _ in range(_MAX_LEVELS):
            if time.monotonic() > self.deadline:
                self.truncated = True
                break
            found, roots = self.climb_batch(frontier[:_MAX_FRONTIER], snapshot, seen, ups, own_ends)
            found += self.disown(roots, snapshot)
            if not found:
                break
            self.truncated |= len(found) > _MAX_FRONTIER
            frontier = found
        else:
            self.truncated = True
        return ups, own_ends

    def disown(self, reached: list[object], snapshot: set[int]) -> list[object]:
        """The functions among ``reached`` that only the probe or the current stack hold (a
        ``body_factory`` closing over the test's locals, a closure in the ``scope`` the probe
        made): no roots, but objects to climb through, to the app's holders or to the probe's."""
        functions = {id(obj): obj for obj in reached if type(obj) is types.FunctionType and obj is not self.app}
        if not functions:
            return []
        held: set[int] = set()
        for ref in gc.get_referrers(*functions.values()):
            # A stack local referring to it is the test's or the probe's (the ``**options`` dict
            # that passed it on), unless it is the app.
            own = id(ref) in self.skip or (id(ref) in self.stack_locals and ref is not self.app)
            if id(ref) in snapshot and not own:
                held.update(id(obj) for obj in gc.get_referents(ref) if id(obj) in functions)
        owned = functions.keys() - held
        self.owned_roots |= owned
        return [functions[key] for key in owned]

    def climb_batch(
        self,
        batch: list[object],
        snapshot: set[int],
        seen: set[int],
        ups: dict[int, list[object]],
        own_ends: set[int],
    ) -> tuple[list[object], list[object]]:
        """One level up from ``batch`` (one heap scan): records the referrers in ``ups`` and
        ``own_ends``, and returns those not seen before that are no root, to climb from next, and
        the roots not seen before."""
        targets = {id(obj) for obj in batch}
        found: list[object] = []
        roots: list[object] = []
        for ref in self.referrers(batch, targets):
            if id(ref) not in snapshot:
                continue  # made by the search (its lists, the frame objects it asked for)
            referred = [id(obj) for obj in gc.get_referents(ref) if id(obj) in targets]
            if id(ref) in self.skip:
                own_ends.update(referred)
                continue
            for key in referred:
                ups.setdefault(key, []).append(ref)
            if id(ref) not in seen:
                seen.add(id(ref))
                if id(ref) in self.stack_locals:
                    own_ends.add(id(ref))
                (found if self.root(ref) is None else roots).append(ref)
        return found, roots

    def referrers(self, batch: list[object], targets: set[int]) -> list[object]:
        """What refers to ``batch``: ``gc.get_referrers`` (in C, but its cost is heap size x batch
        size) for a few, one pass over the snapshot for many."""
        if len(batch) <= _BATCH:
            return gc.get_referrers(*batch)
        found: list[object] = []
        get_referents = gc.get_referents
        for obj in self.objects:
            for ref in get_referents(obj):
                if id(ref) in targets:
                    found.append(obj)
                    break
        return found

    def routes(
        self, holder: object, ups: dict[int, list[object]], own_ends: set[int]
    ) -> list[tuple[str, list[object]]]:
        """The shortest paths from recognisable objects down to ``holder``, with their labels: one
        per distinct object below a root (a ``Request`` held by three coroutines is one path, a parse
        held by a closure and by ``Request._json`` two), at most ``_MAX_ROUTES``, none longer than
        the shortest by more than ``_DETOUR``. Empty when only the probe or the test hold it."""
        parents: dict[int, object | None] = {id(holder): None}
        depth = {id(holder): 0}
        queue = deque([holder])
        best: dict[int, tuple[int, int, str, object]] = {}  # id(below root) -> (rank, depth, label, root)
        shortest: int | None = None
        top = holder
        while queue:
            node = queue.popleft()
            if shortest is not None and depth[id(node)] > shortest + _DETOUR:
                break
            root = None if id(node) in self.owned_roots else self.root(node)
            if root is not None:
                shortest = depth[id(node)] if shortest is None else shortest
                # Paths that reach the same object through cells, closures or frames are one.
                below = node
                while isinstance(parents[id(below)], (types.CellType, tuple, types.FrameType)):
                    below = parents[id(below)]
                key = id(parents[id(below)] or below)
                rank, label = root
                if key not in best or (rank, depth[id(node)]) < best[key][:2]:
                    best[key] = (rank, depth[id(node)], label, node)
                continue
            top = node
            for ref in ups.get(id(node), ()):
                if id(ref) not in parents:
                    parents[id(ref)] = node
                    depth[id(ref)] = depth[id(node)] + 1
                    queue.append(ref)
        if not best:
            if own_ends & parents.keys():
                return []
            # Held from a C stack (another thread's call in progress) or a C extension's field.
            unseen = "holders not searched further" if self.truncated else "held by nothing the gc can see"
            return [(f"({unseen}) {_type_name(top)}", _down(top, parents))]
        chosen = sorted(best.values(), key=lambda item: (item[1], item[0]))[:_MAX_ROUTES]
        return [(label, _down(root, parents)) for _, _, label, root in chosen]

    def root(self, obj: object) -> tuple[int, str] | None:
        """(rank, label) when ``obj`` is recognisable: where a path is worth starting."""
        key = id(obj)
        if key in self.thread_locals:
            return 0, self.thread_locals[key]
        kind = type(obj)
        if kind in _GENERATORS and key not in self.skip and _frame_of(obj) is not None:
            return 0, f"{_KIND[kind]} {_qualified(obj)}"
        if kind is types.FrameType and key not in self.skip and key not in self.generator_frames:
            # (A live generator's frame is named through its generator, one referrer up, on Python
            # 3.10; a finished one's, kept by a traceback, is a frame like any.)
            return 1, f"frame {_qualified(obj)} (line {obj.f_lineno})"  # type: ignore[attr-defined]
        if obj is self.app and obj is not None:
            return 2, f"the app ({_type_name(obj)})"
        if kind is types.FunctionType:
            return 3, f"function {_qualified(obj)}"
        if isinstance(obj, type):
            return 4, f"class {obj.__module__}.{obj.__qualname__}"
        if key in self.module_dicts:
            return 5, f"module {self.module_dicts[key]}"
        return None

    # --- rendering -----------------------------------------------------------------------------

    def render(self, chain: list[object]) -> str:
        chain = _through_contexts(chain)
        edges = [self.edge(chain[i - 1], chain[i], chain[i - 2] if i > 1 else None) for i in range(1, len(chain))]
        # A linked structure (a chain of nodes, of exceptions) as one step and its count: the
        # path stays one line, and the paths to its nodes one group.
        runs: list[list[object]] = []
        for edge in edges:
            if runs and runs[-1][0] == edge:
                runs[-1][1] = cast(int, runs[-1][1]) + 1
            else:
                runs.append([edge, 1])
        return "".join(
            f"{edge} ×{count}" if cast(int, count) >= 3 else str(edge) * cast(int, count) for edge, count in runs
        )

    def edge(self, parent: object, child: object, grand: object) -> str:
        """How ``child`` is reached from ``parent``, as text appended to the path so far."""
        if type(parent) in _GENERATORS or type(parent) is types.FrameType:
            return _frame_edge(parent, child)
        if isinstance(parent, types.CellType):
            return ""
        if isinstance(parent, dict):
            return self.dict_edge(parent, child, grand)
        if isinstance(parent, tuple) and isinstance(grand, types.FunctionType) and parent is grand.__closure__:
            names = grand.__code__.co_freevars
            return next((f" free variable {names[i]!r}" for i, cell in enumerate(parent) if cell is child), "")
        if isinstance(parent, (list, tuple, deque)):
            return next((f"[{i}]" for i, item in enumerate(parent) if item is child), " (an item)")
        if isinstance(parent, (set, frozenset)):
            return " (a set member)"
        return _object_edge(parent, child)

    def dict_edge(self, parent: dict[object, object], child: object, grand: object) -> str:
        owner = ""
        if id(parent) in self.module_dicts or (isinstance(grand, type) and _dict_of(grand) is parent):
            owner = "."
        elif grand is not None and _dict_of(grand) is parent:
            owner = f" → {_type_name(grand)}."
        for key, value in list(parent.items()):
            if value is child:
                return f"{owner}{key}" if owner and isinstance(key, str) else f"[{_short(key)}]"
        return " (a dict key)"


def _object_edge(parent: object, child: object) -> str:
    """How ``child`` is reached from an object that is no container the search walks itself."""
    if isinstance(parent, types.FunctionType):
        if child is parent.__closure__ or child is getattr(parent, "__dict__", None):
            return ""
        if child is parent.__defaults__:
            return ".__defaults__"
        if child is parent.__kwdefaults__:
            return ".__kwdefaults__"
    if isinstance(parent, (type, types.ModuleType)) and child is _dict_of(parent):
        return ""
    if isinstance(parent, memoryview):
        return " (a memoryview)"
    if type(parent) is _LRU_WRAPPER:
        return " → lru_cache"  # its cache dict, or a key or a result it refers to
    if type(parent) is contextvars.Context:
        names = [var.name for var, value in parent.items() if value is child]
        return f"[ContextVar {names[0]!r}]" if names else " (a context's mapping)"
    if type(parent).__name__ == "managedbuffer":
        return ""
    if child is _dict_of(parent):
        return ""  # the next step names the attribute
    for name, value in _attributes(parent):
        if value is child:
            return f" → {_type_name(parent)}.{name}"
    return f" → {_type_name(child)}"


@dataclass(frozen=True)
class Group:
    """The references that differ only in list indexes (``[*]``): one line of a report."""

    path: str
    kind: str
    sizes: dict[int, int]  # id() of each object holding input -> its size

    @property
    def size(self) -> int:
        return sum(self.sizes.values())


def group(found: Iterable[Found]) -> list[Group]:
    """``found`` by path pattern and kind, largest first; a path seen once is kept as it is."""
    groups: dict[tuple[str, str], Group] = {}
    for item in found:
        key = (_INDEX.sub(_any, item.path), item.kind)
        known = groups.get(key)
        sizes = {**(known.sizes if known else {}), item.leaf: item.size}
        path = item.path if known is None or (len(sizes) == 1 and known.path == item.path) else key[0]
        groups[key] = Group(path, item.kind, sizes)
    return sorted(groups.values(), key=lambda g: (-g.size, g.path))


# --- helpers -------------------------------------------------------------------------------------


def _current_stack() -> Iterator[types.FrameType]:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _thread_frames() -> list[tuple[str, types.FrameType]]:
    """The running frames of the other threads (their locals are no gc referents)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    frames: list[tuple[str, types.FrameType]] = []
    for ident, top in sys._current_frames().items():
        frame: types.FrameType | None = top
        while ident != me and frame is not None:
            frames.append((f"thread {names.get(ident, ident)!r} frame {_qualified(frame)}", frame))
            frame = frame.f_back
    return frames


def _frame_of(obj: object) -> types.FrameType | None:
    for name in ("cr_frame", "gi_frame", "ag_frame"):
        frame = getattr(obj, name, None)
        if isinstance(frame, types.FrameType):
            return frame
    return None


def _locals(frame: types.FrameType) -> dict[str, object]:
    # Python 3.13+: a proxy; before, a snapshot the frame keeps (it refers to what the frame does).
    return dict(frame.f_locals)


def _frame_edge(parent: object, child: object) -> str:
    frame = parent if isinstance(parent, types.FrameType) else _frame_of(parent)
    if child is frame:
        return ""
    if frame is not None and child is frame.f_back:
        return ".f_back"
    if frame is not None:
        for name, value in _locals(frame).items():
            if value is child or (isinstance(child, types.CellType) and _cell_holds(child, value)):
                return f" local {name!r}"
    if any(child is getattr(parent, name, None) for name in ("cr_await", "gi_yieldfrom", "ag_await")):
        return " awaiting"
    return " (on its evaluation stack)"


def _cell_holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _qualified(obj: object) -> str:
    """``module.qualname`` of a function, coroutine, generator or frame."""
    if isinstance(obj, types.FrameType):
        code = obj.f_code
        module = obj.f_globals.get("__name__", "?")
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
    frame = _frame_of(obj)
    module = frame.f_globals.get("__name__", "?") if frame is not None else getattr(obj, "__module__", "?")
    return f"{module}.{getattr(obj, '__qualname__', '?')}"


def _dict_of(obj: object) -> object:
    """The dict holding ``obj``'s attributes (a class's real dict, not its mappingproxy)."""
    if issubclass(type(obj), type):
        inner = gc.get_referents(type.__dict__["__dict__"].__get__(obj))
        return inner[0] if inner else None
    try:
        return object.__getattribute__(obj, "__dict__")
    except Exception:  # none, or a descriptor that fails
        return None


def _attributes(obj: object) -> Iterator[tuple[str, object]]:
    attrs = _dict_of(obj)
    if isinstance(attrs, dict) and not isinstance(obj, type):
        yield from ((str(name), value) for name, value in list(attrs.items()))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            try:
                yield slot, object.__getattribute__(obj, slot)
            except Exception:  # an empty slot, or a descriptor that fails
                continue
    names: tuple[str, ...] = ("__self__", "__func__", "__traceback__", "__cause__", "__context__")
    names += ("tb_frame", "tb_next")
    if issubclass(type(obj), (BaseException, functools.partial)):
        names = ("args", "keywords", "func", *names)  # C members, in no __dict__
    for name in names:
        try:
            yield name, object.__getattribute__(obj, name)
        except Exception:
            continue


def _container(obj: object) -> None:
    return None


def _nothing(obj: object) -> bool:
    return False


def _is_buffer(obj: object) -> bool:
    try:
        with memoryview(obj):  # type: ignore[arg-type]
            return True
    except Exception:  # not a buffer (TypeError), or one that cannot be read now
        return False


def _views_bytes(view: object) -> bool:
    try:
        return type(view.obj) in (bytes, bytearray)  # type: ignore[attr-defined]
    except ValueError:  # released
        return True


def _content(obj: object) -> bytes:
    """The bytes of a buffer, a view or a BytesIO; empty when they cannot be read."""
    try:
        if type(obj) in (bytes, bytearray):
            return obj  # type: ignore[return-value]
        if isinstance(obj, io.BytesIO):
            return obj.getvalue()
        with memoryview(obj) as view:  # type: ignore[arg-type]
            return view.tobytes()
    except Exception:  # closed, released, or unreadable
        return b""


def _text(obj: object) -> str:
    try:
        return cast(io.StringIO, obj).getvalue()
    except ValueError:
        return ""


def _size(obj: object) -> int:
    kind = type(obj)
    if issubclass(kind, (str, bytes, bytearray)):
        return len(obj)  # type: ignore[arg-type]
    if issubclass(kind, io.StringIO):
        return len(_text(obj))
    return len(_content(obj))


def _kind(obj: object) -> str:
    return _type_name(obj)


def _type_name(obj: object) -> str:
    return type(obj).__name__


def _short(key: object) -> str:
    try:
        text = repr(key)
    except Exception:
        text = f"<{_type_name(key)}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _encodings(needle: str) -> tuple[str, ...]:
    """What any copy of the needle looks like inside a base64 (standard or URL-safe) or hex encoding
    of the input: base64 has three forms, one per offset of the needle modulo 3, each without the
    characters that also encode its neighbours."""
    raw = needle.encode("utf-8")
    forms = [raw.hex(), raw.hex().upper()]
    for offset in range(3):
        text = base64.b64encode(bytes(offset) + raw).decode("ascii")
        first, end = (1 if offset else 0), (offset + len(raw)) // 3  # the groups of 3 bytes all the needle's
        form = text[4 * first : 4 * end]
        forms += [form, form.translate(_URLSAFE)]
    return tuple(dict.fromkeys(forms))


_URLSAFE = str.maketrans("+/", "-_")
_LRU_WRAPPER = type(functools.lru_cache(maxsize=1)(len))


def _any(match: re.Match[str]) -> str:
    """``[*]`` for any list index, `` ×*`` for any count of a repeated step."""
    return "[*]" if match.group().startswith("[") else " ×*"


def _through_contexts(chain: list[object]) -> list[object]:
    """``chain`` without the nodes of a context's mapping between a ``Context`` and its value."""
    for i, node in enumerate(chain):
        if type(node) is contextvars.Context:
            values = {id(value) for value in node.values()}
            end = next((j for j in range(i + 1, len(chain)) if id(chain[j]) in values), i + 1)
            return [*chain[: i + 1], *_through_contexts(chain[end:])]
    return chain


def _down(node: object, parents: dict[int, object | None]) -> list[object]:
    """From ``node`` down to the holder the climb started at."""
    chain = [node]
    parent = parents[id(node)]
    while parent is not None:
        chain.append(parent)
        parent = parents[id(parent)]
    return chain
