"""Step times of a batch under a fixed pattern of draft shapes: what a step costs after a step whose requests
kept different numbers of drafts (their cache rows move to end together) against after a plain one.

    python bench/bench_ragged_steps.py [--requests 8] [--first 32] [--threads 2]

`ngram` on HumanEval prompts <first>..<first + requests - 1> together (greedy, Gemma-3-270M float32), its
draft shape forced step by step: 6 plain steps, 6 steps of one draft token per request, 6 plain, then
one-draft and plain steps alternating, then rows of two. Prints each step's shape (draft tokens per request)
and its time in ms, then the medians of plain steps after plain ones, plain steps after drafting ones, and
one-draft steps after plain and after drafting ones. docs/benchmarks.md ("Steps after ragged steps") has a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

PATTERN = [(0, 0)] * 6 + [(1, 1)] * 6 + [(0, 0)] * 6 + [(1, 1), (0, 0)] * 6 + [(1, 2)] * 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--first", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _timing import load_prompts

    import specops
    import specops.decoding.ngram as ngram
    from specops.decoding.ngram_shape import DraftShape

    torch.set_num_threads(args.threads)
    calls = [0]

    def forced(self, rows, source):  # this process only: the shape the pattern says
        calls[0] += 1
        return PATTERN[calls[0] - 1] if calls[0] <= len(PATTERN) else (0, 0)

    DraftShape.choose = forced
    steps = []
    accept = ngram.NgramProposer.accept

    def timed(self, result):
        steps.append((result.size, result.step_seconds * 1000))
        return accept(self, result)

    ngram.NgramProposer.accept = timed
    kwargs = dict(target="gemma-3-270m", method="ngram", options={"tables": "none"})
    specops.decode(["def add(a, b):\n"], max_new_tokens=16, **kwargs)  # loads and probes the model
    steps.clear()
    calls[0] = 0
    specops.decode(load_prompts(args.first, args.requests), max_new_tokens=len(PATTERN) + 2, stop=[], **kwargs)
    print(" ".join(f"{size}:{ms:.0f}" for size, ms in steps))
    pairs = list(zip(steps, steps[1:]))
    for name, before, now in (("plain after plain", 0, 0), ("plain after drafts", 1, 0),
                              ("one draft after plain", 0, 1), ("one draft after drafts", 1, 1)):
        times = [b[1] for a, b in pairs if (a[0] > 0) == bool(before) and b[0] == now]
        if times:
            print(f"{name}: median {statistics.median(times):.1f} ms over {len(times)} steps")


if __name__ == "__main__":
    main()
