"""Which float32 GEMM takes a product of many rows (a prefill) on a CPU: torch's BLAS (`F.linear`), or
oneDNN's linear where the BLAS is MKL on a CPU that is not Intel's. Read by the CPU forward
(decoding/cpu_forward.py, for float32 layers) and by `QuantizedLinear` (quantization.py, for the
de-quantized weight of a long prefill chunk)."""

from __future__ import annotations

from functools import cache

import torch

__all__ = ["blas_is_slow_here", "many_rows_linear", "onednn_linear", "onednn_pays", "onednn_works", "slow_here"]


def blas_is_slow_here() -> bool:
    """Whether torch's BLAS is MKL on a CPU that is not Intel's. MKL takes a generic path there: on a 2-vCPU
    AMD EPYC (Zen 5) F.linear reached 41-114 GFLOP/s where skinny_linear reached 150-250, at every row count
    from 16 to 512 (Gemma-3-270M's output head: 98.9 against 26.6 ms at 16 rows and 265 against 102 at 64 in
    docs/benchmarks.md's run of 2026-12-03; 1,504 against 900 at 512 in an earlier one). On an Intel Xeon MKL
    is as fast from about 24 rows."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return vendor not in ("", "GenuineIntel")


slow_here = cache(blas_is_slow_here)  # asked once per process


def onednn_works() -> bool:
    """Whether oneDNN's linear runs float32 products in this torch build (tried once, on a small product)."""
    return torch.backends.mkldnn.is_available() and _onednn_probe()


@cache
def _onednn_probe() -> bool:
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 3.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# The least multiply-adds (rows x weights) of a product that goes through oneDNN. oneDNN makes a primitive for
# every new shape, row count included: on a 2-vCPU AMD EPYC (Zen 5, 2026-12-08) a product whose row count it
# had not seen took 0.7-1.3 ms more (64-103 rows; 64 x 64 to 2048 x 640 weights: 750 against 26 us for 64 x 64,
# 1.7 against 0.5 ms for 2048 x 640), so a prefill pays that once per weight shape and prompt length. Below
# this (about 0.2 ms of skinny_linear's work) it would cost more than it saves; Gemma-3-270M's q, gate, up,
# down and o weights pass it from 64 rows, its k and v from 205.
_ONEDNN_WORK = 1 << 25


def onednn_pays(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product is large enough for oneDNN (_ONEDNN_WORK)."""
    return rows.shape[0] * weight.numel() >= _ONEDNN_WORK


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [n, d] @ weight [out, d]^T (+ bias) through oneDNN, on the weight as it is (no packed copy)."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")


def many_rows_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 CPU product of many rows: oneDNN where MKL is slow, oneDNN runs and the product is large
    enough (_ONEDNN_WORK), else F.linear. On a 2-vCPU AMD EPYC (Zen 5) oneDNN made 291-388 GFLOP/s at
    128-512 rows where MKL made about 150 (bench/bench_prefill.py, docs/benchmarks.md, 2026-12-07)."""
    if slow_here() and rows.dtype == torch.float32 and weight.dtype == torch.float32 and \
            onednn_pays(rows, weight) and onednn_works():
        return onednn_linear(rows, weight, bias)
    return torch.nn.functional.linear(rows, weight, bias)
