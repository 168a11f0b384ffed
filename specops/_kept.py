"""Everything specops keeps from one call to the next, in one place (docs/methods.md, "What specops keeps
between calls").

A call leaves the process as it found it but for what is registered here: what specops found out about a
model object (or a tokenizer) and reuses in later calls, kept with the object through a weak reference, so it
goes when the object goes; and a few process-wide memos (the embedded models loaded by name). None of it
changes what a call outputs for a seed under the default schemes; it changes how fast the call is and which
draft lengths it starts from. `specops.kept(obj)` says what is held for an object, `specops.forget(obj)`
drops it (the next call probes, measures and learns again), and `specops.forget()` drops everything.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

__all__ = ["forget", "kept", "per_object", "process_wide"]

_LOCK = threading.Lock()
_PER_OBJECT: dict[str, tuple[str, weakref.WeakKeyDictionary]] = {}  # name -> (what it holds, the table)
_PROCESS_WIDE: dict[str, tuple[str, Callable[[], None]]] = {}  # name -> (what it holds, how to clear it)


def per_object(name: str, what: str) -> weakref.WeakKeyDictionary:
    """A table keyed by a model or tokenizer object, registered under `name` with what it holds."""
    table: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    with _LOCK:
        if name in _PER_OBJECT:
            raise ValueError(f"specops: kept state {name!r} is registered twice")
        _PER_OBJECT[name] = (what, table)
    return table


def process_wide(name: str, what: str, clear: Callable[[], None]) -> None:
    """Register a memo that belongs to no object (`clear` empties it)."""
    with _LOCK:
        if name in _PROCESS_WIDE:
            raise ValueError(f"specops: kept state {name!r} is registered twice")
        _PROCESS_WIDE[name] = (what, clear)


def _held(table: weakref.WeakKeyDictionary, obj) -> list:
    """The keys of `table` that are `obj` or, for a torch module, one of its submodules (some state is kept
    under the decoder a model wraps)."""
    modules = getattr(obj, "modules", None)
    objects = list(modules()) if callable(modules) else [obj]
    found = []
    for o in objects:
        try:
            if o in table:
                found.append(o)
        except TypeError:  # an object that cannot be weakly referenced is never a key
            pass
    return found


def kept(obj=None) -> dict[str, str]:
    """What specops holds for `obj` (a model, its modules included, or a tokenizer), as {name: what it is};
    without an object, every kind of state it can keep, per object and process-wide."""
    with _LOCK:
        if obj is None:
            return {name: what for name, (what, _) in {**_PER_OBJECT, **_PROCESS_WIDE}.items()}
        return {name: what for name, (what, table) in _PER_OBJECT.items() if _held(table, obj)}


def forget(obj=None) -> list[str]:
    """Drop what specops holds for `obj`, or, without one, everything it holds; returns the names dropped.
    A call in progress keeps what it already read; later calls find nothing and start afresh."""
    with _LOCK:
        dropped = []
        for name, (_, table) in _PER_OBJECT.items():
            if obj is None:
                if len(table):
                    dropped.append(name)
                table.clear()
            else:
                keys = _held(table, obj)
                for key in keys:
                    table.pop(key, None)
                if keys:
                    dropped.append(name)
        if obj is None:
            for name, (_, clear) in _PROCESS_WIDE.items():
                clear()
                dropped.append(name)
        return dropped
