"""Benchmark of `specops.ops.stochastic_beam_step` (one level of Stochastic Beam Search, RSD-S's proposal:
the K = W best truncated-Gumbel children over all W beams of each request, and each beam's q).

    python bench/bench_stochastic_beam_step.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--batches 1,8,64] [--beams 2,4,8] [--vocabs 32000,262144]

Providers, per case (B requests, W beams, vocabulary V, beam_width K = W, top_p):
- `specops`: the op through the public wrapper, validate=False (the C++ kernel on CPU, which checks the
  logits anyway; Triton on CUDA).
  CUDA only: `specops validated` (validate=True: one host sync) and `specops graph` (the validate=False
  call captured as a CUDA graph).
- `reference`: specops.reference.stochastic_beam_step, the pure-torch spec (Python per request, beam and
  draw); run only where B*W*V <= REFERENCE_MAX_ELEMENTS (2^18), skipped above.
- `torch`: one SBS level as public copies write it (Kool et al.'s fairseq gumbel.py form, `torch_step`):
  log q = log_softmax(logits / T), phi = beam_log_probs + log q and Gumbels g = phi - log(-log U) for all
  W*V children, Z = max g per beam, the truncated g~ = G - relu(u) - log1p(exp(-|u|)) with
  u = G - g + log1p(-exp(g - Z)), -inf where phi is, topk over the W*V children of each request; returns q
  = softmax(logits / T) too. U comes from torch.rand inside the timed call (the op draws its counter-based
  random numbers inside its call too).
With top-p, `torch` first masks logits / T as transformers' TopPLogitsWarper does (a sort of each row);
the op and the reference cut by their own top-p.

Workload: logits N(0, 3^2) (float32 on CPU, bfloat16 on CUDA), temperature 1, top-k off, top-p off except
one case with top-p 0.9 (TOP_P_CASE), as bench_sample_without_replacement. Every beam is live: phi and G
are a previous level's, the W children of one root beam per request (phi = G = 0) kept by `torch_step`,
so G descends over the beams. Per-request temperature / top-k / top-p / seed tensors are made before
timing (as a decoding loop keeps them), offset 0.
`agree`, specops: its parents and tokens equal the reference's (same seeds), its log_probs and scores
within 1e-5 and its q within 1e-6; where the reference is skipped, and for torch (other random numbers):
`valid` when the output is a plausible SBS level (see `invalid_reason`), else INVALID.

GB/s is for every provider the bytes that must move: the logits read once and q written,
B * W * V * (sizeof(logits) + 4) bytes (512 KB at B = 1, W = 2, V = 32000 fp32; 1.07 GB at B = 64, W = 8,
V = 262144 fp32). vs_torch: torch time / this time (x faster than torch). Inputs are made before the timed
region; times are medians after warm-up.
"""

from __future__ import annotations

import sys
import time
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
from bench_sample_without_replacement import DTYPE_NAMES, LOGIT_SCALE, TEMPERATURE, TOP_P, scaled_and_q

SEED = 1234
REFERENCE_MAX_ELEMENTS = 2**18  # reference only where B*W*V is at most this (Python per request, beam, draw)
# The default CPU grid leaves out cases above this many logits (B = 64, W = 8, V = 262144): torch's step
# holds ~8 float32 copies of them and takes ~20 s a call there on 2 cores (~10 s at W = 4). Explicit
# --batches/--beams/--vocabs run every case asked for.
CPU_MAX_ELEMENTS = 2**26
TOP_P_CASE = {"full": (8, 4, 262144), "quick": (1, 4, 32000)}  # (B, W, V) also run with top-p 0.9
HEADLINE = (8, 4, 262144)
SLOW_CALL_S = 0.05  # calls slower than this get fewer timed runs (large CPU cases)
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "B", "W", "V", "dtype", "top_p", "provider", "median_us", "GB/s", "vs_torch", "agree",
           "runs", "others", "note"]
KEYS = ("B", "W", "V", "dtype", "top_p")
NEG_INF = float("-inf")


@dataclass
class Case:
    batch: int
    beams: int
    vocab: int
    top_p: float = 1.0


def grid(device: str, quick: bool, batches, beams, vocabs) -> list[Case]:
    if device == "cpu":
        default = ([1], [2, 8], [32000]) if quick else ([1, 8, 64], [2, 4, 8], [32000, 262144])
    else:
        default = ([1, 64], [4], [32000]) if quick else ([1, 8, 64], [2, 4, 8], [32000, 262144])
    explicit = bool(batches or beams or vocabs)
    batches, beams, vocabs = batches or default[0], beams or default[1], vocabs or default[2]
    cases = [Case(b, w, v) for v in vocabs for b in batches for w in beams]
    if device == "cpu" and not quick and not explicit:
        cases = [c for c in cases if c.batch * c.beams * c.vocab <= CPU_MAX_ELEMENTS]
    return cases + [Case(*TOP_P_CASE["quick" if quick else "full"], top_p=TOP_P)]


def bytes_moved(case: Case, dtype: torch.dtype) -> int:
    """The logits read once and q written (float32)."""
    return case.batch * case.beams * case.vocab * (dtype.itemsize + 4)


def torch_step(logits: torch.Tensor, beam_log_probs: torch.Tensor, beam_scores: torch.Tensor, beam_width: int,
               top_p: float = 1.0, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """One SBS level in torch, all W*V children perturbed, as public copies write it: returns parents,
    tokens, log_probs, scores [B, K] and q [B, W, V]."""
    batch, beams, vocab = logits.shape
    scaled, q = scaled_and_q(logits.reshape(batch * beams, vocab), top_p)
    log_q = torch.log_softmax(scaled, dim=-1, dtype=torch.float32).view(batch, beams, vocab)
    phi = beam_log_probs[..., None] + log_q
    uniform = torch.rand(phi.shape, generator=generator, device=phi.device)
    g = phi - torch.log(-torch.log(uniform))
    z = g.max(dim=-1, keepdim=True).values
    parent = beam_scores[..., None]
    u = parent - g + torch.log1p(-torch.exp(g - z))
    truncated = parent - torch.relu(u) - torch.log1p(torch.exp(-u.abs()))
    truncated = truncated.masked_fill(phi == NEG_INF, NEG_INF)
    scores, flat = torch.topk(truncated.view(batch, -1), beam_width, dim=-1)
    log_probs = phi.view(batch, -1).gather(1, flat)
    return flat // vocab, flat % vocab, log_probs, scores, q.view(batch, beams, vocab)


class Providers:
    """One case's inputs on one device and the providers' calls."""

    def __init__(self, specops, case: Case, dtype: torch.dtype, device: str):
        self.specops_module, self.case = specops, case
        batch, beams, vocab = case.batch, case.beams, case.vocab
        gen = torch.Generator(device=device).manual_seed(SEED)
        logits = LOGIT_SCALE * torch.randn(batch, beams, vocab, generator=gen, device=device)
        self.logits = logits.to(dtype)
        # The previous level: the W children one root beam per request kept.
        root = (LOGIT_SCALE * torch.randn(batch, 1, vocab, generator=gen, device=device)).to(dtype)
        zero = torch.zeros(batch, 1, device=device)
        _, _, self.beam_log_probs, self.beam_scores, _ = torch_step(root, zero, zero, beams, generator=gen)
        self.temperature = torch.full((batch,), TEMPERATURE, device=device)
        self.top_k = torch.zeros(batch, dtype=torch.int64, device=device)
        self.top_p = torch.full((batch,), case.top_p, device=device)
        self.seed = torch.arange(batch, dtype=torch.int64, device=device) + SEED

    def specops_fn(self, validate: bool = False):
        op, case = self.specops_module.ops.stochastic_beam_step, self.case
        args = (self.logits, self.beam_log_probs, self.beam_scores, case.beams)
        options = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                   "seed": self.seed, "offset": 0, "validate": validate}
        return lambda: op(*args, **options)

    def reference_fn(self):
        args = (self.logits, self.beam_log_probs, self.beam_scores, self.case.beams, self.temperature,
                self.top_k, self.top_p, self.seed, 0)
        reference = self.specops_module.reference.stochastic_beam_step
        return lambda: reference(*args)

    def torch_fn(self):
        args = (self.logits, self.beam_log_probs, self.beam_scores, self.case.beams, self.case.top_p)
        return lambda: torch_step(*args)


def agreement(p: Providers, result) -> str:
    """Whether specops' parents and tokens equal the reference's, its log_probs and scores are within 1e-5
    and its q within 1e-6 (also the reference's warm-up)."""
    expected = p.reference_fn()()
    same = (torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])
            and all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(result[2:4], expected[2:4]))
            and torch.allclose(result[4], expected[4], rtol=0, atol=1e-6))
    return "yes" if same else "NO"


def invalid_reason(p: Providers, result) -> str | None:
    """Why `result` is not a plausible SBS level of p's inputs with every beam live, or None: shapes,
    parents in [0, W) and tokens in [0, V), distinct (parent, token) pairs, scores finite, descending and
    at most their parent's G, log_probs = phi(parent) + log q(parent, token), q rows >= 0 summing to 1."""
    parents, tokens, log_probs, scores, probs = result
    batch, beams, vocab = p.case.batch, p.case.beams, p.case.vocab
    if any(t.shape != (batch, beams) for t in (parents, tokens, log_probs, scores)):
        return "shapes of parents / tokens / log_probs / scores"
    if probs.shape != (batch, beams, vocab):
        return "shape of q"
    if not (((parents >= 0) & (parents < beams)).all() and ((tokens >= 0) & (tokens < vocab)).all()):
        return "parent or token out of range"
    if (parents * vocab + tokens).sort(dim=-1).values.diff(dim=-1).eq(0).any():
        return "a child kept twice"
    if not (torch.isfinite(scores).all() and (scores.diff(dim=-1) <= 0).all()):
        return "scores not finite and descending"
    bound = p.beam_scores.gather(1, parents)
    if (scores > bound + 1e-5 * (1 + bound.abs())).any():
        return "a child scored above its parent"
    q = probs[torch.arange(batch, device=probs.device)[:, None], parents, tokens]
    expected = p.beam_log_probs.gather(1, parents) + q.log()
    if not torch.allclose(log_probs, expected, rtol=1e-5, atol=1e-4):
        return "log_probs != phi + log q"
    if (probs < 0).any() or ((probs.double().sum(-1) - 1).abs() > 1e-3).any():
        return "q rows not >= 0 summing to 1"
    return None


def validity(p: Providers, result) -> str:
    reason = invalid_reason(p, result)
    if reason is not None:
        print(f"  INVALID: {reason}", file=sys.stderr)
    return "valid" if reason is None else "INVALID"


def run_case(specops, case: Case, device: str, quick: bool) -> list[dict]:
    cuda = device == "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    p = Providers(specops, case, dtype, device)
    sync = torch.cuda.synchronize if cuda else None
    fast = ({"warmup": 2, "min_runs": 5, "min_seconds": 0.05} if quick
            else {"warmup": 3, "min_runs": 20, "min_seconds": 0.3})
    # A first call over SLOW_CALL_S was the warm-up; 5 runs make the median.
    slow_call = {"warmup": 0, "min_runs": 5, "min_seconds": 0.0}
    # The reference is Python per request, beam and draw: fewer runs, no warm-up (it ran for `agree`).
    slow = {"warmup": 0, "min_runs": 3, "min_seconds": 0.0 if quick else 0.5, "max_runs": 20, "sync": sync}
    must_move = bytes_moved(case, dtype)
    with_reference = case.batch * case.beams * case.vocab <= REFERENCE_MAX_ELEMENTS
    rows: list[dict] = []

    def first_call(fn):
        """fn's first result (also its warm-up: compiles Triton kernels), and whether it was slow."""
        started = time.perf_counter()
        result = fn()
        if cuda:
            sync()
        return result, time.perf_counter() - started > SLOW_CALL_S

    def add(provider, fn, note="", events=cuda, params=fast, agree=None):
        row = {"device": device, "B": case.batch, "W": case.beams, "V": case.vocab,
               "dtype": DTYPE_NAMES[dtype], "top_p": case.top_p, "provider": provider, "median_us": None,
               "GB/s": None, "vs_torch": None, "agree": agree, "runs": None, "note": note}
        time_provider(row, fn, events=events, params=params, quick=quick, must_move=must_move)
        rows.append(row)

    try:
        first, slow_specops = first_call(p.specops_fn())
    except Exception as error:  # noqa: BLE001 - e.g. no kernel for this device yet: the other providers run
        print(f"  specops failed ({type(error).__name__}: {error})", file=sys.stderr)
        first, slow_specops = None, False
    if first is None:
        agree = None
    else:
        agree = agreement(p, first) if with_reference else validity(p, first)
    add("specops", p.specops_fn(), "validate=False", agree=agree,
        params={**fast, **slow_call} if slow_specops else fast)
    if cuda:
        add("specops validated", p.specops_fn(validate=True), "validate=True (one host sync)")
        try:
            graph = cuda_graph_of(p.specops_fn())
        except Exception as error:  # noqa: BLE001 - capture is optional; say why it did not happen
            add("specops graph", None, f"capture failed: {type(error).__name__}: {error}"[:100])
        else:
            add("specops graph", graph, "CUDA graph, validate=False")
    if with_reference:
        add("reference", p.reference_fn(), "wall clock" if cuda else "", events=False, params=slow,
            agree=agree)
    else:
        add("reference", None, f"skipped: B*W*V > 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}")
    masked = "TopPLogitsWarper sort, " if case.top_p < 1.0 else ""
    try:
        torch_first, slow_torch = first_call(p.torch_fn())
    except Exception as error:  # noqa: BLE001 - e.g. out of memory: reported in the row, not fatal
        add("torch", None, f"failed: {type(error).__name__}: {error}"[:100])
    else:
        add("torch", p.torch_fn(), masked + "log_softmax, rand, truncated Gumbel, topk(W*V), softmax",
            agree=validity(p, torch_first), params={**fast, **slow_call} if slow_torch else fast)
        del torch_first
    del p, first
    if cuda:
        torch.cuda.empty_cache()
    return rows


def headline_lines(rows: list[dict], device: str) -> list[str]:
    batch, beams, vocab = HEADLINE
    spec = find_row(rows, "specops", B=batch, W=beams, V=vocab, top_p=1.0)
    peer = find_row(rows, "torch", B=batch, W=beams, V=vocab, top_p=1.0)
    if not (spec and peer):
        return [f"headline: B={batch} W={beams} V={vocab} not measured (not in the grid)"]
    return [(f"headline (B={batch}, W=K={beams}, V={vocab}, {device}): specops {spec['median_us']:.0f} us "
             f"({spec['GB/s']:.1f} GB/s), torch {peer['median_us']:.0f} us, "
             f"{peer['median_us'] / spec['median_us']:.1f}x")]


def main() -> int:
    parser = bench_parser(__doc__, "stochastic_beam_step",
                          "CPU: B 1, W 2,8, V 32000; CUDA: B 1,64, W 4, V 32000; top-p at B 1, W 4, V 32000; "
                          "fewer runs")
    parser.add_argument("--batches", type=int_list, default=None, help="B values (default 1,8,64)")
    parser.add_argument("--beams", type=int_list, default=None,
                        help="W values, beam_width K = W (default 2,4,8)")
    parser.add_argument("--vocabs", type=int_list, default=None, help="V values (default 32000,262144)")
    args, csv_path = parse_bench_args(parser, "stochastic_beam_step")
    if any(n < 1 for n in (args.batches or []) + (args.beams or []) + (args.vocabs or [])):
        parser.error("--batches, --beams and --vocabs must be >= 1")
    if any(w > v for w in args.beams or [] for v in args.vocabs or [32000]):
        parser.error("--beams: W (= beam_width) must be at most V")
    specops = import_specops()
    info = machine_info(args.device)
    cases = grid(args.device, args.quick, args.batches, args.beams, args.vocabs)
    rows, elapsed, other_load = run_cases(
        cases, lambda c: f"B={c.batch} W={c.beams} V={c.vocab} top_p={c.top_p}",
        lambda c: run_case(specops, c, args.device, args.quick), info)
    add_speedup(rows, "vs_torch", "torch", KEYS)
    notes = [("GB/s: bytes that must move, B*W*V*sizeof(logits) (read) + B*W*V*4 (q written), over the "
              "median time, for every provider. vs_torch: torch time / this time (x faster than torch)."),
             (f"reference: run where B*W*V <= 2^{REFERENCE_MAX_ELEMENTS.bit_length() - 1}, skipped above "
              "(Python per request, beam and draw); agree: specops' parents and tokens equal the "
              "reference's, log_probs and scores within 1e-5, q within 1e-6; valid: a plausible SBS level "
              "(torch draws other random numbers, so it cannot match).")]
    if args.device == "cpu" and not args.quick and not (args.batches or args.beams or args.vocabs):
        notes.append(f"CPU default grid: cases with B*W*V > 2^{CPU_MAX_ELEMENTS.bit_length() - 1} left out "
                     "(pass --batches/--beams/--vocabs to run them).")
    if args.device == "cuda":
        notes.append("specops and torch: CUDA events with L2 flushed (triton.testing.do_bench); reference: "
                     "wall clock with sync.")
    notes += mismatch_lines(rows, KEYS, "reference != specops")
    invalid = sorted({(r["provider"], *(r[k] for k in KEYS)) for r in rows if r.get("agree") == "INVALID"})
    notes += [f"INVALID output: (provider, {', '.join(KEYS)}) = {invalid}"] if invalid else []
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes + headline_lines(rows, args.device),
           elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
