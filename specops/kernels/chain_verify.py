"""Triton kernels for `specops::chain_verify`: speculative-sampling verification of a chain of drafts.

Four launches, none of which holds a whole vocabulary row in one program:

1. `_tile_stats_kernel`, grid (B*(K+1), n_tiles): per vocabulary tile of every needed target row,
   the maximum of x = logits / T and sum(exp(x - that maximum)), and the raw logits' maximum with
   its first index (the argmax for greedy rows and for rows where logits / T overflows).
2. `_chain_kernel`, grid (B,): the sequential acceptance test over the drafts of a request. Rows
   without top-k/top-p take their softmax normalizer from the tile statistics; filtered rows find
   their thresholds by bisection over the row. Requests that end on a greedy row finish here.
3. `_residual_partials_kernel`, grid (B, n_tiles): per tile, the float64 mass of the residual
   max(0, p - q) and of p at the position to sample.
4. `_sample_kernel`, grid (B,): inverse-CDF sampling, first over the tile masses, then inside the
   chosen tile.

Scheme "block" (block verification) has four launches of its own, described where they are defined.

Every random number is Philox4x32-10 on the counter (position, stream, offset), as in
`specops.reference`, so the tokens equal the reference's for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.kernels._sampling import (_KEEP_ALL, _STREAM_ACCEPT, _STREAM_SAMPLE, _filter_cut, _inverse_cdf_index,
                                       _inverse_cdf_tile, _ordered_key, _request_sampling, _row_argmax,
                                       _row_normalizer, _row_tile_stats, _scaled_tile, _uniform, offset_words,
                                       register_cap, tile_stat_buffers, vocab_tiling)
from specops.ops._checks import guarded
from specops.ops.sampling import check_chain_verify

__all__ = ["chain_verify_triton"]


@triton.jit
def _tile_weights(row_ptr, draft_probs_row_ptr, draft, bonus, tile, temperature, row_max, z, cut, V,
                  HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """p and the residual max(0, p - q) of one tile, float32 like the reference. q is the draft
    distribution (one-hot on `draft` without draft_probs); a bonus position has q = 0, so r = p."""
    offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
    keep = in_row & (_ordered_key(x) >= cut)
    p = tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)
    if HAS_PROBS:
        # An integer bound rather than `in_row & ~bonus`: the interpreter turns vector & scalar masks
        # into int32, which tl.load rejects.
        q = tl.load(draft_probs_row_ptr + offs, mask=offs < tl.where(bonus, 0, V), other=0.0)
    else:
        q = tl.where(offs == draft, 1.0, 0.0)  # draft is -1 at a bonus position
    residual = tl.maximum(p - q, 0.0)
    return offs, in_row, p, residual


@triton.jit(do_not_specialize=["K1"])
def _tile_stats_kernel(logits_ptr, num_draft_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                       tile_arg_ptr, stride_lb, stride_lj, V, K1, n_tiles, BLOCK_V: tl.constexpr):
    """Per tile of row (b, j): m_t = max x, s_t = sum exp(x - m_t), x = logits / T (T = 1 for greedy
    rows), and the raw logits' maximum with its first index; the row's normalizer is then
    Z = sum_t s_t exp(m_t - m), m = max_t m_t (online softmax, Milakov & Gimelshein 2018)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    b = row // K1
    j = row % K1
    n = tl.load(num_draft_ptr + b)
    # Rows past a request's drafts are never read.
    if j <= n:
        row_ptr = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_lj
        _row_tile_stats(row_ptr, tl.load(temperature_ptr + b), tile, row.to(tl.int64) * n_tiles + tile,
                        tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, V, BLOCK_V)


@triton.jit(do_not_specialize=["K1", "offset_lo", "offset_hi"])
def _chain_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, top_k_ptr,
                  top_p_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, out_ptr,
                  num_accepted_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_emitted_ptr,
                  stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
                  V, K1, n_tiles,
                  offset_lo, offset_hi,
                  HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Accept draft d at position j iff u * q(d) < p(d), u ~ U(0, 1) (Leviathan et al. 2023, Chen et
    al. 2023), stopping at the first rejection or after all drafts; greedy (T = 0, or logits / T
    overflowing, the T -> 0 limit): accept iff d is the first argmax of the logits, and emit the argmax
    at the stop. Stores where and from which p to sample, or that the token is already emitted."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    n = tl.load(num_draft_ptr + b)
    temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok = _request_sampling(
        temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T)
    emitted = tl.zeros([], tl.int32)
    out_row_ptr = out_ptr + b64 * stride_ob

    done = tl.zeros([], tl.int32)
    stop_at = tl.zeros([], tl.int64)
    stop_max = tl.zeros([], tl.float32)
    stop_z = tl.full([], 1.0, tl.float32)
    stop_cut = tl.full([], _KEEP_ALL, tl.int32)
    for j in range(0, K1):
        j64 = tl.cast(j, tl.int64)  # the interpreter's loop index is a Python int
        if done != 0:
            tl.store(out_row_ptr + j, -1)
        else:
            # Not done implies j <= n: the loop stops at the bonus position at the latest.
            row_ptr = logits_ptr + b64 * stride_lb + j64 * stride_lj
            stats = (b64 * K1 + j64) * n_tiles + tiles
            tile_max = tl.load(tile_max_ptr + stats, mask=tile_ok, other=-float("inf"))
            row_max = tl.max(tile_max, 0)
            stop = j >= n
            if greedy | (tl.abs(row_max) == float("inf")):
                _, best = _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V)
                if j < n:
                    draft = tl.load(draft_tokens_ptr + b64 * stride_db + j)
                    stop = draft != best
                    if draft == best:
                        tl.store(out_row_ptr + j, draft)
                if stop:
                    tl.store(out_row_ptr + j, best)
                    emitted = emitted | 1
            else:
                z = _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max)
                cut, z = _filter_cut(row_ptr, scale, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V)
                if j < n:
                    draft = tl.load(draft_tokens_ptr + b64 * stride_db + j)
                    # Out-of-range ids are never read: p(d) = 0 and q(d) = 1 reject them.
                    valid = (draft >= 0) & (draft < V)
                    raw = tl.load(row_ptr + draft, mask=valid, other=-float("inf"))
                    x = tl.math.div_rn(raw.to(tl.float32), scale)
                    keep = valid & (_ordered_key(x) >= cut)
                    p_draft = tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)
                    q_draft = tl.full([], 1.0, tl.float32)
                    if HAS_PROBS:
                        q_ptr = draft_probs_ptr + b64 * stride_pb + j64 * stride_pj + draft
                        q_draft = tl.load(q_ptr, mask=valid, other=1.0)
                    u = _uniform(seed, j64, _STREAM_ACCEPT, offset_lo, offset_hi)
                    # float64 like the reference: u has 52 random bits.
                    stop = u * q_draft.to(tl.float64) >= p_draft.to(tl.float64)
                    if not stop:
                        tl.store(out_row_ptr + j, draft)
                if stop:
                    stop_max = row_max
                    stop_z = z
                    stop_cut = cut
            if stop:
                done = done + 1
                stop_at = j64
    tl.store(num_accepted_ptr + b, stop_at)
    tl.store(row_max_ptr + b, stop_max)
    tl.store(row_z_ptr + b, stop_z)
    tl.store(row_cut_ptr + b, stop_cut)
    tl.store(row_emitted_ptr + b, emitted)


@triton.jit
def _stop_tile_weights(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr,
                       num_accepted_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, b64, tile,
                       stride_lb, stride_lj, stride_db, stride_pb, stride_pj, V,
                       HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """`_tile_weights` of one tile of request b's row at its sampling position, as `_chain_kernel` left it."""
    j = tl.load(num_accepted_ptr + b64)
    bonus = j == tl.load(num_draft_ptr + b64)
    draft = tl.load(draft_tokens_ptr + b64 * stride_db + j, mask=bonus == 0, other=-1)
    row_ptr = logits_ptr + b64 * stride_lb + j * stride_lj
    probs_ptr = draft_probs_ptr + b64 * stride_pb + j * stride_pj
    return _tile_weights(row_ptr, probs_ptr, draft, bonus, tile, tl.load(temperature_ptr + b64),
                         tl.load(row_max_ptr + b64), tl.load(row_z_ptr + b64), tl.load(row_cut_ptr + b64), V,
                         HAS_PROBS, BLOCK_V)


@triton.jit
def _residual_partials_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr,
                              num_accepted_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_emitted_ptr,
                              mass_r_ptr, mass_p_ptr,
                              stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
                              V, n_tiles,
                              HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per tile at the sampling position j: float64 sums of r = max(0, p - q) and of p, the
    recovered-token distribution norm(r) of Leviathan et al. 2023 / Chen et al. 2023 and its fallback."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    if tl.load(row_emitted_ptr + b) == 0:
        b64 = b.to(tl.int64)
        offs, in_row, p, residual = _stop_tile_weights(
            logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, num_accepted_ptr,
            row_max_ptr, row_z_ptr, row_cut_ptr, b64, tile, stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
            V, HAS_PROBS, BLOCK_V)
        slot = b64 * n_tiles + tile
        tl.store(mass_r_ptr + slot, tl.sum(residual.to(tl.float64), 0))
        tl.store(mass_p_ptr + slot, tl.sum(p.to(tl.float64), 0))


@triton.jit(do_not_specialize=["offset_lo", "offset_hi"])
def _sample_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, seed_ptr,
                   num_accepted_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_emitted_ptr, mass_r_ptr, mass_p_ptr,
                   out_ptr,
                   stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
                   V, n_tiles,
                   offset_lo, offset_hi,
                   HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Recovered or bonus token (Leviathan et al. 2023, Chen et al. 2023) by inverse CDF: the first index
    whose float64 running sum of w exceeds u * sum(w), w = max(0, p - q), or p if that has no mass; the
    last index with w > 0 if round-off leaves none."""
    b = tl.program_id(0)
    if tl.load(row_emitted_ptr + b) == 0:
        b64 = b.to(tl.int64)
        j = tl.load(num_accepted_ptr + b)
        seed = tl.load(seed_ptr + b)
        tiles = tl.arange(0, BLOCK_T)
        tile_ok = tiles < n_tiles
        mass_r = tl.load(mass_r_ptr + b64 * n_tiles + tiles, mask=tile_ok, other=0.0)
        mass_p = tl.load(mass_p_ptr + b64 * n_tiles + tiles, mask=tile_ok, other=0.0)
        total_r = tl.sum(mass_r, 0)
        use_r = total_r > 0.0
        mass = tl.where(use_r, mass_r, mass_p)
        total = tl.where(use_r, total_r, tl.sum(mass_p, 0))
        target = _uniform(seed, j, _STREAM_SAMPLE, offset_lo, offset_hi) * total
        tile, prefix, found = _inverse_cdf_tile(mass, tiles, tile_ok, target, BLOCK_T)

        offs, in_row, p, residual = _stop_tile_weights(
            logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, num_accepted_ptr,
            row_max_ptr, row_z_ptr, row_cut_ptr, b64, tile, stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
            V, HAS_PROBS, BLOCK_V)
        w = tl.where(use_r, residual, p).to(tl.float64)
        token = _inverse_cdf_index(w, offs, in_row, prefix, target, found, V)
        tl.store(out_ptr + b64 * stride_ob + j, token)


# ---- scheme "block" (Sun et al., ICLR 2025, arXiv 2403.10444; semantics: specops.reference._block_verify_row) ----
#
# The same four launches: the tile statistics above; `_block_chain_kernel` runs the forward pass over the
# drafts (every row's normalizer and cut, the weights W_k) and settles what it can before any residual is
# known: the whole chain when u_K < W_K, otherwise the positions k whose residual the backward walk may need
# (u_k < W_k, since h_k <= W_k; and position 0, where the walk ends); `_block_residual_kernel` sums those
# residuals per tile, in parallel; `_block_sample_kernel` walks back over them and samples.


@triton.jit
def _block_tile_weights(row_ptr, probs_row_ptr, draft, bonus, tile, temperature, row_max, z, cut, point, scale, V,
                        HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """p and r = max(0, fl(W) p - q) of one tile (r = p at the bonus position), p a point mass at `point` where
    that is >= 0 (logits / T overflowed)."""
    offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
    keep = in_row & (_ordered_key(x) >= cut)
    soft = tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)
    p = tl.where(point >= 0, tl.where(offs == point, 1.0, 0.0), soft)
    if HAS_PROBS:
        q = tl.load(probs_row_ptr + offs, mask=offs < tl.where(bonus, 0, V), other=0.0)
    else:
        q = tl.where(offs == draft, 1.0, 0.0)  # draft is -1 at the bonus position
    residual = tl.where(bonus, p, tl.maximum(scale * p - q, 0.0))
    return offs, in_row, p, residual


# One program per request: block verification's forward pass over the chain (each row's statistics and the
# weight W_k, which carries from one position to the next), then which positions the walk may reach, in one
# launch. The per-row work is the helpers above; the rest carries W and the greedy walk's state across
# positions, so the kernel stays whole.
@triton.jit(do_not_specialize=["K1", "offset_lo", "offset_hi"])
def _block_chain_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, top_k_ptr,
                        top_p_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, out_ptr,
                        num_accepted_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_point_ptr, weight_ptr, need_ptr,
                        decided_ptr, emitted_ptr,
                        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
                        V, K1, n_tiles, offset_lo, offset_hi,
                        HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Forward pass of block verification for request b: per row j <= n its maximum, normalizer, cut and
    point mass; W_0 = 1, W_k = min(1, W_{k-1} p(x_k) / q(x_k)) in float64, up to the first W_k = 0. Then
    `decided` = K when u_K < W_K (or K = 0), else -1 with need[k] set for the positions the walk may
    reach. Greedy requests (T = 0) are verified here as chain_verify's token scheme does."""
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    # Clamped so that an unchecked count (validate=False) never reads past a request's drafts.
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b), 0), K1 - 1)
    temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok = _request_sampling(
        temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T)
    out_row_ptr = out_ptr + b64 * stride_ob
    done = tl.zeros([], tl.int32)  # greedy: the walk has emitted its token
    alive = tl.full([], 1, tl.int32)  # sampled: W is still > 0
    top = n.to(tl.int64)
    w = tl.full([], 1.0, tl.float64)
    for j in range(0, K1):
        j64 = tl.cast(j, tl.int64)
        slot = b64 * K1 + j64
        tl.store(out_row_ptr + j, -1)
        tl.store(need_ptr + slot, 0)
        tl.store(weight_ptr + slot, w)
        if (j <= n) & (done == 0) & (alive != 0):
            row_ptr = logits_ptr + b64 * stride_lb + j64 * stride_lj
            stats = slot * n_tiles + tiles
            tile_max = tl.load(tile_max_ptr + stats, mask=tile_ok, other=-float("inf"))
            row_max = tl.max(tile_max, 0)
            _, best = _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V)
            draft = tl.load(draft_tokens_ptr + b64 * stride_db + j, mask=j < n, other=-1)
            if greedy:
                if (j < n) & (draft == best):
                    tl.store(out_row_ptr + j, draft)
                else:
                    tl.store(out_row_ptr + j, best)
                    tl.store(num_accepted_ptr + b, j64)
                    done = done + 1
            else:
                point = tl.where(tl.abs(row_max) == float("inf"), best, -1)
                z = _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max)
                cut = tl.full([], _KEEP_ALL, tl.int32)
                if point < 0:
                    cut, z = _filter_cut(row_ptr, scale, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V)
                tl.store(row_max_ptr + slot, row_max)
                tl.store(row_z_ptr + slot, z)
                tl.store(row_cut_ptr + slot, cut)
                tl.store(row_point_ptr + slot, point)
                if j < n:
                    valid = (draft >= 0) & (draft < V)
                    raw = tl.load(row_ptr + draft, mask=valid, other=-float("inf"))
                    x = tl.math.div_rn(raw.to(tl.float32), scale)
                    keep = valid & (_ordered_key(x) >= cut)
                    soft = tl.where(keep, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)
                    p_draft = tl.where(point >= 0, tl.where(draft == point, 1.0, 0.0), soft)
                    q_draft = tl.full([], 1.0, tl.float32)
                    if HAS_PROBS:
                        q_draft = tl.load(draft_probs_ptr + b64 * stride_pb + j64 * stride_pj + draft, mask=valid,
                                          other=1.0)
                    pw = w * p_draft.to(tl.float64)
                    q64 = q_draft.to(tl.float64)
                    w = tl.where(pw >= q64, 1.0, pw / tl.where(q64 > 0.0, q64, 1.0))
                    if w == 0.0:
                        alive = 0
                        top = j64
    tl.store(emitted_ptr + b, done)
    if not greedy:
        # W_K (w is the last weight reached; it is W_n when top == n).
        decided = tl.full([], -1, tl.int64)
        if top == n:
            u = _uniform(seed, tl.maximum(n - 1, 0).to(tl.int64), _STREAM_ACCEPT, offset_lo, offset_hi)
            if (n == 0) | (u < w):
                decided = n.to(tl.int64)
        if decided >= 0:
            tl.store(need_ptr + b64 * K1 + decided, 1)
        else:
            tl.store(need_ptr + b64 * K1, 1)
            for k in range(1, K1):
                k64 = tl.cast(k, tl.int64)
                if (k64 <= top) & (k64 < n):
                    u = _uniform(seed, k64 - 1, _STREAM_ACCEPT, offset_lo, offset_hi)
                    # W_k at slot k: the weight stored when the loop reached row k.
                    if u < tl.load(weight_ptr + b64 * K1 + k64):
                        tl.store(need_ptr + b64 * K1 + k64, 1)
        tl.store(decided_ptr + b, decided)


@triton.jit
def _block_row_weights(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, row_max_ptr,
                       row_z_ptr, row_cut_ptr, row_point_ptr, weight_ptr, b64, k64, tile, K1,
                       stride_lb, stride_lj, stride_db, stride_pb, stride_pj, V,
                       HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """`_block_tile_weights` of one tile of request b's row k, with what `_block_chain_kernel` stored."""
    slot = b64 * K1 + k64
    bonus = k64 == tl.minimum(tl.maximum(tl.load(num_draft_ptr + b64), 0), K1 - 1)  # as _block_chain_kernel
    draft = tl.load(draft_tokens_ptr + b64 * stride_db + k64, mask=bonus == 0, other=-1)
    scale = tl.load(weight_ptr + slot).to(tl.float32)
    return _block_tile_weights(logits_ptr + b64 * stride_lb + k64 * stride_lj,
                               draft_probs_ptr + b64 * stride_pb + k64 * stride_pj, draft, bonus, tile,
                               tl.load(temperature_ptr + b64), tl.load(row_max_ptr + slot), tl.load(row_z_ptr + slot),
                               tl.load(row_cut_ptr + slot), tl.load(row_point_ptr + slot), scale, V,
                               HAS_PROBS, BLOCK_V)


@triton.jit(do_not_specialize=["K1"])
def _block_residual_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr,
                           row_max_ptr, row_z_ptr, row_cut_ptr, row_point_ptr, weight_ptr, need_ptr, emitted_ptr,
                           mass_r_ptr, mass_p_ptr, stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
                           V, K1, n_tiles, HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per tile of every needed row k: the float64 masses of r_k and of p_k."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    b64 = (row // K1).to(tl.int64)
    k64 = (row % K1).to(tl.int64)
    if (tl.load(need_ptr + row) != 0) & (tl.load(emitted_ptr + b64) == 0):
        offs, in_row, p, residual = _block_row_weights(
            logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, row_max_ptr, row_z_ptr,
            row_cut_ptr, row_point_ptr, weight_ptr, b64, k64, tile, K1, stride_lb, stride_lj, stride_db,
            stride_pb, stride_pj, V, HAS_PROBS, BLOCK_V)
        slot = row.to(tl.int64) * n_tiles + tile
        tl.store(mass_r_ptr + slot, tl.sum(residual.to(tl.float64), 0))
        tl.store(mass_p_ptr + slot, tl.sum(p.to(tl.float64), 0))


@triton.jit(do_not_specialize=["K1", "offset_lo", "offset_hi"])
def _block_sample_kernel(logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, seed_ptr,
                         row_max_ptr, row_z_ptr, row_cut_ptr, row_point_ptr, weight_ptr, need_ptr, decided_ptr,
                         emitted_ptr, mass_r_ptr, mass_p_ptr, out_ptr, num_accepted_ptr,
                         stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
                         V, K1, n_tiles, offset_lo, offset_hi,
                         HAS_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """The backward walk: keep k drafts when u_k (S_k + 1 - W_k) < S_k, S_k the mass of r_k, at the needed
    positions from the longest down, else none; then the token at the kept position from norm(r_k) (p if r_k
    has no mass) by the two-level inverse CDF, and the kept drafts before it."""
    b = tl.program_id(0)
    if tl.load(emitted_ptr + b) == 0:
        b64 = b.to(tl.int64)
        seed = tl.load(seed_ptr + b)
        tiles = tl.arange(0, BLOCK_T)
        tile_ok = tiles < n_tiles
        kept = tl.load(decided_ptr + b)
        for i in range(1, K1):
            k64 = tl.cast(K1 - i, tl.int64)  # K1 - 1 down to 1
            if kept < 0:
                if tl.load(need_ptr + b64 * K1 + k64) != 0:
                    s = tl.sum(tl.load(mass_r_ptr + (b64 * K1 + k64) * n_tiles + tiles, mask=tile_ok, other=0.0), 0)
                    w = tl.load(weight_ptr + b64 * K1 + k64)
                    u = _uniform(seed, k64 - 1, _STREAM_ACCEPT, offset_lo, offset_hi)
                    if u * (s + 1.0 - w) < s:
                        kept = k64
        kept = tl.maximum(kept, 0)
        out_row_ptr = out_ptr + b64 * stride_ob
        for j in range(0, K1 - 1):
            if j < kept:
                tl.store(out_row_ptr + j, tl.load(draft_tokens_ptr + b64 * stride_db + j))
        tl.store(num_accepted_ptr + b, kept)
        masses = (b64 * K1 + kept) * n_tiles + tiles
        mass_r = tl.load(mass_r_ptr + masses, mask=tile_ok, other=0.0)
        mass_p = tl.load(mass_p_ptr + masses, mask=tile_ok, other=0.0)
        total_r = tl.sum(mass_r, 0)
        use_r = total_r > 0.0
        mass = tl.where(use_r, mass_r, mass_p)
        total = tl.where(use_r, total_r, tl.sum(mass_p, 0))
        target = _uniform(seed, kept, _STREAM_SAMPLE, offset_lo, offset_hi) * total
        tile, prefix, found = _inverse_cdf_tile(mass, tiles, tile_ok, target, BLOCK_T)
        offs, in_row, p, residual = _block_row_weights(
            logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, row_max_ptr, row_z_ptr,
            row_cut_ptr, row_point_ptr, weight_ptr, b64, kept, tile, K1, stride_lb, stride_lj, stride_db,
            stride_pb, stride_pj, V, HAS_PROBS, BLOCK_V)
        token = _inverse_cdf_index(tl.where(use_r, residual, p).to(tl.float64), offs, in_row, prefix, target, found, V)
        tl.store(out_row_ptr + kept, token)


def _launch_args(target_logits, draft_tokens, draft_probs, out_tokens, offset: int):
    """What both schemes' launches share: whether q is given, its pointer (never read without HAS_PROBS, so any
    tensor stands in for it), the strides (logits b, j; drafts b; q b, j; out b) and the offset's two words."""
    has_probs = draft_probs is not None
    probs = draft_probs if has_probs else target_logits
    stride_pb, stride_pj = (draft_probs.stride(0), draft_probs.stride(1)) if has_probs else (0, 0)
    strides = (target_logits.stride(0), target_logits.stride(1), draft_tokens.stride(0), stride_pb, stride_pj,
               out_tokens.stride(0))
    return has_probs, probs, strides, offset_words(offset)


def _chain_verify_block(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p, seed,
                        offset, block_v, out_tokens, num_accepted):
    batch, k1, vocab = target_logits.shape
    device = target_logits.device
    block_v, n_tiles, block_t, num_warps = vocab_tiling("chain_verify", vocab, block_v)
    rows = batch * k1
    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(rows, n_tiles, device)
    row_max = torch.empty((rows,), dtype=torch.float32, device=device)
    row_z = torch.empty((rows,), dtype=torch.float32, device=device)
    row_cut = torch.empty((rows,), dtype=torch.int32, device=device)
    row_point = torch.empty((rows,), dtype=torch.int64, device=device)
    weight = torch.empty((rows,), dtype=torch.float64, device=device)
    need = torch.empty((rows,), dtype=torch.int32, device=device)
    decided = torch.empty((batch,), dtype=torch.int64, device=device)
    emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    mass_r = torch.empty((rows, n_tiles), dtype=torch.float64, device=device)
    mass_p = torch.empty((rows, n_tiles), dtype=torch.float64, device=device)
    has_probs, probs, strides, (offset_lo, offset_hi) = _launch_args(target_logits, draft_tokens, draft_probs,
                                                                     out_tokens, offset)
    stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob = strides
    _tile_stats_kernel[(rows, n_tiles)](
        target_logits, num_draft, temperature, tile_max, tile_sum, tile_raw, tile_arg,
        stride_lb, stride_lj, vocab, k1, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _block_chain_kernel[(batch,)](
        target_logits, draft_tokens, probs, num_draft, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_raw, tile_arg, out_tokens, num_accepted, row_max, row_z, row_cut, row_point,
        weight, need, decided, emitted, stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
        vocab, k1, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
    _block_residual_kernel[(rows, n_tiles)](
        target_logits, draft_tokens, probs, num_draft, temperature, row_max, row_z, row_cut, row_point, weight,
        need, emitted, mass_r, mass_p, stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
        vocab, k1, n_tiles, HAS_PROBS=has_probs, BLOCK_V=block_v, num_warps=num_warps)
    _block_sample_kernel[(batch,)](
        target_logits, draft_tokens, probs, num_draft, temperature, seed, row_max, row_z, row_cut, row_point,
        weight, need, decided, emitted, mass_r, mass_p, out_tokens, num_accepted,
        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, stride_ob,
        vocab, k1, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
    return out_tokens, num_accepted


def chain_verify_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, seed: torch.Tensor, offset: int, validate: bool = True,
                        scheme: str = "token", block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::chain_verify` on the op's normalized arguments (see
    `specops.ops.chain_verify`): tensors on one device. Values are not checked here (that would be a
    host sync inside the op); `specops.ops.chain_verify` checks them when `validate` is true.
    `block_v` overrides the vocabulary tile (a power of two), for tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous, and the
    # kernels index rows and vocabulary densely. A no-op for contiguous inputs.
    target_logits, draft_tokens, num_draft, temperature, top_k, top_p, seed = (
        t.contiguous() for t in (target_logits, draft_tokens, num_draft, temperature, top_k, top_p, seed))
    draft_probs = None if draft_probs is None else draft_probs.contiguous()
    batch, k1, vocab = target_logits.shape
    device = target_logits.device
    out_tokens = torch.empty((batch, k1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return out_tokens, num_accepted
    if scheme not in ("token", "block"):  # the op's own check, for callers that reach the kernel directly
        raise ValueError(f"chain_verify: scheme must be 'token' or 'block', got {scheme!r}")
    if scheme == "block":
        return _chain_verify_block(target_logits, draft_tokens, draft_probs, num_draft, temperature, top_k, top_p,
                                   seed, offset, block_v, out_tokens, num_accepted)
    block_v, n_tiles, block_t, num_warps = vocab_tiling("chain_verify", vocab, block_v)

    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(batch * k1, n_tiles, device)
    row_max = torch.empty((batch,), dtype=torch.float32, device=device)
    row_z = torch.empty((batch,), dtype=torch.float32, device=device)
    row_cut = torch.empty((batch,), dtype=torch.int32, device=device)
    row_emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    mass_r = torch.empty((batch, n_tiles), dtype=torch.float64, device=device)
    mass_p = torch.empty((batch, n_tiles), dtype=torch.float64, device=device)
    has_probs, probs, strides, (offset_lo, offset_hi) = _launch_args(target_logits, draft_tokens, draft_probs,
                                                                     out_tokens, offset)
    stride_lb, stride_lj, stride_db, stride_pb, stride_pj, _ = strides

    _tile_stats_kernel[(batch * k1, n_tiles)](
        target_logits, num_draft, temperature, tile_max, tile_sum, tile_raw, tile_arg,
        stride_lb, stride_lj, vocab, k1, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _chain_kernel[(batch,)](
        target_logits, draft_tokens, probs, num_draft, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_raw, tile_arg, out_tokens, num_accepted, row_max, row_z, row_cut, row_emitted,
        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, out_tokens.stride(0),
        vocab, k1, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps, maxnreg=register_cap(num_warps))
    _residual_partials_kernel[(batch, n_tiles)](
        target_logits, draft_tokens, probs, num_draft, temperature, num_accepted, row_max, row_z, row_cut,
        row_emitted, mass_r, mass_p,
        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, vocab, n_tiles,
        HAS_PROBS=has_probs, BLOCK_V=block_v, num_warps=num_warps)
    _sample_kernel[(batch,)](
        target_logits, draft_tokens, probs, num_draft, temperature, seed, num_accepted, row_max, row_z, row_cut,
        row_emitted, mass_r, mass_p, out_tokens,
        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, out_tokens.stride(0),
        vocab, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
    return out_tokens, num_accepted


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
chain_verify_cuda = guarded(check_chain_verify, chain_verify_triton)
torch.library.register_kernel("specops::chain_verify", "cuda", chain_verify_cuda)
