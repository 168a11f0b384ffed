"""Triton GPU kernels, one op per file, each registered for CUDA with torch.library.register_kernel.

Triton is optional at import: without it the CPU kernels still work and CUDA calls fail with a clear
"no kernel registered" error from the dispatcher.
"""

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    from specops.kernels import (chain_verify, ensemble_logits, int8_linear, ngram_match,  # noqa: F401
                                 ngram_memory_insert, ngram_memory_lookup, quantized_linear,
                                 sample_without_replacement, skinny_linear, stochastic_beam_step,
                                 tree_attention, tree_verify, vocab_project)
