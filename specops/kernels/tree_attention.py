"""Triton kernel for `specops::tree_attention`: attention of draft-tree nodes over a KV-cached prefix and
the tree under a bit-packed ancestor mask (RSD's tree attention, paper 003 Alg 5).

FlashAttention-style: one program per block of BLOCK_M query rows of one (request, key/value head),
the rows of every query head that shares the key/value head packed together (grouped-query attention,
so each key tile is loaded once for all of them). It walks the prefix in tiles of BLOCK_N keys with an
online softmax in float32, starting at the first tile any of its rows can see (a sliding window, counted
in tokens) and skipping tiles that hold no token, then the tree's N keys, whose mask comes from the
packed words: bit j % 32 of word j // 32 of node i's row. Offsets are 64-bit. Keys a row does not see
enter as -inf whatever they hold, non-finite values enter the product as 0 and then only the rows that
see them, and a NaN / +inf score or sink a row sees makes that row NaN (the NaN rules of the op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.attention import check_tree_attention

__all__ = ["tree_attention_triton"]

_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _soft_cap(s, softcap):
    # softcap * tanh(s / softcap), from exp of a non-positive argument.
    y = s / softcap
    e = tl.exp(-2.0 * tl.abs(y))
    t = softcap * (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _online_step(s, seen, v, m, l, acc, poisoned, PRECISION: tl.constexpr):
    # One tile of scores s [M, N], of which each row sees `seen`, and values v [N, D] into the running
    # maximum m, sum l and accumulator acc of each row. Unseen keys enter as -inf whatever they hold; a
    # NaN or +inf seen score poisons its row (its output is NaN). Returns the tile's weights p too.
    sane = s < float("inf")  # False for NaN
    poisoned = poisoned | (tl.sum((seen & ~sane).to(tl.int32), axis=1) > 0)
    s = tl.where(seen & sane, s, _NEG_INF)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    # Non-finite values enter the product as 0 (p = 0 must not carry an unseen NaN into a row):
    # _add_nonfinite adds them to the rows that see them.
    clean = tl.where(tl.abs(v.to(tl.float32)) < float("inf"), v, 0.0).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), clean, out_dtype=tl.float32, input_precision=PRECISION)
    return m_new, l, acc, poisoned, p


@triton.jit
def _add_nonfinite(acc, p, seen, v, BLOCK_N: tl.constexpr):
    # The NaN / inf values of a tile, key by key, into the rows that see them: acc += p * v there.
    # Reached only for tiles that hold one.
    cols = tl.arange(0, BLOCK_N)
    values = v.to(tl.float32)
    for j in range(0, BLOCK_N):
        pick = cols == j
        v_j = tl.sum(tl.where(pick[:, None], values, 0.0), axis=0)
        p_j = tl.sum(tl.where(pick[None, :], p, 0.0), axis=1)
        seen_j = tl.sum((pick[None, :] & seen).to(tl.int32), axis=1) > 0
        bad = ~(tl.abs(v_j) < float("inf"))
        acc += tl.where(seen_j[:, None] & bad[None, :], p_j[:, None] * v_j[None, :], 0.0)
    return acc


@triton.jit
def _has_nonfinite(v):
    return tl.sum((~(tl.abs(v.to(tl.float32)) < float("inf"))).to(tl.int32)) > 0


@triton.jit
def _operand(x, DOT_FP32: tl.constexpr):
    # Triton's interpreter multiplies bfloat16 tiles as raw bits: there, products run in float32.
    if DOT_FP32:
        return x.to(tl.float32)
    return x


# One program per (request, key-value head, query tile): the online softmax over the prefix, then over the
# tree, in one launch; the running maximum, sum and output stay in registers across both loops, so the
# kernel stays whole (a split would write them out and read them back).
@triton.jit(do_not_specialize=["prefix", "N", "W", "window"])
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tree_mask_ptr, kv_mask_ptr, count_ptr, start_ptr,
                           depth_ptr, sinks_ptr,
                           stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_ks,
                           Hkv, G, N, prefix, W, D, window,
                           scale, softcap,
                           HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
                           PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    b = pair // Hkv
    g = pair % Hkv
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * N
    head = g * G + rows // N  # query head of each packed row
    node = rows % N
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D

    q_offsets = b * stride_qb + head.to(tl.int64)[:, None] * stride_qh + node.to(tl.int64)[:, None] * stride_qn
    q = _operand(tl.load(q_ptr + q_offsets + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0),
                 DOT_FP32)
    kv_base = b * stride_kb + g * stride_kh
    depth = tl.load(depth_ptr + b * N + node, mask=row_ok, other=0)
    start = tl.load(start_ptr + b * N + node, mask=row_ok, other=prefix)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        # A NaN or +inf sink leaves no softmax: the row is poisoned, as by a NaN score.
        poisoned = ~(sink < float("inf"))
        m = tl.where(poisoned, _NEG_INF, sink)
        l = tl.where(row_ok & ~poisoned, 1.0, 0.0)
    else:
        m = tl.full((BLOCK_M,), _NEG_INF, tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        poisoned = tl.zeros((BLOCK_M,), tl.int1)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # The prefix, from the first tile any row can see.
    first = tl.min(tl.where(row_ok, start, prefix), axis=0)
    for t0 in range((first // BLOCK_N) * BLOCK_N, prefix, BLOCK_N):
        t1 = tl.minimum(t0 + BLOCK_N, prefix)
        tokens = tl.load(count_ptr + b * (prefix + 1) + t1) - tl.load(count_ptr + b * (prefix + 1) + t0)
        if tokens > 0:
            keys = t0 + tl.arange(0, BLOCK_N)
            key_ok = keys < prefix
            kv_offsets = kv_base + keys.to(tl.int64)[:, None] * stride_ks + dims[None, :]
            k = _operand(tl.load(k_ptr + kv_offsets, mask=key_ok[:, None] & dim_ok[None, :], other=0.0), DOT_FP32)
            v = _operand(tl.load(v_ptr + kv_offsets, mask=key_ok[:, None] & dim_ok[None, :], other=0.0), DOT_FP32)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * scale
            if HAS_SOFTCAP:
                s = _soft_cap(s, softcap)
            valid = tl.load(kv_mask_ptr + b * prefix + keys, mask=key_ok, other=0) != 0
            seen = valid[None, :] & (keys[None, :] >= start[:, None]) & row_ok[:, None]
            m, l, acc, poisoned, p = _online_step(s, seen, v, m, l, acc, poisoned, PRECISION)
            if _has_nonfinite(v):
                acc = _add_nonfinite(acc, p, seen, v, BLOCK_N)

    # The tree: the last N slots, masked by the ancestor words (and the window, by depth).
    for j0 in range(0, N, BLOCK_N):
        nodes = j0 + tl.arange(0, BLOCK_N)
        node_ok = nodes < N
        kv_offsets = kv_base + (prefix + nodes).to(tl.int64)[:, None] * stride_ks + dims[None, :]
        k = _operand(tl.load(k_ptr + kv_offsets, mask=node_ok[:, None] & dim_ok[None, :], other=0.0), DOT_FP32)
        v = _operand(tl.load(v_ptr + kv_offsets, mask=node_ok[:, None] & dim_ok[None, :], other=0.0), DOT_FP32)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        word_offsets = (b * N + node).to(tl.int64)[:, None] * W + (nodes // 32)[None, :]
        both = row_ok[:, None] & node_ok[None, :]
        words = tl.load(tree_mask_ptr + word_offsets, mask=both, other=0)
        seen = both & (((words >> (nodes % 32)[None, :]) & 1) != 0)
        if window > 0:
            key_depth = tl.load(depth_ptr + b * N + nodes, mask=node_ok, other=0)
            seen = seen & (depth[:, None] - key_depth[None, :] < window)
        m, l, acc, poisoned, p = _online_step(s, seen, v, m, l, acc, poisoned, PRECISION)
        if _has_nonfinite(v):
            acc = _add_nonfinite(acc, p, seen, v, BLOCK_N)

    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    out = tl.where(poisoned[:, None], float("nan"), out)
    tl.store(out_ptr + q_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def _layout(tree_mask: torch.Tensor, kv_mask: torch.Tensor, nodes: int, window: int):
    """Per request: valid-slot counts before each prefix slot [B, S - N + 1], each node's depth [B, N] and
    its first visible prefix slot [B, N] (0 without a window), all int32 and computed on the device."""
    shifts = torch.arange(32, device=tree_mask.device, dtype=torch.int32)
    bits = (tree_mask[..., None] >> shifts) & 1  # [B, N, W, 32]
    depth = bits.sum((-1, -2), dtype=torch.int32) - 1
    count = torch.nn.functional.pad(kv_mask.to(torch.int32).cumsum(1, dtype=torch.int32), (1, 0))
    if window > 0:
        # int64: an int32 tensor minus a window past 2**31 would wrap.
        need = (count[:, -1:].long() + depth.long() - window + 1).clamp(min=0)
        start = torch.searchsorted(count, need.to(count.dtype), side="left").to(torch.int32)
    else:
        start = torch.zeros_like(depth)
    return count.contiguous(), depth.contiguous(), start.contiguous()


def tree_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor,
                          kv_mask: torch.Tensor, scale: float, window: int, softcap: float,
                          sinks: torch.Tensor | None, validate: bool = True, block_m: int | None = None,
                          block_n: int | None = None) -> torch.Tensor:
    """Triton implementation of `specops::tree_attention` on the op's normalized arguments (see
    `specops.ops.tree_attention`, which checks shapes, dtypes and, with `validate`, the mask's values:
    the kernel trusts them and never reads outside the tensors either way). `block_m` / `block_n`
    override the tiles (powers of two >= 16), for tests of the multi-tile paths."""
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    tree_mask, kv_mask = tree_mask.contiguous(), kv_mask.contiguous()
    batch, heads, nodes, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group, prefix = heads // kv_heads, slots - nodes
    out = torch.empty_like(query)
    if out.numel() == 0:  # an empty batch: no grid to launch
        return out
    count, depth, start = _layout(tree_mask, kv_mask, nodes, window)
    block_d = max(16, triton.next_power_of_2(dim))
    # Tiles and warps from the compile check (python -m specops.tools.compile_check; docs/gpu.md): the
    # 64 x 64 tiles with 4 warps spilled 1,800 bytes per thread at D = 128 in 16 bits, and in float32 needed
    # 247 KB of shared memory, more than an H100 block has. These, with 8 warps, spill nothing (float32 at
    # D = 256: 8 bytes on sm_90, 216 on sm_80) and take at most 102 KB.
    wide = query.element_size() > 2
    if wide and block_d > 128:
        default_m, default_n = 16, 16
    else:
        default_m, default_n = (16, 32) if wide or block_d > 128 else (32, 32)
    block_m, block_n = block_m or default_m, block_n or default_n
    grid = (triton.cdiv(group * nodes, block_m), batch * kv_heads)
    _tree_attention_kernel[grid](
        query, key, value, out, tree_mask, kv_mask, count, start, depth,
        sinks if sinks is not None else query,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        kv_heads, group, nodes, prefix, tree_mask.shape[-1], dim, window,
        float(scale), float(softcap),
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap > 0,
        DOT_FP32=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        # float32 products as torch does them: TF32 only where the user allowed it.
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8)
    return out


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
tree_attention_cuda = guarded(check_tree_attention, tree_attention_triton)
torch.library.register_kernel("specops::tree_attention", "cuda", tree_attention_cuda)
