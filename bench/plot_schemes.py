"""docs/schemes_e2e_cpu.png from docs/schemes_e2e_cpu_run{1,2}.csv: tokens/s of sampled decoding with each
verification scheme at a fixed draft setting, per method, against plain decoding (bench/bench_e2e.py
--schemes token,block,recursive,traversal; docs/benchmarks.md says how each run was made).

    python bench/plot_schemes.py
"""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
# (label, config name without its scheme suffix, the schemes in bar order: matched first, then the op's two)
GROUPS = [("sd self:{n}\nK=3", "specops sd self:{n} K=3", ("token", "block")),
          ("tli\nK=3", "specops tli K=3", ("token", "block")),
          ("slem\nK=3", "specops slem K=3", ("token", "block")),
          ("ngram\n4 rows x 3", "specops ngram 4,3", ("recursive", "traversal"))]
COLORS = ("#8a8a8a", "#d08c2c", "#2f6db5")


def read(name: str) -> dict[str, dict]:
    with open(DOCS / name) as f:
        return {row["config"]: row for row in csv.DictReader(f)}


def panel(ax, rows: dict[str, dict], title: str) -> None:
    n = next(r["early_exit"] for r in rows.values())
    ar = float(rows["specops ar"]["tok/s"])
    for g, (label, base, schemes) in enumerate(GROUPS):
        base = base.format(n=n)
        names = [base] + [f"{base} scheme={s}" for s in schemes]
        for i, (name, scheme) in enumerate(zip(names, ("positional",) + schemes)):
            row = rows[name]
            x = g + (i - 1) * 0.27
            ax.bar(x, float(row["tok/s"]), 0.27, color=COLORS[i if i == 0 else (1 if scheme in ("token", "recursive") else 2)])
            ax.text(x, float(row["tok/s"]) + 0.3, f"{float(row['acceptance']):.2f}", ha="center", fontsize=7)
    ax.axhline(ar, color="black", linewidth=1, linestyle="--")
    ax.text(-0.45, ar + 0.3, f"plain (ar) {ar:.1f}", fontsize=8, ha="left")
    ax.set_xticks(range(len(GROUPS)), [label.format(n=n) for label, _, _ in GROUPS])
    ax.set_ylabel("tokens/s (4 or 8 prompts, 64 new tokens)")
    ax.set_title(title, fontsize=10)


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    panel(axes[0], read("schemes_e2e_cpu_run1.csv"), "run 1: HumanEval/0-3, sd drafter self:6")
    panel(axes[1], read("schemes_e2e_cpu_run2.csv"), "run 2: HumanEval/4-11, sd drafter self:15")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS]
    fig.suptitle("Sampled decoding (T = 1) by verification scheme, Gemma-3-270M, 2-vCPU Xeon "
                 "(numbers on the bars: fraction of drafts kept)", fontsize=10)
    fig.legend(handles, ["positional (auto with a seed)", "token / recursive", "block / traversal"],
               loc="upper center", ncol=3, fontsize=9, bbox_to_anchor=(0.5, 0.94))
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    fig.savefig(DOCS / "schemes_e2e_cpu.png", dpi=110)
    print(f"wrote {DOCS / 'schemes_e2e_cpu.png'}")


if __name__ == "__main__":
    main()
