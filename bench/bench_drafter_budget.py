"""Where a drafter method's time goes: `ar` and a drafter method (`slem` or `tli`, greedy) with
num_draft_tokens "auto" and with fixed draft lengths, one prompt at a time, the configurations round-robin
per prompt in one process (Gemma-3-270M float32 target, SmolLM2-135M int8 drafter, HumanEval prompts).

    python bench/bench_drafter_budget.py [--method slem] [--ks 1,2,3,4] [--rounds 2] [--prompts 8]
                                         [--new-tokens 48] [--csv PATH] [--plot docs/drafter_budget_cpu.png]

Per configuration, summed over prompts and rounds: tokens/s and its ratio to `ar`; the call's seconds split
into the target's prefill, the drafter's reading of each prompt (its first read, the drafter's prefill), the
rest of the drafting (the drafter's forwards over a few tokens and the re-encoding), verification (the
target's forwards) and the rest; and the ratio to `ar` with both prefills left out (what longer outputs tend
to). Greedy tokens are compared with `ar`'s. Then the forwards themselves, best of 3 after a warm-up: the
drafter's and the target's prefill of the first prompt, a forward over 1 token and over 3 after it, and each
against its floor (bench_floor.weight_bytes read at the read bandwidth measured right before).

The drafter's prompt reads are timed by wrapping `DrafterProposer.read` in this process (the benchmark's own
instrument; the library counts them in its draft time).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from _timing import (
    csv_path,
    e2e_parser,
    load_prompts,
    machine_info,
    markdown_table,
    parse_e2e_args,
    read_bandwidth_gbs,
    write_csv_columns,
)
from bench_floor import weight_bytes

TARGET, DRAFTER = "gemma-3-270m", "smollm2-135m"
PROMPT_READ = 16  # a drafter read of more tokens than this is the prompt's
COLUMNS = ["config", "tokens", "seconds", "tok/s", "vs_ar", "vs_ar_no_prefills", "target_prefill",
           "drafter_prefill", "drafting", "verify", "other", "steps", "drafted", "accepted", "same_as_ar"]
FORWARD_COLUMNS = ["model", "prompt_tokens", "prefill_ms", "one_ms", "three_ms", "weights_MB", "floor_ms",
                   "one_vs_floor"]


def forwards(prompt: str) -> list[dict]:
    """The drafter's and the target's prefill of `prompt` and forwards of 1 and 3 tokens after it, against
    the floor of one forward."""
    from specops import models
    from specops.decoding.engine import CausalLM, KVState

    rows = []
    for name, load in ((DRAFTER, models.load_drafter), (TARGET, models.load)):
        model, tokenizer = load(name)
        lm = CausalLM(model, name)
        ids = tokenizer(prompt)["input_ids"]
        prefill, one, three = [], [], []
        for _ in range(4):  # the first round warms up
            state = KVState(lm, 1)
            began = time.perf_counter()
            state.extend([ids])
            prefill.append(time.perf_counter() - began)
            for i in range(4):
                began = time.perf_counter()
                state.append(torch.tensor([[ids[i]]]))
                one.append(time.perf_counter() - began)
            for i in range(4):
                began = time.perf_counter()
                state.extend([ids[i:i + 3]])
                three.append(time.perf_counter() - began)
        bandwidth = read_bandwidth_gbs()
        mb = weight_bytes(model) / 1e6
        floor = mb / bandwidth  # ms: MB / (GB/s)
        best_one = min(one[4:]) * 1e3
        rows.append(dict(model=name, prompt_tokens=len(ids), prefill_ms=min(prefill[1:]) * 1e3,
                         one_ms=best_one, three_ms=min(three[4:]) * 1e3, weights_MB=mb, floor_ms=floor,
                         one_vs_floor=best_one / floor))
    return rows


def main() -> None:
    parser = e2e_parser(__doc__, "drafter_budget", prompts=8, new_tokens=48, modes=None, seed=None)
    parser.add_argument("--method", default="slem", choices=["slem", "tli"], help="the drafter method")
    parser.add_argument("--ks", default="1,2,3,4", help="fixed draft lengths to run beside auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plot", default=None, help="also draw the time split to this PNG")
    args = parse_e2e_args(parser)

    import specops
    from specops.decoding import drafter as drafter_module

    prompts = load_prompts(args.first, args.prompts)
    reads: list[tuple[int, float]] = []
    unwrapped = drafter_module.DrafterProposer.read

    def timed_read(self):
        tokens, began = sum(len(p) for p in self.pending), time.perf_counter()
        out = unwrapped(self)
        reads.append((tokens, time.perf_counter() - began))
        return out

    drafter_module.DrafterProposer.read = timed_read
    configs = ["ar", "auto", *(int(k) for k in args.ks.split(",") if k)]
    for method in ("ar", args.method):  # warm-up: conversions, probes, first-call work
        specops.decode(["def add(a, b):\n"], target=TARGET, drafter=None if method == "ar" else DRAFTER,
                       method=method, max_new_tokens=8)
    sums = {str(c): dict(tokens=0, seconds=0.0, target_prefill=0.0, drafter_prefill=0.0, drafting=0.0,
                         verify=0.0, steps=0, drafted=0, accepted=0, same=0) for c in configs}
    outputs: list[tuple[str, int, list[int]]] = []  # (config, prompt, greedy tokens), compared at the end
    bandwidth_start = read_bandwidth_gbs()
    try:
        decode_all(specops, args, prompts, configs, sums, outputs, reads)
    finally:
        drafter_module.DrafterProposer.read = unwrapped
    bandwidth_end = read_bandwidth_gbs()
    reference = {i: tokens for config, i, tokens in outputs if config == "ar"}
    for config, i, tokens in outputs:
        sums[config]["same"] += int(tokens == reference[i])

    ar = sums["ar"]
    ar_rate = ar["tokens"] / ar["seconds"]
    ar_decoding = ar["tokens"] / (ar["seconds"] - ar["target_prefill"])
    rows = []
    for config in configs:
        r = sums[str(config)]
        decoding = r["seconds"] - r["target_prefill"] - r["drafter_prefill"]
        rows.append(dict(config="ar" if config == "ar" else f"{args.method} K={config}", tokens=r["tokens"],
                         seconds=r["seconds"], **{"tok/s": r["tokens"] / r["seconds"]},
                         vs_ar=r["tokens"] / r["seconds"] / ar_rate,
                         vs_ar_no_prefills=r["tokens"] / decoding / ar_decoding,
                         target_prefill=r["target_prefill"], drafter_prefill=r["drafter_prefill"],
                         drafting=r["drafting"], verify=r["verify"],
                         other=decoding - r["drafting"] - r["verify"],
                         steps=r["steps"], drafted=r["drafted"], accepted=r["accepted"],
                         same_as_ar=f"{r['same']}/{args.rounds * len(prompts)}"))
    info = {**machine_info("cpu"), "read_GBps_start": f"{bandwidth_start:.1f}",
            "read_GBps_end": f"{bandwidth_end:.1f}"}
    print(f"read bandwidth {bandwidth_start:.1f} GB/s at the start, {bandwidth_end:.1f} at the end")
    print(markdown_table(rows, COLUMNS))
    forward_rows = forwards(prompts[0])
    print(markdown_table(forward_rows, FORWARD_COLUMNS))
    path = csv_path(args)
    write_csv_columns(path, rows + forward_rows, COLUMNS + FORWARD_COLUMNS, info)
    print(f"CSV: {path}")
    if args.plot:
        plot(rows, args.plot, info)


def decode_all(specops, args, prompts, configs, sums, outputs, reads) -> None:
    """Every round: each prompt decoded by every configuration, the order reversed every other prompt."""
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for config in (configs if (round_ + i) % 2 == 0 else configs[::-1]):
                reads.clear()
                options = {} if config == "ar" else dict(drafter=DRAFTER, num_draft_tokens=config)
                began = time.perf_counter()
                method = "ar" if config == "ar" else args.method
                result = specops.decode([prompt], target=TARGET, method=method,
                                        max_new_tokens=args.new_tokens, **options)
                seconds = time.perf_counter() - began
                s, row = result.stats, sums[str(config)]
                prompt_reads = sum(t for n, t in reads if n > PROMPT_READ)
                outputs.append((str(config), i, result.tokens[0]))
                row["tokens"] += s.new_tokens
                row["seconds"] += seconds
                row["target_prefill"] += s.prefill_seconds
                row["drafter_prefill"] += prompt_reads
                row["drafting"] += s.draft_seconds - prompt_reads
                row["verify"] += s.verify_seconds
                row["steps"] += s.steps
                row["drafted"] += s.drafted
                row["accepted"] += s.accepted


def plot(rows: list[dict], path: str, info: dict) -> None:
    """Stacked bars: seconds per generated token of each configuration, by part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("target_prefill", "target prefill"), ("drafter_prefill", "drafter reads the prompt"),
             ("drafting", "drafter forwards, re-encoding"), ("verify", "target forwards"), ("other", "other")]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    bottom = [0.0] * len(rows)
    for key, label in parts:
        heights = [1e3 * r[key] / r["tokens"] for r in rows]
        ax.bar([r["config"] for r in rows], heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (r, top) in enumerate(zip(rows, bottom)):
        ax.text(x, top + 0.3, f"{r['vs_ar']:.2f}x", ha="center", fontsize=9)
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"Where the time goes, one prompt at a time ({info['machine']}, {info['threads']} threads)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
