"""Typed wrappers around `torch.ops.specops.*`, with the fake (meta) implementation of every op.

The wrappers normalize arguments (scalars to per-row tensors, default seeds) and validate shapes,
dtypes and devices without touching tensor values; the op itself (or, on accelerators, a one-sync
check here) rejects bad values. The dispatcher picks the C++ CPU or Triton CUDA kernel by device.

One module per op family, each holding its ops' wrappers, fakes and checks: `sampling` (chain_verify,
tree_verify, sample_without_replacement, stochastic_beam_step, vocab_project), `ngram` (ngram_match),
`attention` (tree_attention), `ensemble` (ensemble_logits), `linear` (skinny_linear, quantized_linear,
llama_layers); `_checks` holds the argument checks they share.
"""

from specops.ops.attention import tree_attention
from specops.ops.ensemble import ensemble_logits
from specops.ops.linear import llama_layers, quantized_linear, skinny_linear
from specops.ops.ngram import ngram_match
from specops.ops.sampling import (CHAIN_SCHEMES, TREE_SCHEMES, chain_verify, sample_without_replacement,
                                  stochastic_beam_step, tree_verify, vocab_project)

__all__ = ["CHAIN_SCHEMES", "TREE_SCHEMES", "chain_verify", "ensemble_logits", "llama_layers", "ngram_match",
           "quantized_linear", "sample_without_replacement", "skinny_linear", "stochastic_beam_step", "tree_attention",
           "tree_verify", "vocab_project"]
