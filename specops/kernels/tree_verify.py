"""Triton kernels for `specops::tree_verify`: recursive rejection sampling over a draft tree (RSD, Jeon et
al. 2024; SpecInfer's multi-step speculative sampling with replacement).

Two launches, none of which holds a whole vocabulary row in one program:

1. `_tile_stats_kernel`, grid (B*N, n_tiles): per vocabulary tile of every valid node's row (n <
   num_nodes[b]), the maximum of x = logits / T and sum(exp(x - that maximum)), and the raw logits'
   maximum with its first index (the argmax for greedy rows and for rows where logits / T overflows).
   The walk reaches only some rows, but which is not known before it runs.
2. `_walk_kernel`, grid (B,): the walk of one request, root -> children in node order -> descend on
   acceptance. Accept child x iff u * q_i(x) * R < r(x), p_i = r / R (r = p, R = 1 until a rejection);
   on a rejection r <- r without x (one-hot q) or r <- max(0, r * f32(1 / R) - q * f32(1 / s)) (q_i =
   q / s, s the float64 mass of q not yet drawn), R <- its float64 mass. The residual r lives in a
   float32 scratch row per request, written only from the first rejection at a node on (two rows with
   draft_probs: the update reads one and writes the other, as it is dropped if it has no mass); its
   per-tile float64 masses stay in registers. The emitted token is the two-level inverse CDF of r.

Every random number is Philox4x32-10 on the counter (position, stream, offset), as in
`specops.reference`, so the tokens equal the reference's for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.kernels._sampling import (_STREAM_ACCEPT, _STREAM_SAMPLE, _filter_cut, _inverse_cdf_index,
                                       _inverse_cdf_tile, _ordered_key, _request_sampling, _row_argmax,
                                       _row_normalizer, _row_tile_stats, _uniform, offset_words, tile_stat_buffers,
                                       vocab_tiling)

__all__ = ["tree_verify_triton"]


@triton.jit(do_not_specialize=["N"])
def _tile_stats_kernel(logits_ptr, num_nodes_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                       tile_arg_ptr, stride_lb, stride_ln, V, N, n_tiles, BLOCK_V: tl.constexpr):
    """Per tile of row (b, n): m_t = max x, s_t = sum exp(x - m_t), x = logits / T (T = 1 for greedy
    rows), and the raw logits' maximum with its first index; the row's normalizer is then
    Z = sum_t s_t exp(m_t - m), m = max_t m_t (online softmax, Milakov & Gimelshein 2018)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    b = row // N
    n = row % N
    # Rows of padding nodes are never read by the walk, which clamps num_nodes to [1, N] as here.
    if n < tl.maximum(tl.load(num_nodes_ptr + b), 1):
        row_ptr = logits_ptr + b.to(tl.int64) * stride_lb + n.to(tl.int64) * stride_ln
        _row_tile_stats(row_ptr, tl.load(temperature_ptr + b), tile, row.to(tl.int64) * n_tiles + tile,
                        tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, V, BLOCK_V)


@triton.jit
def _target_prob(row_ptr, offs, mask, scale, row_max, z, cut):
    """p at `offs` (masked lanes: 0), float32 like the reference's softmax of the filtered row. The one
    formula for p(x) in an acceptance test and for the residual it starts, so both agree bit for bit."""
    raw = tl.load(row_ptr + offs, mask=mask, other=-float("inf"))
    x = tl.math.div_rn(raw.to(tl.float32), scale)
    keep = mask & (_ordered_key(x) >= cut)
    return tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)


@triton.jit
def _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V, n_tiles, BLOCK_V: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Writes p into the residual row; returns its per-tile float64 masses."""
    # Other threads may still be reading the row as the previous node left it.
    tl.debug_barrier()
    masses = tl.zeros([BLOCK_T], tl.float64)
    for tile in range(0, n_tiles):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        p = _target_prob(row_ptr, offs, in_row, scale, row_max, z, cut)
        tl.store(res_ptr + offs, p, mask=in_row)
        masses = tl.where(tiles == tile, tl.sum(p.to(tl.float64), 0), masses)
    # Later reads of the row (a scalar r(x), other lanes' tiles) may come from other threads.
    tl.debug_barrier()
    return masses


@triton.jit
def _subtract_draft(res_ptr, next_ptr, q_ptr, scale_r, scale_q, tiles, V, n_tiles, BLOCK_V: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """Writes max(0, r * scale_r - q * scale_q) into the other residual row; returns its per-tile float64
    masses. Launched without FP fusion: an FMA would round differently from the reference."""
    masses = tl.zeros([BLOCK_T], tl.float64)
    for tile in range(0, n_tiles):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        r = tl.load(res_ptr + offs, mask=in_row, other=0.0)
        q = tl.load(q_ptr + offs, mask=in_row, other=0.0)
        w = tl.maximum(r * scale_r - q * scale_q, 0.0)
        tl.store(next_ptr + offs, w, mask=in_row)
        masses = tl.where(tiles == tile, tl.sum(w.to(tl.float64), 0), masses)
    tl.debug_barrier()
    return masses


@triton.jit(do_not_specialize=["N", "offset_lo", "offset_hi"])
def _walk_kernel(logits_ptr, tokens_ptr, parents_ptr, draft_probs_ptr, num_nodes_ptr, temperature_ptr, top_k_ptr,
                 top_p_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, residual_ptr,
                 out_tokens_ptr, out_nodes_ptr, num_accepted_ptr,
                 stride_lb, stride_ln, stride_tb, stride_pb, stride_qb, stride_qn, stride_rb, stride_ob,
                 V, N, n_tiles,
                 offset_lo, offset_hi,
                 HAS_PROBS: tl.constexpr, REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Recursive rejection sampling (Jeon et al. 2024, paper 003 Alg 3-4) from the root: at node n try its
    children c in node order, accepting x = tokens[c] iff u * q_i(x) < p_i(x), u = uniform(c - 1,
    accept stream), and descend into the accepted child; where none is accepted (or at a leaf) emit a
    token from p_i by inverse CDF at uniform(n, sample stream). Greedy rows (T = 0, or logits / T
    overflowing) follow the first child equal to the first argmax and emit the argmax where none is."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    # Clamped so that unchecked counts (validate=False) never index past the rows.
    count = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b), 1), N).to(tl.int32)
    temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok = _request_sampling(
        temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T)
    tokens_row_ptr = tokens_ptr + b64 * stride_tb
    parents_row_ptr = parents_ptr + b64 * stride_pb
    out_tokens_row_ptr = out_tokens_ptr + b64 * stride_ob
    out_nodes_row_ptr = out_nodes_ptr + b64 * stride_ob
    res_base_ptr = residual_ptr + b64 * stride_rb

    node = tl.zeros([], tl.int32)
    depth = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    # Each step descends one level and a child's index exceeds its parent's: N steps reach any leaf.
    for step in range(0, N):
        if done == 0:
            node64 = node.to(tl.int64)
            row_ptr = logits_ptr + b64 * stride_lb + node64 * stride_ln
            stats = (b64 * N + node64) * n_tiles + tiles
            tile_max = tl.load(tile_max_ptr + stats, mask=tile_ok, other=-float("inf"))
            row_max = tl.max(tile_max, 0)
            follow = tl.full([], -1, tl.int32)
            token = tl.full([], -1, tl.int64)
            if greedy | (tl.abs(row_max) == float("inf")):
                _raw_max, best = _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V)
                for c in range(node + 1, count):
                    if follow < 0:
                        child = (tl.load(parents_row_ptr + c) == node64) & (tl.load(tokens_row_ptr + c) == best)
                        follow = tl.where(child, c, follow)
                token = best.to(tl.int64)
            else:
                z = _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max)
                cut, z = _filter_cut(row_ptr, scale, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V)
                q_row_ptr = draft_probs_ptr + b64 * stride_qb + node64 * stride_qn
                materialized = tl.zeros([], tl.int32)  # else r = p, not written out
                cur = tl.zeros([], tl.int32)  # which residual row holds r
                masses = tl.zeros([BLOCK_T], tl.float64)  # per tile of r, once materialized
                mass = tl.full([], 1.0, tl.float64)  # R: p_i = r / R
                left = tl.full([], 1.0, tl.float64)  # s: q_i = q / s
                for c in range(node + 1, count):
                    if follow < 0:
                        if tl.load(parents_row_ptr + c) == node64:
                            x = tl.load(tokens_row_ptr + c)
                            # Out-of-range ids (only without validation) are never read: p(x) = 0 rejects them.
                            valid = (x >= 0) & (x < V)
                            res_ptr = res_base_ptr + cur * V
                            if materialized != 0:
                                p_x = tl.load(res_ptr + x, mask=valid, other=0.0)
                            else:
                                p_x = _target_prob(row_ptr, x, valid, scale, row_max, z, cut)
                            q_x = tl.full([], 1.0, tl.float64)
                            q_raw = tl.zeros([], tl.float32)
                            if HAS_PROBS:
                                q_raw = tl.load(q_row_ptr + x, mask=valid, other=0.0)
                                q_x = q_raw.to(tl.float64) / left
                            u = _uniform(seed, c - 1, _STREAM_ACCEPT, offset_lo, offset_hi)
                            # float64 like the reference: u has 52 random bits.
                            if u * q_x * mass < p_x.to(tl.float64):
                                follow = c
                            else:
                                if materialized == 0:
                                    masses = _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V,
                                                          n_tiles, BLOCK_V, BLOCK_T)
                                    materialized = materialized + 1
                                if HAS_PROBS:
                                    next_ptr = res_base_ptr + (1 - cur) * V
                                    scale_r = (1.0 / mass).to(tl.float32)
                                    scale_q = (1.0 / left).to(tl.float32)
                                    next_masses = _subtract_draft(res_ptr, next_ptr, q_row_ptr, scale_r, scale_q,
                                                                  tiles, V, n_tiles, BLOCK_V, BLOCK_T)
                                    total = tl.sum(next_masses, 0)
                                    # No mass left (round-off only): keep p_i, chain_verify's policy.
                                    if total > 0.0:
                                        cur = 1 - cur
                                        masses = next_masses
                                        mass = total
                                    if not REPLACEMENT:
                                        left = left - q_raw.to(tl.float64)
                                else:
                                    # max(0, p_i - onehot(x)) is p_i without x, unless nothing would be left.
                                    # Nothing to remove where p_i(x) = 0 (out-of-range ids included).
                                    rest = mass - p_x.to(tl.float64)
                                    if (p_x > 0.0) & (rest > 0.0):
                                        # The tile's mass is summed again rather than decremented, so a tile
                                        # left without weight has mass exactly 0 for the inverse CDF.
                                        x_tile = x // BLOCK_V
                                        offs = x_tile * BLOCK_V + tl.arange(0, BLOCK_V)
                                        in_row = offs < V
                                        r = tl.load(res_ptr + offs, mask=in_row, other=0.0)
                                        r = tl.where(offs == x, 0.0, r)
                                        masses = tl.where(tiles == x_tile, tl.sum(r.to(tl.float64), 0), masses)
                                        # Every thread has read r(x) for the test before it is zeroed, and
                                        # sees the zero in later tests.
                                        tl.debug_barrier()
                                        tl.store(res_ptr + x, 0.0)
                                        tl.debug_barrier()
                                        mass = rest
                if follow < 0:
                    res_ptr = res_base_ptr + cur * V
                    if materialized == 0:
                        masses = _fill_target(row_ptr, res_ptr, scale, row_max, z, cut, tiles, V, n_tiles,
                                              BLOCK_V, BLOCK_T)
                    target = _uniform(seed, node, _STREAM_SAMPLE, offset_lo, offset_hi) * tl.sum(masses, 0)
                    tile, prefix, found = _inverse_cdf_tile(masses, tiles, tile_ok, target, BLOCK_T)
                    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
                    in_row = offs < V
                    w = tl.load(res_ptr + offs, mask=in_row, other=0.0).to(tl.float64)
                    token = _inverse_cdf_index(w, offs, in_row, prefix, target, found, V).to(tl.int64)
                else:
                    token = tl.load(tokens_row_ptr + follow)
            tl.store(out_tokens_row_ptr + depth, token)
            if follow < 0:
                done = done + 1
            else:
                tl.store(out_nodes_row_ptr + depth, follow.to(tl.int64))
                node = follow
                depth = depth + 1
    tl.store(num_accepted_ptr + b, depth.to(tl.int64))
    # Padding, at positions the walk never wrote.
    for d in range(0, N):
        tl.store(out_tokens_row_ptr + d, -1, mask=d > depth)
        tl.store(out_nodes_row_ptr + d, -1, mask=d >= depth)


def tree_verify_triton(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       draft_probs: torch.Tensor | None, num_nodes: torch.Tensor, replacement: bool,
                       temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                       offset: int, validate: bool = True,
                       block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::tree_verify` on the op's normalized arguments (see
    `specops.ops.tree_verify`): tensors on one device. Values are not checked here (that would be a
    host sync inside the op); `specops.ops.tree_verify` checks them when `validate` is true.
    `block_v` overrides the vocabulary tile (a power of two), for tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous, and the
    # kernels index rows and vocabulary densely. A no-op for contiguous inputs.
    target_logits, tokens, parents, num_nodes, temperature, top_k, top_p, seed = (
        t.contiguous() for t in (target_logits, tokens, parents, num_nodes, temperature, top_k, top_p, seed))
    draft_probs = None if draft_probs is None else draft_probs.contiguous()
    batch, nodes, vocab = target_logits.shape
    device = target_logits.device
    out_tokens = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    out_nodes = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return out_tokens, out_nodes, num_accepted
    block_v, n_tiles, block_t, num_warps = vocab_tiling("tree_verify", vocab, block_v)

    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(batch * nodes, n_tiles, device)
    has_probs = draft_probs is not None
    # Row b holds request b's residual; with draft_probs a second row after it, as an update that leaves no
    # mass is dropped: the update reads one row and writes the other.
    residual = torch.empty((batch, 2 if has_probs else 1, vocab), dtype=torch.float32, device=device)

    # Never read without HAS_PROBS; any tensor stands in for the pointer.
    probs = draft_probs if has_probs else target_logits
    stride_qb, stride_qn = (draft_probs.stride(0), draft_probs.stride(1)) if has_probs else (0, 0)
    stride_lb, stride_ln = target_logits.stride(0), target_logits.stride(1)
    offset_lo, offset_hi = offset_words(offset)

    _tile_stats_kernel[(batch * nodes, n_tiles)](
        target_logits, num_nodes, temperature, tile_max, tile_sum, tile_raw, tile_arg,
        stride_lb, stride_ln, vocab, nodes, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    # Without FP fusion: the residual update must round r * a and q * b separately, as the reference does.
    _walk_kernel[(batch,)](
        target_logits, tokens, parents, probs, num_nodes, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_raw, tile_arg, residual, out_tokens, out_nodes, num_accepted,
        stride_lb, stride_ln, tokens.stride(0), parents.stride(0), stride_qb, stride_qn, residual.stride(0),
        out_tokens.stride(0),
        vocab, nodes, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, REPLACEMENT=bool(replacement) and has_probs, BLOCK_V=block_v, BLOCK_T=block_t,
        num_warps=num_warps, enable_fp_fusion=False)
    return out_tokens, out_nodes, num_accepted


torch.library.register_kernel("specops::tree_verify", "cuda", tree_verify_triton)
