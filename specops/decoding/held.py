"""Switches that several calls, in several threads, may hold at once.

A tree forward switches a model's configs to specops' tree attention (tree_forward.tree_forward); a CPU forward
gives its linear layers a routing forward (cpu_forward._routed). Two threads may decode with one model at the
same time, so a switch is taken by the first call that needs an object and undone by the last one to leave;
what the object had before is kept meanwhile, for the forwards of threads outside any call to run with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager

__all__ = ["HeldSwitch"]


class HeldSwitch:
    """Objects switched while any holder holds them. `install(obj)` switches one and returns what it had;
    `restore(obj, saved)` puts that back. Thread safe."""

    def __init__(self, install: Callable[[object], object], restore: Callable[[object, object], None]):
        self.install, self.restore = install, restore
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}  # id(obj) -> [obj, what it had, holders]

    @contextmanager
    def hold(self, objects: Iterable):
        """Within the block, every object is switched (by this holder, or already by another)."""
        objects = list(objects)
        with self._lock:
            for obj in objects:
                held = self._held.get(id(obj))
                if held is None:
                    held = self._held[id(obj)] = [obj, self.install(obj), 0]
                held[2] += 1
        try:
            yield
        finally:
            with self._lock:
                for obj in objects:
                    held = self._held[id(obj)]
                    held[2] -= 1
                    if not held[2]:
                        del self._held[id(obj)]
                        self.restore(obj, held[1])

    def saved(self, obj) -> tuple[bool, object]:
        """(whether `obj` is switched now, what it had before)."""
        with self._lock:
            held = self._held.get(id(obj))
        return (False, None) if held is None else (True, held[1])

    def saved_values(self) -> list:
        """What every object switched now had before."""
        with self._lock:
            return [held[1] for held in self._held.values()]
