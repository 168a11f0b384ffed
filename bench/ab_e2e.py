"""Before / after: `bench_e2e.py` from two checkouts of specops, interleaved in one run.

    python bench/ab_e2e.py --before DIR --after DIR [--rounds 2] [--out DIR] -- [bench_e2e.py arguments]

Each round runs DIR/bench/bench_e2e.py of both checkouts, each in a fresh process with that checkout
first on PYTHONPATH (build each checkout's extension in place first: `python setup.py build_ext
--inplace`), in the order before, after in even rounds and after, before in odd ones (ABBA), so load
from other processes and a drifting machine fall on both alike. Then per configuration and mode: tok/s
of every round, the median ratio after / before, the same ratio for transformers' generate (identical
code on both sides: the machine's own drift), the run-to-run spread of each side (max / min - 1 over
its rounds), the time outside model forwards per generated token, and whether greedy outputs equal
transformers' generate in every run.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _timing import format_table

COLUMNS = ["mode", "config", "before tok/s", "after tok/s", "after/before", "spread before", "spread after",
           "outside ms/tok before", "outside ms/tok after", "same_as_hf"]


def _run(tree: Path, out: Path, args: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(tree / "bench" / "bench_e2e.py"), *args, "--csv", str(out)]
    print(f"# {tree}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    subprocess.run(command, env=env, check=True, cwd=tree / "bench")
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def _outside_ms(row: dict) -> float:
    """Milliseconds outside model forwards per generated token."""
    return float(row["outside_fwd"].rstrip("%")) / 100 * float(row["seconds"]) / max(1, int(row["tokens"])) * 1e3


def _spread(values: list[float]) -> str:
    return f"{max(values) / min(values) - 1:.1%}" if len(values) > 1 and min(values) > 0 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout measured first in each round")
    parser.add_argument("--after", type=Path, required=True, help="checkout measured second in each round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ab")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: arguments of bench_e2e.py")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for side in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
            tree = getattr(args, side).resolve()
            runs[side].append(_run(tree, args.out / f"{side}_{round_}.csv", bench_args))

    def by_key(side):
        table: dict[tuple[str, str], list[dict]] = {}
        for rows in runs[side]:
            for row in rows:
                table.setdefault((row["mode"], row["config"]), []).append(row)
        return table

    before, after = by_key("before"), by_key("after")
    rows = []
    for key in before:
        if key not in after:
            continue
        b = [float(r["tok/s"]) for r in before[key]]
        a = [float(r["tok/s"]) for r in after[key]]
        same = {r["same_as_hf"] for r in before[key] + after[key]} - {""}
        rows.append({
            "mode": key[0], "config": key[1],
            "before tok/s": " ".join(f"{v:.2f}" for v in b), "after tok/s": " ".join(f"{v:.2f}" for v in a),
            "after/before": round(statistics.median(a) / statistics.median(b), 3),
            "spread before": _spread(b), "spread after": _spread(a),
            "outside ms/tok before": " ".join(f"{_outside_ms(r):.2f}" for r in before[key]),
            "outside ms/tok after": " ".join(f"{_outside_ms(r):.2f}" for r in after[key]),
            "same_as_hf": ",".join(sorted(same)),
        })
    print(f"\nbefore: {args.before}  after: {args.after}  rounds: {args.rounds} (interleaved)")
    print(format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
