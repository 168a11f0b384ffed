"""The memory's cost where it cannot help, in many rounds: 8 unrelated HumanEval prompts decoded together (greedy,
96 new tokens, Gemma-3-270M float32, 2 threads), `ngram` without a memory against `ngram` with an empty
`specops.NgramMemory`, and variants of the memory's draft settings, each run in a fresh process, interleaved.

    python bench/bench_memory_unrelated.py [--rounds 10] [--first 32] [--configs ngram,memory]
                                           [--csv docs/memory_unrelated_cpu.csv]

Configurations: `ngram`; `memory` (the defaults); `memory-w8` (the memory's rows at most 8 tokens, as without one,
instead of 16); `memory-s1` (draft-shape sources: matched or not, split by agreement, instead of three match-length
buckets); `memory-w8s1` (both); `memory-d0`, `memory-d2`, `memory-d4` (the memory's rows rank as if their
match were 0, 2 or 4 tokens shorter than the context's, `ngram._MEMORY_DISCOUNT`, 4 by default);
`memory-whole`, `memory-quarter` (the drafts of requests ahead of the one with the most tokens left counted
whole, or a quarter from any lead, where by default a quarter only past one longest draft row:
`ngram_shape._LEAD_FREE`). Per run: the
call's seconds, its prefill, draft time, steps, drafted and accepted tokens. bench_memory.py's "unrelated, 8
together" cell is one round of the first two.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CONFIGS = ["ngram", "memory", "memory-w8", "memory-s1", "memory-w8s1", "memory-d0", "memory-d2", "memory-d4",
           "memory-whole", "memory-quarter"]


def worker(config: str, first: int) -> None:
    import torch

    sys.path.insert(0, str(BENCH))
    from _timing import load_prompts

    import specops
    import specops.decoding.ngram as ngram  # the variants set the memory's draft settings in this process only
    import specops.decoding.ngram_shape as ngram_shape

    if "w8" in config:
        ngram._MEMORY_WIDTH = 8
    if "s1" in config:
        ngram.MEMORY_SOURCES = (1,)
    if "-d" in config:
        ngram._MEMORY_DISCOUNT = int(config.rsplit("-d", 1)[1])
    if config in ("memory-whole", "memory-quarter"):  # requests ahead counted whole, or all at a quarter
        ngram_shape._LEAD_FREE = 1 << 30 if config == "memory-whole" else 0
    torch.set_num_threads(2)
    prompts = load_prompts(first, 8)
    memory = specops.NgramMemory() if config.startswith("memory") else None
    specops.decode(["def add(a, b):\n"], target="gemma-3-270m", method="ngram", memory=memory, max_new_tokens=96)
    start = time.perf_counter()
    result = specops.decode(prompts, target="gemma-3-270m", method="ngram", memory=memory, max_new_tokens=96)
    seconds = time.perf_counter() - start
    s = result.stats
    print(json.dumps(dict(config=config, seconds=seconds, new_tokens=s.new_tokens, prefill=s.prefill_seconds,
                          draft=s.draft_seconds, steps=s.steps, drafted=s.drafted, accepted=s.accepted)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--first", type=int, default=32)
    parser.add_argument("--configs", default="ngram,memory")
    parser.add_argument("--csv", default=str(BENCH / "results" / "memory_unrelated_cpu.csv"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.first)
    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    rows = []
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else configs[::-1]  # alternate who goes first
        for config in order:
            out = subprocess.run([sys.executable, __file__, "--worker", config, "--first", str(args.first)],
                                 capture_output=True, text=True, check=True, env=dict(os.environ))
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = round_
            rows.append(row)
            print(row, flush=True)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    base = statistics.median(r["seconds"] for r in rows if r["config"] == configs[0])
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        med = statistics.median(r["seconds"] for r in mine)
        decode = statistics.median(r["seconds"] - r["prefill"] for r in mine)
        print(f"{config}: median {med:.2f} s ({base / med:.3f}x {configs[0]}), decode {decode:.2f} s, "
              f"drafted {statistics.median(r['drafted'] for r in mine)}, accepted "
              f"{statistics.median(r['accepted'] for r in mine)}, steps {statistics.median(r['steps'] for r in mine)}")


if __name__ == "__main__":
    main()
