"""Triton helpers shared by the sampling kernels (`chain_verify.py`, `vocab_project.py`); the Triton side
of csrc/cpu/sampling.h.

The Philox generator of `specops.reference` and its random streams, order-preserving integer keys of
floats, top-k / top-p cuts by bisection over vocabulary tiles, the tiled online softmax (per-tile
statistics, then a row's maximum, normalizer and first argmax), the two-level inverse CDF, and what the
launchers share: the vocabulary tiling and the offset's two 32-bit words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Philox4x32 multipliers and Weyl key increments (Salmon et al., SC'11), as in specops.reference.
_PHILOX_M0: tl.constexpr = tl.constexpr(0xD2511F53)
_PHILOX_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
_PHILOX_W0: tl.constexpr = tl.constexpr(0x9E3779B9)
_PHILOX_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
# Random streams, part of the counter, so draws at one offset never overlap: chain_verify's (and
# tree_verify's) acceptance test and emitted token, vocab_project's draft, sample_without_replacement's
# draws, stochastic_beam_step's Gumbels.
_STREAM_ACCEPT: tl.constexpr = tl.constexpr(0)
_STREAM_SAMPLE: tl.constexpr = tl.constexpr(1)
_STREAM_DRAFT: tl.constexpr = tl.constexpr(2)
_STREAM_WITHOUT_REPLACEMENT: tl.constexpr = tl.constexpr(3)
_STREAM_BEAM: tl.constexpr = tl.constexpr(4)
# The smallest int32: every ordered float key is >= it, so it is the "keep everything" threshold.
_KEEP_ALL: tl.constexpr = tl.constexpr(-(2**31))

_MAX_BLOCK_V = 8192


@triton.jit
def _uniform(seed, position, stream: tl.constexpr, offset_lo, offset_hi):
    """Float64 uniform in (0, 1): ((a >> 6) * 2**26 + (b >> 6) + 0.5) * 2**-52, (a, b) the first two
    words of Philox4x32-10 (Salmon et al., SC'11) keyed by the int64 seed, at counter (position,
    stream, offset lo, offset hi)."""
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = tl.cast(position, tl.uint32)
    c1 = tl.full([], stream, tl.uint32)
    c2 = offset_lo.to(tl.uint32, bitcast=True)
    c3 = offset_hi.to(tl.uint32, bitcast=True)
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
def _request_sampling(temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, b, n_tiles, BLOCK_T: tl.constexpr):
    """Request b's sampling parameters as the verification walks use them (chain_verify's token and block
    schemes, tree_verify): (temperature, top_k, top_p, seed, greedy, scale, tiles, tile_ok). Greedy is
    T = 0, where logits are compared unscaled (scale 1); tiles are the tile-statistics slots of a row,
    tile_ok the ones a row of n_tiles uses."""
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature == 0.0
    tiles = tl.arange(0, BLOCK_T)
    return (temperature, tl.load(top_k_ptr + b), tl.load(top_p_ptr + b), tl.load(seed_ptr + b), greedy,
            tl.where(greedy, 1.0, temperature), tiles, tiles < n_tiles)


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
def _filter_cut(row_ptr, temperature, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V: tl.constexpr):
    """The keep-cut of a sampled row (x = logits / T is kept iff its ordered key is >= the cut) after
    top-k, then top-p, and the normalizer z over the kept x (unchanged without filtering)."""
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    cut = tl.full([], _KEEP_ALL, tl.int32)
    if use_k:
        cut = _top_k_cut(row_ptr, temperature, top_k, row_max, V, n_tiles, BLOCK_V)
    if use_p:
        cut = _top_p_cut(row_ptr, temperature, top_p, cut, row_max, V, n_tiles, BLOCK_V)
    if use_k | use_p:
        z = _upper_mass(row_ptr, temperature, cut, row_max, V, n_tiles, BLOCK_V).to(tl.float32)
    return cut, z


@triton.jit
def _store_tile_stats(tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, slot, offs, valid, x, raw, V):
    """One tile's online-softmax statistics (Milakov & Gimelshein 2018), m_t = max x and s_t = sum
    exp(x - m_t) over the valid lanes, and the raw logits' maximum with its first index: where x =
    logits / T overflows, several x are +inf and the first of them need not be the largest logit."""
    tile_max = tl.max(x, 0)
    # An all -inf tile would give exp(-inf - -inf) = NaN; its mass is 0.
    shift = tl.where(tile_max == -float("inf"), 0.0, tile_max)
    tile_sum = tl.sum(tl.where(valid, tl.exp(x - shift), 0.0), 0)
    raw_max = tl.max(raw, 0)
    first = tl.min(tl.where(valid & (raw == raw_max), offs, V), 0)
    tl.store(tile_max_ptr + slot, tile_max)
    tl.store(tile_sum_ptr + slot, tile_sum)
    tl.store(tile_raw_ptr + slot, raw_max)
    tl.store(tile_arg_ptr + slot, first)


@triton.jit
def _row_tile_stats(row_ptr, temperature, tile, slot, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, V,
                    BLOCK_V: tl.constexpr):
    """`_store_tile_stats` of one tile of a logit row at `slot`, x = logits / T (T = 0, greedy, read as 1)."""
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    offs, in_row, x = _scaled_tile(row_ptr, tile, temperature, V, BLOCK_V)
    raw = tl.load(row_ptr + offs, mask=in_row, other=-float("inf")).to(tl.float32)
    _store_tile_stats(tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, slot, offs, in_row, x, raw, V)


# What a row of a drafting op is: sampled, greedy (T = 0, or logits / T overflowing: the T -> 0 limit),
# or empty (no finite logit, reachable only without validation).
_SAMPLED: tl.constexpr = tl.constexpr(0)
_GREEDY: tl.constexpr = tl.constexpr(1)
_EMPTY: tl.constexpr = tl.constexpr(2)


@triton.jit
def _row_state(x_ptr, scale, temperature, top_k, top_p, tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr,
               stats, tile_ok, V, n_tiles, BLOCK_V: tl.constexpr):
    """From a row's tile statistics: its maximum m, normalizer Z = sum_t s_t exp(m_t - m), keep-cut
    (top-k, Fan et al. 2018; top-p, Holtzman et al. 2020; on x_ptr's values divided by `scale`, with Z
    then over the kept ids), state (_SAMPLED, _GREEDY, _EMPTY) and first argmax."""
    tile_max = tl.load(tile_max_ptr + stats, mask=tile_ok, other=-float("inf"))
    row_max = tl.max(tile_max, 0)
    raw_max, best = _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V)
    greedy = (temperature == 0.0) | (tl.abs(row_max) == float("inf"))
    # Not `raw_max == -inf`: NaN logits (unchecked without validation) must not reach the bisection.
    empty = ~(raw_max > -float("inf"))
    state = tl.where(empty, _EMPTY, tl.where(greedy, _GREEDY, _SAMPLED))
    z = _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max)
    cut = tl.full([], _KEEP_ALL, tl.int32)
    if state == _SAMPLED:
        cut, z = _filter_cut(x_ptr, scale, top_k, top_p, row_max, z, V, n_tiles, BLOCK_V)
    return row_max, z, cut, state, best


@triton.jit
def _row_normalizer(tile_sum_ptr, stats, tile_ok, tile_max, row_max):
    """A row's softmax normalizer from its tiles' statistics: Z = sum_t s_t exp(m_t - m)."""
    tile_sum = tl.load(tile_sum_ptr + stats, mask=tile_ok, other=0.0)
    return tl.sum(tl.where(tile_max == -float("inf"), 0.0, tile_sum * tl.exp(tile_max - row_max)), 0)


@triton.jit
def _row_argmax(tile_raw_ptr, tile_arg_ptr, stats, tile_ok, V):
    """A row's raw maximum and its first index, from its tiles' statistics."""
    tile_raw = tl.load(tile_raw_ptr + stats, mask=tile_ok, other=-float("inf"))
    raw_max = tl.max(tile_raw, 0)
    tile_arg = tl.load(tile_arg_ptr + stats, mask=tile_ok, other=V)
    return raw_max, tl.min(tl.where(tile_ok & (tile_raw == raw_max), tile_arg, V), 0)


@triton.jit
def _inverse_cdf_tile(mass, tiles, tile_ok, target, BLOCK_T: tl.constexpr):
    """First level of the inverse CDF: the first tile whose float64 running mass exceeds `target` (the
    last tile with mass if round-off leaves none), the mass before it, and whether one exceeded it."""
    running = tl.cumsum(mass, 0)
    hit_tile = tl.min(tl.where(tile_ok & (running > target), tiles, BLOCK_T), 0)
    found = hit_tile < BLOCK_T
    last_tile = tl.max(tl.where(tile_ok & (mass > 0.0), tiles, 0), 0)
    tile = tl.where(found, hit_tile, last_tile)
    prefix = tl.sum(tl.where(tiles < tile, mass, 0.0), 0)
    return tile, prefix, found


@triton.jit
def _inverse_cdf_index(w, offs, in_row, prefix, target, found, V):
    """Second level, inside the chosen tile of float64 weights w: the first index whose running sum
    from `prefix` exceeds `target`. The tile sums and the in-tile running sum round differently, so
    where none does, the last index with w > 0: never an index of zero weight."""
    cum = prefix + tl.cumsum(w, 0)
    hit = tl.min(tl.where(in_row & (cum > target), offs, V), 0)
    last = tl.max(tl.where(in_row & (w > 0.0), offs, -1), 0)
    return tl.where(found & (hit < V), hit, last)


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


def register_cap(num_warps: int) -> int:
    """The registers a thread may take in a block of `num_warps` warps: an SM's 65,536 shared by the block's
    threads, at most 255. Passed as `maxnreg` to the one-block-per-row kernels that ptxas otherwise holds to
    half of that, where they spill: chain_verify's `_chain_kernel` at 16 warps took 64 registers and spilled
    72 bytes for sm_90, and takes 119 and spills nothing with the cap (docs/gpu.md). The tile kernels keep
    ptxas's choice: they run many blocks to an SM, which a higher count would keep out."""
    return min(255, 65536 // (32 * num_warps))


def tile_stat_buffers(rows: int, n_tiles: int, device) -> tuple[torch.Tensor, ...]:
    """What `_store_tile_stats` writes for `rows` rows of `n_tiles` tiles: each tile's maximum, sum and raw
    maximum (float32) and the raw maximum's first index (int32)."""
    stats = [torch.empty((rows, n_tiles), dtype=torch.float32, device=device) for _ in range(3)]
    return (*stats, torch.empty((rows, n_tiles), dtype=torch.int32, device=device))


def row_state_buffers(rows: int, device) -> tuple[torch.Tensor, ...]:
    """What `_row_state` returns, per row: maximum and normalizer (float32), keep-cut and state (int32)."""
    return (torch.empty((rows,), dtype=torch.float32, device=device),
            torch.empty((rows,), dtype=torch.float32, device=device),
            torch.empty((rows,), dtype=torch.int32, device=device),
            torch.empty((rows,), dtype=torch.int32, device=device))


def offset_words(offset: int) -> tuple[int, int]:
    """The Philox offset's low and high 32-bit words as int32 bit patterns: one kernel signature for
    every offset (kernels take them with do_not_specialize, so no step recompiles)."""
    offset = int(offset) & 0xFFFFFFFFFFFFFFFF
    return ((offset & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000, ((offset >> 32) ^ 0x80000000) - 0x80000000
