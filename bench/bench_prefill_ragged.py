"""What a batch of prompts of unequal lengths pays for its prefill: 8 HumanEval prompts (Gemma-3-270M float32,
2 threads) prefilled in one decode call, left-padded to the longest, against the same prompts prefilled in 8
calls of one, alternating, in one process.

    python bench/bench_prefill_ragged.py [--rounds 3] [--first 32] [--target gemma-3-270m]

Prints the prompts' token counts, the slots the batched prefill feeds (8 x the longest), and per round the
prefill seconds of the batch and the sum over the 8 single calls (`Stats.prefill_seconds`; one new token each).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import load_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first", type=int, default=32)
    parser.add_argument("--target", default="gemma-3-270m")
    args = parser.parse_args()
    import specops
    import specops.models

    torch.set_num_threads(2)
    prompts = load_prompts(args.first, 8)
    specops.decode(["def add(a, b):\n"], target=args.target, method="ar", max_new_tokens=2)  # loads, probes
    tokenizer = specops.models.load_tokenizer(args.target)
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    print(f"prompt tokens {lengths}: {sum(lengths)} tokens in {len(lengths) * max(lengths)} slots")
    for round_ in range(args.rounds):
        together = specops.decode(prompts, target=args.target, method="ar", max_new_tokens=1).stats.prefill_seconds
        alone = sum(specops.decode([p], target=args.target, method="ar", max_new_tokens=1).stats.prefill_seconds
                    for p in prompts)
        print(f"round {round_}: 8 together {together:.2f} s, one at a time {alone:.2f} s "
              f"({together / alone:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
