"""Names in transformers' model interface that moved between the versions specops is tested with
(pyproject.toml's transformers range), resolved per model from what its forward accepts, so every call
specops makes uses the current name and no deprecation shim warns.

- The KV cache argument and output: `cache` from transformers 5.24, `past_key_values` before it (5.24
  still accepts the old name, with a FutureWarning, until 5.40). A model outside transformers' own
  classes (remote code, a wrapper) keeps whichever name its forward declares.
"""

from __future__ import annotations

import inspect
import weakref

from specops._kept import per_object

__all__ = ["CACHE_ARGUMENTS", "cache_argument"]

# Every name a forward may take its KV cache by, the current one first.
CACHE_ARGUMENTS = ("cache", "past_key_values")

_KNOWN: weakref.WeakKeyDictionary[object, str] = per_object(
    "cache argument", "the name the model's forward takes its KV cache by")


def cache_argument(module) -> str:
    """The keyword `module.forward` takes its KV cache by: the first of CACHE_ARGUMENTS its signature names
    (transformers' deprecation wrappers keep the wrapped signature), else `past_key_values` (a forward that
    takes **kwargs only: transformers' name before 5.24, which 5.24 still maps)."""
    known = _KNOWN.get(module)
    if known is not None:
        return known
    try:
        accepted = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or otherwise unreadable forward
        accepted = {}
    name = next((arg for arg in CACHE_ARGUMENTS if arg in accepted), CACHE_ARGUMENTS[-1])
    try:
        _KNOWN[module] = name
    except TypeError:  # not weak-referenceable: looked up on every call
        pass
    return name
