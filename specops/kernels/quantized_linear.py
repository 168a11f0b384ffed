"""Triton kernel for `specops::quantized_linear`: input [M, K] @ W^T + bias with W stored in low precision
(bfloat16; int8 times per-group scales; int4, two per byte, times per-group scales plus minimums, in
ggml's Q4_1 block layout) and de-quantized in registers as it is read (weight-only quantization).

skinny_linear's tiling: one program per block of BLOCK_N weight rows and BLOCK_M input rows (16: the
smallest tile tl.dot takes; rows past M are masked) walks K in BLOCK_K steps, loading each weight tile
in its storage format once for all of the program's rows, de-quantizing it to float32 and accumulating
in float32. For 16-bit inputs the de-quantized tile is rounded to the input's type and multiplied
natively. Offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.ops._checks import guarded
from specops.ops.linear import check_quantized_linear

__all__ = ["quantized_linear_triton"]

# FORMAT, named by the weight's dtype.
_BF16, _INT8, _INT4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_FORMATS = {torch.bfloat16: _BF16.value, torch.int8: _INT8.value, torch.uint8: _INT4.value}


@triton.jit
def _quantized_linear_kernel(x_ptr, w_ptr, scales_ptr, mins_ptr, b_ptr, out_ptr, M, N, K, GROUPS, GROUP_SIZE,
                             FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
                             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        in_w = (cols[:, None] < N) & (k[None, :] < K)
        if FORMAT == _INT4:
            # Weight k of a row sits in byte (k // 32) * 16 + k % 16: the low nibble for the first 16 of
            # its block of 32, the high one for the last 16. Each byte is loaded for both (from cache).
            byte = (k // 32) * 16 + k % 16
            packed = tl.load(w_ptr + cols[:, None] * (K // 2) + byte[None, :], mask=in_w, other=0)
            w = tl.where(((k // 16) % 2 == 1)[None, :], packed >> 4, packed & 15).to(tl.float32)
        else:
            w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=in_w, other=0).to(tl.float32)
        if FORMAT != _BF16:
            group = cols[:, None] * GROUPS + (k // GROUP_SIZE)[None, :]
            w = w * tl.load(scales_ptr + group, mask=in_w, other=0.0)
            if FORMAT == _INT4:
                w = w + tl.load(mins_ptr + group, mask=in_w, other=0.0)
        w = w.to(x.dtype)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def quantized_linear_triton(input: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                            mins: torch.Tensor | None, bias: torch.Tensor | None, block_n: int = 64,
                            block_k: int | None = None) -> torch.Tensor:
    """Triton implementation of `specops::quantized_linear` on the op's arguments (input [M, K]; weight,
    scales, mins in one of the formats of `specops.ops.quantized_linear`, which checks them; bias [N] of
    input's dtype or None). `block_n` / `block_k` override the tiles (powers of two, block_n >= 16 and
    block_k >= 16), for tests of the tails."""
    x, w = input.contiguous(), weight.contiguous()
    rows, dim = x.shape
    out_features = w.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if dim == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    fmt = _FORMATS[w.dtype]
    groups = 1 if scales is None else scales.shape[1]
    block_m = 16
    # From the compile check (docs/gpu.md): with 4 warps and 64 x 64 tiles every format spilled on sm_90 (up
    # to 1,448 bytes per thread for float32 input on int4). 8 warps spill nothing, with K tiles of 32 where
    # float32 input meets int8 or int4.
    block_k = block_k or (32 if x.dtype == torch.float32 and fmt != _BF16.value else 64)
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))
    _quantized_linear_kernel[grid](
        x, w, scales.contiguous() if scales is not None else x, mins.contiguous() if mins is not None else x,
        bias.contiguous() if bias is not None else x, out, rows, out_features, dim, groups, dim // groups,
        FORMAT=fmt, HAS_BIAS=bias is not None,
        # 16-bit tiles multiply natively (float32 accumulation); Triton's interpreter multiplies bfloat16
        # tiles as raw bits, so on the CPU they are converted first (after the same rounding to 16 bits).
        DOT_FP32=x.device.type == "cpu" and x.dtype != torch.float32,
        # float32 products as torch does them: TF32 only where the user allowed it.
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8)
    return out


# What CUDA calls run, through the wrapper or torch.ops directly: the op's contract (the C++ kernel's checks,
# which this kernel cannot make), then the kernel.
quantized_linear_cuda = guarded(check_quantized_linear, quantized_linear_triton)
torch.library.register_kernel("specops::quantized_linear", "cuda", quantized_linear_cuda)
