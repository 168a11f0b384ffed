"""Triton kernels for `specops::sample_without_replacement`: num_samples distinct tokens per row, in draw
order, from q = softmax of the filtered logits (the siblings of an RSD-C draft tree, paper 003), and q.

Four launches (`sample_rows`, shared with stochastic_beam_step.py), none of which holds a whole vocabulary
row in one program. A row whose state enters as _EMPTY (a dead beam of stochastic_beam_step) is not read by
any of them: its probs row is 0 and its draws -1.

1. `_tile_stats_kernel`, grid (N, n_tiles): per tile the maximum of x = logits / T (T = 1 for greedy
   rows) and sum(exp(x - that maximum)), and the raw logits' maximum with its first index.
2. `_row_kernel`, grid (N,): the row's maximum m and normalizer Z from the tile statistics; top-k and
   top-p cuts by bisection over the row (`_sampling.py`); greedy rows (T = 0, or logits / T overflowing
   float32) and rows without a finite logit are marked as such.
3. `_probs_kernel`, grid (N, n_tiles): q = exp(x - m) / Z on the kept ids (one-hot on the first argmax
   for greedy rows) into probs and, for sampled rows, into a float32 weights scratch row, with the
   tile's float64 mass.
4. `_draw_kernel`, grid (N,): the draws in order. Draw i is the inverse CDF of the weights left,
   first over the tile masses, then inside the chosen tile, at target u_i * sum(masses),
   u_i = uniform(seed, offset, i, STREAM_WITHOUT_REPLACEMENT); the drawn weight is then zeroed and its
   tile's mass re-summed. Draws once no mass is left are -1. The mass left before each draw, sum(masses),
   is kept for stochastic_beam_step's scores. Greedy rows take, num_samples times, the largest
   (logit, -index) below the previous pick, tile by tile, stopping at -inf.

The random numbers are Philox4x32-10 as in `specops.reference`, so the tokens equal the reference's
for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.kernels._sampling import (_EMPTY, _GREEDY, _SAMPLED, _STREAM_WITHOUT_REPLACEMENT, _inverse_cdf_index,
                                       _inverse_cdf_tile, _ordered_key, _row_state, _row_tile_stats, _scaled_tile,
                                       _uniform, offset_words, register_cap, row_state_buffers, tile_stat_buffers,
                                       vocab_tiling)
from specops.ops._checks import guarded
from specops.ops.sampling import check_sample_without_replacement

__all__ = ["sample_without_replacement_triton"]

_SMALLEST_NORMAL_LOG: tl.constexpr = tl.constexpr(-87.33654475)  # log(2**-126)


@triton.jit
def _tile_stats_kernel(logits_ptr, temperature_ptr, row_state_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                       tile_arg_ptr, stride_ln, V, n_tiles, BLOCK_V: tl.constexpr):
    """Per tile of row n: m_t = max x, s_t = sum exp(x - m_t), x = logits / T (online softmax, Milakov &
    Gimelshein 2018), and the raw logits' maximum with its first index."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    if tl.load(row_state_ptr + row) != _EMPTY:
        _row_tile_stats(logits_ptr + row * stride_ln, tl.load(temperature_ptr + row), tile, row * n_tiles + tile,
                        tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, V, BLOCK_V)


@triton.jit
def _row_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                tile_arg_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_state_ptr, row_best_ptr,
                stride_ln, V, n_tiles, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row n's maximum, normalizer, top-k / top-p cut, state and first argmax (`_row_state`); a row that
    enters _EMPTY stays so, with nothing else written."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(row_state_ptr + row) != _EMPTY:
        tiles = tl.arange(0, BLOCK_T)
        temperature = tl.load(temperature_ptr + row)
        row_max, z, cut, state, best = _row_state(
            logits_ptr + row * stride_ln, temperature, temperature, tl.load(top_k_ptr + row),
            tl.load(top_p_ptr + row), tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, row * n_tiles + tiles,
            tiles < n_tiles, V, n_tiles, BLOCK_V)
        tl.store(row_max_ptr + row, row_max)
        tl.store(row_z_ptr + row, z)
        tl.store(row_cut_ptr + row, cut)
        tl.store(row_state_ptr + row, state)
        tl.store(row_best_ptr + row, best)


@triton.jit
def _probs_kernel(logits_ptr, temperature_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_state_ptr, row_best_ptr,
                  probs_ptr, weights_ptr, mass_ptr, stride_ln, V, n_tiles, BLOCK_V: tl.constexpr):
    """q of one tile, float32 like the reference's softmax: exp(x - m) / Z on the kept ids, 0 elsewhere;
    one-hot on the first argmax for greedy rows, 0 for empty rows (no finite logit, or not to be read).
    Sampled rows also get their weights scratch and the tile's float64 mass."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    state = tl.load(row_state_ptr + row)
    if state == _EMPTY:
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        tl.store(probs_ptr + row * V + offs, tl.zeros([BLOCK_V], tl.float32), mask=offs < V)
    else:
        temperature = tl.load(temperature_ptr + row)
        # Greedy rows never use x; T = 0 would only make NaNs there.
        scale = tl.where(state == _SAMPLED, temperature, 1.0)
        offs, in_row, x = _scaled_tile(logits_ptr + row * stride_ln, tile, scale, V, BLOCK_V)
        keep = in_row & (_ordered_key(x) >= tl.load(row_cut_ptr + row))
        shifted = x - tl.load(row_max_ptr + row)
        # Weights below float32's smallest normal are 0, as the CPU kernel's exp gives them (the spec's rule).
        keep = keep & (shifted >= _SMALLEST_NORMAL_LOG)
        sampled = tl.where(keep, tl.math.div_rn(tl.exp(shifted), tl.load(row_z_ptr + row)), 0.0)
        one_hot = tl.where(offs == tl.load(row_best_ptr + row), 1.0, 0.0)
        q = tl.where(state == _SAMPLED, sampled, one_hot)
        tl.store(probs_ptr + row * V + offs, q, mask=in_row)
        if state == _SAMPLED:
            tl.store(weights_ptr + row * V + offs, q, mask=in_row)
            tl.store(mass_ptr + row * n_tiles + tile, tl.sum(q.to(tl.float64), 0))


@triton.jit
def _greedy_pick(row_ptr, prev_value, prev_index, V, n_tiles, BLOCK_V: tl.constexpr):
    """The largest (logit, -index) strictly below (prev_value, -prev_index) among the logits above
    -inf, as (value, index); (-inf, V) when none is left."""
    best_value = tl.full([], -float("inf"), tl.float32)
    best_index = tl.zeros([], tl.int32) + V
    for tile in range(0, n_tiles):
        offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        raw = tl.load(row_ptr + offs, mask=in_row, other=-float("inf")).to(tl.float32)
        below = (raw < prev_value) | ((raw == prev_value) & (offs > prev_index))
        # -inf logits are never taken; NaNs (unchecked without validation) fail every comparison.
        candidate = in_row & below & (raw > -float("inf"))
        tile_value = tl.max(tl.where(candidate, raw, -float("inf")), 0)
        tile_index = tl.min(tl.where(candidate & (raw == tile_value), offs, V), 0)
        # Tiles come in index order, so an equal value in a later tile never wins.
        better = tile_value > best_value
        best_value = tl.where(better, tile_value, best_value)
        best_index = tl.where(better, tile_index, best_index)
    return best_value, best_index


@triton.jit(do_not_specialize=["num_samples", "offset_lo", "offset_hi"])
def _draw_kernel(logits_ptr, seed_ptr, row_state_ptr, weights_ptr, mass_ptr, tokens_ptr, left_ptr, stride_ln, V,
                 n_tiles, num_samples, offset_lo, offset_hi, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row n's draws in order: sequential sampling without replacement, each draw the first index whose
    float64 running sum of the weights left exceeds u_i * sum(weights left), the last index with weight
    if round-off leaves none; greedy rows: the num_samples largest logits, ties to the lower index.
    Sampled rows also record sum(weights left) before each draw in `left`."""
    row = tl.program_id(0).to(tl.int64)
    state = tl.load(row_state_ptr + row)
    tokens_row_ptr = tokens_ptr + row * num_samples
    if state == _SAMPLED:
        seed = tl.load(seed_ptr + row)
        weights_row_ptr = weights_ptr + row * V
        tiles = tl.arange(0, BLOCK_T)
        tile_ok = tiles < n_tiles
        mass = tl.load(mass_ptr + row * n_tiles + tiles, mask=tile_ok, other=0.0)
        for i in range(0, num_samples):
            i64 = tl.cast(i, tl.int64)  # the interpreter's loop index is a Python int
            total = tl.sum(mass, 0)
            # Re-summed, so relative to what is left: m_total - sum(q drawn) would cancel once the first
            # draws hold nearly all the mass.
            tl.store(left_ptr + row * num_samples + i64, total)
            token = tl.full([], -1, tl.int64)
            # Masses are re-summed from the weights, so a tile whose weights are all zero has mass
            # exactly 0: no mass left means q's support is drawn (the reference stops there), and a
            # tile chosen below always holds a positive weight. NaN q (unchecked NaN logits) stops too.
            if total > 0.0:
                target = _uniform(seed, i64, _STREAM_WITHOUT_REPLACEMENT, offset_lo, offset_hi) * total
                tile, prefix, found = _inverse_cdf_tile(mass, tiles, tile_ok, target, BLOCK_T)
                offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
                in_row = offs < V
                w = tl.load(weights_row_ptr + offs, mask=in_row, other=0.0).to(tl.float64)
                token = _inverse_cdf_index(w, offs, in_row, prefix, target, found, V).to(tl.int64)
                valid = (token >= 0) & (token < V)
                # Re-summed rather than decremented: a subtraction can leave round-off mass in a tile
                # with no weight left.
                tile_mass = tl.sum(tl.where(offs == token, 0.0, w), 0)
                mass = tl.where(valid & (tiles == tile), tile_mass, mass)
                tl.store(weights_row_ptr + token, 0.0, mask=valid)
                # The next draw's tile load may read this weight in other threads of the program.
                tl.debug_barrier()
                token = tl.where(valid, token, -1)
            tl.store(tokens_row_ptr + i64, token)
    elif state == _GREEDY:
        row_ptr = logits_ptr + row * stride_ln
        # (+inf, -1): everything, an unchecked +inf logit included, is below it.
        value = tl.full([], float("inf"), tl.float32)
        index = tl.full([], -1, tl.int32)
        for i in range(0, num_samples):
            value, index = _greedy_pick(row_ptr, value, index, V, n_tiles, BLOCK_V)
            # Once none is left the pick stays (-inf, V), and so do the later ones.
            tl.store(tokens_row_ptr + i, tl.where(index < V, index, -1).to(tl.int64))
    else:
        for i in range(0, num_samples):
            tl.store(tokens_row_ptr + i, tl.full([], -1, tl.int64))


def sample_rows(logits: torch.Tensor, num_samples: int, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, seed: torch.Tensor, offset: int, tiling: tuple[int, int, int, int],
                live: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The four launches on contiguous rows: logits [N, V], temperature, top_k, top_p, seed [N], `tiling` from
    `vocab_tiling`. Rows where `live` [N] bool is false are not read (probs 0, draws -1). Returns tokens
    [N, num_samples] int64, probs [N, V] float32, the row states [N] int32 (_SAMPLED, _GREEDY, _EMPTY) and,
    for sampled rows, the float64 mass of q left before each draw [N, num_samples] (unset elsewhere)."""
    rows, vocab = logits.shape
    device = logits.device
    tokens = torch.empty((rows, num_samples), dtype=torch.int64, device=device)
    probs = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    left = torch.empty((rows, num_samples), dtype=torch.float64, device=device)
    row_max, row_z, row_cut, row_state = row_state_buffers(rows, device)
    if rows == 0:
        return tokens, probs, row_state, left
    block_v, n_tiles, block_t, num_warps = tiling

    # In: _EMPTY marks the rows not to read; out: every row's state, set by _row_kernel.
    if live is None:
        row_state.fill_(_SAMPLED.value)
    else:
        row_state.copy_(torch.where(live, _SAMPLED.value, _EMPTY.value))
    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(rows, n_tiles, device)
    row_best = torch.empty((rows,), dtype=torch.int32, device=device)
    weights = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    mass = torch.empty((rows, n_tiles), dtype=torch.float64, device=device)
    stride_ln = logits.stride(0)
    offset_lo, offset_hi = offset_words(offset)

    _tile_stats_kernel[(rows, n_tiles)](
        logits, temperature, row_state, tile_max, tile_sum, tile_raw, tile_arg, stride_ln, vocab, n_tiles,
        BLOCK_V=block_v, num_warps=num_warps)
    _row_kernel[(rows,)](
        logits, temperature, top_k, top_p, tile_max, tile_sum, tile_raw, tile_arg, row_max, row_z, row_cut,
        row_state, row_best, stride_ln, vocab, n_tiles, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps,
        maxnreg=register_cap(num_warps))
    _probs_kernel[(rows, n_tiles)](
        logits, temperature, row_max, row_z, row_cut, row_state, row_best, probs, weights, mass,
        stride_ln, vocab, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _draw_kernel[(rows,)](
        logits, seed, row_state, weights, mass, tokens, left, stride_ln, vocab, n_tiles, num_samples,
        offset_lo, offset_hi, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
    return tokens, probs, row_state, left


def sample_without_replacement_triton(logits: torch.Tensor, num_samples: int, temperature: torch.Tensor,
                                      top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, offset: int,
                                      validate: bool = True,
                                      block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::sample_without_replacement` on the op's normalized arguments
    (see `specops.ops.sample_without_replacement`): tensors on one device. Values are not checked here
    (that would be a host sync inside the op); the op's contract checks them when `validate` is true. Without
    that check a row with no finite logit gives a zero probs row and tokens -1. `block_v` overrides the
    vocabulary tile (a power of two), for tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous.
    logits, temperature, top_k, top_p, seed = (t.contiguous() for t in (logits, temperature, top_k, top_p, seed))
    tiling = vocab_tiling("sample_without_replacement", logits.shape[1], block_v)
    tokens, probs, _, _ = sample_rows(logits, num_samples, temperature, top_k, top_p, seed, offset, tiling)
    return tokens, probs


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
sample_without_replacement_cuda = guarded(check_sample_without_replacement, sample_without_replacement_triton)
torch.library.register_kernel("specops::sample_without_replacement", "cuda", sample_without_replacement_cuda)
