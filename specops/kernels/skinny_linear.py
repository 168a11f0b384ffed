"""Triton kernel for `specops::skinny_linear`: input [M, K] @ weight[N, K]^T + bias for the few rows of a
decoding forward.

One program per block of BLOCK_N weight rows and BLOCK_M input rows (16: the smallest tile tl.dot takes;
rows past M are masked): it walks K in BLOCK_K steps, each weight tile read once for all of the
program's rows, and accumulates in float32. With M <= 16 there is one row block, so the weight is read
once in all; each program's tiles stream BLOCK_N rows of it. Offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.linear import check_skinny_linear

__all__ = ["skinny_linear_triton"]


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                          HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_linear_triton(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """Triton implementation of `specops::skinny_linear` on the op's arguments (input [M, K], weight [N, K],
    bias [N] or None, one dtype; `specops.ops.skinny_linear` checks them). `block_n` / `block_k` override
    the tiles (powers of two >= 16), for tests of the tails."""
    x, w = input.contiguous(), weight.contiguous()
    rows, dim = x.shape
    out_features = w.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if dim == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    block_m = 16
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))
    _skinny_linear_kernel[grid](
        x, w, bias.contiguous() if bias is not None else x, out, rows, out_features, dim,
        HAS_BIAS=bias is not None,
        # 16-bit tiles multiply natively (float32 accumulation); Triton's interpreter multiplies bfloat16
        # tiles as raw bits, so on the CPU they are converted first.
        DOT_FP32=x.device.type == "cpu" and x.dtype != torch.float32,
        # float32 products as torch does them: TF32 only where the user allowed it.
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8)  # 4 spilled on sm_90 (docs/gpu.md)
    return out


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
skinny_linear_cuda = guarded(check_skinny_linear, skinny_linear_triton)
torch.library.register_kernel("specops::skinny_linear", "cuda", skinny_linear_cuda)
