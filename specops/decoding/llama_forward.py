"""Decoding forwards of Llama-family models (Llama, Mistral without a sliding window, Qwen2, Qwen3) and of
Gemma-3 on the CPU, every decoder layer in one call of the `llama_layers` op.

A small model's decoding forward on a CPU is as much the framework's work as the arithmetic: SmolLM2-135M
runs about 35 ATen calls per layer through transformers' modules (norms as five ops, rotary embedding as
eight, a mask built per forward, module calls), about 10 ms of a 20 ms forward over 30 layers; a layer loop
in Python still spent about 25 calls a layer. That decides whether the model pays as a drafter. Here the
embedding, the rotary tables and the mask are computed once per forward, then `specops.ops.llama_layers`
runs every layer in C++ (norms, rotary embedding, attention and residual adds as loops, direct calls of the
product kernels), writing the new rows' keys and values into room behind each layer's cache (`_room`: the
cache's tensors are the leading slots of buffers with spare slots, so no forward copies the cache).
Products go through `quantized_linear` for a model `specops.quantize` made low-precision (q|k|v and
gate|up fused into one weight each, packed once per model) and through skinny_linear for float32 layers
(kept separate: a fused copy would double a float model's memory).

Gemma-3 (the embedded target) and Qwen3 take the op's options: q and k norms per head, Gemma-3's four norms
a layer that scale by 1 + w, its GELU-tanh MLP, and its sliding-window layers, which read their own rotary
tables and a mask that hides the slots at least `sliding_window` before the query's slot (transformers'
window, which counts slots: the engine's cache keeps every slot). Gemma-3's scaled embedding is its
embedding module's own, and a final logit soft-cap, where the config sets one, is applied as the model does.

The path takes forwards of at most `_FEW_ROWS` rows (64, or 32 where torch's BLAS is fast from 32 rows on:
decoding steps, drafts, verification of a chain or of a draft tree, whose mask the op takes as it takes a
chain's); prefills go through `CpuForward`. The cache is the transformers cache the model's
own forward fills (post-rotary keys, [B, Hkv, L, D]), so both paths share it. Used only where a probe
shows this path reproduces the model's logits, a ragged batch with a cache included (its 8 tokens are
inside any window; the window's mask is checked against the model's own forward on small windows by
python_tests/test_llama_forward.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from specops._kept import per_object
from specops.decoding.tree_forward import TreeMask, _chain_index
from specops.decoding.cpu_forward import _FEW_ROWS, CpuForward, _Product, remember, reproduces
from specops.decoding.greedy_head import capped, greedy_logits
from specops.decoding.hf_compat import cache_argument

__all__ = ["LlamaForward", "settle"]

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_QK_NORMED = ("qwen3", "gemma3_text")  # families whose attention norms each q and k head
_GEMMA = "gemma3_text"  # four norms a layer scaling by 1 + w, GELU-tanh, sliding-window and global layers
_GELU_TANH = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation")  # transformers' tanh-approximated GELUs
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Cache layers whose update only appends (the engine's CompactingLayer may first apply a pending move:
# `settle`): the op appends to their keys and values itself.
_LAYERS = ("DynamicLayer", "CompactingLayer")
_USABLE: weakref.WeakKeyDictionary[object, LlamaForward | None] = per_object(
    "few-call forward", "the llama_layers forward of the model's layers, its weights packed, or why there is none")


# On a cache layer: (keys buffer, values buffer, the keys view, the values view) that `_room` last gave it.
_ROOM = "_specops_room"


def _room(layer, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [B, Hkv, slots, D] of buffers whose first slots are `layer`'s keys and values, the rest room
    for the forward's new rows; the caller makes them the layer's tensors after the op wrote the rows in
    place, instead of a cat copying the cache per forward.

    The buffers are reused while the layer's tensors are still their leading slots: the views this
    function gave, or a crop of them (rejected drafts dropped): same storage, offset and strides. Slots past
    the layer's length belong to nobody but these views. Otherwise (a cache class's own update or reorder
    made new tensors, or the buffer is full) new buffers get the cache copied once, with room to grow by
    half its length (at least 64 slots)."""
    keys, values = layer.keys, layer.values
    held = getattr(layer, _ROOM, None)
    if held is not None:
        kbuf, vbuf, given_keys, given_values = held
        if slots <= kbuf.shape[2] and ((keys is given_keys and values is given_values) or all(
                t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride() and t.shape[:2] == buf.shape[:2]
                and t.shape[3] == buf.shape[3] for t, buf in ((keys, kbuf), (values, vbuf)))):
            return _give(layer, kbuf, vbuf, slots)
    batch, heads, length, dim = keys.shape
    kbuf, vbuf = (t.new_empty(batch, heads, _capacity(slots), dim) for t in (keys, values))
    kbuf[:, :, :length].copy_(keys)
    vbuf[:, :, :length].copy_(values)
    return _give(layer, kbuf, vbuf, slots)


def settle(cache, slots: int | None = None) -> None:
    """Apply the pending moves of a cache's layers (the engine's CompactingLayer: rows that kept different
    numbers of drafts move to end together) into buffers with room for `slots` slots (None: the cache's own
    length) and more, which `_room` then reuses. Settled first and given room after, the cache was copied
    twice: 20 ms of a 90 ms step of Gemma-3-270M with 8 requests on a 2-vCPU Xeon, after every step whose
    rows kept different numbers of drafts; 10 ms now."""
    for layer in getattr(cache, "layers", None) or []:
        if getattr(layer, "pending", None) is not None:
            buffers = layer.settle(capacity=_capacity(layer.pending[1] if slots is None else slots))
            if buffers is not None:
                layer.keys, layer.values = _give(layer, *buffers, layer.keys.shape[2])


def _capacity(slots: int) -> int:
    """Slots of a new buffer for a cache of `slots` slots: room to grow by half its length, at least 64."""
    return slots + max(64, slots // 2)


def _give(layer, kbuf: torch.Tensor, vbuf: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers' first `slots` slots as views, remembered on the layer."""
    keys, values = kbuf.narrow(2, 0, slots), vbuf.narrow(2, 0, slots)
    setattr(layer, _ROOM, (kbuf, vbuf, keys, values))
    return keys, values


def _norms(layer) -> list:
    """A decoder layer's hidden-size norms in the op's order: input and post-attention, then Gemma-3's
    pre- and post-MLP norms where it has them."""
    names = ["input_layernorm", "post_attention_layernorm"]
    if hasattr(layer, "pre_feedforward_layernorm"):
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    return [getattr(layer, name) for name in names]


def _qk_norms(layer) -> list:
    attn = layer.self_attn
    return [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []


def _eps(norm) -> float | None:
    """An RMSNorm's epsilon (Llama's and Qwen's call it variance_epsilon, Gemma's eps)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


def _layer_modules(layer) -> tuple:
    """The modules of a decoder layer this path computes from."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
            *_norms(layer), *_qk_norms(layer))


class _Layer:
    """A decoder layer as `specops.ops.llama_layers` takes it: its norm weights (2, or Gemma-3's 4), its q and
    k norm weights (Qwen3, Gemma-3) and 28 linear entries (q, k, v, o, gate, up, down as weight, scales, mins,
    bias; q|k|v and gate|up fused in the first slot for quantized layers, the other slots empty)."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.norms = [norm.weight for norm in _norms(layer)]
        self.qk_norms = [norm.weight for norm in _qk_norms(layer)]
        self.eps = {_eps(norm) for norm in _norms(layer) + _qk_norms(layer)}
        self.linears = []
        for modules in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                        [mlp.down_proj]):
            product = _Product(modules)
            if product.fused is not None:
                self.linears += [*product.fused] + [None] * 4 * (len(modules) - 1)
            else:
                self.linears += [t for m in modules for t in (m.weight, None, None, m.bias)]
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)


def _config(model):
    return getattr(model.config, "get_text_config", lambda: model.config)()


def _structure(model) -> str | None:
    """None if `model` has the layers this path computes, else why not."""
    config = _config(model)
    family = getattr(config, "model_type", None)
    if family not in _FAMILIES:
        return f"model type {family!r} is not one of {_FAMILIES}"
    types = list(getattr(config, "layer_types", None) or [])
    if any(t not in _LAYER_TYPES for t in types):
        return "layers other than full and sliding-window attention"
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            return "sliding-window layers without a window size"
    elif not types and window is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention without layer types"
    if getattr(config, "attn_logit_softcapping", None) is not None or \
            getattr(config, "use_bidirectional_attention", False):
        return "attention logit soft-capping or bidirectional attention"
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(base, "layers", None)
    if base is None or not layers or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        return "no decoder with layers, rotary embedding and token embedding"
    if len(layers) != getattr(config, "num_hidden_layers", len(layers)) or (types and len(types) != len(layers)):
        return "a decoder whose layer count is not the config's"
    for layer in layers:
        why = _layer_structure(layer, family)
        if why is not None:
            return why
    if _eps(base.norm) is None or not type(base.norm).__name__.endswith("RMSNorm"):
        return "a final norm other than an RMSNorm"
    return None


def _layer_structure(layer, family: str) -> str | None:
    """None if a decoder layer is the family's (attention with q and k norms for Qwen3 and Gemma-3 only,
    the gated MLP with SiLU, or GELU-tanh for Gemma-3, RMSNorms: four for Gemma-3), else why not."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "a layer other than Llama's attention and gated MLP"
    if (family in _QK_NORMED) != (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")) or \
            (family not in _QK_NORMED and any(hasattr(attn, n) for n in ("q_norm", "k_norm"))):
        return "q and k norms other than the family's"
    act = getattr(mlp, "act_fn", None)
    if family == _GEMMA:
        if type(act).__name__ not in _GELU_TANH:
            return "an MLP activation other than GELU-tanh"
    elif not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return "an MLP activation other than SiLU"
    norms = _norms(layer)
    if (family == _GEMMA) != (len(norms) == 4):
        return "norms other than the family's"
    for norm in norms + _qk_norms(layer):
        if not type(norm).__name__.endswith("RMSNorm") or _eps(norm) is None:
            return "a norm other than an RMSNorm"
    return None


class LlamaForward:
    """Chain forwards of a Llama-family CPU model in few ATen calls per layer (see the module docstring);
    `fits` says which forwards it takes, `CpuForward` (`fallback`) does the rest."""

    def __init__(self, model, fallback: CpuForward):
        self.fallback = fallback
        self.base = model.get_decoder()
        self.head = model.get_output_embeddings()
        config = _config(model)
        layers = [_Layer(layer) for layer in self.base.layers]
        shapes = {(layer.heads, layer.kv_heads, layer.head_dim, layer.scaling, *layer.eps) for layer in layers}
        if len(shapes) != 1 or len(layers[0].eps) != 1:
            raise ValueError("layers of different head counts, scaling or norm epsilon")
        self.heads, self.kv_heads, _, self.scaling, self.eps = shapes.pop()
        self.norms = [w for layer in layers for w in layer.norms]
        self.qk_norms = [w for layer in layers for w in layer.qk_norms] or None
        self.linears = [t for layer in layers for t in layer.linears]
        self.head_product = _Product([self.head])
        self.final_eps = _eps(self.base.norm)
        gemma = config.model_type == _GEMMA
        self.norm_offset = 1.0 if gemma else 0.0  # Gemma's norms scale by 1 + w
        self.activation = "gelu_tanh" if gemma else "silu"
        self.softcap = getattr(config, "final_logit_softcapping", None) if gemma else None
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
        self.local_layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        self.window = config.sliding_window if self.local_layers else None
        # Per-type rotary tables where the rotary embedding takes a layer type (Gemma-3's), else one table.
        self.typed_rotary = isinstance(getattr(self.base.rotary_emb, "rope_type", None), dict)
        self.global_type = "full_attention" if "full_attention" in types else types[0]
        self.signature = self._signature()

    def _signature(self) -> tuple:
        mods = [self.head, self.base.norm, *(m for layer in self.base.layers for m in _layer_modules(layer))]
        return tuple(id(m) for m in mods) + tuple(id(getattr(m, "weight", None)) for m in mods)

    def fits(self, rows: int) -> bool:
        """Whether a forward of `rows` = B * n rows goes this way (decoding steps; not prefills)."""
        return rows <= _FEW_ROWS

    @torch.inference_mode()
    def __call__(self, keep: int, cache, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, tree: TreeMask | None = None, argmax_only: bool = False,
                 follow=None, **kwargs) -> torch.Tensor:
        """Logits [B, keep, V] of the last `keep` of input_ids [B, n], appending them to `cache` (a
        transformers cache); attention_mask [B, L] (L = cached + n): the valid slots; position_ids [B, n];
        tree: the n inputs are a draft tree (tree_forward.py's layout), whose nodes see their ancestors only and
        whose windows count tokens along each node's own path. argmax_only: only each row's argmax is read;
        follow: which rows a greedy verification can read (greedy_head.py)."""
        layers = getattr(cache, "layers", None)
        if layers is None or getattr(cache, "offloading", False) or len(layers) > len(self.base.layers) or \
                any(type(layer).__name__ not in _LAYERS for layer in layers):
            # a tree: inside the caller's tree_forward
            return self.fallback(keep, cache, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, argmax_only=argmax_only, follow=follow, **kwargs)
        batch, n = input_ids.shape
        past = attention_mask.shape[1] - n
        settle(cache, past + n)
        x = self.base.embed_tokens(input_ids).reshape(batch * n, -1).float()
        cos, sin = self._rotary(x, position_ids, self.global_type)  # [B, n, D]
        mask, local = self._masks(attention_mask.bool(), past, n) if tree is None else self._tree_masks(tree, past, n)
        ready = [i < len(layers) and layers[i].is_initialized for i in range(len(self.base.layers))]
        if any(ready) != all(ready) or any(ok and layers[i].keys.shape[2] != past for i, ok in enumerate(ready)) or \
                (not ready[0] and past):
            # not a state decoding creates (layers of other lengths than the mask's): the general path
            # a tree: inside the caller's tree_forward
            return self.fallback(keep, cache, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, argmax_only=argmax_only, follow=follow, **kwargs)
        dim = cos.shape[-1]
        if ready[0]:
            room = [_room(layers[i], past + n) for i in range(len(layers))]
        else:  # the cache's first rows: its own update takes them after the op (initializing the layer)
            room = [(x.new_empty(batch, self.kv_heads, n, dim), x.new_empty(batch, self.kv_heads, n, dim))
                    for _ in self.base.layers]
        keys, values = [k for k, _ in room], [v for _, v in room]
        options = {}
        if self.qk_norms is not None or self.local_layers or self.norm_offset or self.activation != "silu":
            local_cos, local_sin = self._rotary(x, position_ids, "sliding_attention") if self.local_layers else \
                (None, None)
            options = dict(qk_norms=self.qk_norms, norm_offset=self.norm_offset, activation=self.activation,
                           local_layers=self.local_layers, local_cos=local_cos, local_sin=local_sin, local_mask=local)
        x = torch.ops.specops.llama_layers(x, cos.float(), sin.float(), mask, self.norms, self.linears, keys, values,
                                           self.heads, self.kv_heads, self.eps, self.scaling, **options)
        for i, (k, v) in enumerate(room):
            if ready[i]:
                layers[i].keys, layers[i].values = k, v
            else:
                cache.update(k, v, i)
        x = x.view(batch, n, -1)[:, -keep:].reshape(batch * keep, -1)
        if self.norm_offset:
            h = self.base.norm(x)  # Gemma's norm, 1 + w, as the model computes it
        else:
            h = F.rms_norm(x, (x.shape[-1],), self.base.norm.weight, self.final_eps)
        logits = greedy_logits(self.head, h, self.softcap, self.head_product, follow) if argmax_only else \
            capped(self.head_product(h), self.softcap)
        return logits.view(batch, keep, -1).float()

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
        """cos, sin [B, n, D] float32 of the rotary embedding for layers of `layer_type`."""
        if self.typed_rotary:
            cos, sin = self.base.rotary_emb(x, position_ids, layer_type)
        else:
            cos, sin = self.base.rotary_emb(x, position_ids)
        return cos.float(), sin.float()

    def _masks(self, valid: torch.Tensor, past: int, n: int) -> tuple:
        """The masks [B, 1, n, past + n] of the full-attention and the sliding-window layers (None: every slot
        seen) for n new rows after `past` slots, `valid` [B, past + n] the slots that hold a token. A slot is
        seen if it holds a token and is not after the query; a query always sees itself; a sliding layer
        also hides the slots at least `window` before the query's slot."""
        slots = torch.arange(past + n, device=valid.device)
        query = past + torch.arange(n, device=valid.device)
        mask = None
        if n > 1 or not bool(valid.all()):
            mask = (valid[:, None, :] & (slots[None, None, :] <= query[None, :, None])) | \
                (slots[None, None, :] == query[None, :, None])
            mask = mask[:, None]
        if self.window is None or past + n - 1 < self.window:  # the window hides nothing yet
            return mask, mask
        inside = (slots[None, :] > query[:, None] - self.window)[None, None]  # [1, 1, n, past + n]
        return mask, inside.expand(valid.shape[0], 1, n, past + n) if mask is None else mask & inside

    def _tree_masks(self, tree: TreeMask, past: int, n: int) -> tuple:
        """The masks [B, 1, n, past + n] of a tree forward: each node sees the valid prefix slots, its
        ancestors and itself; a sliding layer also hides the keys whose chain index (a prefix slot's own,
        a node's past + its depth: where it would sit in its own root-to-node chain) is at least `window`
        before the query's."""
        mask = tree.dense()
        if self.window is None or past + n - 1 < self.window:  # no chain index reaches the window
            return mask, mask
        keys = _chain_index(tree, past, torch.arange(past + n, device=mask.device)[None])  # [B, past + n]
        query = past + tree.depth  # [B, n]
        return mask, mask & (keys[:, None, :] > query[:, :, None] - self.window)[:, None]

    @staticmethod
    def of(model, fallback: CpuForward | None) -> LlamaForward | None:
        """The path for `model` if it is a Llama-family model whose logits this path reproduces (probed
        once per model and set of modules), else None."""
        if fallback is None:
            return None
        known = _USABLE.get(model, False)
        if known is not False and (known is None or known.signature == known._signature()):
            return known
        path = None
        try:
            if _structure(model) is None:
                path = LlamaForward(model, fallback)
                if not _probe(model, path):
                    path = None
        except Exception:  # any model that does not fit the pattern keeps the general path
            path = None
        return remember(_USABLE, model, path)


def _probe(model, path: LlamaForward) -> bool:
    """A ragged batch of two rows (the first left-padded) read by the model's own forward into a cache,
    then two chain steps through this path (2 tokens, then 1); every logit compared with the model's own
    forward over the whole rows without a cache."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(8).view(2, 4) * 7 + 3) % vocab
    valid = torch.ones(2, 4, dtype=torch.long)
    valid[0, 0] = 0
    steps = [(torch.tensor([[5, 9], [11, 2]]) % vocab), (torch.tensor([[4], [6]]) % vocab)]
    with torch.inference_mode():
        cache = DynamicCache()
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=valid, position_ids=positions, use_cache=True,
              **{cache_argument(model): cache})
        mask, got = valid, []
        for tokens in steps:
            n = tokens.shape[1]
            start = mask.sum(1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, n, dtype=torch.long)], dim=1)
            got.append(path(n, cache, input_ids=tokens, attention_mask=mask,
                            position_ids=start + torch.arange(n)))
        full = torch.cat([ids, *steps], dim=1)
        want = model(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                     use_cache=False).logits[:, 4:].float()
    return reproduces(want, torch.cat(got, dim=1))
