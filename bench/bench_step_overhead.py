"""What a decoding step costs outside the model: the host's share of every step, by method, from the decode
call's own clock (no patching).

    python bench/bench_step_overhead.py [--rounds 2] [--configs ar,ngram,ngram-memory]
                                        [--workloads alone,together8,samples8] [--csv PATH] [--plot PNG]

Target Gemma-3-270M float32, 2 threads, one process, the configurations interleaved (a new order every round).
Workloads: `alone`, HumanEval/0-7 one at a time, greedy, 48 new tokens; `together8`, the same 8 prompts in one
call; `samples8`, HumanEval/40-43 with 8 samples each (T = 0.8, top-p 0.95, 48 new tokens, one call per
prompt). `ngram-memory` starts every workload of every round with an empty specops.NgramMemory, which that
workload's calls then share (the 8 samples of a prompt draft from each other as they go).

Per configuration and workload, per step (medians over rounds): the model's forwards (the target's, and a
drafter's where there is one), the host's time outside them (the call's seconds less its forwards: drafting,
verification's bookkeeping, sampling, the loop, and the call's setup spread over its steps), and the drafting
alone (the proposer's `propose`). The host's read bandwidth is measured at the start and the end. Against `ar`
in the same run, the host time a method adds to a step is what it must win back in accepted drafts before it
pays; on a CPU where a step of 8 requests takes about 40 ms, a millisecond is 2.5 %.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _timing import (load_prompts, machine_info, markdown_table, read_bandwidth_gbs,  # noqa: E402
                     shuffled_rounds, write_csv_columns)

CONFIGS = ["ar", "ngram", "ngram-memory"]
WORKLOADS = ["alone", "together8", "samples8"]
NEW_TOKENS = 48
COLUMNS = ["workload", "config", "steps", "forward_ms", "host_ms", "draft_ms", "host_vs_ar_ms", "tok_s"]


def run(specops, workload: str, config: str) -> dict:
    """One workload with one configuration: summed seconds, forwards, drafting, steps and tokens of its calls."""
    method = "ar" if config == "ar" else "ngram"
    kwargs = dict(memory=specops.NgramMemory()) if config == "ngram-memory" else {}
    if workload == "alone":
        calls = [dict(prompts=[p]) for p in load_prompts(0, 8)]
    elif workload == "together8":
        calls = [dict(prompts=load_prompts(0, 8))]
    else:
        calls = [dict(prompts=[p], num_samples=8, temperature=0.8, top_p=0.95, seed=1000 * i)
                 for i, p in enumerate(load_prompts(40, 4))]
    total = dict(seconds=0.0, forwards=0.0, draft=0.0, steps=0, tokens=0)
    for call in calls:
        prompts = call.pop("prompts")
        start = time.perf_counter()
        result = specops.decode(prompts, target="gemma-3-270m", method=method, max_new_tokens=NEW_TOKENS,
                                **call, **kwargs)
        total["seconds"] += time.perf_counter() - start
        stats = result.stats
        total["forwards"] += stats.forward_seconds
        total["draft"] += stats.draft_seconds
        total["steps"] += stats.steps
        total["tokens"] += stats.new_tokens
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--csv", default=None)
    parser.add_argument("--plot", default=None, help="a bar plot of the host's time per step")
    args = parser.parse_args()
    configs, workloads = args.configs.split(","), args.workloads.split(",")
    for name in configs:
        if name not in CONFIGS:
            parser.error(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")

    import torch

    import specops

    torch.set_num_threads(2)
    for method in ("ar", "ngram"):  # models, tables and first-call probes before the clock
        specops.decode(["def add(a, b):\n"] * 2, target="gemma-3-270m", method=method, max_new_tokens=8)
    read_start = read_bandwidth_gbs()
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_, config in shuffled_rounds(configs, args.rounds):
        for workload in workloads:
            runs.setdefault((workload, config), []).append(run(specops, workload, config))
        print(f"round {round_} {config} done", flush=True)

    rows = []
    for workload in workloads:
        for config in configs:
            measured = runs[(workload, config)]
            steps = statistics.median(r["steps"] for r in measured)
            per_step = {key: statistics.median(1e3 * r[key] / r["steps"] for r in measured)
                        for key in ("seconds", "forwards", "draft")}
            rows.append(dict(workload=workload, config=config, steps=steps,
                             forward_ms=round(per_step["forwards"], 2),
                             host_ms=round(per_step["seconds"] - per_step["forwards"], 3),
                             draft_ms=round(per_step["draft"], 3),
                             tok_s=round(statistics.median(r["tokens"] / r["seconds"] for r in measured), 1)))
        base = next((r for r in rows if r["workload"] == workload and r["config"] == "ar"), None)
        for row in rows:
            if row["workload"] == workload and base is not None:
                row["host_vs_ar_ms"] = round(row["host_ms"] - base["host_ms"], 3)
    info = machine_info("cpu")
    info.update(read_gbs_start=f"{read_start:.1f}", read_gbs_end=f"{read_bandwidth_gbs():.1f}")
    print(f"{info['machine']}, {info['cpu_cores']} cores, {info['threads']} threads; {args.rounds} rounds; "
          f"read bandwidth {info['read_gbs_start']} -> {info['read_gbs_end']} GB/s; medians per step")
    print(markdown_table(rows, COLUMNS))
    if args.csv:
        write_csv_columns(args.csv, rows, COLUMNS, info)
    if args.plot:
        plot(rows, args.plot, f"{info['machine']}, 2 threads, Gemma-3-270M; medians of {args.rounds} rounds")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Per workload and configuration, the host's milliseconds per step: drafting, and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']}\n{r['config']}" for r in rows]
    draft = [r["draft_ms"] for r in rows]
    rest = [r["host_ms"] - r["draft_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.0))
    ax.bar(labels, draft, label="drafting (propose)")
    ax.bar(labels, rest, bottom=draft, label="the rest outside the forwards")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
