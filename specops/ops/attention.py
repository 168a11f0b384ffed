"""tree_attention: attention of draft-tree nodes over the KV cache and their own ancestors."""

from __future__ import annotations

import math

import torch

from specops.ops._checks import (_LOGIT_DTYPES, _c_number, _check_devices, _float, _int, _raise_first, _require,
                                 _sizes, _tensor)

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
        scale: the softmax scale, finite and > 0 (default D ** -0.5).
        window: keep only keys with position(query) - position(key) < window: an int >= 1 (None or 0:
            no window).
        softcap: scores become softcap * tanh(scores / softcap) before masking: finite and > 0 (None or
            0: off).
        sinks: [Hq] float32, one extra logit per query head in each row's softmax denominator, with no
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
    query, key = _tensor(op, "query", query), _tensor(op, "key", key)
    batch, _, nodes, dim = _sizes(query, 4)
    if kv_mask is None:
        kv_mask = torch.ones(batch, max(_sizes(key, 3)[2] - nodes, 0), dtype=torch.bool, device=query.device)
    scale = max(dim, 1) ** -0.5 if scale is None else _float(op, "scale", scale)
    window = 0 if window is None else _int(op, "window", window)
    softcap = 0.0 if softcap is None else _float(op, "softcap", softcap)
    return torch.ops.specops.tree_attention(
        query, key, _tensor(op, "value", value), _tensor(op, "tree_mask", tree_mask), _tensor(op, "kv_mask", kv_mask),
        scale, window, softcap, _tensor(op, "sinks", sinks, True), validate)


def _as_float32(number: float) -> float:
    """`number` as the CPU kernel holds it (a float32: a double beyond its range is inf there too)."""
    return torch.tensor(number, dtype=torch.float64).float().item()


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
    _require(math.isfinite(_as_float32(scale)) and scale > 0, op,
             f"scale must be finite and > 0, got {_c_number(scale)}")
    _require(window >= 0, op, f"window must be >= 0 (0: no window), got {window}")
    _require(math.isfinite(_as_float32(softcap)) and softcap >= 0, op,
             f"softcap must be finite and >= 0 (0: no soft-cap), got {_c_number(softcap)}")
    _check_devices(op, "query", query.device, {"key": key, "value": value, "tree_mask": tree_mask,
                                               "kv_mask": kv_mask, "sinks": sinks})
    if validate and batch and heads:
        _raise_first(op, _tree_mask_checks(tree_mask, nodes))


@torch.library.register_fake("specops::tree_attention")
def _tree_attention_fake(query, key, value, tree_mask, kv_mask, scale, window, softcap, sinks, validate=True):
    check_tree_attention(query, key, value, tree_mask, kv_mask, scale, window, softcap, sinks, False)
    return torch.empty_like(query)
