"""Where vLLM's sampled step spends its time, with and without a speculative proposer: cProfile of the engine run
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), 4 HumanEval prompts one at a time, 48 tokens, T 0.8, top-p 0.95,
async scheduling off in both (as vLLM runs every custom_class proposer).

    python bench/profile_vllm_sampling.py plain|spec

Run it in vLLM's environment (README, "Serving with vLLM"); `spec` configures specops.vllm.NgramProposer.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

from _timing import load_prompts


def main() -> None:
    if sys.argv[1:] not in (["plain"], ["spec"]):
        raise SystemExit("usage: python bench/profile_vllm_sampling.py plain|spec")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where cProfile sees it
    from vllm import LLM, SamplingParams

    from specops import models

    spec = {"model": "specops.vllm.NgramProposer", "num_speculative_tokens": 8} if sys.argv[1] == "spec" else None
    llm = LLM(model=str(models.path("gemma-3-270m")), dtype="float32", enforce_eager=True, max_model_len=2048,
              seed=0, kv_cache_memory_bytes=1 << 30, speculative_config=spec, async_scheduling=False)
    params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95)
    prompts = load_prompts(0, 4)
    llm.generate(prompts[:1], params, use_tqdm=False)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    out = [llm.generate([p], params, use_tqdm=False) for p in prompts]
    profile.disable()
    tokens = sum(len(o[0].outputs[0].token_ids) for o in out)
    print(sys.argv[1], "seconds", round(time.perf_counter() - start, 2), "tokens", tokens)
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(r"sample|sampler|top_p|top_k|rejection|propose|execute_model|forward", 25)


if __name__ == "__main__":
    main()
