"""The "self:N" drafter: the target's first N decoder layers with its final norm and LM head, sharing
the target's weights (like transformers' assistant_early_exit, but with its own KV cache), so every
model has a same-vocabulary drafter at no memory cost."""

from __future__ import annotations

import copy

import torch


def _decoder_layers(model) -> tuple[torch.nn.Module, str]:
    """The module holding the decoder layers and the attribute name of their ModuleList."""
    base = getattr(model, "model", None)
    if base is not None and isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        return base, "layers"
    base = getattr(model, "transformer", None)
    if base is not None and isinstance(getattr(base, "h", None), torch.nn.ModuleList):
        return base, "h"
    raise ValueError(f"self:N drafting needs a decoder with `model.layers` or `transformer.h`; "
                     f"{type(model).__name__} has neither")


def truncated(model, num_layers: int):
    """A view of `model` that runs only its first `num_layers` decoder layers."""
    base, attr = _decoder_layers(model)
    total = len(getattr(base, attr))
    if not 1 <= num_layers < total:
        raise ValueError(f"self:N needs 1 <= N < {total} (the target has {total} layers), got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    # Shallow copies with their own child-module tables: the target itself is left untouched.
    short_base = copy.copy(base)
    short_base._modules = dict(base._modules)
    setattr(short_base, attr, torch.nn.ModuleList(list(getattr(base, attr))[:num_layers]))
    short_base.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    setattr(draft, "model" if attr == "layers" else "transformer", short_base)
    draft.config = config
    return draft
