"""Triton kernels for `specops::stochastic_beam_step`: one level of Stochastic Beam Search (Kool, van Hoof,
Welling 2019), RSD-S's proposal (paper 003). Each live beam draws its children without replacement, they are
scored by truncated Gumbels below the beam's own score, and the beam_width best of each request are kept.

Five launches on the B * W beam rows, then a few torch ops on the device:

1-4. `sample_rows` of sample_without_replacement.py on the [B * W, V] logits, beam w of request b with
   temperature, top-k and top-p of b and its seed from `beam_seeds`: its draws d_0, d_1, ... in order, its
   q, and the float64 mass of q left before each draw. Dead beams (phi or G = -inf) enter as empty rows,
   so none of the launches reads their logits: their probs row is 0 and they draw nothing.
5. `_scores_kernel`, grid (B * W,): each draw's score and log-probability, in float64. Sampled rows:
   s_0 = G, s_i = truncated_gumbel(phi + log m_i - log(-log u_i), s_{i-1}), m_i the mass of q left before
   draw i, u_i = uniform(beam seed, offset, i, STREAM_BEAM), and log-probability phi + log q(d_i). Greedy
   rows: both phi + log_softmax(logits)(d_i), without noise, from one pass over the row.
6. The selection, torch ops without a host sync: per request, a stable descending sort of the W * K float32
   scores (ties to the lower w * K + i), missing draws last; the first K are kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops._seeds import beam_seeds
from specops.kernels._sampling import _GREEDY, _SAMPLED, _STREAM_BEAM, _uniform, offset_words, vocab_tiling
from specops.kernels.sample_without_replacement import sample_rows
from specops.ops._checks import guarded
from specops.ops.sampling import check_stochastic_beam_step

__all__ = ["stochastic_beam_step_triton"]

# Below every finite float32, so a drawn child whose float32 score is -inf still sorts before the missing ones.
_BELOW_FLOAT32 = -(2.0**129)


@triton.jit
def _truncated_gumbel(g, bound):
    """-log(exp(-bound) + exp(-g)), a Gumbel g conditioned below `bound` (Kool et al. 2019, top-down), as
    min(bound, g) - log1p(exp(-|bound - g|)), which neither overflows nor cancels."""
    x = tl.exp(-tl.abs(bound - g))
    # log1p(x) for x in (0, 1] without libdevice (the interpreter has none): log(1 + x) corrected by
    # x / ((1 + x) - 1), accurate to a few ulps where 1 + x rounds (Goldberg 1991, Theorem 4).
    y = 1.0 + x
    log1p = tl.where(y == 1.0, x, tl.log(y) * (x / tl.where(y == 1.0, 1.0, y - 1.0)))
    return tl.minimum(bound, g) - log1p


@triton.jit(do_not_specialize=["beam_width", "offset_lo", "offset_hi"])
def _scores_kernel(logits_ptr, beam_log_probs_ptr, beam_scores_ptr, seed_ptr, row_state_ptr, probs_ptr, draws_ptr,
                   left_ptr, scores_ptr, log_probs_ptr, stride_ln, V, n_tiles, beam_width, offset_lo, offset_hi,
                   BLOCK_V: tl.constexpr):
    """Beam row n's draws in order, float64: s_0 = G, s_i = -log(exp(-s_{i-1}) + exp(-g_i)), g_i = phi +
    log m_i + Gumbel (Kool et al. 2019), log-probability phi + log q(d_i); greedy rows phi + log_softmax(d_i)
    for both. -inf past the draws and for empty rows."""
    row = tl.program_id(0).to(tl.int64)
    state = tl.load(row_state_ptr + row)
    phi = tl.load(beam_log_probs_ptr + row).to(tl.float64)
    score = tl.load(beam_scores_ptr + row).to(tl.float64)
    draws_row = row * beam_width
    if state == _SAMPLED:
        seed = tl.load(seed_ptr + row)
        for i in range(0, beam_width):
            i64 = tl.cast(i, tl.int64)  # the interpreter's loop index is a Python int
            token = tl.load(draws_ptr + draws_row + i64)
            drawn = token >= 0
            if i > 0:
                noise = -tl.log(-tl.log(_uniform(seed, i64, _STREAM_BEAM, offset_lo, offset_hi)))
                # Past the draws no mass is left; the score there is never stored.
                left = tl.load(left_ptr + draws_row + i64, mask=drawn, other=1.0)
                score = _truncated_gumbel(phi + tl.log(left) + noise, score)
            q = tl.load(probs_ptr + row * V + token, mask=drawn, other=1.0).to(tl.float64)
            log_prob = phi + tl.log(q)
            tl.store(scores_ptr + draws_row + i64, tl.where(drawn, score, -float("inf")).to(tl.float32))
            tl.store(log_probs_ptr + draws_row + i64, tl.where(drawn, log_prob, -float("inf")).to(tl.float32))
    elif state == _GREEDY:
        row_ptr = logits_ptr + row * stride_ln
        # d_0 is the row's first argmax (greedy rows draw the largest logits first): the softmax's shift.
        first = tl.load(draws_ptr + draws_row)
        top = tl.load(row_ptr + first, mask=first >= 0, other=0.0).to(tl.float32).to(tl.float64)
        z = tl.zeros([], tl.float64)
        for tile in range(0, n_tiles):
            offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
            raw = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            z += tl.sum(tl.exp(raw.to(tl.float64) - top), 0)
        log_z = tl.log(z)
        for i in range(0, beam_width):
            i64 = tl.cast(i, tl.int64)
            token = tl.load(draws_ptr + draws_row + i64)
            drawn = token >= 0
            logit = tl.load(row_ptr + token, mask=drawn, other=0.0).to(tl.float32).to(tl.float64)
            log_prob = tl.where(drawn, phi + ((logit - top) - log_z), -float("inf")).to(tl.float32)
            tl.store(scores_ptr + draws_row + i64, log_prob)
            tl.store(log_probs_ptr + draws_row + i64, log_prob)
    else:
        for i in range(0, beam_width):
            tl.store(scores_ptr + draws_row + i, tl.full([], -float("inf"), tl.float32))
            tl.store(log_probs_ptr + draws_row + i, tl.full([], -float("inf"), tl.float32))


def stochastic_beam_step_triton(logits: torch.Tensor, beam_log_probs: torch.Tensor, beam_scores: torch.Tensor,
                                beam_width: int, temperature: torch.Tensor, top_k: torch.Tensor,
                                top_p: torch.Tensor, seed: torch.Tensor, offset: int, validate: bool = True,
                                block_v: int | None = None) -> tuple[torch.Tensor, ...]:
    """Triton implementation of `specops::stochastic_beam_step` on the op's normalized arguments (see
    `specops.ops.stochastic_beam_step`): tensors on one device. Values are not checked here (that would be a
    host sync inside the op); the op's contract checks them when `validate` is true. `block_v` overrides the
    vocabulary tile (a power of two), for tests of the multi-tile paths."""
    # The op is reachable directly, not only through the wrapper that makes inputs contiguous.
    logits, beam_log_probs, beam_scores, temperature, top_k, top_p, seed = (
        t.contiguous() for t in (logits, beam_log_probs, beam_scores, temperature, top_k, top_p, seed))
    batch, beams, vocab = logits.shape
    k = beam_width
    rows = batch * beams
    device = logits.device
    tiling = vocab_tiling("stochastic_beam_step", vocab, block_v)
    block_v, n_tiles, _, num_warps = tiling

    # Beam w of request b is row b * W + w, with b's sampling parameters and its own seed.
    flat_logits = logits.view(rows, vocab)
    seeds = beam_seeds(seed, beams).view(rows)
    live = (beam_log_probs > float("-inf")) & (beam_scores > float("-inf"))
    draws, probs, row_state, left = sample_rows(
        flat_logits, k, temperature.repeat_interleave(beams), top_k.repeat_interleave(beams),
        top_p.repeat_interleave(beams), seeds, offset, tiling, live.view(rows))
    draw_scores = torch.empty((rows, k), dtype=torch.float32, device=device)
    draw_log_probs = torch.empty((rows, k), dtype=torch.float32, device=device)
    if rows > 0:
        offset_lo, offset_hi = offset_words(offset)
        _scores_kernel[(rows,)](
            flat_logits, beam_log_probs, beam_scores, seeds, row_state, probs, draws, left, draw_scores,
            draw_log_probs, flat_logits.stride(0), vocab, n_tiles, k, offset_lo, offset_hi,
            BLOCK_V=block_v, num_warps=num_warps)

    # Candidate c = w * K + i of each request; a stable sort keeps ties in that order.
    draws, draw_scores, draw_log_probs = (t.view(batch, beams * k) for t in (draws, draw_scores, draw_log_probs))
    key = torch.where(draws >= 0, draw_scores.double().clamp_min(_BELOW_FLOAT32), float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    tokens = draws.gather(1, order)
    parents = torch.where(tokens >= 0, order // k, -1)
    return (parents, tokens, draw_log_probs.gather(1, order), draw_scores.gather(1, order),
            probs.view(batch, beams, vocab))


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
stochastic_beam_step_cuda = guarded(check_stochastic_beam_step, stochastic_beam_step_triton)
torch.library.register_kernel("specops::stochastic_beam_step", "cuda", stochastic_beam_step_cuda)
