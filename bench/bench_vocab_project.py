"""Benchmark of `specops.ops.vocab_project` (a heterogeneous drafter's distribution over the vocabulary
intersection, in target ids, and a draft sampled from it).

    python bench/bench_vocab_project.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--batches 1,8,64]

Providers. `reference` (specops.reference.vocab_project, the pure-torch spec; rows in Python),
`transformers` (the peer: what universal assisted generation does with a drafter's logits, written
here in torch: `AssistantToTargetTranslator.get_target_logits` builds a full -inf [N, V_t] tensor and
scatters the mapped drafter logits into it; then the logits processors (temperature, and top-p as
`TopPLogitsWarper` does it: a sort over V_t), softmax and torch.multinomial), `zeros` (torch.zeros(N,
V_t) alone: allocating and clearing the output, which every provider returning a fresh probs tensor
pays). CPU: `cpu` and `cpu no-validate` (the C++ kernel through the public wrapper, validate=True and
False). CUDA: `triton` (public wrapper, validate=False) and `triton validate` (validate=True: one host
sync).

Workload: drafter vocabulary V_d = 49,152 (SmolLM2) and target vocabulary V_t = 262,144 (Gemma 3), a
random injective map of 32,000 drafter ids (the rest -1, about the real pair's intersection), logits
N(0, 3^2) in float32, N rows with distinct seeds. `sampled`: T = 1; `top_p`: T = 1, top-p 0.9.
`agree`: specops' drafts equal the reference's (same seeds).

Bytes moved, the floor of any implementation: the logits read and the probs written,
N * (V_d * 4 + V_t * 4) bytes = N * 1,245,184 B (the 393 KB map is read once per call on top):
1.25 MB at N = 1, 9.96 MB at N = 8 and, the headline case, 79.7 MB at N = 64 (sampled). GB/s is those
bytes over the median time, for every provider. At N = 64 the output alone is 67 MB: on the CPU a fresh
allocation that large comes from the kernel (mmap) and every 4 KB page faults in on first touch, which
the `zeros` row measures and which dominates every provider there. torch's THP_MEM_ALLOC_ENABLE=1 (huge
pages for large CPU allocations) cut that case from 47.7 ms to 12.6 ms (zeros: 33 ms to 7.3 ms) on the
2-core EPYC this was written on; the benchmark leaves the environment as it finds it.

Inputs and random numbers are made before the timed region; times are medians after warm-up. vs_peer:
transformers time / this time.
"""

from __future__ import annotations

import sys

import torch
from _timing import (add_speedup, bench_parser, cuda_median_time, find_row, import_specops, int_list, machine_info,
                     median_time, mismatch_lines, parse_bench_args, report, run_cases)

DRAFT_VOCAB = 49_152
TARGET_VOCAB = 262_144
MAPPED = 32_000
LOGIT_SCALE = 3.0
SEED = 1234
WORKLOADS = {"sampled": {"temperature": 1.0, "top_p": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9}}
HEADLINE = (64, "sampled")
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "N", "workload", "provider", "median_us", "GB/s", "vs_peer", "agree", "runs", "others",
           "note"]


def bytes_moved(rows: int) -> int:
    return rows * (DRAFT_VOCAB * 4 + TARGET_VOCAB * 4)


def target_ids_map(device: str) -> torch.Tensor:
    """[V_d] int64: MAPPED random drafter ids sent to distinct random target ids, the rest -1."""
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.full((DRAFT_VOCAB,), -1, dtype=torch.int64)
    drafter = torch.randperm(DRAFT_VOCAB, generator=gen)[:MAPPED]
    ids[drafter] = torch.randperm(TARGET_VOCAB, generator=gen)[:MAPPED]
    return ids.to(device)


class Case:
    """One (N, workload) on one device: inputs and the providers' calls."""

    def __init__(self, specops, rows: int, workload: str, ids: torch.Tensor, device: str):
        self.specops, self.rows, self.workload = specops, rows, workload
        gen = torch.Generator().manual_seed(SEED + rows)
        self.logits = (LOGIT_SCALE * torch.randn(rows, DRAFT_VOCAB, generator=gen)).to(device)
        self.ids = ids
        options = WORKLOADS[workload]
        self.temperature = torch.full((rows,), options["temperature"], device=device)
        self.top_p = torch.full((rows,), options["top_p"], device=device)
        self.top_k = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seed = torch.arange(rows, dtype=torch.int64, device=device) + SEED
        # The peer's translator keeps these from its construction (not timed).
        self.mapped = ids >= 0
        self.supported = ids[self.mapped]

    def op_fn(self, validate: bool = True):
        vocab_project, logits, ids = self.specops.ops.vocab_project, self.logits, self.ids
        options = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                   "seed": self.seed, "offset": 0, "validate": validate}
        return lambda: vocab_project(logits, ids, TARGET_VOCAB, **options)

    def reference_fn(self):
        args = (self.logits, self.ids, TARGET_VOCAB, self.temperature, self.top_k, self.top_p, self.seed, 0)
        reference = self.specops.reference.vocab_project
        return lambda: reference(*args)

    def peer_fn(self):
        """transformers' universal assisted generation on these logits, in torch (module docstring)."""
        logits, mapped, supported = self.logits, self.mapped, self.supported
        temperature, top_p = WORKLOADS[self.workload]["temperature"], WORKLOADS[self.workload]["top_p"]

        def run():
            target = torch.full((logits.shape[0], TARGET_VOCAB), float("-inf"), device=logits.device)
            target[..., supported] = logits[..., mapped]  # get_target_logits
            if temperature != 1.0:
                target = target / temperature
            if top_p < 1.0:  # TopPLogitsWarper
                sorted_logits, sorted_indices = torch.sort(target, descending=False)
                cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
                remove = cumulative <= (1 - top_p)
                remove[..., -1:] = False
                target = target.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))
            probs = torch.softmax(target, dim=-1)
            return probs, torch.multinomial(probs, 1).squeeze(1)
        return run


def row(device, case: Case, provider, seconds, runs, note="", agree=None) -> dict:
    return {"device": device, "N": case.rows, "workload": case.workload, "provider": provider,
            "median_us": None if seconds is None else seconds * 1e6,
            "GB/s": None if seconds is None else bytes_moved(case.rows) / seconds / 1e9, "vs_peer": None,
            "agree": agree, "runs": runs, "note": note}


def agreement(case: Case, result) -> str:
    """Whether specops' drafts equal the reference's and its probs agree to 1e-6 (also the reference's
    warm-up)."""
    probs, _, drafts = case.reference_fn()()
    same = torch.equal(result[2], drafts) and torch.allclose(result[0], probs, rtol=0, atol=1e-6)
    return "yes" if same else "NO"


def bench_cpu_case(case: Case, quick: bool) -> list[dict]:
    fast = ({"warmup": 2, "min_runs": 5, "min_seconds": 0.05} if quick else
            {"warmup": 3, "min_runs": 20, "min_seconds": 0.3})
    slow = {"warmup": 1, "min_runs": 3, "min_seconds": 0.0 if quick else 0.5, "max_runs": 20}
    agree = agreement(case, case.op_fn()())  # also the kernel's warm-up
    out = []
    t, n = median_time(case.reference_fn(), **slow)
    out.append(row("cpu", case, "reference", t, n, "rows in Python"))
    t, n = median_time(case.peer_fn(), **slow)
    out.append(row("cpu", case, "transformers", t, n, "full [N, V_t] -inf + scatter, softmax, multinomial"))
    t, n = median_time(case.op_fn(), **fast)
    out.append(row("cpu", case, "cpu", t, n, "validate=True (default)", agree))
    t, n = median_time(case.op_fn(validate=False), **fast)
    out.append(row("cpu", case, "cpu no-validate", t, n, "validate=False", agree))
    rows = case.rows
    t, n = median_time(lambda: torch.zeros(rows, TARGET_VOCAB), **fast)
    out.append(row("cpu", case, "zeros", t, n, "torch.zeros(N, V_t) alone"))
    return out


def bench_cuda_case(case: Case, quick: bool) -> list[dict]:
    rep_ms = 30 if quick else 100
    sync = torch.cuda.synchronize
    agree = agreement(case, case.op_fn(validate=False)())  # also compiles the kernels
    sync()
    out = []

    def add(provider, fn, note, agree_=None, events=True):
        try:
            if events:
                t, n = cuda_median_time(fn, rep_ms=rep_ms), None
            else:  # host-bound: wall clock with sync
                t, n = median_time(fn, warmup=1, min_runs=3, min_seconds=0.0 if quick else 0.3, max_runs=20,
                                   sync=sync)
            out.append(row("cuda", case, provider, t, n, note, agree_))
        except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
            out.append(row("cuda", case, provider, None, 0, f"failed: {type(error).__name__}: {error}"[:80]))

    add("reference", case.reference_fn(), "rows in Python, wall clock", events=False)
    add("transformers", case.peer_fn(), "full [N, V_t] -inf + scatter, softmax, multinomial")
    add("triton", case.op_fn(validate=False), "eager, validate=False", agree)
    add("triton validate", case.op_fn(validate=True), "eager, validate=True (one host sync)", agree)
    rows = case.rows
    add("zeros", lambda: torch.zeros(rows, TARGET_VOCAB, device="cuda"), "torch.zeros(N, V_t) alone")
    return out


def summary_lines(rows, device) -> list[str]:
    lines = mismatch_lines(rows, ("N", "workload"), "specops differs from the reference")
    n, workload = HEADLINE
    spec = find_row(rows, "cpu" if device == "cpu" else "triton", N=n, workload=workload)
    peer = find_row(rows, "transformers", N=n, workload=workload)
    zeros = find_row(rows, "zeros", N=n, workload=workload)
    if spec and peer:
        lines.append(f"headline: N={n} {workload} ({device}): specops {spec['median_us']:.0f} us "
                     f"({spec['GB/s']:.1f} GB/s of the {bytes_moved(n) / 1e6:.1f} MB floor), transformers' "
                     f"approach {peer['median_us']:.0f} us, "
                     f"ratio {peer['median_us'] / spec['median_us']:.1f}x"
                     + (f"; torch.zeros of the output alone {zeros['median_us']:.0f} us" if zeros else ""))
    else:
        lines.append(f"headline: N={n} {workload} not measured (not in the grid)")
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "vocab_project", "N 1,8 and fewer runs, for smoke runs")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 64], help="comma-separated N values")
    args, csv_path = parse_bench_args(parser, "vocab_project")
    if args.quick:
        args.batches = [1, 8]

    specops = import_specops()
    info = machine_info(args.device)
    info.update(draft_vocab=str(DRAFT_VOCAB), target_vocab=str(TARGET_VOCAB), mapped=str(MAPPED),
                dtype="fp32")
    ids = target_ids_map(args.device)
    def run_case(n_workload):
        case = Case(specops, *n_workload, ids, args.device)
        if args.device == "cpu":
            return bench_cpu_case(case, args.quick)
        case_rows = bench_cuda_case(case, args.quick)
        del case
        torch.cuda.empty_cache()
        return case_rows

    cases = [(n, w) for w in WORKLOADS for n in args.batches]
    rows, elapsed, other_load = run_cases(cases, lambda c: f"N={c[0]} {c[1]}", run_case, info)
    add_speedup(rows, "vs_peer", "transformers", ("device", "N", "workload"))  # x faster than transformers
    notes = ["GB/s: bytes moved N*(V_d*4 + V_t*4) (logits read, probs written) over the median time, for every "
             "provider. vs_peer: transformers time / this time. agree: drafts equal to the reference's, probs "
             "within 1e-6."]
    if args.device == "cuda":
        notes.append("triton, transformers and zeros: CUDA events with L2 flushed (triton.testing.do_bench); "
                     "reference: wall clock with sync.")
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes + summary_lines(rows, args.device), elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
