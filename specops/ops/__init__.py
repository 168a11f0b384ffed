"""Typed wrappers around `torch.ops.specops.*`, with the fake (meta) implementation of every op.

The wrappers only shape arguments (numbers to per-row tensors, default seeds, None to the op's defaults);
the op checks them, one checker per device path: the C++ kernel on the CPU, and on accelerators the op's
contract (CONTRACTS below: the same checks and messages, one host sync for the values) before its Triton
kernel. The dispatcher picks the C++ CPU or Triton CUDA kernel by device; a fake runs its op's contract
without the value checks.

One module per op family, each holding its ops' wrappers, fakes and checks: `sampling` (chain_verify,
tree_verify, sample_without_replacement, stochastic_beam_step, vocab_project), `ngram` (ngram_match, ngram_memory_insert, ngram_memory_lookup),
`attention` (tree_attention), `ensemble` (ensemble_logits), `linear` (skinny_linear, quantized_linear,
int8_linear, llama_layers); `_checks` holds what they share.
"""

from specops.ops import attention, ensemble, linear, ngram, sampling
from specops.ops.attention import tree_attention
from specops.ops.ensemble import ensemble_logits
from specops.ops.linear import int8_linear, int8_linear_pack, llama_layers, quantized_linear, skinny_linear
from specops.ops.ngram import ngram_match, ngram_memory_insert, ngram_memory_lookup
from specops.ops.sampling import (CHAIN_SCHEMES, TREE_SCHEMES, chain_verify, sample_without_replacement,
                                  stochastic_beam_step, tree_verify, vocab_project)

# Each op's contract on its own arguments, for the kernels that cannot check for themselves: the checks
# its C++ kernel makes, with the same messages (`specops.ops._checks.guarded` runs it before a Triton
# launch; python_tests/test_validation.py holds the two to the same outcome on the same bad inputs).
CONTRACTS = {"chain_verify": sampling.check_chain_verify, "tree_verify": sampling.check_tree_verify,
             "sample_without_replacement": sampling.check_sample_without_replacement,
             "stochastic_beam_step": sampling.check_stochastic_beam_step,
             "vocab_project": sampling.check_vocab_project, "ngram_match": ngram.check_ngram_match,
             "ngram_memory_insert": ngram.check_ngram_memory_insert,
             "ngram_memory_lookup": ngram.check_ngram_memory_lookup,
             "ensemble_logits": ensemble.check_ensemble_logits, "tree_attention": attention.check_tree_attention,
             "skinny_linear": linear.check_skinny_linear, "quantized_linear": linear.check_quantized_linear,
             "int8_linear": linear.check_int8_linear}

__all__ = ["CHAIN_SCHEMES", "CONTRACTS", "TREE_SCHEMES", "chain_verify", "ensemble_logits", "int8_linear",
           "int8_linear_pack", "llama_layers",
           "ngram_match", "ngram_memory_insert", "ngram_memory_lookup",
           "quantized_linear", "sample_without_replacement", "skinny_linear", "stochastic_beam_step", "tree_attention",
           "tree_verify", "vocab_project"]
