"""specops: speculative-decoding kernels for PyTorch, and the decoders built on them.

Public API: `specops.decode` (generation with any method; `specops.hf.generate` runs it inside transformers'
`model.generate(..., custom_generate=specops.hf.generate)`; `specops.WeightedEnsemble` and
`specops.ContrastiveEnsemble` define ensembles of targets; `specops.NgramMemory` holds what earlier requests
wrote, for n-gram drafting across requests, calls and processes), `specops.quantize` (weight-only int8 / int4 /
bf16 linear layers, for fast drafters), `specops.ops` (the kernels, as typed wrappers over
`torch.ops.specops.*`), `specops.models` (the embedded default models) and
`specops.vocab` (vocabulary maps between two tokenizers: `specops.vocab.vocab_map`).
"""

import os as _os

import torch  # noqa: F401  (loads libtorch before the extension)

# SPECOPS_CPU_ISA caps the instruction set the C++ kernels take (csrc/cpu/per_isa.h), for benchmarking the
# AVX2 copies on an AVX-512 machine; read by the kernels once, so it is checked before they load.
if _os.environ.get("SPECOPS_CPU_ISA", "") not in ("", "avx512", "avx2", "base"):
    raise ValueError(f"SPECOPS_CPU_ISA must be avx512, avx2 or base (or unset), got "
                     f"{_os.environ['SPECOPS_CPU_ISA']!r}")

from specops import _C  # noqa: F401  (registers the op schemas and the C++ CPU kernels)
from specops import ops

if torch.backends.cuda.is_built() or _os.environ.get("TRITON_INTERPRET") == "1":
    # Registers the Triton kernels for CUDA (or, interpreted, for the tests). A torch built without CUDA can
    # never run them, and importing Triton would add most of a second to every start. Whether a GPU is there
    # is not asked: importing specops touches no device (torch.cuda.is_available() would load the driver).
    from specops import kernels  # noqa: F401
from specops import vocab
from specops._kept import forget, kept
from specops.decoding import DecodeResult, decode
from specops.decoding.ensemble_target import ContrastiveEnsemble, WeightedEnsemble
from specops.decoding.stats import Stats
from specops.memory import NgramMemory
from specops.quantization import QuantizedLinear, quantize

__all__ = ["decode", "DecodeResult", "forget", "kept", "Stats", "ContrastiveEnsemble", "WeightedEnsemble",
           "NgramMemory", "QuantizedLinear", "quantize", "ops", "models", "hf", "vocab"]
__version__ = "0.1.0"


def __getattr__(name):
    # specops.models and specops.hf import transformers; load them on first use, not with the kernels.
    if name in ("models", "hf"):
        import importlib

        return importlib.import_module(f"specops.{name}")
    raise AttributeError(f"module 'specops' has no attribute {name!r}")
