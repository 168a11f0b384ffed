"""`specops.decode` from two checkouts of specops side by side: each run a fresh process, the order
alternating per round, decode time (a call's seconds less its prefill) per workload.

    git worktree add /tmp/old <commit>; cp specops/_C*.so /tmp/old/specops/   # the same C++ in both
    python bench/bench_ab_trees.py --old /tmp/old [--new .] [--rounds 2]
                                   [--workloads ngram8,ngram1,slem1,ngram8s]

Workloads (Gemma-3-270M float32, 2 threads, HumanEval prompts 32 on, after a warm-up call): ngram8: 8
prompts together, greedy, 96 new tokens; ngram8s: the same sampled (T 0.8, top-p 0.95, seed 1); ngram1: 4
prompts one at a time, greedy, 64 tokens; slem1: the same with the SmolLM2-135M drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
WORKLOADS = {
    "ngram8": dict(method="ngram", prompts=8, together=True, temperature=0.0, tokens=96),
    "ngram8s": dict(method="ngram", prompts=8, together=True, temperature=0.8, tokens=96),
    "ngram1": dict(method="ngram", prompts=4, together=False, temperature=0.0, tokens=64),
    "slem1": dict(method="slem", prompts=4, together=False, temperature=0.0, tokens=64),
}


def worker(name: str) -> None:
    import torch

    sys.path.insert(0, str(BENCH))
    from _timing import load_prompts

    import specops

    torch.set_num_threads(2)
    work = WORKLOADS[name]
    kwargs = dict(target="gemma-3-270m", method=work["method"], max_new_tokens=work["tokens"],
                  temperature=work["temperature"], seed=1)
    if work["temperature"]:
        kwargs["top_p"] = 0.95
    if work["method"] == "slem":
        kwargs["drafter"] = "smollm2-135m"
    specops.decode(["def add(a, b):\n"], **{**kwargs, "max_new_tokens": 16})
    prompts = load_prompts(32, work["prompts"])
    start, prefill, tokens = time.perf_counter(), 0.0, 0
    for batch in [prompts] if work["together"] else [[p] for p in prompts]:
        result = specops.decode(batch, **kwargs)
        prefill += result.stats.prefill_seconds
        tokens += result.stats.new_tokens
    seconds = time.perf_counter() - start
    print(json.dumps(dict(specops=specops.__file__, seconds=seconds, decode=seconds - prefill, tokens=tokens)))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default=str(BENCH.parent))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="ngram8,ngram1,slem1,ngram8s")
    args = parser.parse_args()
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    names = args.workloads.split(",")
    decode: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in names:
            for code in (("old", "new") if r % 2 == 0 else ("new", "old")):
                env = dict(os.environ, PYTHONPATH=trees[code])
                done = subprocess.run([sys.executable, str(BENCH / "bench_ab_trees.py"), "--worker", name], env=env,
                                      capture_output=True, text=True, cwd="/tmp")
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if not lines:
                    sys.exit(done.stderr[-3000:])
                run = json.loads(lines[-1])
                if not run["specops"].startswith(trees[code]):
                    sys.exit(f"the {code} run imported specops from {run['specops']}")
                decode.setdefault((name, code), []).append(run["decode"])
                print(f"round {r} {name} {code}: {run['seconds']:.2f} s, decode {run['decode']:.2f} s, "
                      f"{run['tokens']} tokens", flush=True)
    for name in names:
        old, new = (statistics.median(decode[(name, code)]) for code in ("old", "new"))
        print(f"{name}: decode old {old:.2f} s, new {new:.2f} s, new against old {old / new:.3f}x")


if __name__ == "__main__":
    main()
