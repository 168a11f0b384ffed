"""How far recursive rejection sampling and traversal verification are from the most any lossless verifier
can keep, on whole trees of small Markov tables, exactly.

    python bench/tree_bound.py [--vocabs 2,3] [--seeds 4] [--tables correlated] [--csv docs/tree_bound.csv]

For each vocabulary, pair of tables (a target and a drafter distribution after every prefix; "correlated":
the drafter's logits are the target's plus noise, as a real drafter's are, `tree_laws.correlated_pair`;
"independent": unrelated tables with some probabilities exactly 0, python_tests/chain_cases.markov_tables)
and tree shape, every tree the drafter can draw is enumerated (children without
replacement as rsd-c draws them, i.i.d. as specinfer does, or the drafter's most likely tokens with one-hot
q), each verifier's outcomes on it are enumerated (python_tests/tree_laws.py), and the expected accepted
drafts are compared with the optimum over every lossless verifier (`tree_laws.optimal_accepted`: an optimal
transport bound over the whole tree). A chain (shape (1, ..., 1)) is block verification's case, which is
optimal for chains (Sun et al., ICLR 2025), so there the bound must be met. Prints a table per tree law and
writes every row to the CSV.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))

from tree_laws import (correlated_pair, optimal_accepted, recursive_outcomes, table_pair,  # noqa: E402
                       traversal_outcomes, tree_law)

SHAPES = [(1,), (1, 1), (1, 1, 1), (2,), (3,), (2, 1), (1, 2), (2, 2), (2, 1, 1)]
MODES = {"rsd": "without replacement (rsd-c)", "specinfer": "i.i.d. (specinfer)", "rows": "one-hot q (ngram)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="2,3")
    parser.add_argument("--seeds", type=int, default=4, help="table pairs per vocabulary and shape")
    parser.add_argument("--tables", choices=["correlated", "independent"], default="correlated")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    rows = []
    for mode in MODES:
        for shape in SHAPES:
            for vocab in (int(v) for v in args.vocabs.split(",")):
                for seed in range(args.seeds):
                    pair = correlated_pair if args.tables == "correlated" else table_pair
                    target, drafter = pair(vocab, len(shape), 1000 + 100 * vocab + 10 * seed + len(shape))
                    _, recursive = tree_law(target, drafter, vocab, shape, mode, recursive_outcomes)
                    _, traversal = tree_law(target, drafter, vocab, shape, mode, traversal_outcomes)
                    try:
                        bound = optimal_accepted(target, drafter, vocab, shape, mode)
                    except RuntimeError as error:  # HiGHS, on some tables with exact zeros: left out, and said
                        print(f"{mode} {shape} V={vocab} seed {seed}: {error}", file=sys.stderr)
                        continue
                    rows.append(dict(mode=mode, shape=",".join(map(str, shape)), vocab=vocab, seed=seed,
                                     recursive=recursive, traversal=traversal, bound=bound))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print("| trees | shape | pairs | recursive / bound | traversal / bound | traversal / recursive |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, label in MODES.items():
        for shape in SHAPES:
            group = [r for r in rows if r["mode"] == mode and r["shape"] == ",".join(map(str, shape))
                     and r["bound"] > 1e-9]

            def spread(key, over):
                ratios = [r[key] / r[over] for r in group if r[over] > 1e-9]
                return f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"

            print(f"| {label} | ({', '.join(map(str, shape))}) | {len(group)} | {spread('recursive', 'bound')} | "
                  f"{spread('traversal', 'bound')} | {spread('traversal', 'recursive')} |")


if __name__ == "__main__":
    main()
