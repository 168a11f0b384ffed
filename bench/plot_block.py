"""docs/block_verification_cpu.png from the CSVs in docs/: drafts kept per chain on the real pair (token-level
against block verification, bench/block_acceptance.py) and tli's tokens/s by scheme (bench/bench_e2e.py
--schemes token,block, two runs).

    python bench/plot_block.py
"""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"


def read(name: str) -> list[dict]:
    with open(DOCS / name) as f:
        return list(csv.DictReader(f))


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = read("block_acceptance.csv")
    labels = [f"T={float(r['T']):g}\nK={r['K']}" for r in rows]
    x = range(len(rows))
    token = [float(r["token"]) for r in rows]
    block = [float(r["block"]) for r in rows]
    left.bar([i - 0.2 for i in x], token, 0.4, label="token-level", color="#8a8a8a")
    left.bar([i + 0.2 for i in x], block, 0.4, label="block", color="#2f6db5")
    for i, (t, b) in enumerate(zip(token, block)):
        left.text(i + 0.2, b + 0.02, f"{b / t:.3f}x", ha="center", fontsize=8)
    left.set_xticks(list(x), labels)
    left.set_ylabel("drafts kept per chain (expected)")
    left.set_title("Gemma-3-270M / SmolLM2-135M (TLI q), code")
    left.legend(loc="upper left")

    schemes = [("specops tli", "positional"), ("specops tli scheme=token", "token"),
               ("specops tli scheme=block", "block")]
    settings = [("block_e2e_cpu_run1.csv", "sample", "T=1 (run 1)"), ("block_e2e_cpu_run2.csv", "sample", "T=1 (run 2)"),
                ("block_e2e_cpu_run2.csv", "nucleus", "T=0.8, top-p 0.95")]
    colors = {"positional": "#c9a227", "token": "#8a8a8a", "block": "#2f6db5"}
    for j, (name, mode, label) in enumerate(settings):
        by_config = {r["config"]: r for r in read(name) if r["mode"] == mode}
        ar = float(by_config["specops ar"]["tok/s"])
        for s, (config, scheme) in enumerate(schemes):
            value = float(by_config[config]["tok/s"]) / ar
            right.bar(j + (s - 1) * 0.27, value, 0.27, color=colors[scheme], label=scheme if j == 0 else None)
            right.text(j + (s - 1) * 0.27, value + 0.01, f"{value:.2f}", ha="center", fontsize=7)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(settings)), [label for _, _, label in settings])
    right.set_ylim(0.8, 1.25)
    right.set_ylabel("tli tokens/s over specops ar")
    right.set_title("tli by scheme, 4 HumanEval prompts, 64 tokens")
    right.legend(loc="upper left", fontsize=8)
    fig.suptitle("Block verification, Intel Xeon 2 vCPUs, 2026-11-28", fontsize=10)
    fig.tight_layout()
    fig.savefig(DOCS / "block_verification_cpu.png", dpi=110)


if __name__ == "__main__":
    main()
