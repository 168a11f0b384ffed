"""Block efficiency of draft trees against chains: tokens per target call (and tokens per second) of
specops `sd` (a chain of K drafts; `tli` for a drafter with another vocabulary), `specinfer` (a tree with
i.i.d. siblings), `rsd-c` (the same tree, siblings without replacement) and `rsd-s` (W beams of
Stochastic Beam Search), with the same drafter, prompts and settings (paper 003 Figures 4 and 5).

    python bench/bench_trees.py [--prompts 6] [--first 0] [--new-tokens 64] [--drafter self:15]
                                [--temperatures 1,0.3] [--study depth,budget] [--depths 2,3,4,5]
                                [--budgets 6,10,14,21,30] [--methods sd,specinfer,rsd-c,rsd-s] [--beams 3]
                                [--seed 1234] [--threads 2] [--device cpu] [--csv PATH] [--plot PATH]

Target Gemma-3-270M (float32, embedded), HumanEval/0.. prompts decoded one at a time, sampling at each
temperature (top-k 0, top-p 1), the same seed for every configuration. The drafter is `self:N` or
SmolLM2-135M (`--drafter smollm2-135m`: another vocabulary, drafted through the intersection of both). Two
studies:

- depth: draft depth L = 2..5. sd with K = L; rsd-c and specinfer trees (2, 2, 1, ..., 1) of depth L (two
  children at the first two levels, then one: 6, 10, 14, 18 nodes); rsd-s with W = 3 beams (6, 9, 12, 15;
  --beams sets W).
- budget: trees of about B draft nodes per target call, B in {6, 10, 14, 21, 30}: (2, 2), (2, 2, 1),
  (2, 2, 2), (3, 2, 1, 1), (2, 2, 2, 2); rsd-s (3, 2), (5, 2), (7, 2), (7, 3), (10, 3); sd with K = the
  rsd-c tree's depth (the chain a budget of B could afford is longer, but its acceptance falls off
  geometrically, so depth is the fair length).

Tokens per target call counts every new token (accepted drafts and the target's own) over target
forwards, the prefill included. On a CPU, tok/s is what a user gets here; on a GPU, where a forward of
30 tokens costs about one of 1, tokens per call is what tok/s follows.
"""

from __future__ import annotations

import csv
import sys
import time

import torch

from _timing import csv_path, e2e_parser, load_prompts, parse_e2e_args

DEPTH_SHAPES = {2: (2, 2), 3: (2, 2, 1), 4: (2, 2, 1, 1), 5: (2, 2, 1, 1, 1)}
BUDGET_SHAPES = {6: (2, 2), 10: (2, 2, 1), 14: (2, 2, 2), 21: (3, 2, 1, 1), 30: (2, 2, 2, 2)}
DEPTH_BEAMS = {d: (3, d) for d in DEPTH_SHAPES}  # rsd-s (W, L)
BUDGET_BEAMS = {6: (3, 2), 10: (5, 2), 14: (7, 2), 21: (7, 3), 30: (10, 3)}
METHODS = ("sd", "specinfer", "rsd-c", "rsd-s")


def nodes(method: str, setting) -> int:
    """Draft tokens per request a step carries."""
    if method == "sd":
        return setting
    if method == "rsd-s":
        return setting[0] * setting[1]
    total, width = 0, 1
    for b in setting:
        width *= b
        total += width
    return total


def cases(studies: list[str], depths: list[int], budgets: list[int],
          methods: list[str]) -> list[tuple[str, int, str, object]]:
    """(study, x, method, num_draft_tokens)."""
    out = []
    for study in studies:
        xs = depths if study == "depth" else budgets
        for x in xs:
            shape = DEPTH_SHAPES[x] if study == "depth" else BUDGET_SHAPES[x]
            beams = DEPTH_BEAMS[x] if study == "depth" else BUDGET_BEAMS[x]
            for method in methods:
                out.append((study, x, method, len(shape) if method == "sd" else beams if method == "rsd-s"
                            else shape))
    return out


def main() -> int:
    parser = e2e_parser(__doc__, "trees", prompts=6, modes=None, seed=1234)
    parser.add_argument("--drafter", default="self:15",
                        help="same-vocabulary drafter (Gemma's first 6 or 12 layers accept almost nothing at T = 1)")
    parser.add_argument("--temperatures", default="1,0.3")
    parser.add_argument("--study", default="depth,budget")
    parser.add_argument("--depths", default="2,3,4,5", help=f"of {sorted(DEPTH_SHAPES)}")
    parser.add_argument("--budgets", default="6,10,14,21,30", help=f"of {sorted(BUDGET_SHAPES)}")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--beams", type=int, default=3, help="rsd-s beams W in the depth study")
    parser.add_argument("--plot", default=None, help="PNG of tokens per target call (both studies)")
    parser.add_argument("--from-csv", default=None,
                        help="comma-separated CSVs of earlier runs: merge them into --csv and plot, without decoding")
    args = parse_e2e_args(parser)
    args.csv = csv_path(args)
    if args.from_csv:
        return merge(args)
    import specops

    model, tokenizer = specops.models.load("gemma-3-270m", device=args.device)
    prompts = load_prompts(args.first, args.prompts)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    studies = [s for s in args.study.split(",") if s]
    rows = []
    depths = [int(d) for d in args.depths.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    DEPTH_BEAMS.update({d: (args.beams, d) for d in DEPTH_SHAPES})
    todo = [(t, *c) for t in temperatures for c in cases(studies, depths, budgets, methods)]
    drafter = args.drafter
    other_vocabulary = not drafter.startswith("self:")
    if other_vocabulary:
        drafter = specops.models.load(drafter, device=args.device)  # (model, tokenizer)
    for i, (temperature, study, x, method, setting) in enumerate(todo):
        kwargs = dict(target=model, tokenizer=tokenizer, num_draft_tokens=setting, temperature=temperature,
                      method="tli" if method == "sd" and other_vocabulary else method)
        if other_vocabulary:
            kwargs.update(drafter=drafter[0], drafter_tokenizer=drafter[1])
        else:
            kwargs.update(drafter=drafter)
        specops.decode(prompts[0], seed=args.seed, max_new_tokens=4, **kwargs)  # warm-up (tree probe, caches)
        tokens = calls = accepted = drafted = 0
        seconds = 0.0
        for p, prompt in enumerate(prompts):
            start = time.perf_counter()
            result = specops.decode(prompt, seed=args.seed + p, max_new_tokens=args.new_tokens, **kwargs)
            seconds += time.perf_counter() - start
            tokens += result.stats.new_tokens
            calls += result.stats.target_calls
            accepted += result.stats.accepted
            drafted += result.stats.drafted
        row = dict(temperature=temperature, study=study, x=x, method=method, setting=str(setting),
                   nodes=nodes(method, setting), tokens=tokens, target_calls=calls,
                   tokens_per_call=tokens / calls, tok_s=tokens / seconds, accepted=accepted, drafted=drafted)
        rows.append(row)
        print(f"[{i + 1}/{len(todo)}] T={temperature} {study} {x} {method} {setting}: "
              f"{row['tokens_per_call']:.3f} tokens/call, {row['tok_s']:.1f} tok/s", flush=True)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'T':>4} {'study':6} {'x':>3} {'method':9} {'setting':16} {'nodes':>5} {'tok/call':>8} "
          f"{'vs sd':>6} {'tok/s':>6}")
    for row in rows:
        sd = next(r for r in rows if r["temperature"] == row["temperature"] and r["study"] == row["study"]
                  and r["x"] == row["x"] and r["method"] == "sd")
        print(f"{row['temperature']:>4} {row['study']:6} {row['x']:>3} {row['method']:9} {row['setting']:16} "
              f"{row['nodes']:>5} {row['tokens_per_call']:>8.3f} "
              f"{row['tokens_per_call'] / sd['tokens_per_call']:>6.2f} "
              f"{row['tok_s']:>6.1f}")
    print(f"\nGemma-3-270M fp32, drafter {args.drafter}, {len(prompts)} HumanEval prompts, {args.new_tokens} new "
          f"tokens, {args.threads} threads, torch {torch.__version__}; wrote {args.csv}")
    if args.plot:
        plot(rows, temperatures, studies, args.plot, args.drafter)
        print(f"wrote {args.plot}")
    return 0


def merge(args) -> int:
    """Rows of earlier runs (the last row of a repeated configuration wins), written to --csv, plotted."""
    rows = {}
    for path in args.from_csv.split(","):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("temperature", "tokens_per_call", "tok_s"):
                    row[key] = float(row[key])
                for key in ("x", "nodes", "tokens", "target_calls", "accepted", "drafted"):
                    row[key] = int(row[key])
                rows[(row["temperature"], row["study"], row["x"], row["method"], row["setting"])] = row
    ordered = sorted(rows.values(), key=lambda r: (-r["temperature"], r["study"], r["x"],
                                                    METHODS.index(r["method"]), r["nodes"]))
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ordered[0]))
        writer.writeheader()
        writer.writerows(ordered)
    temperatures = sorted({r["temperature"] for r in ordered}, reverse=True)
    studies = [s for s in ("depth", "budget") if any(r["study"] == s for r in ordered)]
    if args.plot:
        plot(ordered, temperatures, studies, args.plot, args.drafter)
    print(f"merged {len(ordered)} rows into {args.csv}" + (f", plotted {args.plot}" if args.plot else ""))
    return 0


def plot(rows, temperatures, studies, path, drafter):
    """One panel per (temperature, study) that has rows: tokens per target call of each method. In the
    depth study rsd-s is drawn at W = 3 (other widths are in the CSV and the table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(t, study) for t in temperatures for study in studies
              if any(r["temperature"] == t and r["study"] == study for r in rows)]
    columns = min(2, len(panels))
    lines = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(5.5 * columns, 3.6 * lines), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (temperature, study) in zip(axes.flat, panels):
        for method in sorted({r["method"] for r in rows}, key=METHODS.index):
            points = sorted((r["x"], r["tokens_per_call"]) for r in rows
                            if r["temperature"] == temperature and r["study"] == study and r["method"] == method
                            and (method != "rsd-s" or study != "depth" or r["setting"].startswith("(3,")))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft depth L" if study == "depth" else "draft tree nodes per call")
        ax.set_ylabel("tokens per target call")
        ax.set_title(f"T = {temperature}, {study}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Gemma-3-270M, drafter {drafter}, HumanEval prompts (sd: a chain of L drafts; tli for a drafter "
                 "with another vocabulary)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
