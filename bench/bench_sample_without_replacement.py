"""Benchmark of `specops.ops.sample_without_replacement` (k distinct tokens per row in draw order from
the filtered softmax q, and q: a draft tree's siblings for RSD-C and the draft_probs tree_verify needs).

    python bench/bench_sample_without_replacement.py [--device cpu|cuda] [--quick] [--csv PATH]
        [--threads N] [--batches 1,8,64] [--vocabs 32000,262144] [--samples 2,4,8]

Providers, per case (N rows, vocabulary V, k = num_samples draws per row, top_p):
- `specops`: the op through the public wrapper, validate=False (the C++ kernel on CPU, which checks the
  logits anyway; Triton on CUDA).
  CUDA only: `specops validated` (validate=True: one host sync) and `specops graph` (the validate=False
  call captured as a CUDA graph).
- `reference`: specops.reference.sample_without_replacement, the pure-torch spec (Python per row and per
  draw); run only where N*V <= REFERENCE_MAX_ELEMENTS (2^18), skipped above.
- `torch`: what a user writes today: q = torch.softmax(logits / T, -1, dtype=float32), then
  torch.multinomial(q, k, replacement=False); returns q too.
- `gumbel-topk`: Gumbel-top-k in torch: torch.topk(logits / T + G, k) with G = -log(-log(U)), U from
  torch.rand(N, V) inside the timed call, plus the same softmax for q.
With top-p, `torch` and `gumbel-topk` first mask logits / T as transformers' TopPLogitsWarper does (a sort
of each row, softmax, cumsum); the op and the reference cut by their own top-p.

Workload: logits N(0, 3^2) (float32 on CPU, bfloat16 on CUDA), temperature 1 (every provider still
divides by it, as for any T), top-k off, top-p off except one case with top-p 0.9 (TOP_P_CASE). The op
gets per-row temperature / top-k / top-p / seed tensors made before timing (as a decoding loop keeps
them), offset 0. `agree`: specops' tokens equal the reference's (same seeds; equal up to float ties at
an inverse-CDF boundary) and its q within 1e-6.

GB/s is for every provider the bytes that must move: the logits read once and q written,
N * V * (sizeof(logits) + 4) bytes (131 KB at N = 1, V = 32000 fp32; 134 MB at N = 64, V = 262144 fp32).
vs_torch: torch time / this time (x faster than torch). Inputs are made before the timed region; times
are medians after warm-up.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from _timing import (
    add_speedup,
    bench_parser,
    cuda_graph_of,
    find_row,
    import_specops,
    int_list,
    machine_info,
    mismatch_lines,
    parse_bench_args,
    report,
    run_cases,
    time_provider,
)

LOGIT_SCALE = 3.0
TEMPERATURE = 1.0
SEED = 1234
REFERENCE_MAX_ELEMENTS = 2**18  # reference only where N*V is at most this (Python per row and draw)
TOP_P = 0.9
TOP_P_CASE = {"full": (8, 262144, 4), "quick": (1, 32000, 4)}  # (N, V, k) also run with top-p 0.9
HEADLINE = (8, 262144, 8)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "N", "V", "k", "dtype", "top_p", "provider", "median_us", "GB/s", "vs_torch", "agree",
           "runs", "others", "note"]
KEYS = ("N", "V", "k", "dtype", "top_p")


@dataclass
class Case:
    batch: int
    vocab: int
    samples: int
    top_p: float = 1.0


def grid(device: str, quick: bool, batches, vocabs, samples) -> list[Case]:
    if device == "cpu":
        default = ([1], [32000], [2, 8]) if quick else ([1, 8], [32000, 262144], [2, 8])
    else:
        default = ([1, 64], [32000], [4]) if quick else ([1, 8, 64], [32000, 262144], [2, 4, 8])
    batches, vocabs, samples = batches or default[0], vocabs or default[1], samples or default[2]
    cases = [Case(n, v, k) for v in vocabs for n in batches for k in samples]
    return cases + [Case(*TOP_P_CASE["quick" if quick else "full"], top_p=TOP_P)]


def bytes_moved(case: Case, dtype: torch.dtype) -> int:
    """The logits read once and q written (float32)."""
    return case.batch * case.vocab * (dtype.itemsize + 4)


def top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper on logits / T: the smallest tokens whose cumulative probability is
    at most 1 - top_p set to -inf (the top token always kept)."""
    sorted_logits, sorted_indices = torch.sort(scaled, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False
    return scaled.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))


def scaled_and_q(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the torch providers compute before drawing: logits / T (top-p masked as transformers does) and
    their softmax q."""
    scaled = logits / TEMPERATURE
    if top_p < 1.0:
        scaled = top_p_mask(scaled, top_p)
    return scaled, torch.softmax(scaled, dim=-1, dtype=torch.float32)


class Providers:
    """One case's inputs on one device and the providers' calls."""

    def __init__(self, specops, case: Case, dtype: torch.dtype, device: str):
        self.specops_module, self.case = specops, case
        gen = torch.Generator(device=device).manual_seed(SEED)
        logits = LOGIT_SCALE * torch.randn(case.batch, case.vocab, generator=gen, device=device)
        self.logits = logits.to(dtype)
        rows = case.batch
        self.temperature = torch.full((rows,), TEMPERATURE, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.int64, device=device)
        self.top_p = torch.full((rows,), case.top_p, device=device)
        self.seed = torch.arange(rows, dtype=torch.int64, device=device) + SEED

    def specops_fn(self, validate: bool = False):
        op, logits, k = self.specops_module.ops.sample_without_replacement, self.logits, self.case.samples
        options = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                   "seed": self.seed, "offset": 0, "validate": validate}
        return lambda: op(logits, k, **options)

    def reference_fn(self):
        args = (self.logits, self.case.samples, self.temperature, self.top_k, self.top_p, self.seed, 0)
        reference = self.specops_module.reference.sample_without_replacement
        return lambda: reference(*args)

    def torch_fn(self):
        """softmax then torch.multinomial without replacement; returns (tokens, q)."""
        logits, k, top_p = self.logits, self.case.samples, self.case.top_p

        def run():
            _, q = scaled_and_q(logits, top_p)
            return torch.multinomial(q, k, replacement=False), q
        return run

    def gumbel_fn(self):
        """Gumbel-top-k: topk(logits / T + G), G = -log(-log(U)) drawn in the call; returns (tokens, q)."""
        logits, k, top_p = self.logits, self.case.samples, self.case.top_p

        def run():
            scaled, q = scaled_and_q(logits, top_p)
            gumbel = -torch.log(-torch.log(torch.rand(scaled.shape, device=scaled.device)))
            return torch.topk(scaled + gumbel, k, dim=-1).indices, q
        return run


def agreement(p: Providers, result) -> str:
    """Whether specops' tokens equal the reference's and its q is within 1e-6 (also the reference's
    warm-up)."""
    tokens, probs = p.reference_fn()()
    same = torch.equal(result[0], tokens) and torch.allclose(result[1], probs, rtol=0, atol=1e-6)
    return "yes" if same else "NO"


def run_case(specops, case: Case, device: str, quick: bool) -> list[dict]:
    cuda = device == "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    p = Providers(specops, case, dtype, device)
    sync = torch.cuda.synchronize if cuda else None
    fast = (dict(warmup=2, min_runs=5, min_seconds=0.05) if quick
            else dict(warmup=3, min_runs=20, min_seconds=0.3))
    # The reference is Python per row and draw: fewer runs, no warm-up (it ran for `agree`).
    slow = dict(warmup=0, min_runs=3, min_seconds=0.0 if quick else 0.5, max_runs=20, sync=sync)
    must_move = bytes_moved(case, dtype)
    try:
        first = p.specops_fn()()  # also the kernel's warm-up (compiles the Triton kernels)
        if cuda:
            sync()
    except Exception as error:  # noqa: BLE001 - e.g. no kernel for this device yet: the other providers run
        print(f"  specops failed ({type(error).__name__}: {error})", file=sys.stderr)
        first = None
    rows: list[dict] = []

    def add(provider, fn, note="", events=cuda, params=fast, agree=None):
        row = {"device": device, "N": case.batch, "V": case.vocab, "k": case.samples,
               "dtype": DTYPE_NAMES[dtype], "top_p": case.top_p, "provider": provider, "median_us": None,
               "GB/s": None, "vs_torch": None, "agree": agree, "runs": None, "note": note}
        time_provider(row, fn, events=events, params=params, quick=quick, must_move=must_move)
        rows.append(row)

    if case.batch * case.vocab <= REFERENCE_MAX_ELEMENTS:
        agree = None if first is None else agreement(p, first)
        add("specops", p.specops_fn(), "validate=False", agree=agree)
    else:
        agree = None
        add("specops", p.specops_fn(), "validate=False")
    if cuda:
        add("specops validated", p.specops_fn(validate=True), "validate=True (one host sync)")
        try:
            graph = cuda_graph_of(p.specops_fn())
        except Exception as error:  # noqa: BLE001 - capture is optional; say why it did not happen
            add("specops graph", None, f"capture failed: {type(error).__name__}: {error}"[:100])
        else:
            add("specops graph", graph, "CUDA graph, validate=False")
    if case.batch * case.vocab <= REFERENCE_MAX_ELEMENTS:
        add("reference", p.reference_fn(), "wall clock" if cuda else "", events=False, params=slow,
            agree=agree)
    else:
        add("reference", None, f"skipped: N*V > 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}")
    masked = "TopPLogitsWarper sort, " if case.top_p < 1.0 else ""
    add("torch", p.torch_fn(), masked + "softmax, multinomial(replacement=False)")
    add("gumbel-topk", p.gumbel_fn(), masked + "softmax, rand, topk(x / T + Gumbel)")
    del p
    if cuda:
        torch.cuda.empty_cache()
    return rows


def headline_lines(rows: list[dict], device: str) -> list[str]:
    batch, vocab, samples = HEADLINE
    spec = find_row(rows, "specops", N=batch, V=vocab, k=samples, top_p=1.0)
    peer = find_row(rows, "torch", N=batch, V=vocab, k=samples, top_p=1.0)
    if not (spec and peer):
        return [f"headline: N={batch} V={vocab} k={samples} not measured (not in the grid)"]
    gumbel = find_row(rows, "gumbel-topk", N=batch, V=vocab, k=samples, top_p=1.0)
    return [f"headline (N={batch}, V={vocab}, k={samples}, {device}): specops {spec['median_us']:.0f} us "
            f"({spec['GB/s']:.1f} GB/s), torch {peer['median_us']:.0f} us, "
            f"{peer['median_us'] / spec['median_us']:.1f}x"
            + (f"; gumbel-topk {gumbel['median_us']:.0f} us" if gumbel else "")]


def main() -> int:
    parser = bench_parser(__doc__, "sample_without_replacement",
                          "CPU: N 1, V 32000, k 2,8; CUDA: N 1,64, V 32000, k 4; top-p at N 1, V 32000, k 4; "
                          "fewer runs")
    parser.add_argument("--batches", type=int_list, default=None,
                        help="N values (CPU default 1,8; CUDA 1,8,64)")
    parser.add_argument("--vocabs", type=int_list, default=None, help="V values (default 32000,262144)")
    parser.add_argument("--samples", type=int_list, default=None,
                        help="k values, num_samples (CPU default 2,8; CUDA 2,4,8)")
    args, csv_path = parse_bench_args(parser, "sample_without_replacement")
    if any(n < 1 for n in (args.batches or []) + (args.samples or [])):
        parser.error("--batches and --samples must be >= 1")
    if any(k > v for k in args.samples or [] for v in args.vocabs or [32000]):
        parser.error("--samples: k must be at most V")
    specops = import_specops()
    info = machine_info(args.device)
    cases = grid(args.device, args.quick, args.batches, args.vocabs, args.samples)
    rows, elapsed, other_load = run_cases(
        cases, lambda c: f"N={c.batch} V={c.vocab} k={c.samples} top_p={c.top_p}",
        lambda c: run_case(specops, c, args.device, args.quick), info)
    add_speedup(rows, "vs_torch", "torch", KEYS)
    notes = [("GB/s: bytes that must move, N*V*sizeof(logits) (read) + N*V*4 (q written), over the median "
              "time, for every provider. vs_torch: torch time / this time (x faster than torch)."),
             (f"reference: run where N*V <= 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}, skipped above "
              "(Python per row and draw); agree: specops' tokens equal the reference's and q within 1e-6.")]
    if args.device == "cuda":
        notes.append("specops, torch and gumbel-topk: CUDA events with L2 flushed (triton.testing.do_bench); "
                     "reference: wall clock with sync.")
    notes += mismatch_lines(rows, KEYS, "reference != specops")
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes + headline_lines(rows, args.device),
           elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
