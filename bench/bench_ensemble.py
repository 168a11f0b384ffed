"""Ensemble benchmark: Speculative Ensemble (`se`) and ensemble-SD against the standard ensemble on the
real models, HumanEval prompts, greedy and T=1, in one run (also `bench_e2e.py --configs ensembles`).

    python bench/bench_ensemble.py [--prompts 4] [--first 0] [--new-tokens 64] [--modes greedy,sample]
                                   [--pairs hetero,same] [--rules w55,w73,cd] [--methods all] [--early-exit 6]
                                   [--threads 2]

Pairs (members in order; the first member's tokenizer gives the output):
  hetero  Gemma-3-270M + SmolLM2-135M (another vocabulary: it contributes through the shared tokens)
  same    Gemma-3-270M + its own first N layers (self:N, --early-exit), the same vocabulary

Rules: w55 / w73 `specops.WeightedEnsemble([0.5, 0.5])` / `([0.7, 0.3])`, cd `specops.ContrastiveEnsemble(0.1)`
(Gemma the expert). Methods per pair and rule:
  ensemble     every member scores every token (the baseline)
  se           specops' default: at T=1 for a weighted rule, mixture draws (each token from one member chosen
               with its weight, no verification); otherwise the members propose to each other
               (num_draft_tokens "auto": gamma 1 each)
  se alternate (T=1, weighted rules) the members propose to each other, as the paper's Alg. 1
               (options={"draws": "alternate"})
  ensemble-SD  the second member drafts and the ensemble verifies: tli with drafter SmolLM2 (hetero), sd
               with drafter self:N (same); num_draft_tokens "auto"
  hf ensemble  transformers `generate(assistant_model=<Gemma's first N layers>, assistant_ensemble_weight=w)`
               (same pair, weighted rules: it verifies against w * p_target + (1 - w) * q_draft, the same
               mixture; transformers has no heterogeneous or contrastive form)

Reported: tok/s, ratio to the ensemble (same pair, rule, mode), forwards per new token of each member,
acceptance, and for greedy whether every prompt's tokens equal the ensemble's. Configurations run
round-robin per prompt; `others` is the load other processes put on the machine meanwhile.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _timing import CpuLoad, e2e_parser, format_table, machine_info, parse_e2e_args, write_csv

MODES = {"greedy": dict(temperature=0.0), "sample": dict(temperature=1.0)}
WARMUP_TOKENS = 4
COLUMNS = ["mode", "pair", "rule", "method", "tokens", "seconds", "tok/s", "vs_ensemble", "calls/tok by member",
           "acceptance", "same_as_ensemble", "others"]


@dataclass
class Row:
    mode: str
    pair: str
    rule: str
    method: str
    tokens: int = 0
    seconds: float = 0.0
    member_calls: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    outputs: dict = field(default_factory=dict)
    others: list = field(default_factory=list)


def rules(specops):
    return {"w55": specops.WeightedEnsemble([0.5, 0.5]), "w73": specops.WeightedEnsemble([0.7, 0.3]),
            "cd": specops.ContrastiveEnsemble(0.1)}


def main() -> None:
    parser = e2e_parser(__doc__, "ensemble", prompts=4)
    parser.add_argument("--pairs", default="hetero,same")
    parser.add_argument("--rules", default="w55,w73,cd")
    parser.add_argument("--methods", default="all",
                        help="comma-separated methods to run beside the ensemble (se, se alternate, ensemble-SD, "
                             "hf ensemble), or all")
    parser.add_argument("--early-exit", type=int, default=6)
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw the speed-ups into this PNG")
    parser.add_argument("--plot-from", default=None, metavar="CSV", help="only draw --plot from an earlier run's CSV")
    args = parse_e2e_args(parser)
    if args.plot_from:
        plot(args.plot_from, args.plot or "docs/ensembles_cpu.png")
        return
    run(args)
    if args.plot:
        plot(args.csv or Path(__file__).parent / "results" / f"ensemble_{args.device}.csv", args.plot)


def plot(csv_path, png_path) -> None:
    """Bars: tok/s of each method over the standard ensemble's, per pair and rule, greedy and T=1."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    methods = [m for m in ("se", "se alternate", "ensemble-SD", "hf ensemble") if any(r["method"] == m for r in rows)]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    groups = list(dict.fromkeys((r["pair"], r["rule"]) for r in rows))
    labels = {"w55": "w .5/.5", "w73": "w .7/.3", "cd": "contr. μ=.1"}
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 3.8), squeeze=False, sharey=True)
    width = 0.8 / len(methods)
    for ax, mode in zip(axes[0], modes):
        for i, method in enumerate(methods):
            values = []
            for pair, rule in groups:
                match = [r for r in rows if (r["mode"], r["pair"], r["rule"], r["method"]) == (mode, pair, rule, method)]
                values.append(float(match[0]["vs_ensemble"]) if match and match[0]["vs_ensemble"] else 0.0)
            label = "se (mixture draws)" if method == "se" and mode != "greedy" and "se alternate" in methods else method
            ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{'+SmolLM2' if p == 'hetero' else '+self:6'}\n{labels.get(r, r)}" for p, r in groups],
                           fontsize=7)
        ax.set_title("greedy" if mode == "greedy" else "T = 1")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("tok/s over the standard ensemble")
    top = max(bar.get_height() for ax in axes[0] for bar in ax.patches)
    axes[0][0].set_ylim(0, top * 1.22)  # room for the legend above the bars
    axes[0][0].legend(fontsize=8, loc="upper center", ncol=len(methods))
    fig.suptitle("Gemma-3-270M ensembles on a 2-core Xeon:\ntok/s over the standard ensemble (every member scores "
                 "every token)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def run(args) -> None:
    import specops
    from specops import models
    from specops.decoding.self_draft import truncated

    from _timing import load_prompts

    torch.set_num_threads(args.threads)
    gemma, gemma_tok = models.load("gemma-3-270m", device=args.device)
    smol, smol_tok = models.load("smollm2-135m", device=args.device)
    short = truncated(gemma, args.early_exit)
    pairs = {"hetero": ([gemma, smol], [gemma_tok, smol_tok], dict(method="tli", drafter=smol, drafter_tokenizer=smol_tok)),
             "same": ([gemma, short], [gemma_tok, gemma_tok], dict(method="sd", drafter=f"self:{args.early_exit}"))}
    chosen_rules = rules(specops)
    prompts = load_prompts(args.first, args.prompts)
    configs = []  # (pair, rule name, method, decode kwargs or None for transformers)
    for pair in args.pairs.split(","):
        members, tokenizers, sd = pairs[pair]
        for name in args.rules.split(","):
            rule = chosen_rules[name]
            base = dict(target=members, tokenizer=tokenizers, ensemble=rule)
            configs += [(pair, name, "ensemble", {**base, "method": "ensemble"}),
                        (pair, name, "se", {**base, "method": "se"})]
            if name.startswith("w"):  # at T=1 "se" draws from the mixture; the paper's proposals beside it
                configs.append((pair, name, "se alternate", {**base, "method": "se", "options": {"draws": "alternate"}}))
            configs.append((pair, name, "ensemble-SD", {**base, **sd}))
            if pair == "same" and name.startswith("w"):
                configs.append((pair, name, "hf ensemble", dict(weight=rule.weights[0])))
    if args.methods != "all":
        wanted = {"ensemble", *args.methods.split(",")}
        configs = [c for c in configs if c[2] in wanted]
    rows = []
    all_configs = configs
    for mode in args.modes.split(","):
        # Greedy se never draws from the mixture: "se alternate" is "se" there.
        configs = [c for c in all_configs if mode != "greedy" or c[2] != "se alternate"]
        records = [Row(mode, p, r, m) for p, r, m, _ in configs]

        def once(kwargs, prompt, seed, tokens):
            if "weight" in kwargs:  # transformers' static ensemble verification
                encoded = gemma_tok([prompt], return_tensors="pt").to(gemma.device)
                sample = MODES[mode]["temperature"] > 0
                torch.manual_seed(seed)
                extra = dict(temperature=1.0, top_k=0, top_p=1.0) if sample else {}
                with torch.inference_mode():
                    out = gemma.generate(**encoded, max_new_tokens=tokens, do_sample=sample, assistant_model=short,
                                         assistant_ensemble_weight=kwargs["weight"],
                                         pad_token_id=gemma_tok.pad_token_id, **extra)
                return out[0, encoded["input_ids"].shape[1]:].tolist(), None
            result = specops.decode(prompt, max_new_tokens=tokens, seed=seed, **kwargs, **MODES[mode])
            return result.tokens, result.stats

        for _, _, _, kwargs in configs:  # warm-up
            once(kwargs, prompts[0], 0, WARMUP_TOKENS)
        for index, prompt in enumerate(prompts):
            for record, (_, _, _, kwargs) in zip(records, configs):
                load = CpuLoad().start()
                start = time.perf_counter()
                tokens, stats = once(kwargs, prompt, args.seed + index, args.new_tokens)
                record.seconds += time.perf_counter() - start
                record.others.append(load.stop())
                record.tokens += len(tokens)
                record.outputs[index] = tokens
                if stats is not None:
                    calls = stats.member_calls or []
                    record.member_calls = [a + b for a, b in zip(record.member_calls or [0] * len(calls), calls)]
                    record.drafted += stats.drafted
                    record.accepted += stats.accepted
            print(f"  {mode}: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
        base = {(r.pair, r.rule): r for r in records if r.method == "ensemble"}
        for r in records:
            ref = base.get((r.pair, r.rule))
            tps = r.tokens / r.seconds if r.seconds else 0.0
            ref_tps = ref.tokens / ref.seconds if ref and ref.seconds else 0.0
            same = ""
            if mode == "greedy" and ref is not None and r is not ref:
                equal = sum(r.outputs[i] == ref.outputs[i] for i in ref.outputs)
                same = f"{equal}/{len(ref.outputs)}"
            rows.append({"mode": mode, "pair": r.pair, "rule": r.rule, "method": r.method, "tokens": r.tokens,
                         "seconds": f"{r.seconds:.1f}", "tok/s": f"{tps:.2f}",
                         "vs_ensemble": f"{tps / ref_tps:.2f}" if ref_tps else "",
                         "calls/tok by member": " + ".join(f"{c / r.tokens:.2f}" for c in r.member_calls)
                         if r.member_calls and r.tokens else "",
                         "acceptance": f"{r.accepted / r.drafted:.2f}" if r.drafted else "",
                         "same_as_ensemble": same,
                         "others": f"{max(r.others):.2f}" if r.others else ""})
    info = machine_info(args.device)
    print()
    print(f"ensembles: Gemma-3-270M + SmolLM2-135M (hetero) / + self:{args.early_exit} (same), {len(prompts)} HumanEval "
          f"prompts from {args.first}, {args.new_tokens} new tokens, batch 1; {info['machine']}, {info['threads']} "
          f"threads, torch {info['torch']}")
    print(format_table(rows, COLUMNS))
    path = args.csv or Path(__file__).parent / "results" / f"ensemble_{args.device}.csv"
    write_csv(path, rows, info)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
