"""Batched decoding with products of more than 32 rows on skinny_linear or on torch's BLAS, interleaved in one
process.

    python bench/bench_batched_rows.py [--rounds 2]

Where torch's BLAS is MKL on a CPU that is not Intel's (an AMD EPYC here), specops keeps every product on
skinny_linear and lets the few-call path (llama_forward.py) take up to 64 rows; elsewhere products of more than
32 rows go to the BLAS and the few-call path stops at 32 (specops/decoding/cpu_forward.py). This runs the same
calls both ways by switching those two limits in the process: Gemma-3-270M (float32, 2 threads), `ar` and
`ngram` on 8 HumanEval prompts (32-39) together, 96 new tokens, and on 8 prompts (48-55) x 8 samples in one
call (num_samples=8, T = 0.8, top-p 0.95, seed 1), 64 new tokens; tokens/s over the whole call, prefill
included. Each round runs both settings, the larger limit first.
"""

from __future__ import annotations

import argparse
import time

import torch
from _timing import load_prompts

import specops
from specops.decoding import cpu_forward, llama_forward

CALLS = {
    "ar, 8 prompts together": dict(method="ar", max_new_tokens=96),
    "ngram, 8 prompts together": dict(method="ngram", max_new_tokens=96),
    "ar, 64 samples in one call": dict(method="ar", num_samples=8, temperature=0.8, top_p=0.95, seed=1,
                                       max_new_tokens=64),
    "ngram, 64 samples in one call": dict(method="ngram", num_samples=8, temperature=0.8, top_p=0.95, seed=1,
                                          max_new_tokens=64),
}


def limit(rows: int) -> None:
    """Products of more than `rows` rows go to torch's BLAS, and the few-call path takes at most `rows`
    (64 at most) rows."""
    cpu_forward._SKINNY_ROWS = rows
    llama_forward._FEW_ROWS = min(rows, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    together, samples = load_prompts(32, 8), load_prompts(48, 8)
    model, tokenizer = specops.models.load("gemma-3-270m")
    specops.decode(together[:1], target=model, tokenizer=tokenizer, method="ngram", max_new_tokens=8)  # warm-up
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for setting, rows in (("skinny_linear beyond 32 rows", 1 << 30), ("BLAS beyond 32 rows", 32)):
            limit(rows)
            for name, kwargs in CALLS.items():
                prompts = samples if "samples" in name else together
                start = time.perf_counter()
                out = specops.decode(prompts, target=model, tokenizer=tokenizer, **kwargs)
                seconds = time.perf_counter() - start
                tokens = sum(sum(map(len, row)) if row and isinstance(row[0], list) else len(row) for row in out.tokens)
                results.setdefault((name, setting), []).append(tokens / seconds)
                print(f"{setting:30s} {name:32s} {tokens / seconds:7.1f} tokens/s", flush=True)
    print("| call | BLAS beyond 32 rows | skinny_linear beyond 32 rows |")
    print("| --- | ---: | ---: |")
    for name in CALLS:
        cells = [results[name, s] for s in ("BLAS beyond 32 rows", "skinny_linear beyond 32 rows")]
        print(f"| {name} | " + " | ".join("-".join(f"{v:.0f}" for v in sorted(c)) for c in cells) + " |")


if __name__ == "__main__":
    main()
