"""Runs vLLM's real samplers in a process of its own for test_vllm_proposers.py, set up as a vLLM worker sets
itself up (specops' plugin, then the CPU kernel overrides), and compares specops' shortcut through vLLM's
rejection sampler (specops/vllm/_sampler.py) with vLLM's own path on the same steps: a batch of seeded sampled
requests and a greedy one, a step without drafts and a step where some requests have drafts, two steps each
with the same generators. Prints JSON: per case whether the tokens agreed, whether another seed changed
them (so the comparison can fail), and how often each shortcut was taken.

    python vllm_sampler_check.py
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import torch


def main() -> None:
    import specops.vllm

    specops.vllm.register()  # what vLLM's plugin loader does in every process, before the worker's set-up
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as module
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    if hasattr(current_platform, "register_triton_kernel_overrides"):
        with warnings.catch_warnings():  # it walks every loaded module, deprecated attributes included
            warnings.simplefilter("ignore")
            current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start-up
    vllms = module.RejectionSampler.forward.__wrapped__  # vLLM's own path (the noise for every request)
    config = type("SpeculativeConfig", (), {"method": "custom_class", "model": "specops.vllm.NgramProposer",
                                            "rejection_sample_method": "standard",
                                            "synthetic_acceptance_rates": None})()
    ours = module.RejectionSampler(Sampler(), config, torch.device("cpu"))
    rows, vocab = 6, 50_000

    def sampling(seed: int):
        temperature = torch.full((rows,), 0.8)
        temperature[2] = 0.0  # a greedy request among sampled ones
        generators = {row: torch.Generator().manual_seed(seed + row) for row in range(rows)}
        return SamplingMetadata(
            temperature=temperature, all_greedy=False, all_random=False, top_p=torch.full((rows,), 0.95),
            top_k=None, generators=generators, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
            repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=[[] for _ in range(rows)])

    def metadata_for(drafts: list[list[int]]):
        """The step's SpecDecodeMetadata, its logit rows as the runner lays them out (each request's draft
        rows, then its bonus row)."""
        metadata = module.SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
        ends = np.cumsum([len(d) + 1 for d in drafts])
        metadata.bonus_logits_indices = torch.tensor(ends - 1, dtype=torch.int32)
        metadata.target_logits_indices = torch.tensor(
            [i for end, d in zip(ends, drafts) for i in range(end - 1 - len(d), end - 1)], dtype=torch.int32)
        return metadata

    torch.manual_seed(0)
    cases = {"no drafts": [[]] * rows, "some drafts": [[], [4, 9], [1], [], [7, 7, 2], []]}
    out = {}
    for name, drafts in cases.items():
        metadata = metadata_for(drafts)
        agree, accepted, differ = True, 0, False
        for seed in range(0, 40, 10):
            logits = torch.randn(rows + sum(map(len, drafts)), vocab) * 4
            targets = metadata.target_logits_indices.long()
            # every other draft token the target's clear choice: some drafts are accepted, others rejected
            logits[targets[::2], metadata.draft_token_ids.long()[::2]] += 60.0
            mine, theirs = sampling(seed), sampling(seed)
            for _ in range(2):  # two steps: the generators must stand where vLLM's path leaves them
                got = ours(metadata, None, logits.clone(), mine).sampled_token_ids
                want = vllms(ours, metadata, None, logits.clone(), theirs).sampled_token_ids
                agree &= got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
                accepted += int((got[:, 1:] >= 0).sum())
            other = vllms(ours, metadata, None, logits.clone(), sampling(seed + 1)).sampled_token_ids
            differ |= not torch.equal(got, other)
        out[name] = {"agree": bool(agree), "differ": bool(differ), "accepted": accepted}
    out["plain steps"] = ours.specops_plain_steps
    out["narrowed"] = getattr(module.sample_recovered_tokens, "narrowed", None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
