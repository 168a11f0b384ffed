"""The decoding methods `specops.decode` knows, each an entry of one registry.

A method is a module that defines `METHODS`: `Method` entries saying what it needs (a drafter, and with
which vocabulary; models that must take draft trees), its options with their defaults, and how to build
its proposer. Adding a method is its own module plus one line in `_MODULES` below.
"""

from __future__ import annotations

import importlib

from specops.decoding.cost_model import DraftLength
from specops.decoding.protocol import Given, Method

__all__ = ["METHODS", "NAMES", "check_draft_setting", "check_options", "plain", "resolve"]

# Method modules, in the order methods are listed to users ("auto" comes first).
_MODULES = ("ar", "sd", "tli", "slem", "slrs", "ngram", "rsd", "ensemble", "se")


def _load() -> dict[str, Method]:
    methods = {}
    for name in _MODULES:
        for method in importlib.import_module(f"specops.decoding.{name}").METHODS:
            methods[method.name] = method
    return methods


METHODS: dict[str, Method] = _load()
NAMES = ("auto", *METHODS)


def resolve(name: str, *, drafter: bool, same_vocabulary: bool, greedy: bool, ensemble: bool = False,
            trees: bool = True) -> Method:
    """The method `name` stands for: itself, or for "auto" the first method whose `auto` rule picks it
    for what is given (trees: whether the target scores draft trees exactly)."""
    if name != "auto":
        return METHODS[name]
    given = Given(drafter, same_vocabulary, greedy, ensemble, trees)
    return next(m for m in METHODS.values() if m.auto is not None and m.auto(given))


def plain(ensemble: bool) -> Method:
    """The method without speculation, the baseline of the others: for one target or for an ensemble."""
    return next(m for m in METHODS.values() if m.plain and (m.ensemble == "only") == ensemble)


def check_draft_setting(name: str, setting) -> None:
    method = METHODS.get(name)
    if method is not None and method.draft_setting is not None:
        method.draft_setting(setting)
    else:
        DraftLength(setting)  # raises for anything but "auto" or an int >= 1


def check_options(method: Method, options: dict | None) -> dict:
    """The method's options: its defaults, updated by `options` (checked)."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"decode: options must be a dict of {method.name!r}'s options, got {type(options).__name__}")
    given = dict(options or {})
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        takes = f"it takes {', '.join(sorted(method.options))}" if method.options else "it takes none"
        raise ValueError(f"decode: unknown option {unknown[0]!r} for method {method.name!r}; {takes}")
    merged = {**method.options, **given}
    if method.check is not None:
        method.check(merged)
    return merged
