"""The attention path for draft trees: a forward over a token tree per request, where a node sees the
valid prefix of its row and its own ancestors, exactly as if its root-to-node path had been appended as
a chain.

transformers builds every attention mask from index functions (`masking_utils`: causal, sliding window,
chunked, per layer type) and calls attention through a registry (`AttentionInterface`). For a tree
forward, specops registers one mask function and one attention function under the name `specops_tree`
and switches the model's configs to it for the duration of the call:

- the mask function evaluates the model's own mask function for each layer type on *chain indices*: a
  node at depth d is queried as if it sat at the slot right after its row's prefix plus d, and the node
  it looks at as a key likewise, so windows and chunks count tokens along the path, never the slots of
  cousins; then it keeps only the row's valid keys and, among the tree's nodes, the ancestors;
- the attention function hands that mask to the attention implementation the model was configured with
  (its eager function, as a float mask; anything else through SDPA, as a boolean mask).

So whatever windows, soft-caps or sinks a model defines stay the model's own. A model whose attention
does not go through the registry (ALiBi models build their biases from the 2-D mask, GPT-Neo keeps its
own local-attention buffer) cannot take trees exactly; `probe.tree_support` finds that out once per model, by
a forward that must reach the registered functions in every layer and reproduce the logits of the same
paths run as chains, and decoding refuses such a model before it starts.

Models that are not transformers `PreTrainedModel`s receive the tree as a 4-D boolean mask [B, 1, n, L]
(query i may see key j) with the position ids of each node; honouring them is their contract (the test
suite's table-defined models check every mask they get).
"""

from __future__ import annotations

import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specops._kept import per_object
from specops.decoding.held import HeldSwitch

__all__ = ["TreeMask", "pack_rows", "tree_forward", "weakly_keyed"]

NAME = "specops_tree"
_ACTIVE = threading.local()  # the tree of this thread's tree forward (None outside one)
_REGISTERED = False


def _switch_config(config) -> str:
    implementation = config._attn_implementation
    config._attn_implementation_internal = NAME
    return implementation


def _restore_config(config, implementation: str) -> None:
    config._attn_implementation_internal = implementation


# A config is switched to NAME while any thread runs a tree forward with it; a forward of the same model in
# another thread meanwhile reaches the registered functions without a tree of its own, and they hand it to
# the implementation the config had.
_SWITCHED = HeldSwitch(_switch_config, _restore_config)


@dataclass
class TreeMask:
    """One tree forward's layout. valid [B, S] bool: which slots hold a token (the new nodes included;
    padding nodes are invalid); depth [B, N] int64: each new node's depth below its root (the root, the
    row's last emitted token, at depth 0); visible [B, N, N] bool: node i may see node j (j is i or an
    ancestor of i). The new nodes are the last N of the S slots."""

    valid: torch.Tensor
    depth: torch.Tensor
    visible: torch.Tensor
    kernel: bool = False  # attend with specops.ops.tree_attention where a layer's mask allows
    original: str = "sdpa"  # the attention implementation the model was configured with
    attention_calls: int = 0
    mask_calls: int = 0
    kernel_calls: int = 0
    windows: dict = field(default_factory=dict)  # data_ptr of a mask handle -> its layer's window (0: none)
    handles: list = field(default_factory=list)  # the handles themselves, alive while the forward runs

    @property
    def bits(self) -> torch.Tensor:
        """[B, N, ceil(N/32)] int32: the ancestor rows packed as tree_attention takes them."""
        if not hasattr(self, "_bits"):
            self._bits = pack_rows(self.visible)
        return self._bits

    def dense(self) -> torch.Tensor:
        """[B, 1, N, S] bool: the mask for a model with no index-based mask functions (plain causal, no
        window): every valid prefix slot, the tree's ancestors, and always the query's own slot."""
        batch, nodes = self.depth.shape
        slots = self.valid.shape[1]
        base = slots - nodes
        allowed = self.valid[:, None, :].expand(batch, nodes, slots).clone()
        allowed[:, :, base:] &= self.visible
        allowed[:, torch.arange(nodes), torch.arange(base, slots)] = True
        return allowed[:, None]


def pack_rows(visible: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool (node i sees node j) -> [B, N, ceil(N/32)] int32, bit j % 32 of word j // 32."""
    batch, nodes, _ = visible.shape
    words = (nodes + 31) // 32
    padded = torch.zeros(batch, nodes, words * 32, dtype=torch.int64, device=visible.device)
    padded[:, :, :nodes] = visible.long()
    weights = torch.ones(32, dtype=torch.int64, device=visible.device) << torch.arange(32, device=visible.device)
    packed = (padded.view(batch, nodes, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


_FAR = 1 << 40  # a query index far from any real one: windows are measured there


_WINDOWS: dict = {}  # _fingerprint of a mask function -> its window (transformers rebuilds them every forward)


def _fingerprint(value, depth: int = 0):
    """A hashable key that determines a mask function's behaviour: its code and defaults, with the same
    for every function, int, bool, str, None, or tuple of them its closure holds; None when it holds anything else
    (tensors: per-token data), which is then probed every time."""
    if value is None or isinstance(value, (bool, int, str, float)):
        return (type(value), value)
    if isinstance(value, (tuple, list)) and depth <= 8:  # and_masks / or_masks keep their parts in one
        parts = tuple(_fingerprint(item, depth + 1) for item in value)
        return None if None in parts else (type(value), parts)
    code = getattr(value, "__code__", None)
    if code is None or depth > 8:
        return None
    parts = [code]
    for item in (*(value.__defaults__ or ()), *(cell.cell_contents for cell in value.__closure__ or ())):
        part = _fingerprint(item, depth + 1)
        if part is None:
            return None
        parts.append(part)
    return tuple(parts)


def _causal_window(mask_function, device) -> int | None:
    """The window W of a mask function that is causal with keys kept while q - kv < W (0: no window up to
    2**40), found by probing it (once per distinct function); None if it is anything else (chunked,
    bidirectional, data-dependent), whose masks tree_attention cannot reproduce."""
    if mask_function is None:
        return 0
    try:
        key = _fingerprint(mask_function)
    except (AttributeError, ValueError):  # an empty closure cell
        key = None
    if key is not None and key in _WINDOWS:
        return _WINDOWS[key]
    try:
        window = _probe_window(mask_function, device)
    except (IndexError, RuntimeError, ValueError):  # it reads per-token data (blockwise overlays)
        window = None
    if key is not None and len(_WINDOWS) < 256:
        _WINDOWS[key] = window
    return window


def _probe_window(mask_function, device) -> int | None:
    distances = sorted({0, 1, 2, 3} | {2**k + e for k in range(2, 40) for e in (-1, 0)})
    d = torch.tensor(distances + [-1, -2], device=device)  # -1, -2: keys after the query
    rows = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    answers = []
    for q in (_FAR, _FAR + 12345):
        queries = torch.full((1, 1, 1, 1), q, dtype=torch.long, device=device)
        got = mask_function(rows, rows, queries, (q - d).view(1, 1, 1, -1))
        answers.append(torch.as_tensor(got, device=device).reshape(-1).expand(d.shape[0]))
    if not torch.equal(answers[0], answers[1]):
        return None  # not translation-invariant (chunks)
    allowed = answers[0].tolist()
    if allowed[-1] or allowed[-2] or not allowed[0]:
        return None  # sees the future, or not itself
    seen = allowed[:-2]
    cut = next((i for i, a in enumerate(seen) if not a), None)
    if cut is None:
        return 0
    if any(seen[cut:]):
        return None  # not a window
    low, high = distances[cut - 1], distances[cut]  # allowed at low, not at high: W in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        probe = torch.tensor([[[[_FAR - middle]]]], device=device)
        inside = bool(torch.as_tensor(mask_function(rows, rows, torch.full_like(probe, _FAR), probe)).reshape(-1)[0])
        low, high = (middle, high) if inside else (low, middle)
    return high


def _chain_index(tree: TreeMask, base: int, slots: torch.Tensor) -> torch.Tensor:
    """[B, len(slots)]: prefix slots unchanged, node slots as base + depth (where the node would sit in
    its own root-to-node chain)."""
    nodes = tree.depth.shape[1]
    node = slots - base
    inside = (node >= 0) & (node < nodes)
    depth = tree.depth.gather(1, node.clamp(0, nodes - 1).expand(tree.depth.shape[0], -1))
    return torch.where(inside, base + depth, slots)


def _own_implementation(config) -> str:
    """The attention implementation `config` had before a tree forward switched it (a forward outside any
    tree forward of its thread runs with it). Without the config (older transformers do not pass it to mask
    functions), the one every switched config had."""
    switched, own = _SWITCHED.saved(config) if config is not None else (False, None)
    names = {own} if switched else set(_SWITCHED.saved_values())
    if len(names) != 1:
        raise RuntimeError(f"specops tree attention: a forward outside specops' tree forwards reached '{NAME}' "
                           "while models with different attention implementations decode trees in other threads")
    return names.pop() or "eager"


def _mask(*args, **kwargs):
    """AttentionMaskInterface entry: inside a tree forward of this thread the tree's mask (`_tree_mask`),
    else the mask of the implementation the model had (another thread's forward of the same model)."""
    tree = getattr(_ACTIVE, "tree", None)
    if tree is None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[_own_implementation(kwargs.get("config"))](*args, **kwargs)
    return _tree_mask(tree, *args, **kwargs)


def _tree_mask(tree: TreeMask, batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask=None, dtype=torch.float32, device=None, cache_position=None, **_):
    """The model's mask function on chain indices, restricted to valid keys and to each node's ancestors
    (module docstring). Bool for SDPA, additive float for eager."""
    tree.mask_calls += 1
    nodes = tree.depth.shape[1]
    if cache_position is not None:  # older transformers pass the query slots themselves
        q_offset, q_length = int(cache_position[0]), cache_position.shape[0]
        kv_length = kv_length if kv_length is not None else attention_mask.shape[-1]
    slots = tree.valid.shape[1]
    base = slots - nodes
    if q_length != nodes or q_offset != base or kv_offset != 0 or kv_length != slots:
        raise RuntimeError(f"specops tree attention: the model asked for a mask of {q_length} queries at slot "
                           f"{q_offset} over keys {kv_offset}..{kv_offset + kv_length}, not the tree's {nodes} "
                           f"nodes after {base} cached slots")
    device = tree.valid.device
    if tree.kernel:
        window = _causal_window(mask_function, device)
        if window is not None:  # tree_attention computes this layer's mask itself: pass a handle
            handle = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
            tree.windows[handle.data_ptr()] = window
            tree.handles.append(handle)
            return handle
    queries = (base + tree.depth)[:, None, :, None]
    keys = _chain_index(tree, base, torch.arange(slots, device=device)[None])[:, None, None, :]
    rows = torch.arange(tree.depth.shape[0], device=device)[:, None, None, None]
    heads = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    if mask_function is None:
        allowed = keys <= queries
    else:
        allowed = torch.as_tensor(mask_function(rows, heads, queries, keys), device=device)
    allowed = allowed.expand(tree.depth.shape[0], 1, nodes, slots) & tree.dense()
    if tree.original == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def _eager_function(module):
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise RuntimeError(f"specops tree attention: {type(module).__name__} has no eager_attention_forward")
    return function


def _attention(module, query, key, value, attention_mask, **kwargs):
    """AttentionInterface entry: the model's configured attention with the tree mask (outside a tree forward
    of this thread, the model's configured attention as it is)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tree = getattr(_ACTIVE, "tree", None)
    if tree is None:
        own = _own_implementation(getattr(module, "config", None))
        function = _eager_function(module) if own == "eager" else ALL_ATTENTION_FUNCTIONS[own]
        return function(module, query, key, value, attention_mask, **kwargs)
    tree.attention_calls += 1
    window = tree.windows.get(attention_mask.data_ptr()) if attention_mask is not None else None
    if window is not None and attention_mask.numel() == 1:
        tree.kernel_calls += 1
        return _kernel(module, query, key, value, tree, window, kwargs), None
    if tree.original == "eager":
        function = _eager_function(module)
    else:  # flash and flex kernels take no arbitrary mask: SDPA computes the same attention
        function = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return function(module, query, key, value, attention_mask, **kwargs)


def _kernel(module, query, key, value, tree: TreeMask, window: int, kwargs) -> torch.Tensor:
    """specops.ops.tree_attention for one layer: [B, N, Hq, D], as transformers' attention functions
    return it."""
    from specops import ops

    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None)
    sinks = kwargs.get("s_aux")
    nodes, slots = query.shape[2], key.shape[2]
    out = ops.tree_attention(query, key, value, tree.bits, kv_mask=tree.valid[:, :slots - nodes], scale=scale,
                             window=window or None, softcap=kwargs.get("softcap") or None,
                             sinks=None if sinks is None else sinks.float(), validate=False)
    return out.transpose(1, 2).contiguous()


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)
        _REGISTERED = True


_CONFIGS: weakref.WeakKeyDictionary[object, tuple] = per_object(
    "config objects", "the config objects the model's modules read, which tree forwards switch")


def _configs(model) -> list:
    """Every distinct config object the model's modules read (a `self:N` view holds a copy of the
    target's, while its layers still read the target's own). Found once per model: walking the modules
    took 2 ms of every tree step on Gemma-3-270M."""
    known = _CONFIGS.get(model)
    if known is not None and known[0] is model.config:
        return known[1]
    from transformers import PretrainedConfig

    seen = {}
    for module in (model, *model.modules()):
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen[id(config)] = config
            for name in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, name, None)
                if isinstance(sub, PretrainedConfig):
                    seen[id(sub)] = sub
    configs = list(seen.values())
    try:
        _CONFIGS[model] = (model.config, configs)
    except TypeError:  # not weak-referenceable: walk every time
        pass
    return configs


def is_transformers_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


@contextmanager
def tree_forward(model, tree: TreeMask):
    """Within this block, forwards of `model` attend along `tree` (a transformers model through the
    registered functions; anything else is given tree.dense() as its attention mask by the caller)."""
    if not is_transformers_model(model):
        yield
        return
    _register()
    with _SWITCHED.hold(_configs(model)):  # switched while any thread's tree forward holds it
        tree.original = _SWITCHED.saved(model.config)[1] or "eager"
        _ACTIVE.tree = tree
        try:
            yield
        finally:
            _ACTIVE.tree = None


def weakly_keyed(model) -> bool:
    """Whether `model` can key a weakref.WeakKeyDictionary (a probe's verdict is kept per model)."""
    try:
        weakref.ref(model)
        return True
    except TypeError:
        return False
