"""The output head of greedy steps through its int8 screen (specops/decoding/greedy_head.py), on the embedded
target Gemma-3-270M: how many ids each row computes exactly, and what the head costs with and without it.

    python bench/bench_greedy_head.py [--prompts 8] [--new-tokens 48] [--rounds 15] [--limit-rounds 2]
                                      [--csv PATH]

1. Decodes HumanEval's first --prompts prompts greedily with `ar` and `ngram` (one at a time and all together),
   recording every screened head call: rows, and the ids each row computed exactly (the rest are -inf).
2. Times the head on hidden rows recorded there, 1, 2, 4 and 8 at a time: the full float32 head
   (skinny_linear, then the soft-cap, as the engine computes it without the screen) against the screen
   (int8 product, bounds, the exact ids), alternating, --rounds times each; medians and minima in ms. Each
   screened result's argmax is checked against the full head's.
3. Times making the screen (the int8 copy and the bounds) twice.
4. Greedy verification's rows: every verification of `ngram` one at a time (step 1) is recorded with the
   rows it could read (`greedy_logits`' follow), then replayed --rounds times, alternating, with only those
   rows computed (the default) and with every row: rows computed, passes over the head, and the head's ms.
5. The screen's block limit (`_MOST_BLOCKS`; --limit-rounds, 0 skips it): `ar` and `ngram`, one at a time and
   all together, decoded with the limit at 32 blocks a row (what it was, _MOST_IDS / _BLOCK) and at today's,
   alternating, --limit-rounds times: head calls that went to the whole head, seconds in the head, seconds of
   the calls (medians), and the tokens, which must be the same.
The host's read bandwidth is measured at the start and the end.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _timing import load_prompts, machine_info, read_bandwidth_gbs, write_csv_columns

TARGET = "gemma-3-270m"


def _record(greedy_head) -> tuple[list[int], list[torch.Tensor]]:
    """Patch the screen to record each row's exact ids and the hidden rows it was given."""
    counts, hidden = [], []
    own = greedy_head._Screen.logits

    def logits(self, weight, rows, softcap):
        out = own(self, weight, rows, softcap)
        if out is not None:
            counts.extend(torch.isfinite(out).sum(1).tolist())
            hidden.extend(rows.clone())
        return out

    greedy_head._Screen.logits = logits
    return counts, hidden


def _record_verifications(calls: list) -> None:
    """Patch the CPU forwards' greedy_logits to record each call that carries a verification's `follow`:
    (hidden rows, follow, rows computed, passes)."""
    from specops.decoding import cpu_forward, greedy_head, llama_forward

    own, computed = greedy_head.greedy_logits, greedy_head._computed

    def counted(*args):  # one pass over the head
        _Passes.count += 1
        start = time.perf_counter()
        out = computed(*args)
        _Passes.seconds += time.perf_counter() - start
        return out

    def logits(head, rows, softcap, product, follow=None):
        before = _Passes.count
        out = own(head, rows, softcap, product, follow)
        if follow is not None and _Passes.on:
            calls.append((rows.clone(), tuple(t.clone() for t in follow), int(out.any(1).sum()),
                          _Passes.count - before))
        return out

    greedy_head._computed = counted
    cpu_forward.greedy_logits = logits
    llama_forward.greedy_logits = logits


class _Passes:
    """Passes over the head (greedy_head._computed calls), and whether verifications are recorded."""
    count = 0
    on = False
    seconds = 0.0  # in passes over the head
    whole = 0  # passes the screen did not serve


def _limits(specops, greedy_head, model, tokenizer, prompts: list[str], new_tokens: int, rounds: int) -> list[dict]:
    """Part 5: the block limit at 32 (before) and at _MOST_BLOCKS, alternating."""
    screened = greedy_head.screened_logits

    def counting(*args):
        out = screened(*args)
        _Passes.whole += out is None
        return out

    greedy_head.screened_logits = counting
    today, seen, tokens = greedy_head._MOST_BLOCKS, {}, {}
    try:
        for round_ in range(rounds):
            for blocks in ((32, today) if round_ % 2 == 0 else (today, 32)):
                greedy_head._MOST_BLOCKS = blocks
                for method in ("ar", "ngram"):
                    for together in (False, True):
                        case = f"{method} {'together' if together else 'alone'}"
                        _Passes.count = _Passes.whole = 0
                        _Passes.seconds = 0.0
                        start, emitted = time.perf_counter(), []
                        for batch in ([prompts] if together else [[p] for p in prompts]):
                            emitted += specops.decode(batch, target=model, tokenizer=tokenizer, method=method,
                                                      max_new_tokens=new_tokens, temperature=0).tokens
                        seconds = time.perf_counter() - start
                        assert tokens.setdefault(case, emitted) == emitted, f"{case}: tokens moved"
                        seen.setdefault((case, blocks), []).append(
                            (_Passes.whole, _Passes.count, _Passes.seconds, seconds))
    finally:
        greedy_head._MOST_BLOCKS, greedy_head.screened_logits = today, screened
    rows = []
    for (case, blocks), runs in seen.items():
        rows.append({"part": "block limit", "case": f"{case}, {blocks} blocks", "calls": runs[0][1],
                     "whole head": runs[0][0], "head s": round(statistics.median(r[2] for r in runs), 3),
                     "seconds": round(statistics.median(r[3] for r in runs), 3)})
        print(rows[-1], flush=True)
    return rows


def _quantiles(values: list[int]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"rows": len(ordered), "median": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--limit-rounds", type=int, default=2, help="part 5's rounds (0: skip it)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    import specops
    from specops.decoding import greedy_head

    start_bw = read_bandwidth_gbs()
    model, tokenizer = specops.models.load(TARGET)
    prompts = load_prompts(0, args.prompts)
    counts, hidden = _record(greedy_head)
    verifications: list = []
    _record_verifications(verifications)
    rows = []
    for method in ("ar", "ngram"):
        for together in (False, True):
            counts.clear()
            _Passes.on = method == "ngram" and not together
            batches = [prompts] if together else [[p] for p in prompts]
            for batch in batches:
                specops.decode(batch, target=model, tokenizer=tokenizer, method=method,
                               max_new_tokens=args.new_tokens, temperature=0)
            row = {"part": "ids", "case": f"{method} {'together' if together else 'alone'}", **_quantiles(counts)}
            rows.append(row)
            print(row, flush=True)

    head = model.get_output_embeddings()
    weight, softcap = head.weight.detach(), model.config.get_text_config().final_logit_softcapping
    screen = greedy_head._screen(head)
    with torch.inference_mode():
        for n in (1, 2, 4, 8):
            x = torch.stack(hidden[:n]).contiguous()
            full = lambda: torch.tanh(torch.ops.specops.skinny_linear(x, weight, None) / softcap) * softcap  # noqa
            if softcap is None:
                full = lambda: torch.ops.specops.skinny_linear(x, weight, None)  # noqa: E731
            screened = lambda: screen.logits(weight, x, softcap)  # noqa: E731
            assert torch.equal(screened().argmax(1), full().argmax(1))
            times = {"full": [], "screened": []}
            for _ in range(args.rounds):
                for name, fn in (("full", full), ("screened", screened)):
                    t = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t) * 1e3)
            row = {"part": "head ms", "case": f"{n} rows"}
            for name, ts in times.items():
                row[f"{name} median"] = round(statistics.median(ts), 2)
                row[f"{name} min"] = round(min(ts), 2)
            row["ratio"] = round(row["full median"] / row["screened median"], 2)
            rows.append(row)
            print(row, flush=True)
        product = lambda x: torch.ops.specops.skinny_linear(x, weight, None)  # noqa: E731
        offered = sum(r.shape[0] for r, _, _, _ in verifications)
        row = {"part": "verification rows", "case": "ngram alone", "rows": offered,
               "computed": sum(c for _, _, c, _ in verifications), "calls": len(verifications),
               "passes": sum(p for _, _, _, p in verifications)}
        times = {"read rows": [], "every row": []}
        for _ in range(args.rounds):
            for name, follow_on in (("read rows", True), ("every row", False)):
                t = time.perf_counter()
                for x, follow, _, _ in verifications:
                    greedy_head.greedy_logits(head, x, softcap, product, follow if follow_on else None)
                times[name].append((time.perf_counter() - t) * 1e3 / max(len(verifications), 1))
        row["read rows ms"] = round(statistics.median(times["read rows"]), 2)
        row["every row ms"] = round(statistics.median(times["every row"]), 2)
        row["ratio"] = round(row["every row ms"] / row["read rows ms"], 2)
        rows.append(row)
        print(row, flush=True)
        for attempt in range(2):
            t = time.perf_counter()
            greedy_head._Screen(weight)
            row = {"part": "make", "case": f"screen {attempt + 1}", "seconds": round(time.perf_counter() - t, 3)}
            rows.append(row)
            print(row, flush=True)
    _Passes.on = False
    if args.limit_rounds:
        rows += _limits(specops, greedy_head, model, tokenizer, prompts, args.new_tokens, args.limit_rounds)
    end_bw = read_bandwidth_gbs()
    print(f"read bandwidth {start_bw:.1f} GB/s at the start, {end_bw:.1f} at the end", flush=True)
    if args.csv:
        info = machine_info("cpu")
        info["read_gbs_start"], info["read_gbs_end"] = f"{start_bw:.1f}", f"{end_bw:.1f}"
        columns = ["part", "case", "rows", "median", "p90", "p99", "max", "full median", "full min",
                   "screened median", "screened min", "ratio", "seconds", "computed", "calls", "passes",
                   "read rows ms", "every row ms", "whole head", "head s"]
        write_csv_columns(args.csv, rows, columns, info)


if __name__ == "__main__":
    main()
