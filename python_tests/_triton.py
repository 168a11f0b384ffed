"""What the op tests share about Triton: whether its kernels can run here, on which device, and the
implementation parameters whose "triton" cases skip where they cannot.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; conftest.py turns it on before
anything imports triton. With Triton installed a kernel file must import: a broken one fails its test
module, never skips.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # Triton not installed: the "triton" cases skip
    triton = None

# Direct Triton calls run on the GPU, else in the interpreter on CPU tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TRITON_RUNS = triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not _TRITON_RUNS, reason="needs triton, and a GPU or TRITON_INTERPRET=1")
# Implementations of an op, for parametrize: every one, and the kernels alone.
IMPLS = ["reference", "cpp", pytest.param("triton", marks=needs_triton)]
KERNELS = ["cpp", pytest.param("triton", marks=needs_triton)]


def triton_launcher(op: str):
    """`specops.kernels.<op>.<op>_triton`, or None where Triton is not installed."""
    if triton is None:
        return None
    return getattr(importlib.import_module(f"specops.kernels.{op}"), f"{op}_triton")
