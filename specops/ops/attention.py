"""tree_attention: attention of draft-tree nodes over the KV cache and their own ancestors."""

from __future__ import annotations

import torch

from specops.ops._checks import (_INT64_MAX, _LOGIT_DTYPES, _check_devices, _check_int, _check_tensor,
                                 _finite_positive, _raise_first, _require)

__all__ = ["tree_attention"]


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor, *,
                   kv_mask: torch.Tensor | None = None, scale: float | None = None, window: int | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None,
                   validate: bool = True) -> torch.Tensor:
    """Attention of a draft tree's nodes over a KV-cached prefix and the tree itself, for ragged trees of
    N nodes per request (RSD's tree attention, paper 003 Alg 5; a chain is a tree).

    Node i attends to every prefix slot that holds a token and to the nodes set in its row of the
    ancestor bitmask (its ancestors and itself): softmax(q.k * scale) over those keys, with an online
    softmax accumulated in float32. Positions count tokens (a prefix slot: the valid slots before it;
    node i: all valid prefix slots plus its depth, popcount(row i) - 1), so a sliding window is counted
    in tokens whatever holes the prefix has.

    Shape:
        query: [B, Hq, N, D] float32, bfloat16 or float16, N >= 1 (B >= 0).
        key, value: [B, Hkv, S, D] of query's dtype, S >= N: each request's cache, its last N slots the
            nodes' keys and values in node order; Hq a multiple of Hkv (grouped-query attention).
        tree_mask: [B, N, ceil(N/32)] int32: bit j % 32 of word j // 32 of row i is set iff node j is
            node i or an ancestor of node i (RSD's construction: a child's row is its parent's row plus
            its own bit). Padding nodes of a ragged tree see only themselves.
        kv_mask: [B, S - N] bool, which prefix slots hold a token (default: all).
        scale: the softmax scale (default D ** -0.5).
        window: keep only keys with position(query) - position(key) < window: an int in [1, 2**63)
            (None: no window).
        softcap: scores become softcap * tanh(scores / softcap) before masking (None: off).
        sinks: [Hq] float, one extra logit per query head in each row's softmax denominator, with no
            value (attention sinks; None: off).
        validate: check the mask's values (no bit at or past N, every node sees itself). On CPU the kernel
            does this in its pass over the rows; on accelerators it costs one host sync in the op's contract. Shapes,
            dtypes and devices are always checked, and no kernel reads out of bounds either way.

    NaN and inf: what a row does not see never enters it, whatever it holds: a prefix slot kv_mask hides
    or outside its window, a node that is not its ancestor (a padding node, a sibling's branch); a cache
    fresh from torch.empty is ordinary input. A NaN in what it sees shows in its output, never as
    plausible numbers: a NaN (or +inf) in its query, in a score it sees or in its head's sink makes the
    whole row NaN; a NaN or inf in a value it sees enters as p * v (NaN / inf in those columns).

    Returns [B, Hq, N, D] in query's dtype (B = 0: empty); a row with nothing to attend to is zeros.
    """
    op = "tree_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor ([B, H, N or S, D])")
    if query.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{op}: query must be float32, bfloat16 or float16, got {query.dtype}")
    batch, heads, nodes, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if nodes < 1 or dim < 1:
        raise ValueError(f"{op}: query {tuple(query.shape)} needs N >= 1 nodes and D >= 1")
    if key.shape != (batch, kv_heads, slots, dim) or value.shape != key.shape:
        raise ValueError(f"{op}: key and value must both be [B, Hkv, S, D] = [{batch}, Hkv, S, {dim}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{op}: key and value must have query's dtype {query.dtype}, got {key.dtype} and "
                        f"{value.dtype}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{op}: Hq = {heads} query heads must be a multiple of Hkv = {kv_heads} key/value heads")
    if slots < nodes:
        raise ValueError(f"{op}: key/value hold S = {slots} slots, fewer than the N = {nodes} tree nodes")
    words = (nodes + 31) // 32
    _check_tensor(op, "tree_mask", tree_mask, (batch, nodes, words), f"[B, N, ceil(N/32)] = [{batch}, {nodes}, "
                  f"{words}]", torch.int32)
    device = query.device
    if kv_mask is None:
        kv_mask = torch.ones(batch, slots - nodes, dtype=torch.bool, device=device)
    _check_tensor(op, "kv_mask", kv_mask, (batch, slots - nodes), f"[B, S - N] = [{batch}, {slots - nodes}]",
                  torch.bool)
    tensors = {"key": key, "value": value, "tree_mask": tree_mask, "kv_mask": kv_mask}
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,) or not sinks.is_floating_point():
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"{op}: sinks must be a float [Hq] = [{heads}] tensor, got {got}")
        tensors["sinks"] = sinks
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but query is on {device}")
    scale = dim ** -0.5 if scale is None else scale
    for name, number in (("scale", scale), ("softcap", softcap)):
        if number is not None and not _finite_positive(number):
            raise ValueError(f"{op}: {name} must be a finite number > 0, got {number!r}")
    if window is not None:
        _check_int(op, "window", window, 1, _INT64_MAX, "an int >= 1 or None (at most 2**63 - 1)")
    return torch.ops.specops.tree_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), tree_mask.contiguous(), kv_mask.contiguous(),
        float(scale), int(window or 0), float(softcap or 0.0),
        None if sinks is None else sinks.float().contiguous(), validate)


def _tree_mask_checks(tree_mask: torch.Tensor, nodes: int) -> list:
    """The tree mask's value checks (the CPU kernel makes the same ones): no bit at or past N, and every
    node's own bit set."""
    from specops.reference import tree_visibility

    words = tree_mask.shape[-1]
    spare = 32 * words - nodes
    high = torch.zeros((), dtype=torch.bool, device=tree_mask.device)
    if spare:
        keep = (1 << (32 - spare)) - 1  # the bits of nodes < N in the last word
        high = (tree_mask[..., -1].to(torch.int64) & ~keep & 0xFFFFFFFF).ne(0).any()
    sees = tree_visibility(tree_mask, nodes)
    own = torch.diagonal(sees, dim1=1, dim2=2)
    return [(high, f"tree_mask has a bit set at or past node N = {nodes}"),
            (~own.all(), "tree_mask has a node that does not see itself (its own bit is clear)")]


def check_tree_attention(query, key, value, tree_mask, kv_mask, scale, window, softcap, sinks, validate=True) -> None:
    """tree_attention's contract where its kernel cannot check: the C++ kernel's checks and messages
    (`specops.ops.sampling.check_chain_verify` says more), and the dtypes and devices the Triton kernel
    needs."""
    op = "tree_attention"
    _require(query.dim() == 4 and key.dim() == 4 and value.dim() == 4, op, "query, key and value must be 4-D")
    batch, heads, nodes, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    words = (nodes + 31) // 32
    _require(nodes >= 1 and kv_heads >= 1 and heads % kv_heads == 0 and slots >= nodes, op,
             "need N >= 1, Hq a multiple of Hkv and S >= N")
    _require(tuple(key.shape) == (batch, kv_heads, slots, dim) and value.shape == key.shape, op,
             "key and value must be [B, Hkv, S, D]")
    _require(query.dtype in _LOGIT_DTYPES, op, "query must be float32, bfloat16 or float16", TypeError)
    _require(key.dtype == query.dtype and value.dtype == query.dtype, op, "key and value must have query's dtype",
             TypeError)
    _require(tree_mask.dtype == torch.int32 and tuple(tree_mask.shape) == (batch, nodes, words), op,
             "tree_mask must be [B, N, ceil(N/32)] int32")
    _require(kv_mask.dtype == torch.bool and tuple(kv_mask.shape) == (batch, slots - nodes), op,
             "kv_mask must be [B, S - N] bool")
    _require(sinks is None or (sinks.dtype == torch.float32 and sinks.dim() == 1 and sinks.shape[0] == heads), op,
             "sinks must be a float32 [Hq] tensor")
    _check_devices(op, "query", query.device, {"key": key, "value": value, "tree_mask": tree_mask,
                                               "kv_mask": kv_mask, "sinks": sinks})
    if validate and batch and heads:
        _raise_first(op, _tree_mask_checks(tree_mask, nodes))


@torch.library.register_fake("specops::tree_attention")
def _tree_attention_fake(query, key, value, tree_mask, kv_mask, scale, window, softcap, sinks, validate=True):
    return torch.empty_like(query)
