"""Drafter weights benchmark: SmolLM2-135M as a drafter for Gemma-3-270M with float32, bf16, int8 and int4
weights (`specops.quantize`), side by side in one run (also `bench_e2e.py --configs drafters`).

    python bench/bench_drafters.py [--prompts 4] [--first 0] [--new-tokens 64] [--modes greedy,sample]
                                   [--weights float32,bf16,int8,int4] [--threads 2] [--plot]

Three parts, each on the same models and HumanEval prompts:
  forward      one forward over 1 and 4 new tokens after a 100-token cache, through specops' CPU path, best
               of 7 interleaved runs: SmolLM2 in each format and Gemma float32; the ratio to Gemma's.
  agreement    SmolLM2's greedy (argmax) token in each format against float32's, teacher-forced over every
               position of prompt + 64 tokens float32 SmolLM2 generates greedily.
  decoding     specops slem (greedy) and tli (T=1), num_draft_tokens "auto", with the drafter in each format,
               and specops ar; configurations round-robin per prompt. tok/s, ratio to ar, target calls and
               drafter calls per token, acceptance, mean drafts per step, and greedy outputs equal to ar's.

Writes bench/results/drafters_<device>.csv and, with --plot, docs/drafters_cpu.png.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _timing import CpuLoad, e2e_parser, format_table, machine_info, parse_e2e_args, write_csv_columns

MODES = {"greedy": dict(temperature=0.0, method="slem"), "sample": dict(temperature=1.0, method="tli")}
WEIGHTS = ("float32", "bf16", "int8", "int4")
WARMUP_TOKENS = 8
COLUMNS = ["part", "mode", "config", "weights", "fwd1_ms", "fwd4_ms", "vs_gemma_1", "vs_gemma_4", "agreement",
           "tokens", "tok/s", "vs_ar", "calls/tok", "drafter/tok", "acceptance", "mean_K", "same_as_ar", "others"]


@dataclass
class Run:
    mode: str
    config: str
    weights: str
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    in_flight: int = 0
    outputs: dict = field(default_factory=dict)
    others: list = field(default_factory=list)


def forward_ms(models: dict, rounds: int = 7, context: int = 100) -> dict:
    """{(name, new tokens): best ms} of a forward over 1 and 4 new tokens after `context` cached tokens,
    through the path decoding takes (`CausalLM.forward`: the Llama-family path or CpuForward where they
    apply), names interleaved per round."""
    from specops.decoding.engine import CausalLM

    best = {}
    adapters = {name: CausalLM(model, name) for name, model in models.items()}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, lm in adapters.items():
                device = lm.device
                for n in (1, 4):
                    cache = lm.new_cache()
                    prompt = (torch.arange(context, device=device).unsqueeze(0) * 7 + 3) % 1000
                    lm.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(context).unsqueeze(0),
                               cache, keep=1)
                    ids = torch.arange(n, device=device).unsqueeze(0) + 7
                    mask = torch.ones(1, context + n, dtype=torch.bool, device=device)
                    positions = torch.arange(context, context + n, device=device).unsqueeze(0)
                    _sync(device)
                    start = time.perf_counter()
                    lm.forward(ids, mask, positions, cache, keep=n)
                    _sync(device)
                    ms = (time.perf_counter() - start) * 1e3
                    best[name, n] = min(best.get((name, n), ms), ms)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreement(reference, model, sequences: list[torch.Tensor]) -> float:
    """Share of positions where `model`'s argmax equals `reference`'s, teacher-forced over `sequences`."""
    same = total = 0
    with torch.inference_mode():
        for ids in sequences:
            want = reference(ids).logits.argmax(-1)
            got = model(ids).logits.argmax(-1)
            same += int((want == got).sum())
            total += want.numel()
    return same / total


def plot(csv_path, png_path) -> None:
    """Left: SmolLM2 forward time over Gemma's per format; right: slem greedy / tli T=1 tok/s over ar."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    forward = [r for r in rows if r["part"] == "forward" and r["config"] == "smollm2-135m"]
    decoding = [r for r in rows if r["part"] == "decoding" and r["weights"] and r["vs_ar"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["weights"] for r in forward]
    for i, (column, label) in enumerate((("vs_gemma_1", "1 token"), ("vs_gemma_4", "4 tokens"))):
        left.bar([x + (i - 0.5) * 0.38 for x in range(len(names))], [float(r[column]) for r in forward], 0.38,
                 label=label)
    left.axhline(0.4, color="red", linewidth=0.8, linestyle="--", label="goal 0.4")
    left.set_xticks(range(len(names)))
    left.set_xticklabels([f"{n}\n{float(r['agreement']):.1%} agree" if r["agreement"] else n
                          for n, r in zip(names, forward)], fontsize=8)
    left.set_ylabel("SmolLM2 forward / Gemma fp32 forward")
    left.set_title("drafter forward cost")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    modes = list(dict.fromkeys(r["mode"] for r in decoding))
    weights = list(dict.fromkeys(r["weights"] for r in decoding))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        values = [next((float(r["vs_ar"]) for r in decoding if r["mode"] == mode and r["weights"] == w), 0.0)
                  for w in weights]
        config = next(r["config"] for r in decoding if r["mode"] == mode)
        label = f"{config} {'greedy' if mode == 'greedy' else 'T=1'}"
        right.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(weights))], values, width, label=label)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.axhline(1.2, color="red", linewidth=0.8, linestyle="--", label="goal 1.2")
    right.set_xticks(range(len(weights)))
    right.set_xticklabels(weights)
    right.set_ylabel("tok/s over specops ar")
    right.set_title("Gemma-3-270M with drafter SmolLM2-135M")
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    where = f"{rows[0].get('machine', '?')}, {rows[0].get('threads', '?')} threads" if rows else "?"
    fig.suptitle(f"SmolLM2-135M drafter weights on {where} (HumanEval, 64 tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def run(args) -> None:
    import specops
    from specops import models

    from _timing import load_prompts

    torch.set_num_threads(args.threads)
    weights = [w for w in args.weights.split(",") if w]
    if any(w not in WEIGHTS for w in weights):
        raise SystemExit(f"--weights: choose from {', '.join(WEIGHTS)}")
    gemma, gemma_tok = models.load("gemma-3-270m", device=args.device)
    smol, smol_tok = models.load("smollm2-135m", device=args.device)
    drafters = {w: smol if w == "float32" else specops.quantize(copy.deepcopy(smol), w) for w in weights}
    default = models.drafter_weights("smollm2-135m")
    prompts = load_prompts(args.first, args.prompts)
    rows = []
    info = machine_info(args.device)
    start_all = time.perf_counter()

    # forward cost
    best = forward_ms({"gemma-3-270m": gemma, **{f"smollm2-135m:{w}": m for w, m in drafters.items()}})
    sequences = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = smol_tok(prompt, return_tensors="pt").input_ids.to(args.device)
            sequences.append(smol.generate(ids, max_new_tokens=64, do_sample=False,
                                           pad_token_id=smol_tok.pad_token_id))
    rows.append({"part": "forward", "config": "gemma-3-270m", "weights": "float32",
                 "fwd1_ms": f"{best['gemma-3-270m', 1]:.2f}", "fwd4_ms": f"{best['gemma-3-270m', 4]:.2f}"})
    for w, model in drafters.items():
        key = f"smollm2-135m:{w}"
        rows.append({"part": "forward", "config": "smollm2-135m", "weights": w + (" (default)" if w == default else ""),
                     "fwd1_ms": f"{best[key, 1]:.2f}", "fwd4_ms": f"{best[key, 4]:.2f}",
                     "vs_gemma_1": f"{best[key, 1] / best['gemma-3-270m', 1]:.3f}",
                     "vs_gemma_4": f"{best[key, 4] / best['gemma-3-270m', 4]:.3f}",
                     "agreement": f"{agreement(smol, model, sequences):.4f}" if w != "float32" else ""})
    print("forward and agreement done", file=sys.stderr, flush=True)

    # decoding
    for mode in args.modes.split(","):
        settings = MODES[mode]
        configs = [("specops ar", "", dict(method="ar"))]
        configs += [(f"specops {settings['method']}", w, dict(method=settings["method"], drafter=m,
                                                              drafter_tokenizer=smol_tok, num_draft_tokens="auto"))
                    for w, m in drafters.items()]
        runs = [Run(mode, name, w) for name, w, _ in configs]

        def once(kwargs, prompt, seed, tokens):
            return specops.decode(prompt, target=gemma, tokenizer=gemma_tok, max_new_tokens=tokens, seed=seed,
                                  temperature=settings["temperature"], **kwargs)

        for _, _, kwargs in configs:
            once(kwargs, prompts[0], 0, WARMUP_TOKENS)
        for index, prompt in enumerate(prompts):
            for record, (_, _, kwargs) in zip(runs, configs):
                load = CpuLoad().start()
                start = time.perf_counter()
                result = once(kwargs, prompt, args.seed + index, args.new_tokens)
                record.seconds += time.perf_counter() - start
                record.others.append(load.stop())
                stats = result.stats
                record.tokens += len(result.tokens)
                record.outputs[index] = result.tokens
                record.target_calls += stats.target_calls
                record.drafter_calls += stats.drafter_calls
                record.drafted += stats.drafted
                record.accepted += stats.accepted
                record.steps += stats.steps
                record.in_flight += sum(stats.draft_lengths)
            print(f"  {mode}: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
        ar = runs[0]
        ar_tps = ar.tokens / ar.seconds
        for r in runs:
            tps = r.tokens / r.seconds if r.seconds else 0.0
            same = ""
            if mode == "greedy" and r is not ar:
                same = f"{sum(r.outputs[i] == ar.outputs[i] for i in ar.outputs)}/{len(ar.outputs)}"
            rows.append({"part": "decoding", "mode": mode, "config": r.config,
                         "weights": r.weights + (" (default)" if r.weights == default else ""),
                         "tokens": r.tokens, "tok/s": f"{tps:.2f}", "vs_ar": f"{tps / ar_tps:.2f}" if r is not ar else "",
                         "calls/tok": f"{r.target_calls / r.tokens:.2f}" if r.tokens else "",
                         "drafter/tok": f"{r.drafter_calls / r.tokens:.2f}" if r.drafter_calls and r.tokens else "",
                         "acceptance": f"{r.accepted / r.drafted:.2f}" if r.drafted else "",
                         "mean_K": f"{r.in_flight / r.steps:.2f}" if r.drafted and r.steps else "",
                         "same_as_ar": same, "others": f"{max(r.others):.2f}" if r.others else ""})
    print()
    print(f"drafter weights: SmolLM2-135M drafting for Gemma-3-270M (float32), {len(prompts)} HumanEval prompts from "
          f"{args.first}, {args.new_tokens} new tokens, batch 1; {info['machine']}, {info['threads']} threads, torch "
          f"{info['torch']}; run took {time.perf_counter() - start_all:.0f} s")
    print(format_table(rows, COLUMNS))
    print("\nvs_gemma_n: SmolLM2 forward over n new tokens / Gemma float32's; agreement: SmolLM2's argmax equal to "
          "float32 SmolLM2's; vs_ar: tok/s over specops ar; mean_K: drafter tokens per step; others: cores kept busy "
          "by other processes.")
    path = Path(args.csv or Path(__file__).parent / "results" / f"drafters_{args.device}.csv")
    write_csv_columns(path, rows, COLUMNS, info)
    print(f"wrote {path}")
    if args.plot:
        plot(path, Path(__file__).parent.parent / "docs" / "drafters_cpu.png")


def main() -> None:
    parser = e2e_parser(__doc__, "drafters", prompts=4, modes_help="greedy (slem), sample (tli at T=1)")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="drafter weights to compare")
    parser.add_argument("--plot", action="store_true", help="also draw docs/drafters_cpu.png")
    parser.add_argument("--plot-from", default=None, help="only draw the plot from this CSV")
    args = parse_e2e_args(parser)
    if args.plot_from:
        plot(args.plot_from, Path(__file__).parent.parent / "docs" / "drafters_cpu.png")
        return
    run(args)


if __name__ == "__main__":
    main()
