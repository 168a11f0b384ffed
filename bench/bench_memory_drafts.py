"""How far the memory's drafts go on pass@k: tokens per target forward, not time (so it may run beside other
work; its ratios do not depend on the machine).

    python bench/bench_memory_drafts.py [--prompts 4] [--samples 6] [--new-tokens 96] [--csv PATH]

Gemma-3-270M samples each of `--prompts` HumanEval prompts (0, 1, ...) `--samples` times at T = 0.8, top-p 0.95,
one call per sample, one after another (so each sample can draft from the ones before it), in four settings:

  ngram            n-gram drafting from the request's own context (and the model's bigram when cached), trees
                   sized by the cost model
  memory, chain    a memory of the earlier samples too, but one chain of 8 tokens per step (num_draft_tokens
                   (1, 8)): what a drafter that follows only the most frequent continuation gets
  memory, trees    the memory, trees of up to 8 rows of up to 16 tokens sized by the cost model (the default)
  memory, 8x16     the memory, always 8 rows of 16 tokens (the widest tree it drafts)

Reported: new tokens per target forward (prefill excluded), and their ratio to `ngram`. Every setting samples
with the same seeds, so every setting emits the same texts (positional verification), and the counts compare
like with like.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from _timing import load_prompts, machine_info, markdown_table

SETTINGS = {"ngram": (False, "auto"), "memory, chain": (True, (1, 8)), "memory, trees": (True, "auto"),
            "memory, 8x16": (True, (8, 16))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    import specops

    prompts = load_prompts(0, args.prompts)
    model, tokenizer = specops.models.load("gemma-3-270m")
    rows, texts = [], {}
    for name, (with_memory, shape) in SETTINGS.items():
        memory = specops.NgramMemory(budget_bytes=64 << 20) if with_memory else None
        tokens = forwards = 0
        outputs = []
        for p, prompt in enumerate(prompts):
            for s in range(args.samples):
                result = specops.decode(prompt, target=model, tokenizer=tokenizer, method="ngram",
                                        max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.95,
                                        seed=1000 * p + s, num_draft_tokens=shape, memory=memory)
                tokens += len(result.tokens)
                forwards += result.stats.target_calls - 1  # the prefill's forward emits the first token
                outputs.append(result.tokens)
        texts[name] = outputs
        rows.append({"setting": name, "new_tokens": tokens, "target_forwards": forwards,
                     "tokens_per_forward": tokens / forwards})
        print(f"{name}: {tokens / forwards:.2f} tokens per forward", file=sys.stderr, flush=True)
    base = rows[0]["tokens_per_forward"]
    for row in rows:
        row["vs_ngram"] = row["tokens_per_forward"] / base
        row["same_tokens"] = texts[row["setting"]] == texts["ngram"]
    print(markdown_table(rows, ["setting", "new_tokens", "target_forwards", "tokens_per_forward", "vs_ngram",
                                "same_tokens"]))
    if args.csv:
        info = machine_info("cpu")
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*rows[0], *info])
            writer.writeheader()
            writer.writerows({**row, **info} for row in rows)
        print(f"wrote {Path(args.csv)}", file=sys.stderr)


if __name__ == "__main__":
    main()
