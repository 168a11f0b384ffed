"""Where the Triton traversal walk (`tree_verify(..., scheme="traversal")`) departs from the C++ kernel.

    python bench/gpu_traversal_check.py [--device cuda] [--cases 40] [--csv PATH]

On an H200 (Triton 3.6, 2026-12-04) `_traversal_kernel` kept more drafts than the reference and left rows
without a token, while it matches the reference in Triton's interpreter and the recursive walk matches
on the GPU too. This runs both walks on random ragged trees, against the C++ kernel on host copies of the
same inputs, at several warp counts and vocabulary tiles, and prints the share of requests that differ:
one warp failing as eight do points at the walk's own arithmetic, only several warps at the scratch it
shares between threads. Exit status 1 when any traversal request differs. On a CPU machine it runs the
kernels in Triton's interpreter (a few minutes).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import specops  # noqa: E402,F401  (registers the ops)
from specops.kernels import tree_verify as kernel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python_tests"))
from tree_cases import random_case  # noqa: E402


def _cases(count: int) -> list[tuple]:
    """(name, args): ragged random trees, with and without draft probabilities, two vocabularies."""
    gen = torch.Generator().manual_seed(2026)
    cases = []
    for i in range(count):
        vocab = 40 if i % 2 == 0 else 3000
        cases.append((f"{i}", random_case(gen, 6, 7, vocab, torch.float32, with_probs=i % 3 != 0)))
    return cases


def _differing(args, offset: int, scheme: str, device: str, block_v: int | None) -> int:
    """Requests whose (tokens, nodes, accepted) differ between the Triton walk and the C++ kernel."""
    want = torch.ops.specops.tree_verify(*args, offset, True, scheme)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = [t.cpu() for t in kernel.tree_verify_triton(*moved, offset, scheme=scheme, block_v=block_v)]
    same = (got[0] == want[0]).all(1) & (got[1] == want[1]).all(1) & (got[2] == want[2])
    return int((~same).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--warps", default="1,2,4,8", help="warp counts of the traversal walk to try")
    parser.add_argument("--csv", default="")
    args = parser.parse_args()
    cases = _cases(args.cases if args.device != "cpu" else min(args.cases, 4))
    requests = sum(int(a[0].shape[0]) for _, a in cases)
    rows = []
    default_warps = kernel._TRAVERSAL_WARPS
    settings = [("recursive", default_warps, None)]
    settings += [("traversal", int(w), None) for w in args.warps.split(",")]
    settings += [("traversal", default_warps, 16)]
    try:
        for scheme, warps, block_v in settings:
            kernel._TRAVERSAL_WARPS = warps
            start = time.perf_counter()
            bad = sum(_differing(a, 11 * i, scheme, args.device, block_v) for i, (_, a) in enumerate(cases))
            rows.append(dict(scheme=scheme, warps=warps if scheme == "traversal" else "default",
                             block_v=block_v or "default", requests=requests, differing=bad,
                             seconds=round(time.perf_counter() - start, 1)))
            print(f"{scheme:9} warps {rows[-1]['warps']!s:7} block_v {rows[-1]['block_v']!s:7} "
                  f"differing {bad:4} of {requests} ({rows[-1]['seconds']} s)", flush=True)
    finally:
        kernel._TRAVERSAL_WARPS = default_warps
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 1 if any(r["differing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
