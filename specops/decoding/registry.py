"""The decoding methods `specops.decode` knows, each an entry of one registry.

A method is a module that defines `METHODS`: `Method` entries saying what it needs (a drafter, and with
which vocabulary; models that must take draft trees), its options with their defaults, and how to build
its proposer. Adding a method is its own module plus one line in `_MODULES` below.
"""

from __future__ import annotations

import importlib

from specops.decoding.draft_length import DraftLength
from specops.decoding.step import Method

__all__ = ["METHODS", "NAMES", "check_draft_setting", "check_options", "resolve"]

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


def resolve(name: str, *, drafter: bool, same_vocabulary: bool, greedy: bool, ensemble: bool = False) -> Method:
    """The method `name` stands for: "auto" picks sd for a drafter with the target's vocabulary, tli
    (sampling) or slem (greedy) for one with another vocabulary (with an ensemble of targets: sd, or tli
    for either mode), and without a drafter se for an ensemble. (For one target without a drafter, decode
    picks ngram where the target scores draft trees exactly, else ar: that needs the prompts.)"""
    if name == "auto":
        if not drafter:
            name = "se" if ensemble else "ar"
        else:
            name = "sd" if same_vocabulary else "tli" if ensemble or not greedy else "slem"
    return METHODS[name]


def check_draft_setting(name: str, setting) -> None:
    method = METHODS.get(name)
    if method is not None and method.draft_setting is not None:
        method.draft_setting(setting)
    else:
        DraftLength(setting)  # raises for anything but "auto" or an int >= 1


def check_options(method: Method, options: dict | None, legacy: dict) -> dict:
    """The method's options: its defaults, then the decode() keywords that set one, then `options`."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"decode: options must be a dict of {method.name!r}'s options, got {type(options).__name__}")
    given = dict(options or {})
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        takes = f"it takes {', '.join(sorted(method.options))}" if method.options else "it takes none"
        raise ValueError(f"decode: unknown option {unknown[0]!r} for method {method.name!r}; {takes}")
    merged = dict(method.options)
    for keyword, option in method.legacy.items():
        merged[option] = legacy[keyword]
    merged.update(given)
    if method.check is not None:
        method.check(merged)
    return merged


def tree_roles_refused(method: Method) -> list[str]:
    """Methods that score no draft tree on the given roles (for refusals: what works instead)."""
    return [m.name for m in METHODS.values() if not set(m.trees) & set(method.trees)]
