"""Triton kernel for `specops::ensemble_logits`: the logits of a weighted or contrastive ensemble of
next-token distributions (semantics: `specops.reference.ensemble_logits`).

One program per row. Pass 1 walks the vocabulary in BLOCK_V tiles once per member, keeping a running
maximum and (weighted) a running softmax sum per lane, rescaled when the maximum grows (online softmax);
the lanes are reduced at the end and each member's maximum and log-normalizer are stored in small scratch tensors.
Pass 2 reads every member's tile once more and writes the ensemble tile. The launcher stacks the members
into one [M, R, V] tensor (one copy: members arrive as separate tensors). Offsets are 64-bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.ensemble import check_ensemble_logits

__all__ = ["ensemble_logits_triton"]

_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))  # a plain float global does not compile for a GPU


@triton.jit
def _ensemble_logits_kernel(x_ptr, w_ptr, top_ptr, add_ptr, out_ptr, R, V, MEMBERS, mu, log_alpha,
                            CONTRASTIVE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    # Pass 1: per member, the row's maximum into top_ptr[row, m] and (weighted) log w_m - log z into
    # add_ptr[row, m]: member m's log-softmax plus its log-weight is (x - top) + add, the maximum taken off
    # first so that rows far from zero keep full precision.
    for m in range(MEMBERS):
        base = x_ptr + (m * R + row) * V
        run_max = tl.full((BLOCK_V,), _NEG_INF, tl.float32)
        run_sum = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < V, other=_NEG_INF).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max > _NEG_INF, new_max, 0.0)
            run_sum = run_sum * tl.exp(tl.where(run_max > _NEG_INF, run_max - safe, _NEG_INF)) + \
                tl.exp(tl.where(x > _NEG_INF, x - safe, _NEG_INF))
            run_max = new_max
        top = tl.max(run_max, axis=0)
        tl.store(top_ptr + row * MEMBERS + m, top)
        if not CONTRASTIVE:
            z = tl.sum(tl.where(run_max > _NEG_INF, run_sum * tl.exp(run_max - top), 0.0), axis=0)
            w = tl.load(w_ptr + m)
            tl.store(add_ptr + row * MEMBERS + m, tl.where(w > 0, tl.log(w) - tl.log(z), _NEG_INF))
    # Pass 2: combine tile by tile.
    out_row = out_ptr + row * V
    finite = 0
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + cols
        inside = idx < V
        if CONTRASTIVE:
            e = tl.load(x_ptr + row * V + idx, mask=inside, other=_NEG_INF).to(tl.float32) - \
                tl.load(top_ptr + row * MEMBERS)
            a = tl.load(x_ptr + (R + row) * V + idx, mask=inside, other=_NEG_INF).to(tl.float32) - \
                tl.load(top_ptr + row * MEMBERS + 1)
            keep = (e >= log_alpha) & (e > _NEG_INF) & (a > _NEG_INF)
            value = tl.where(keep, e - mu * tl.where(keep, a, 0.0), _NEG_INF)
        else:
            top = tl.full((BLOCK_V,), _NEG_INF, tl.float32)
            for m in range(MEMBERS):
                a = (tl.load(x_ptr + (m * R + row) * V + idx, mask=inside, other=_NEG_INF).to(tl.float32) -
                     tl.load(top_ptr + row * MEMBERS + m)) + tl.load(add_ptr + row * MEMBERS + m)
                top = tl.maximum(top, a)
            keep = top > _NEG_INF
            safe = tl.where(keep, top, 0.0)
            total = tl.zeros((BLOCK_V,), tl.float32)
            for m in range(MEMBERS):
                a = (tl.load(x_ptr + (m * R + row) * V + idx, mask=inside, other=_NEG_INF).to(tl.float32) -
                     tl.load(top_ptr + row * MEMBERS + m)) + tl.load(add_ptr + row * MEMBERS + m)
                total += tl.exp(tl.where(a > _NEG_INF, a - safe, _NEG_INF))
            value = tl.where(keep, safe + tl.log(tl.where(keep, total, 1.0)), _NEG_INF)
        finite += tl.sum((keep & inside).to(tl.int32), axis=0)
        tl.store(out_row + idx, value, mask=inside)
    if CONTRASTIVE:
        if finite == 0:  # no token both plausible and known to the amateur: the expert's cut logits
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + cols
                inside = idx < V
                e = tl.load(x_ptr + row * V + idx, mask=inside, other=_NEG_INF).to(tl.float32) - \
                    tl.load(top_ptr + row * MEMBERS)
                tl.store(out_row + idx, tl.where((e >= log_alpha) & (e > _NEG_INF), e, _NEG_INF), mask=inside)


def ensemble_logits_triton(members: list[torch.Tensor], weights: torch.Tensor, mode: int, mu: float, alpha: float,
                           block_v: int = 1024) -> torch.Tensor:
    """Triton implementation of `specops::ensemble_logits` on the op's arguments (checked by
    `specops.ops.ensemble_logits`). `block_v` overrides the tile (a power of two), for tests of the tails."""
    first = members[0]
    vocab = first.shape[-1]
    rows = first.numel() // vocab
    out = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    if rows == 0:
        return out
    stacked = torch.stack([m.reshape(rows, vocab) for m in members]).contiguous()
    count = len(members)
    top = torch.empty((rows, count), dtype=torch.float32, device=first.device)
    add = torch.empty_like(top)
    w = weights.to(device=first.device, dtype=torch.float32).contiguous() if mode == 0 else top
    log_alpha = math.log(alpha) if alpha > 0 else float("-inf")  # a runtime float, not the constexpr
    _ensemble_logits_kernel[(rows,)](stacked, w, top, add, out, rows, vocab, count, float(mu), log_alpha,
                                     CONTRASTIVE=mode == 1, BLOCK_V=block_v)
    return out


def _launch(members, weights, mode, mu, alpha, validate=True):
    return ensemble_logits_triton(list(members), weights, mode, mu, alpha)


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
ensemble_logits_cuda = guarded(check_ensemble_logits, _launch)
torch.library.register_kernel("specops::ensemble_logits", "cuda", ensemble_logits_cuda)
