"""One picture of every kernel's speedup over its peer, from the CSVs the kernel benchmarks wrote.

    python bench/plot_kernels.py [--device cpu] [--out docs/kernels_<device>.png]

Reads bench/results/<op>_<device>.csv (run bench/bench_<op>.py first; a missing CSV leaves its kernel out)
and draws, per kernel, the speedup of specops' kernel (with its input validation) over the peer named in
the label, one dot per benchmark case, and the median as a bar. The peer is what a user would otherwise
run: transformers' own code, the op as plain torch, or torch's own kernel.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# op: (speedup column, the specops row filter, the peer)
KERNELS = {
    "chain_verify": ("vs_hf", {"provider": "cpu"}, "transformers' speculative sampling"),
    "tree_verify": ("vs_loop", {"provider": "specops validated"}, "a torch loop over the tree"),
    "vocab_project": ("vs_peer", {"provider": "cpu"}, "transformers' TLI projection"),
    "ngram_match": ("vs_ref", {"provider": "cpu"}, "the torch reference"),
    "sample_without_replacement": ("vs_torch", {"provider": "specops"}, "torch sequential multinomial"),
    "stochastic_beam_step": ("vs_torch", {"provider": "specops"}, "the same step in torch"),
    "ensemble_logits": ("speedup", {}, "torch ops over the vocabulary"),
    "skinny_linear": ("speedup", {}, "F.linear (MKL)"),
    "quantized_linear": ("speedup", {"format": ("int8", "int4")}, "torch's int8 / int4 weight-only mm"),
}


def _matches(row: dict, wanted: dict) -> bool:
    for key, value in wanted.items():
        allowed = value if isinstance(value, tuple) else (value,)
        if row.get(key) not in allowed:
            return False
    return True


def speedups(device: str) -> dict[str, tuple[list[float], str]]:
    found = {}
    for op, (column, wanted, peer) in KERNELS.items():
        path = RESULTS / f"{op}_{device}.csv"
        if not path.exists():
            continue
        with open(path, newline="") as f:
            values = [float(r[column]) for r in csv.DictReader(f) if _matches(r, wanted) and r.get(column)]
        if values:
            found[op] = (values, peer)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    data = speedups(args.device)
    if not data:
        raise SystemExit(f"no bench/results/*_{args.device}.csv: run the kernel benchmarks first")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    ops = sorted(data, key=lambda op: statistics.median(data[op][0]))
    fig, ax = plt.subplots(figsize=(9.5, 0.55 * len(ops) + 1.4))
    for y, op in enumerate(ops):
        values, peer = data[op]
        median = statistics.median(values)
        ax.barh(y, median, color="#1f77b4", alpha=0.35, height=0.6)
        ax.scatter(values, [y] * len(values), s=10, color="#1f77b4", zorder=3)
        ax.annotate(f"{median:.1f}x", (median, y), xytext=(4, 6), textcoords="offset points", fontsize=8)
        print(f"{op:28s} median {median:7.2f}x  min {min(values):7.2f}x  max {max(values):7.2f}x  "
              f"({len(values)} cases) vs {peer}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_yticks(range(len(ops)))
    ax.set_yticklabels([f"{op}\nvs {data[op][1]}" for op in ops], fontsize=7.5)
    ax.set_xlabel("speedup over the peer (log scale; dots: benchmark cases, bar: median)")
    ax.set_title(f"specops kernels on {args.device.upper()}", fontsize=10)
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(__file__).parent.parent / "docs" / f"kernels_{args.device}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
