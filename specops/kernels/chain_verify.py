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

Every random number is Philox4x32-10 on the counter (position, stream, offset), as in
`specops.reference`, so the tokens equal the reference's for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chain_verify_triton"]

# Philox4x32 multipliers and Weyl key increments (Salmon et al., SC'11), as in specops.reference.
_PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
_PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
_PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
_PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
# Random streams, part of the counter: the acceptance draw and the sampling draw never overlap.
_STREAM_ACCEPT: tl.constexpr = tl.constexpr(0)
_STREAM_SAMPLE: tl.constexpr = tl.constexpr(1)
# The smallest int32: every ordered float key is >= it, so it is the "keep everything" threshold.
_KEEP_ALL: tl.constexpr = tl.constexpr(-(2**31))

_MAX_BLOCK_V = 8192


@triton.jit
def _uniform(key0, key1, position, stream: tl.constexpr, offset_lo, offset_hi):
    """Float64 uniform in (0, 1): ((a >> 6) * 2**26 + (b >> 6) + 0.5) * 2**-52, (a, b) the first two
    words of Philox4x32-10 (Salmon et al., SC'11) at counter (position, stream, offset lo, offset hi)."""
    c0 = tl.cast(position, tl.uint32)
    c1 = tl.full([], stream, tl.uint32)
    c2 = offset_lo.to(tl.uint32, bitcast=True)
    c3 = offset_hi.to(tl.uint32, bitcast=True)
    k0 = key0
    k1 = key1
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _PHILOX_M0)
        lo0 = c0 * _PHILOX_M0
        hi1 = tl.umulhi(c2, _PHILOX_M1)
        lo1 = c2 * _PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _PHILOX_W0
        k1 = k1 + _PHILOX_W1
    bits = ((c0 >> 6).to(tl.int64) << 26) | (c1 >> 6).to(tl.int64)
    return (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52


@triton.jit
def _ordered_key(x):
    """Order-preserving int32 image of float32 x, so thresholds can be bisected on integers."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # The reference compares floats, where -0.0 == +0.0; the raw bit images would split them.
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V: tl.constexpr):
    """x = logits / T of one vocabulary tile, -inf past the row's end."""
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    raw = tl.load(row_ptr + offs, mask=in_row, other=-float("inf"))
    # Correctly rounded division (plain `/` is approximate on GPUs): top-k/top-p thresholds compare
    # these values exactly, and must select the same tokens as the reference's torch division.
    x = tl.math.div_rn(raw.to(tl.float32), temperature)
    return offs, in_row, x


@triton.jit
def _upper_count(row_ptr, temperature, cut, V, n_tiles, BLOCK_V: tl.constexpr):
    count = tl.zeros([], tl.int64)
    for tile in range(0, n_tiles):
        offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
        count += tl.sum((in_row & (_ordered_key(x) >= cut)).to(tl.int32), 0)
    return count


@triton.jit
def _upper_mass(row_ptr, temperature, cut, row_max, V, n_tiles, BLOCK_V: tl.constexpr):
    # float64 like the reference's cumulative sums, so top-p cuts differ only on exact ties.
    mass = tl.zeros([], tl.float64)
    for tile in range(0, n_tiles):
        offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
        keep = in_row & (_ordered_key(x) >= cut)
        w = tl.where(keep, tl.exp(x - row_max), 0.0)
        mass += tl.sum(w.to(tl.float64), 0)
    return mass


@triton.jit
def _top_k_cut(row_ptr, temperature, top_k, row_max, V, n_tiles, BLOCK_V: tl.constexpr):
    """Top-k cut (Fan et al. 2018) as an ordered key: the largest t with count(x >= t) >= k, which is the
    k-th largest x, by bisection; ties at the k-th value are kept."""
    lo = tl.full([], _KEEP_ALL, tl.int64)  # count(x >= lo) = V >= k
    hi = _ordered_key(row_max).to(tl.int64)  # the answer is never above the maximum
    for _ in range(0, 32):  # the int32 key range halves each step
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            enough = _upper_count(row_ptr, temperature, mid.to(tl.int32), V, n_tiles, BLOCK_V) >= top_k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _top_p_cut(row_ptr, temperature, top_p, cut_k, row_max, V, n_tiles, BLOCK_V: tl.constexpr):
    """Top-p cut (Holtzman et al. 2020) as an ordered key: the largest t >= cut_k whose upper set
    {x >= t} holds >= top_p of the exp(x - m) mass kept by top-k, by bisection."""
    need = top_p.to(tl.float64) * _upper_mass(row_ptr, temperature, cut_k, row_max, V, n_tiles, BLOCK_V)
    lo = cut_k.to(tl.int64)
    hi = _ordered_key(row_max).to(tl.int64)
    for _ in range(0, 32):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            mass = _upper_mass(row_ptr, temperature, mid.to(tl.int32), row_max, V, n_tiles, BLOCK_V)
            enough = mass >= need
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
    return lo.to(tl.int32)


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
        temperature = tl.load(temperature_ptr + b)
        temperature = tl.where(temperature == 0.0, 1.0, temperature)
        row_ptr = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_lj
        offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
        tile_max = tl.max(x, 0)
        # An all -inf tile would give exp(-inf - -inf) = NaN; its mass is 0.
        shift = tl.where(tile_max == -float("inf"), 0.0, tile_max)
        tile_sum = tl.sum(tl.where(in_row, tl.exp(x - shift), 0.0), 0)
        # The argmax of the raw logits: where logits / T overflows, several x are +inf and the first of
        # them need not be the largest logit.
        raw = tl.load(row_ptr + offs, mask=in_row, other=-float("inf")).to(tl.float32)
        raw_max = tl.max(raw, 0)
        first = tl.min(tl.where(in_row & (raw == raw_max), offs, V), 0)
        slot = row.to(tl.int64) * n_tiles + tile
        tl.store(tile_max_ptr + slot, tile_max)
        tl.store(tile_sum_ptr + slot, tile_sum)
        tl.store(tile_raw_ptr + slot, raw_max)
        tl.store(tile_arg_ptr + slot, first)


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
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    seed = tl.load(seed_ptr + b)
    key0 = seed.to(tl.uint32)
    key1 = (seed >> 32).to(tl.uint32)
    greedy = temperature == 0.0
    sampled = temperature != 0.0
    emitted = tl.zeros([], tl.int32)
    use_k = sampled & (top_k > 0) & (top_k < V)
    use_p = sampled & (top_p < 1.0)
    scale = tl.where(greedy, 1.0, temperature)
    tiles = tl.arange(0, BLOCK_T)
    tile_ok = tiles < n_tiles
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
            if greedy | (row_max == float("inf")):
                tile_raw = tl.load(tile_raw_ptr + stats, mask=tile_ok, other=-float("inf"))
                raw_max = tl.max(tile_raw, 0)
                tile_arg = tl.load(tile_arg_ptr + stats, mask=tile_ok, other=V)
                best = tl.min(tl.where(tile_ok & (tile_raw == raw_max), tile_arg, V), 0)
                if j < n:
                    draft = tl.load(draft_tokens_ptr + b64 * stride_db + j)
                    stop = draft != best
                    if draft == best:
                        tl.store(out_row_ptr + j, draft)
                if stop:
                    tl.store(out_row_ptr + j, best)
                    emitted = emitted | 1
            else:
                tile_sum = tl.load(tile_sum_ptr + stats, mask=tile_ok, other=0.0)
                scaled = tl.where(tile_max == -float("inf"), 0.0, tile_sum * tl.exp(tile_max - row_max))
                z = tl.sum(scaled, 0)
                cut = tl.full([], _KEEP_ALL, tl.int32)
                if use_k:
                    cut = _top_k_cut(row_ptr, scale, top_k, row_max, V, n_tiles, BLOCK_V)
                if use_p:
                    cut = _top_p_cut(row_ptr, scale, top_p, cut, row_max, V, n_tiles, BLOCK_V)
                if use_k | use_p:
                    z = _upper_mass(row_ptr, scale, cut, row_max, V, n_tiles, BLOCK_V).to(tl.float32)
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
                    u = _uniform(key0, key1, j64, _STREAM_ACCEPT, offset_lo, offset_hi)
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
        u = _uniform(seed.to(tl.uint32), (seed >> 32).to(tl.uint32), j, _STREAM_SAMPLE, offset_lo, offset_hi)
        target = u * total
        running = tl.cumsum(mass, 0)
        hit_tile = tl.min(tl.where(tile_ok & (running > target), tiles, BLOCK_T), 0)
        found = hit_tile < BLOCK_T
        last_tile = tl.max(tl.where(tile_ok & (mass > 0.0), tiles, 0), 0)
        tile = tl.where(found, hit_tile, last_tile)
        prefix = tl.sum(tl.where(tiles < tile, mass, 0.0), 0)

        offs, in_row, p, residual = _stop_tile_weights(
            logits_ptr, draft_tokens_ptr, draft_probs_ptr, num_draft_ptr, temperature_ptr, num_accepted_ptr,
            row_max_ptr, row_z_ptr, row_cut_ptr, b64, tile, stride_lb, stride_lj, stride_db, stride_pb, stride_pj,
            V, HAS_PROBS, BLOCK_V)
        w = tl.where(use_r, residual, p).to(tl.float64)
        cum = prefix + tl.cumsum(w, 0)
        hit = tl.min(tl.where(in_row & (cum > target), offs, V), 0)
        # The tile sums and the in-tile running sum round differently; never emit a zero-weight token.
        last = tl.max(tl.where(in_row & (w > 0.0), offs, -1), 0)
        token = tl.where(found & (hit < V), hit, last)
        tl.store(out_ptr + b64 * stride_ob + j, token)


def vocab_tiling(op: str, vocab: int, block_v: int | None) -> tuple[int, int, int, int]:
    """(tile width, tiles per row, tile count rounded up to a power of two, warps) for rows of `vocab`
    values; block_v overrides the tile width (a power of two; tests use small tiles)."""
    if block_v is None:
        block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    elif block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"{op}: block_v must be a power of two, got {block_v}")
    n_tiles = triton.cdiv(vocab, block_v)
    # Enough threads that a tile's values, float64 running sums included, stay in registers.
    num_warps = 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4
    return block_v, n_tiles, max(2, triton.next_power_of_2(n_tiles)), num_warps


def chain_verify_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, seed: torch.Tensor, offset: int, validate: bool = True,
                        block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    block_v, n_tiles, block_t, num_warps = vocab_tiling("chain_verify", vocab, block_v)

    tile_max = torch.empty((batch * k1, n_tiles), dtype=torch.float32, device=device)
    tile_sum = torch.empty((batch * k1, n_tiles), dtype=torch.float32, device=device)
    tile_raw = torch.empty((batch * k1, n_tiles), dtype=torch.float32, device=device)
    tile_arg = torch.empty((batch * k1, n_tiles), dtype=torch.int32, device=device)
    row_max = torch.empty((batch,), dtype=torch.float32, device=device)
    row_z = torch.empty((batch,), dtype=torch.float32, device=device)
    row_cut = torch.empty((batch,), dtype=torch.int32, device=device)
    row_emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    mass_r = torch.empty((batch, n_tiles), dtype=torch.float64, device=device)
    mass_p = torch.empty((batch, n_tiles), dtype=torch.float64, device=device)

    has_probs = draft_probs is not None
    # Never read without HAS_PROBS; any tensor stands in for the pointer.
    probs = draft_probs if has_probs else target_logits
    stride_pb, stride_pj = (draft_probs.stride(0), draft_probs.stride(1)) if has_probs else (0, 0)
    stride_lb, stride_lj = target_logits.stride(0), target_logits.stride(1)
    stride_db = draft_tokens.stride(0)
    # The offset's two 32-bit words as int32 bit patterns: one kernel signature for every offset.
    offset = int(offset) & 0xFFFFFFFFFFFFFFFF
    offset_lo = ((offset & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    offset_hi = ((offset >> 32) ^ 0x80000000) - 0x80000000

    _tile_stats_kernel[(batch * k1, n_tiles)](
        target_logits, num_draft, temperature, tile_max, tile_sum, tile_raw, tile_arg,
        stride_lb, stride_lj, vocab, k1, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _chain_kernel[(batch,)](
        target_logits, draft_tokens, probs, num_draft, temperature, top_k, top_p, seed,
        tile_max, tile_sum, tile_raw, tile_arg, out_tokens, num_accepted, row_max, row_z, row_cut, row_emitted,
        stride_lb, stride_lj, stride_db, stride_pb, stride_pj, out_tokens.stride(0),
        vocab, k1, n_tiles, offset_lo, offset_hi,
        HAS_PROBS=has_probs, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
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


torch.library.register_kernel("specops::chain_verify", "cuda", chain_verify_triton)
