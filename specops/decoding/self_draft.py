"""The "self:N" drafter: the target's first N decoder layers with its final norm and LM head, sharing
the target's weights (like transformers' assistant_early_exit, but with its own KV cache), so every
model has a same-vocabulary drafter at no memory cost."""

from __future__ import annotations

import copy

import torch

__all__ = ["SelfDraftError", "truncated"]


class SelfDraftError(ValueError):
    """The model has no list of decoder layers to take the first N of."""


def _text_config(model):
    getter = getattr(model.config, "get_text_config", None)
    return getter() if callable(getter) else model.config


def _decoder_layers(model) -> list[str]:
    """The attribute path from `model` to the ModuleList of its decoder layers (`model.layers`,
    `transformer.h`, `model.decoder.layers`, `gpt_neox.layers`, ...): the shallowest ModuleList holding
    as many modules as the config has layers."""
    text = _text_config(model)
    # num_hidden_layers, or the decoder's own count where a config counts encoder layers there (the decoder
    # halves of encoder-decoder families: Bart, Whisper, ...).
    counts = {getattr(text, name, None) for name in ("num_hidden_layers", "decoder_layers", "num_decoder_layers")}
    found = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name and len(module) in counts - {None}:
            path = name.split(".")
            if found is None or len(path) < len(found):
                found = path
    if found is None:
        raise SelfDraftError(f"self:N drafting needs a decoder with `model.layers`, `transformer.h` or another "
                         f"ModuleList of its layers; {type(model).__name__} has none")
    return found


def truncated(model, num_layers: int):
    """A view of `model` that runs only its first `num_layers` decoder layers."""
    path = _decoder_layers(model)
    total = len(model.get_submodule(".".join(path)))
    if not 1 <= num_layers < total:
        raise ValueError(f"self:N needs 1 <= N < {total} (the target has {total} layers), got {num_layers}")
    config = copy.deepcopy(model.config)
    text = _text_config(model)
    short = config.get_text_config() if hasattr(config, "get_text_config") else config
    # Models with per-layer inputs (Gemma-3n, Gemma-4: hidden_size_per_layer_input) embed every token once
    # for all layers, shaped by num_hidden_layers, and hand layer i its slice: they keep the full count,
    # and simply run fewer layers.
    if not getattr(text, "hidden_size_per_layer_input", None):
        for name in ("num_hidden_layers", "decoder_layers", "num_decoder_layers"):
            if getattr(text, name, None) == total:
                setattr(short, name, num_layers)
        for name, value in vars(text).items():  # per-layer settings: layer_types, attention_layers, ...
            if isinstance(value, list) and len(value) == total and name != "architectures":
                setattr(short, name, value[:num_layers])
    # Shallow copies of the modules on the way to the layers, each with its own child-module table, so the
    # target itself is left untouched; every module that held the target's config holds the copy.
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    parent = draft
    for name in path[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    parent._modules[path[-1]] = torch.nn.ModuleList(list(parent._modules[path[-1]])[:num_layers])
    draft.__dict__["_specops_layers"] = num_layers  # the layers it runs, whatever its config counts
    node = draft
    for name in [None, *path[:-1]]:
        node = node if name is None else node._modules[name]
        if getattr(node, "config", None) is model.config:
            node.config = config
        elif getattr(node, "config", None) is text:
            node.config = short
    return draft
