"""Does n-gram drafting get the tokens it expects? The accepted drafts the draft-shape chooser predicted for the
steps where it chose to draft, against those verification then accepted.

    python bench/bench_draft_calibration.py [--first 40] [--prompts 8] [--samples 8] [--new-tokens 96] [--csv PATH]

Gemma-3-270M, `specops.decode(..., method="ngram", num_samples=8)` on each of `--prompts` HumanEval prompts
(from `--first`), T = 0.8, top-p 0.95, one call per prompt (docs/memory.md's pass@k, 8 calls of 8 samples), with
and without one specops.NgramMemory for the whole run. For every step the chooser drafted, the prediction is the
expected accepted tokens of the shape it chose for each request, summed (what the chooser weighed against the
step's cost); realized is what verification accepted. A chooser that drafts only where its estimate looks best
accepts less than it expects (it picks the noisiest-high estimates); the ratio says by how much. Every setting
samples with the same seeds, so the texts are the same whatever the chooser does.

The prediction is read from the chooser itself (DraftShape.choose and DraftShape.shapes are wrapped for the
run), so the script measures the version of specops it imports.
"""

from __future__ import annotations

import argparse
import csv
import sys

from _timing import load_prompts, machine_info, markdown_table


def predicted(shape, rows, source, chosen: list[tuple[int, int]]) -> float:
    """Expected accepted tokens of each request's chosen (k, w), summed, as the chooser valued them."""
    if hasattr(shape, "_expected"):  # rows valued by the distinct rows among them
        table = shape._expected(rows.cpu(), source.cpu())
    else:  # older versions: by row count
        table = shape.expected_accepted()[source.cpu().clamp(max=shape.sources - 1)]
    return sum(float(table[b, k - 1, w - 1]) for b, (k, w) in enumerate(chosen) if k)


def run(memory: bool, args) -> dict:
    import specops
    from specops.decoding import ngram, ngram_shape

    steps: list[dict] = []
    choose, shapes, accept = ngram_shape.DraftShape.choose, ngram_shape.DraftShape.shapes, ngram.NgramProposer.accept

    def choose_logged(self, rows, source):
        k, w = choose(self, rows, source)
        if k:
            steps.append({"predicted": predicted(self, rows, source, [(k, w)] * rows.shape[0])})
        return k, w

    def shapes_logged(self, rows, source):
        out = shapes(self, rows, source)
        if int(out[:, 0].max()):
            steps.append({"predicted": predicted(self, rows, source, [tuple(s) for s in out.tolist()])})
        return out

    def accept_logged(self, result):
        if steps and "realized" not in steps[-1] and result.size > 0:
            steps[-1]["realized"] = sum(result.accepted)
        accept(self, result)

    ngram_shape.DraftShape.choose, ngram_shape.DraftShape.shapes = choose_logged, shapes_logged
    ngram.NgramProposer.accept = accept_logged
    try:
        store = specops.NgramMemory() if memory else None
        specops.decode(["def add(a, b):\n"], target="gemma-3-270m", method="ngram", memory=store, max_new_tokens=8)
        steps.clear()
        seconds = tokens = 0.0
        for i, prompt in enumerate(load_prompts(args.first, args.prompts)):
            result = specops.decode([prompt], target="gemma-3-270m", method="ngram", memory=store,
                                    max_new_tokens=args.new_tokens, num_samples=args.samples, temperature=0.8,
                                    top_p=0.95, seed=1000 * i)
            seconds += result.stats.seconds
            tokens += result.stats.new_tokens
    finally:
        ngram_shape.DraftShape.choose, ngram_shape.DraftShape.shapes = choose, shapes
        ngram.NgramProposer.accept = accept
    done = [s for s in steps if "realized" in s]
    expected = sum(s["predicted"] for s in done)
    realized = sum(s["realized"] for s in done)
    return {"setting": "ngram + memory" if memory else "ngram", "drafting_steps": len(done),
            "predicted": round(expected, 1), "realized": realized,
            "realized_over_predicted": round(realized / expected, 3) if expected else "",
            "tok_s": round(tokens / seconds, 1), **machine_info("cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    rows = [run(False, args), run(True, args)]
    columns = ["setting", "drafting_steps", "predicted", "realized", "realized_over_predicted", "tok_s"]
    print(markdown_table(rows, columns))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}", file=sys.stderr)


if __name__ == "__main__":
    main()
