"""Triton kernel for `specops::int8_linear`: int8 input [M, K] times int8 weight [N, K]^T with exact int32
sums, out[m, n] = float32(sum_k x[m, k] w[n, k]) * input_scales[m] * weight_scales[n].

skinny_linear's tiling: one program per block of BLOCK_N weight rows and BLOCK_M input rows (16: the
smallest tile tl.dot takes; rows past M are masked) walks K in BLOCK_K steps, each int8 weight tile read
once for all of the program's rows, and multiplies the int8 tiles into int32 (exact while 128^2 K < 2^31:
the op's K limit). The sum is converted and scaled in float32 in the C++ kernel's order, float(sum) * input
scale, then * weight scale, so the two give the same bits. Offsets are 64-bit. A packed weight
(`specops.reference.int8_linear_pack`: uint8 [ceil(N / 16), ceil(K / 4), 64], weight + 128) is read through
its own offsets and shifted back to int8 in registers; the tiles and sums are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.linear import check_int8_linear

__all__ = ["int8_linear_triton"]


@triton.jit
def _int8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0)
        inside = (cols[:, None] < N) & (k[None, :] < K)
        if PACKED:  # weight[n, k] + 128 at [n // 16, k // 4, 4 (n % 16) + k % 4]
            at = (cols[:, None] // 16) * ((K + 3) // 4 * 64) + (k[None, :] // 4) * 64 + (cols[:, None] % 16) * 4
            w = (tl.load(w_ptr + at + k[None, :] % 4, mask=inside, other=128).to(tl.int32) - 128).to(tl.int8)
        else:
            w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=inside, other=0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    # Two products, rounded one after the other (no FMA can form): the C++ kernel's float32 order.
    out = acc.to(tl.float32) * xs[:, None]
    out = out * ws[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_linear_triton(input: torch.Tensor, input_scales: torch.Tensor, weight: torch.Tensor,
                       weight_scales: torch.Tensor, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """Triton implementation of `specops::int8_linear` on the op's arguments (input int8 [M, K], input_scales
    float32 [M], weight int8 [N, K] or packed uint8 [ceil(N / 16), ceil(K / 4), 64], weight_scales float32 [N];
    `specops.ops.int8_linear` checks them).
    `block_n` / `block_k` override the tiles (powers of two, block_n >= 16 and block_k >= 32: int8 MMAs take
    32 bytes of K), for tests of the tails."""
    x, w = input.contiguous(), weight.contiguous()
    rows, dim = x.shape
    packed = w.dim() == 3
    out_features = weight_scales.shape[0] if packed else w.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.float32, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    # K = 0 runs too: no steps, and the sums' 0 is scaled as the C++ kernel scales it (a negative scale: -0).
    block_m = 16
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))
    _int8_linear_kernel[grid](x, input_scales.contiguous(), w, weight_scales.contiguous(), out, rows, out_features,
                              dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PACKED=packed,
                              num_warps=4)
    return out


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
int8_linear_cuda = guarded(check_int8_linear, int8_linear_triton)
torch.library.register_kernel("specops::int8_linear", "cuda", int8_linear_cuda)
