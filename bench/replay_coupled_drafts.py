"""Could n-gram drafts read the random numbers the verifier will sample with? A replay on pass@k.

    python bench/replay_coupled_drafts.py [--prompts 8] [--samples 8] [--new-tokens 96] [--csv PATH]

Sampled n-gram drafts are verified positionally (docs/same_seed.md): the target's token at sequence position t
is the inverse CDF, over its filtered distribution in vocabulary order, at a uniform number keyed by the
request's seed and t alone. The emitted text is sampled `ar`'s whatever is drafted, so a drafter may look at
those numbers without changing a token: where the memory holds several continuations of the matched text
(earlier samples of the prompt that parted ways there), it could pick the one whose share of the counts, laid
out in vocabulary order, holds the position's number, instead of the most frequent one. If the counts
resembled the target's distribution, that pick would match the target's draw far more often than the mode.

The replay answers it without timing anything. Gemma-3-270M samples `--prompts` HumanEval prompts
`--samples` times each with `ar` (T = 0.8, top-p 0.95, seed 1000 * prompt + sample); one forward over every
finished sequence checks that `verify.positional` with the recorded numbers gives back each sampled token.
Then, sample after sample (each drafting from the samples before it, as 64 calls one after another would),
every step drafts a chain of up to `--length` tokens from the longest match (2 to 12 tokens) of its context in
its own context alone or in its context and the memory, each draft token picked by the mode of the counts or
by the coupled rule; a draft is kept up to its first token unlike the sample's, and the step emits one more.
Reported: new tokens per target forward and kept / drafted; and, at every position with a match, how often
the sample's token is the mode, the coupled pick, or anywhere among the continuations (what a tree of all of
them would keep). Tokens per forward do not depend on the machine.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter, defaultdict

import torch

from _timing import load_prompts, markdown_table

MAX_MATCH, MIN_MATCH = 12, 2


class Continuations:
    """Every n-gram (MIN_MATCH..MAX_MATCH tokens) of some token runs, with the tokens that followed it."""

    def __init__(self):
        self.after = defaultdict(list)

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Record the tokens at positions start.. of `tokens` as continuations of the n-grams before them."""
        for j in range(max(start, MIN_MATCH), len(tokens)):
            for n in range(MIN_MATCH, min(MAX_MATCH, j) + 1):
                self.after[tuple(tokens[j - n:j])].append(tokens[j])

    def match(self, context: list[int], other: "Continuations | None") -> list[int]:
        """The continuations of the longest suffix of `context` seen in this or `other` ([] if none)."""
        for n in range(min(MAX_MATCH, len(context)), MIN_MATCH - 1, -1):
            key = tuple(context[-n:])
            found = self.after.get(key, []) + (other.after.get(key, []) if other is not None else [])
            if found:
                return found
        return []


def pick(rule: str, found: list[int], u: float) -> int:
    counts = Counter(found)
    if rule == "mode":  # most frequent, the latest on a tie
        latest = {t: i for i, t in enumerate(found)}
        return max(counts, key=lambda t: (counts[t], latest[t]))
    total, below = len(found), 0
    for t in sorted(counts):  # the counts' inverse CDF in vocabulary order, as the target's draw
        below += counts[t]
        if u * total < below:
            return t
    return max(counts)


def sample(args) -> list[dict]:
    import specops
    from specops import reference
    from specops._seeds import position_seeds, row_seeds
    from specops.decoding.protocol import SamplingParams
    from specops.decoding.verify import positional

    model, tokenizer = specops.models.load("gemma-3-270m")
    params = SamplingParams(temperature=0.8, top_p=0.95)
    records = []
    for p, prompt in enumerate(load_prompts(0, args.prompts)):
        ids = tokenizer(prompt).input_ids
        for s in range(args.samples):
            seed = 1000 * p + s
            out = list(specops.decode(prompt, target=model, tokenizer=tokenizer, method="ar", seed=seed,
                                      max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.95).tokens)
            first = len(ids)
            positions = torch.arange(first, first + len(out) + args.length)[None]
            seeds = row_seeds(seed, 1)
            with torch.no_grad():
                logits = model(torch.tensor([ids + out])).logits.float()[:, first - 1:first - 1 + len(out)]
            again = positional(logits, params, seeds, positions[:, :len(out)])[0].tolist()
            if again != out:
                raise SystemExit(f"prompt {p} sample {s}: the recorded numbers do not give back the sample")
            keys = position_seeds(seeds, positions).reshape(-1)
            u = reference.uniform(keys, 0, 0, reference.STREAM_SAMPLE).tolist()
            records.append({"prompt": ids, "tokens": out, "u": u})
            print(f"prompt {p} sample {s}: {len(out)} tokens", file=sys.stderr, flush=True)
    return records


def replay(records: list[dict], rule: str, with_memory: bool, length: int) -> dict:
    memory = Continuations()
    forwards = emitted = drafted = kept = 0
    for rec in records:
        tokens, u = rec["tokens"], rec["u"]
        own = Continuations()
        context = rec["prompt"] + tokens[:1]  # the prefill's forward emits the first token
        own.add(context)
        i = 1
        while i < len(tokens):
            draft, ahead = [], list(context)
            while len(draft) < length:
                found = own.match(ahead, memory if with_memory else None)
                if not found:
                    break
                draft.append(pick(rule, found, u[i + len(draft)]))
                ahead.append(draft[-1])
            ok = 0
            while ok < len(draft) and i + ok < len(tokens) and draft[ok] == tokens[i + ok]:
                ok += 1
            forwards, drafted, kept = forwards + 1, drafted + len(draft), kept + ok
            start = len(context)
            context += tokens[i:i + ok + 1]
            own.add(context, start)
            i += ok + 1
        emitted += len(tokens) - 1
        if with_memory:
            memory.add(rec["prompt"] + tokens)
    return {"tokens_per_forward": emitted / forwards, "kept_per_drafted": kept / max(drafted, 1)}


def first_tokens(records: list[dict], with_memory: bool) -> dict:
    """At every position with a match (teacher-forced): the share where the sample's token is the mode, the
    coupled pick, or one of the continuations."""
    memory = Continuations()
    seen = mode = coupled = among = 0
    for rec in records:
        own = Continuations()
        context = list(rec["prompt"])
        own.add(context)
        for i, token in enumerate(rec["tokens"]):
            found = own.match(context, memory if with_memory else None)
            if found:
                seen += 1
                mode += pick("mode", found, rec["u"][i]) == token
                coupled += pick("coupled", found, rec["u"][i]) == token
                among += token in found
            context.append(token)
            own.add(context, len(context) - 1)
        if with_memory:
            memory.add(rec["prompt"] + rec["tokens"])
    return {"positions": seen, "mode": mode / seen, "coupled": coupled / seen, "among": among / seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--length", type=int, default=8, help="the longest chain a step drafts")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    records = sample(args)
    rows = []
    for with_memory in (False, True):
        where = "context and memory" if with_memory else "own context"
        first = first_tokens(records, with_memory)
        for rule in ("mode", "coupled"):
            rows.append({"drafts_from": where, "rule": rule, **replay(records, rule, with_memory, args.length),
                         "positions_matched": first["positions"], "first_token_is_pick": first[rule],
                         "first_token_among_continuations": first["among"]})
    columns = list(rows[0])
    print(markdown_table(rows, columns))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
