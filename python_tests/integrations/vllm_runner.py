"""Runs vLLM offline in a process of its own for test_vllm.py: one engine (a model folder, a speculative
config, environment settings), several scenarios, the generated token ids and the speculation counters
written as JSON. A process per engine keeps vLLM's engine processes and memory from outliving it.

    python vllm_runner.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.update(spec.get("env", {}))
    from vllm import LLM, SamplingParams

    # An explicit KV cache size: on CPU, vLLM otherwise reserves a fraction of the machine's memory that
    # fails when other processes hold some of it.
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec.get("max_model_len", 1024),
              seed=0, kv_cache_memory_bytes=spec.get("kv_bytes", 1 << 30), speculative_config=spec.get("speculative"),
              disable_log_stats=False, tensor_parallel_size=spec.get("tp", 1))

    def counters() -> dict:
        names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
        return {names[m.name]: m.value for m in llm.get_metrics() if m.name in names}

    out = {}
    for name, scenario in spec["scenarios"].items():
        before = counters()
        lengths = scenario["max_tokens"]
        stops = scenario.get("stop_token_ids") or [None] * len(lengths)
        params = [SamplingParams(temperature=scenario.get("temperature", 0.0), top_p=scenario.get("top_p", 1.0),
                                 max_tokens=n, seed=scenario.get("seed"), n=scenario.get("n", 1),
                                 ignore_eos=scenario.get("ignore_eos", False), stop_token_ids=stop)
                  for n, stop in zip(lengths, stops)]
        prompts = scenario["prompts"]
        if scenario.get("each"):
            results = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        after = counters()
        out[name] = {
            "tokens": [[list(o.token_ids) for o in r.outputs] for r in results],
            "text": [[o.text for o in r.outputs] for r in results],
            "finish": [[o.finish_reason for o in r.outputs] for r in results],
            **{k: after.get(k, 0) - before.get(k, 0) for k in ("drafted", "accepted")},
        }
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
