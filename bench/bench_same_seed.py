"""Sampled decoding with a drafter: speed, acceptance and reproducibility of the coupled drafts
(drafter.TokenDrafter: drafts drawn with the random number of the target's token at the same position),
against speculative sampling's rule as specops had it before (`--scheme token`: drafts drawn with their own
random numbers and verified against their q by chain_verify).

    python bench/bench_same_seed.py [--method tli] [--scheme auto] [--num-draft-tokens auto]
                                    [--prompts 4] [--first 0] [--new-tokens 64] [--seed 1] [--threads N]
                                    [--csv PATH] [--check]

Target Gemma-3-270M, drafter SmolLM2-135M (int8; another vocabulary, so "tli"), HumanEval/0-3, 64 new tokens,
T = 0.8, top-p 0.95, seed 1: the prompts one at a time, then together. --num-draft-tokens takes "auto", an
int, or a comma-separated tuple (a tree shape: "2,2"). Prints one JSON line: tokens/s, accepted, drafted and
target calls per mode, and writes them to the CSV (bench/results/same_seed.csv). The models are the embedded
ones, by name, on the CPU. --scheme is the method's option "scheme" (auto, positional, token, joint). --check
decodes HumanEval/0-7 (48 tokens, seed 123) twice and with "ar", and prints how many outputs were the same
twice and equal to ar's.
"""

from __future__ import annotations

import csv
import json
import time

import specops
from _timing import csv_path, e2e_parser, load_prompts, parse_e2e_args


def main() -> None:
    parser = e2e_parser(__doc__, "same_seed", prompts=4, modes=None, seed=1, threads=None, device=False)
    parser.add_argument("--method", default="tli")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--num-draft-tokens", default="auto")
    parser.add_argument("--scheme", default="auto")
    parser.add_argument("--check", action="store_true")
    args = parse_e2e_args(parser)
    k = args.num_draft_tokens
    if k != "auto":
        k = tuple(int(v) for v in k.split(",")) if "," in k else int(k)
    kw = {"target": "gemma-3-270m", "drafter": args.drafter, "method": args.method, "temperature": 0.8,
          "top_p": 0.95, "options": {"scheme": args.scheme}}
    if args.check:
        prompts = load_prompts(args.first, 8)
        first = specops.decode(prompts, max_new_tokens=48, seed=123, num_draft_tokens=k, **kw)
        second = specops.decode(prompts, max_new_tokens=48, seed=123, num_draft_tokens=k, **kw)
        plain = {key: v for key, v in kw.items() if key not in ("drafter", "method", "options")}
        ar = specops.decode(prompts, method="ar", max_new_tokens=48, seed=123, **plain)
        print(json.dumps({"same_twice": sum(a == b for a, b in zip(first.tokens, second.tokens)),
                          "equal_to_ar": sum(a == b for a, b in zip(first.tokens, ar.tokens)), "of": len(prompts)}))
        return
    prompts = load_prompts(args.first, args.prompts)
    specops.decode(["def f(x):"], max_new_tokens=8, seed=args.seed, num_draft_tokens=k, **kw)  # warm-up
    out = {}
    for mode, groups in (("one at a time", [[p] for p in prompts]), (f"{len(prompts)} together", [prompts])):
        start = time.perf_counter()
        results = [specops.decode(g, max_new_tokens=args.new_tokens, seed=args.seed, num_draft_tokens=k, **kw)
                   for g in groups]
        seconds = time.perf_counter() - start
        out[mode] = {"tokens_per_s": round(sum(len(t) for r in results for t in r.tokens) / seconds, 2),
                     "accepted": sum(r.stats.accepted for r in results),
                     "drafted": sum(r.stats.drafted for r in results),
                     "target_calls": sum(r.stats.target_calls for r in results)}
    print(json.dumps(out))
    path = csv_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["method", "scheme", "num_draft_tokens", "mode", "tokens_per_s",
                                               "accepted", "drafted", "target_calls"])
        writer.writeheader()
        for mode, row in out.items():
            writer.writerow({"method": args.method, "scheme": args.scheme, "num_draft_tokens": args.num_draft_tokens,
                             "mode": mode, **row})


if __name__ == "__main__":
    main()
