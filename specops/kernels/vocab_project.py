"""Triton kernels for `specops::vocab_project`: a heterogeneous drafter's distribution over the
vocabulary it shares with the target, renormalized and in target ids, and a draft sampled from it
(TLI, paper 000 Alg 4).

Four launches after a zero-filled output, none of which holds a whole vocabulary row in one program:

1. `_mask_stats_kernel`, grid (N, n_tiles): x = logits / T with unmapped drafter ids set to -inf
   (T = 1 for greedy rows), stored to a float32 scratch row; per tile the maximum of x and
   sum(exp(x - that maximum)), and the masked logits' maximum with its first index (the greedy argmax).
2. `_row_kernel`, grid (N,): the row's maximum and softmax normalizer from the tile statistics; top-k
   and top-p cuts by bisection over the scratch row (`_sampling.py`, shared with chain_verify); greedy
   rows (T = 0, or logits / T overflowing float32) take the first argmax.
3. `_scatter_kernel`, grid (N, n_tiles): w = exp(x - m) / Z on the kept ids (one-hot for greedy rows),
   stored at their target ids, and each tile's float64 mass.
4. `_sample_kernel`, grid (N,): the draft by inverse CDF in drafter-id order, first over the tile
   masses, then inside the chosen tile, at u = uniform(seed, offset, 0, STREAM_DRAFT).

The random number is Philox4x32-10 on the counter (position 0, stream 2, offset), as in
`specops.reference`, so the drafts equal the reference's for the same seeds up to float ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.kernels._sampling import (_EMPTY, _GREEDY, _SAMPLED, _STREAM_DRAFT, _inverse_cdf_index,
                                       _inverse_cdf_tile, _ordered_key, _row_state, _store_tile_stats, _uniform,
                                       offset_words, register_cap, row_state_buffers, tile_stat_buffers, vocab_tiling)
from specops.ops._checks import guarded
from specops.ops.sampling import check_vocab_project

__all__ = ["vocab_project_triton"]


@triton.jit
def _mask_stats_kernel(logits_ptr, target_ids_ptr, temperature_ptr, x_ptr, tile_max_ptr, tile_sum_ptr,
                       tile_raw_ptr, tile_arg_ptr, stride_ln, V, target_vocab, n_tiles,
                       BLOCK_V: tl.constexpr):
    """Per tile of row n: x = masked logits / T, m_t = max x, s_t = sum exp(x - m_t) (online softmax,
    Milakov & Gimelshein 2018), and the masked logits' maximum with its first index."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    ids = tl.load(target_ids_ptr + offs, mask=in_row, other=-1)
    # Ids outside [0, target_vocab) (only without validation) count as unmapped: never read or written.
    mapped = (ids >= 0) & (ids < target_vocab)
    raw = tl.load(logits_ptr + row * stride_ln + offs, mask=mapped, other=-float("inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    # Correctly rounded division, as torch's: top-k/top-p compare these values exactly.
    x = tl.math.div_rn(raw, temperature)
    tl.store(x_ptr + row * V + offs, x, mask=in_row)
    slot = row * n_tiles + tile
    _store_tile_stats(tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, slot, offs, mapped, x, raw, V)


@triton.jit
def _row_kernel(x_ptr, temperature_ptr, top_k_ptr, top_p_ptr, tile_max_ptr, tile_sum_ptr, tile_raw_ptr,
                tile_arg_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_state_ptr, draft_tokens_ptr,
                V, n_tiles, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row n's maximum, normalizer, top-k / top-p cut and state (`_row_state`); greedy rows store their
    draft."""
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, BLOCK_T)
    one = tl.full([], 1.0, tl.float32)  # x is already scaled
    row_max, z, cut, state, best = _row_state(
        x_ptr + row * V, one, tl.load(temperature_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row),
        tile_max_ptr, tile_sum_ptr, tile_raw_ptr, tile_arg_ptr, row * n_tiles + tiles, tiles < n_tiles, V, n_tiles,
        BLOCK_V)
    tl.store(row_max_ptr + row, row_max)
    tl.store(row_z_ptr + row, z)
    tl.store(row_cut_ptr + row, cut)
    tl.store(row_state_ptr + row, state)
    tl.store(draft_tokens_ptr + row, tl.where(state == _GREEDY, best, -1).to(tl.int64))


@triton.jit
def _tile_probs(x_ptr, target_ids_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, draft_tokens_ptr, row, state,
                tile, V, target_vocab, BLOCK_V: tl.constexpr):
    """w of one tile of row n in drafter ids, float32 like the reference's softmax: exp(x - m) / Z on
    the kept ids, 0 elsewhere; one-hot on the draft for greedy rows. Also the tile's target ids."""
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = offs < V
    ids = tl.load(target_ids_ptr + offs, mask=in_row, other=-1)
    mapped = (ids >= 0) & (ids < target_vocab)
    x = tl.load(x_ptr + row * V + offs, mask=in_row, other=-float("inf"))
    keep = mapped & (_ordered_key(x) >= tl.load(row_cut_ptr + row))
    sampled = tl.where(keep, tl.math.div_rn(tl.exp(x - tl.load(row_max_ptr + row)), tl.load(row_z_ptr + row)),
                       0.0)
    one_hot = tl.where(offs == tl.load(draft_tokens_ptr + row), 1.0, 0.0)
    w = tl.where(state == _GREEDY, one_hot, sampled)
    return offs, in_row, ids, mapped, w


@triton.jit
def _scatter_kernel(x_ptr, target_ids_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_state_ptr,
                    draft_tokens_ptr, probs_ptr, mass_ptr, stride_pn, V, target_vocab, n_tiles,
                    BLOCK_V: tl.constexpr):
    """probs[n, target_ids[v]] = w[v] for the tile's drafter ids v with w > 0 (the rest is already 0),
    and the tile's float64 mass for the inverse CDF."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    state = tl.load(row_state_ptr + row)
    if state != _EMPTY:
        _, _, ids, mapped, w = _tile_probs(x_ptr, target_ids_ptr, row_max_ptr, row_z_ptr, row_cut_ptr,
                                           draft_tokens_ptr, row, state, tile, V, target_vocab, BLOCK_V)
        tl.store(probs_ptr + row * stride_pn + ids, w, mask=mapped & (w > 0.0))
        tl.store(mass_ptr + row * n_tiles + tile, tl.sum(w.to(tl.float64), 0))


@triton.jit(do_not_specialize=["offset_lo", "offset_hi"])
def _sample_kernel(x_ptr, target_ids_ptr, seed_ptr, row_max_ptr, row_z_ptr, row_cut_ptr, row_state_ptr,
                   mass_ptr, draft_tokens_ptr, tokens_ptr, V, target_vocab, n_tiles, offset_lo, offset_hi,
                   BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """The draft: the first drafter id whose float64 running sum of w exceeds u * sum(w), the last id
    with w > 0 if round-off leaves none; then its target id."""
    row = tl.program_id(0).to(tl.int64)
    state = tl.load(row_state_ptr + row)
    draft = tl.load(draft_tokens_ptr + row)
    if state == _SAMPLED:
        tiles = tl.arange(0, BLOCK_T)
        tile_ok = tiles < n_tiles
        mass = tl.load(mass_ptr + row * n_tiles + tiles, mask=tile_ok, other=0.0)
        u = _uniform(tl.load(seed_ptr + row), tl.zeros([], tl.int64), _STREAM_DRAFT, offset_lo, offset_hi)
        target = u * tl.sum(mass, 0)
        tile, prefix, found = _inverse_cdf_tile(mass, tiles, tile_ok, target, BLOCK_T)
        offs, in_row, _, _, w = _tile_probs(x_ptr, target_ids_ptr, row_max_ptr, row_z_ptr, row_cut_ptr,
                                            draft_tokens_ptr, row, state, tile, V, target_vocab, BLOCK_V)
        draft = _inverse_cdf_index(w.to(tl.float64), offs, in_row, prefix, target, found, V).to(tl.int64)
    # Unchecked NaN logits can leave no valid id: -1 then, and never an out-of-bounds read.
    valid = (draft >= 0) & (draft < V)
    token = tl.load(target_ids_ptr + draft, mask=valid, other=-1)
    tl.store(draft_tokens_ptr + row, tl.where(valid, draft, -1))
    tl.store(tokens_ptr + row, tl.where(valid, token, -1))


def vocab_project_triton(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_vocab: int,
                         temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         seed: torch.Tensor, offset: int, validate: bool = True,
                         block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of `specops::vocab_project` on the op's normalized arguments (see
    `specops.ops.vocab_project`): tensors on one device. Values are not checked here (that would be a
    host sync inside the op); `specops.ops.vocab_project` checks them when `validate` is true. Without
    that check, ids outside [0, target_vocab) count as unmapped and a row with no finite mapped logit
    gives a zero probs row and tokens -1. `block_v` overrides the vocabulary tile (a power of two), for
    tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous.
    draft_logits, target_ids, temperature, top_k, top_p, seed = (
        t.contiguous() for t in (draft_logits, target_ids, temperature, top_k, top_p, seed))
    rows, vocab = draft_logits.shape
    device = draft_logits.device
    probs = torch.zeros((rows, target_vocab), dtype=torch.float32, device=device)
    tokens = torch.empty((rows,), dtype=torch.int64, device=device)
    draft_tokens = torch.empty((rows,), dtype=torch.int64, device=device)
    if rows == 0:
        return probs, tokens, draft_tokens
    block_v, n_tiles, block_t, num_warps = vocab_tiling("vocab_project", vocab, block_v)

    x = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    tile_max, tile_sum, tile_raw, tile_arg = tile_stat_buffers(rows, n_tiles, device)
    row_max, row_z, row_cut, row_state = row_state_buffers(rows, device)
    mass = torch.empty((rows, n_tiles), dtype=torch.float64, device=device)
    offset_lo, offset_hi = offset_words(offset)

    _mask_stats_kernel[(rows, n_tiles)](
        draft_logits, target_ids, temperature, x, tile_max, tile_sum, tile_raw, tile_arg,
        draft_logits.stride(0), vocab, target_vocab, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _row_kernel[(rows,)](
        x, temperature, top_k, top_p, tile_max, tile_sum, tile_raw, tile_arg, row_max, row_z, row_cut,
        row_state, draft_tokens, vocab, n_tiles, BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps,
        maxnreg=register_cap(num_warps))
    _scatter_kernel[(rows, n_tiles)](
        x, target_ids, row_max, row_z, row_cut, row_state, draft_tokens, probs, mass,
        probs.stride(0), vocab, target_vocab, n_tiles, BLOCK_V=block_v, num_warps=num_warps)
    _sample_kernel[(rows,)](
        x, target_ids, seed, row_max, row_z, row_cut, row_state, mass, draft_tokens, tokens,
        vocab, target_vocab, n_tiles, offset_lo, offset_hi,
        BLOCK_V=block_v, BLOCK_T=block_t, num_warps=num_warps)
    return probs, tokens, draft_tokens


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
vocab_project_cuda = guarded(check_vocab_project, vocab_project_triton)
torch.library.register_kernel("specops::vocab_project", "cuda", vocab_project_cuda)
