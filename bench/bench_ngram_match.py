"""Benchmark of `specops.ops.ngram_match` (context n-gram drafts: continuations of earlier matches).

    python bench/bench_ngram_match.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--batches 1,16,64] [--contexts 1024,4096,16384,32768] [--min-ngram 1] [--max-ngram 3]
        [--num-candidates 8] [--width 8] [--dtype int64|int32] [--reference-max-tokens N]

Providers. CPU: `reference` (specops.reference.ngram_match, the pure-torch `unfold` implementation: the
peer the issue names), `cpu` and `cpu no-validate` (the C++ kernel through the public wrapper,
validate=True and False). CUDA: `reference` on GPU tensors (wall clock with sync), `triton` (public
wrapper, validate=False; eager, and as a CUDA graph) and `triton validate` (validate=True: one host sync).

Workload: every row is a full context of L tokens over a 32000-token vocabulary, Zipf-distributed
(p(rank r) ~ r^-1.1, ranks shuffled over the ids) with about a third of each row overwritten by spans
copied from earlier in the row (geometric lengths, mean 24): repeats as in code, quoted text or
retrieved documents, where n-gram drafting pays. `found` is the mean number of candidates returned per
row (of num_candidates); `agree` says whether the op returned exactly the reference's outputs.

Inputs are made before the timed region; times are medians after warm-up. The reference loops over
rows in Python, so it gets few runs (3 to 10, at least 0.5 s of timed work) and can be skipped above
--reference-max-tokens tokens per call. vs_ref: reference time / this time.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from _timing import (add_speedup, bench_parser, cuda_graph_of, cuda_median_time, find_row, import_specops, int_list,
                     machine_info, median_time, mismatch_lines, parse_bench_args, report, run_cases)

VOCAB = 32000
ZIPF_EXPONENT = 1.1
COPY_FRACTION = 1 / 3  # share of each row overwritten by copies of earlier spans
MEAN_SPAN = 24
SEED = 1234
HEADLINE = (16, 16384)  # the goal: the C++ op >= 10x faster than the reference at B=16, L=16K
GOAL = 10.0
DTYPES = {"int64": torch.int64, "int32": torch.int32}
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "B", "L", "provider", "median_us", "Mtok/s", "found", "agree", "vs_ref", "runs",
           "others", "note"]


def token_streams(batch: int, length: int, dtype: torch.dtype, seed: int = SEED) -> torch.Tensor:
    """[batch, length] text-like token ids: Zipf-distributed, with spans copied from earlier in the row."""
    rng = np.random.default_rng([seed, batch, length])
    p = np.arange(1, VOCAB + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    ids = rng.permutation(VOCAB)  # frequent tokens are not the small ids
    tokens = ids[rng.choice(VOCAB, size=(batch, length), p=p / p.sum())]
    spans = int(length * COPY_FRACTION / MEAN_SPAN)
    for row in tokens:
        for _ in range(spans):
            span = int(min(rng.geometric(1 / MEAN_SPAN), length // 4)) + 1
            dst = int(rng.integers(span, length - span + 1)) if length > 2 * span else 0
            if dst == 0:
                continue
            src = int(rng.integers(0, dst - span + 1))
            row[dst:dst + span] = row[src:src + span]
    return torch.from_numpy(tokens).to(dtype)


class Case:
    """One (B, L) workload on one device, with the op's options, and its providers' calls."""

    def __init__(self, specops, batch: int, length: int, options: dict, dtype: torch.dtype, device: str):
        self.specops, self.batch, self.length, self.options = specops, batch, length, options
        self.tokens = token_streams(batch, length, dtype).to(device)
        self.lengths = torch.full((batch,), length, dtype=torch.int64, device=device)

    def op_fn(self, validate: bool = True):
        tokens, lengths, options = self.tokens, self.lengths, self.options
        ngram_match = self.specops.ops.ngram_match
        return lambda: ngram_match(tokens, lengths, validate=validate, **options)

    def reference_fn(self):
        o = self.options
        args = (self.tokens, self.lengths, o["min_ngram"], o["max_ngram"], o["num_candidates"], o["width"])
        reference = self.specops.reference.ngram_match
        return lambda: reference(*args)


def found(result) -> float:
    """Mean number of candidates returned per row."""
    return (result[1] > 0).sum().item() / max(1, result[1].shape[0])


def same(a, b) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def row(device, case: Case, provider, seconds, runs, note="", found_=None, agree=None) -> dict:
    tokens = case.batch * case.length
    return {"device": device, "B": case.batch, "L": case.length, "provider": provider,
            "median_us": None if seconds is None else seconds * 1e6,
            "Mtok/s": None if seconds is None else tokens / seconds / 1e6, "found": found_,
            "agree": agree, "vs_ref": None, "runs": runs, "note": note}


def bench_reference(device, case: Case, quick: bool, max_tokens: int | None, expected, sync=None):
    """The reference's row (few runs: it loops over rows in Python), or a skipped row."""
    if max_tokens is not None and case.batch * case.length > max_tokens:
        return row(device, case, "reference", None, 0,
                   f"skipped: B*L > --reference-max-tokens {max_tokens}")
    fn = case.reference_fn()
    reference_result = fn()  # also the warm-up
    agree = "yes" if same(reference_result, expected) else "NO"
    slow = dict(warmup=0, min_runs=3, min_seconds=0.0 if quick else 0.5, max_runs=10, sync=sync)
    t, n = median_time(fn, **slow)
    return row(device, case, "reference", t, n, "torch unfold, rows in Python", found(reference_result),
               agree)


def bench_cpu_case(case: Case, quick: bool, max_tokens: int | None) -> list[dict]:
    fast = dict(warmup=2, min_runs=5, min_seconds=0.05) if quick else dict(warmup=3, min_runs=20,
                                                                            min_seconds=0.3)
    result = case.op_fn()()
    out = [bench_reference("cpu", case, quick, max_tokens, result)]
    agree = out[0]["agree"]
    t, n = median_time(case.op_fn(), **fast)
    out.append(row("cpu", case, "cpu", t, n, "validate=True (default)", found(result), agree))
    t, n = median_time(case.op_fn(validate=False), **fast)
    out.append(row("cpu", case, "cpu no-validate", t, n, "validate=False", found(result), agree))
    return out


def bench_cuda_case(case: Case, quick: bool, max_tokens: int | None) -> list[dict]:
    rep_ms = 30 if quick else 100
    sync = torch.cuda.synchronize
    result = case.op_fn(validate=False)()  # also compiles the kernels
    sync()
    out = [bench_reference("cuda", case, quick, max_tokens, result, sync)]
    agree = out[0]["agree"]

    def add(provider, fn, note):
        try:
            out.append(row("cuda", case, provider, cuda_median_time(fn, rep_ms=rep_ms), None, note,
                           found(result), agree))
        except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
            out.append(row("cuda", case, provider, None, 0, f"failed: {type(error).__name__}: {error}"[:80]))

    add("triton", case.op_fn(validate=False), "eager, validate=False")
    try:
        graph = cuda_graph_of(case.op_fn(validate=False))
    except Exception as error:  # noqa: BLE001 - capture is optional; say why it did not happen
        out.append(row("cuda", case, "triton graph", None, 0,
                       f"capture failed: {type(error).__name__}: {error}"[:80]))
    else:
        add("triton graph", graph, "CUDA graph, validate=False")
    add("triton validate", case.op_fn(validate=True), "eager, validate=True (one host sync)")
    return out


def summary_lines(rows, device) -> list[str]:
    lines = mismatch_lines(rows, ("B", "L"), "the op's outputs differ from the reference")
    batch, length = HEADLINE
    spec = find_row(rows, "cpu" if device == "cpu" else "triton", B=batch, L=length)
    ref = find_row(rows, "reference", B=batch, L=length)
    if spec and ref:
        ratio = ref["median_us"] / spec["median_us"]
        goal = f" (goal >= {GOAL:.0f}x: {'met' if ratio >= GOAL else 'NOT met'})" if device == "cpu" else ""
        lines.append(f"headline: B={batch} L={length} ({device}): specops {spec['median_us']:.0f} us, "
                     f"reference (torch unfold) {ref['median_us']:.0f} us, ratio {ratio:.1f}x{goal}")
    elif spec is None or ref is None:
        lines.append(f"headline: B={batch} L={length} not measured (not in the grid, or reference skipped)")
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "ngram_match", "a small grid (B 1,16; L 1024,16384) with fewer runs, for smoke runs")
    parser.add_argument("--batches", type=int_list, default=[1, 16, 64], help="comma-separated B values")
    parser.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768],
                        help="comma-separated context lengths L")
    parser.add_argument("--min-ngram", type=int, default=1)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--num-candidates", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--dtype", choices=list(DTYPES), default="int64", help="token dtype")
    parser.add_argument("--reference-max-tokens", type=int, default=None,
                        help="skip the reference where B*L exceeds this (default: time it everywhere)")
    args, csv_path = parse_bench_args(parser, "ngram_match")
    if args.quick:
        args.batches, args.contexts = [1, 16], [1024, 16384]
    options = dict(min_ngram=args.min_ngram, max_ngram=args.max_ngram, num_candidates=args.num_candidates,
                   width=args.width)

    specops = import_specops()
    info = machine_info(args.device)
    info.update({key: str(value) for key, value in options.items()})
    info.update(dtype=args.dtype, vocab=str(VOCAB), zipf=str(ZIPF_EXPONENT))
    def run_case(batch_length):
        case = Case(specops, *batch_length, options, DTYPES[args.dtype], args.device)
        if args.device == "cpu":
            return bench_cpu_case(case, args.quick, args.reference_max_tokens)
        case_rows = bench_cuda_case(case, args.quick, args.reference_max_tokens)
        del case
        torch.cuda.empty_cache()
        return case_rows

    cases = [(b, n) for n in args.contexts for b in args.batches]
    rows, elapsed, other_load = run_cases(cases, lambda c: f"B={c[0]} L={c[1]}", run_case, info)
    add_speedup(rows, "vs_ref", "reference", ("device", "B", "L"))  # x faster than the torch unfold reference
    notes = ["Mtok/s: context tokens (B*L) per second. vs_ref: reference time / this time. found: mean "
             "candidates per row. agree: outputs equal to the reference's."]
    if args.device == "cuda":
        notes.append("triton: CUDA events with L2 flushed (triton.testing.do_bench); reference: wall clock with sync.")
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes + summary_lines(rows, args.device), elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
