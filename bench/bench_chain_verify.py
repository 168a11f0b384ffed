"""Benchmark of `specops.ops.chain_verify` (speculative-sampling verification of a chain of drafts).

    python bench/bench_chain_verify.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N] [--top-p P]

Providers. CPU: `reference` (specops.reference, the pure-torch spec), `cpu` and `cpu no-validate` (the C++
kernel through the public wrapper, validate=True and False), `cpu block` (scheme="block", validate=True),
`transformers` (`_speculative_sampling`, the torch verification step of assisted
generation). CUDA: `reference` on GPU tensors, `triton` (public wrapper, validate=False; eager, as a CUDA
graph, with validate=True, and `triton block` with scheme="block"), `transformers` on GPU tensors, and `flashinfer` where it is installed.

Workload: sampling at temperature 1. Target logits are N(0, 3^2); draft logits are the target's plus
N(0, 0.6^2) noise, so a draft is accepted with probability about 0.77 (1 - total variation), and draft
chains are sampled from the draft distribution. The timed calls cycle through 16 draft chains, each at
its own Philox offset, so they see varied acceptance as decoding steps do: specops reads target rows
lazily on the CPU, and its cost grows with acceptance. `accepted` is the mean number of accepted
drafts per request (the reference row repeats specops', which it equals by construction). --top-p P < 1 adds
nucleus sampling (top-p P) to every specops and reference call, and leaves transformers out (its
`_speculative_sampling` takes probabilities already filtered by generate()'s warpers); K = 0 cases then time
what sampling one token per row costs, as positional verification draws every position of a chain.

GB/s is for every provider the bytes that must be read, B*(K+1)*V*sizeof(logits) + B*V*4 (the
target rows and one draft-probability row for the residual), divided by the median time.
Inputs and random numbers are all made before the timed region; times are medians after warm-up.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys

import torch

from _timing import (add_speedup, bench_parser, cuda_graph_of, cuda_median_time, find_row, import_specops, machine_info,
                     median_time, parse_bench_args, report, run_cases)

TARGET_SCALE = 3.0
DRAFT_NOISE = 0.6
NUM_VARIANTS = 16  # draft chains (and Philox offsets) the timed calls cycle through
PROMPT_LEN = 16
SEED = 1234
HEADLINE = (1, 5, 262144, torch.float32)  # CPU goal: >= 10x faster than transformers
TOP_P = 1.0  # --top-p
REQUIRED_CUDA = (64, 4, 128256)  # CUDA goal: report kernel time against the bandwidth floor
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["device", "B", "K", "V", "dtype", "provider", "median_us", "GB/s", "accepted", "vs_hf",
           "x_floor", "runs", "others", "note"]


def grid(device: str, quick: bool) -> list[tuple[int, int, int, torch.dtype]]:
    if device == "cpu":
        dtypes = [torch.float32]
        vocabs, drafts, batches = ([32000], [4], [1, 8]) if quick else (
            [32000, 49152, 128256, 262144], [1, 4, 8], [1, 8])
        extra = [HEADLINE]
    else:
        dtypes = [torch.float32, torch.bfloat16]
        vocabs, drafts, batches = ([32000], [4], [1, 64]) if quick else (
            [32000, 128256, 262144], [1, 4, 8], [1, 8, 64])
        extra = [(*REQUIRED_CUDA, dt) for dt in dtypes] + [(*HEADLINE[:3], dt) for dt in dtypes]
    cases = [(b, k, v, dt) for dt in dtypes for v in vocabs for k in drafts for b in batches]
    return cases + [c for c in extra if c not in cases]


def make_inputs(batch: int, k: int, vocab: int, dtype: torch.dtype, device: str) -> dict:
    """Target logits, draft logits/probabilities, NUM_VARIANTS draft chains sampled from the draft
    distribution, and the op's per-row arguments, all on `device`."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    target32 = torch.randn(batch, k + 1, vocab, generator=gen, device=device) * TARGET_SCALE
    draft_logits = target32[:, :k] + DRAFT_NOISE * torch.randn(batch, k, vocab, generator=gen, device=device)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    chains = torch.multinomial(draft_probs.reshape(batch * k, vocab), NUM_VARIANTS, replacement=True,
                               generator=gen).T.reshape(NUM_VARIANTS, batch, k)
    prompt = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen, device=device)
    target = target32.to(dtype)
    return {
        "target": target,
        # transformers' assisted generation casts the target logits to float32 before verification.
        "target32": target32 if dtype == torch.float32 else target.float(),
        "draft_logits": draft_logits, "draft_probs": draft_probs,
        "draft_tokens": [c.contiguous() for c in chains],
        "candidate_input_ids": [torch.cat([prompt, c], dim=1) for c in chains],
        "seed": torch.arange(batch, dtype=torch.int64, device=device) + SEED,
        "num_draft": torch.full((batch,), k, dtype=torch.int64, device=device),
        "temperature": torch.ones(batch, dtype=torch.float32, device=device),
        "top_k": torch.zeros(batch, dtype=torch.int64, device=device),
        "top_p": torch.full((batch,), TOP_P, dtype=torch.float32, device=device),
    }


def must_read_bytes(batch: int, k: int, vocab: int, dtype: torch.dtype) -> int:
    return batch * (k + 1) * vocab * dtype.itemsize + batch * vocab * 4


class Providers:
    """The providers' calls for one case. Call i verifies draft chain i (of NUM_VARIANTS) at Philox
    offset i, so the timed runs see varied acceptance as decoding steps do; each `*_fn` cycles i."""

    def __init__(self, specops, x: dict):
        self.specops_module, self.x = specops, x

    def specops(self, i: int, validate: bool = True, scheme: str = "token"):
        x = self.x
        return self.specops_module.ops.chain_verify(x["target"], x["draft_tokens"][i], x["draft_probs"],
                                                    seed=x["seed"], offset=i, validate=validate, scheme=scheme)

    def specops_fn(self, validate: bool = True, scheme: str = "token"):
        variants = itertools.cycle(range(NUM_VARIANTS))
        return lambda: self.specops(next(variants), validate, scheme)

    def reference_fn(self):
        x, ref, variants = self.x, self.specops_module.reference, itertools.cycle(range(NUM_VARIANTS))

        def run():
            i = next(variants)
            return ref.chain_verify(x["target"], x["draft_tokens"][i], x["draft_probs"], x["num_draft"],
                                    x["temperature"], x["top_k"], x["top_p"], x["seed"], i)
        return run

    def transformers_fn(self):
        """`_speculative_sampling` takes batch size 1, so a batch is one call per request. It gets the
        draft logits and softmaxes them itself; specops gets softmax(draft logits) as draft_probs.
        Returns a callable giving a list of (tokens, n_matches), one per request."""
        from transformers.generation.utils import _speculative_sampling

        x, variants = self.x, itertools.cycle(range(NUM_VARIANTS))
        batch, k = x["draft_tokens"][0].shape
        extra = {"is_done_candidate": False} if "is_done_candidate" in inspect.signature(
            _speculative_sampling).parameters else {}
        requests = [[(ids[b:b + 1], x["draft_logits"][b:b + 1], x["target32"][b:b + 1]) for b in range(batch)]
                    for ids in x["candidate_input_ids"]]

        def run():
            return [_speculative_sampling(ids, draft, k, target, **extra)
                    for ids, draft, target in requests[next(variants)]]
        return run

    def specops_accepted(self, scheme: str = "token") -> float:
        """Mean accepted drafts per request over all draft chains (also the kernel's warm-up)."""
        counts = [self.specops(i, scheme=scheme)[1] for i in range(NUM_VARIANTS)]
        return torch.stack(counts).double().mean().item()


def transformers_accepted(run) -> float:
    """Mean accepted drafts per request over NUM_VARIANTS calls (also the provider's warm-up)."""
    counts = [int(n) for _ in range(NUM_VARIANTS) for _, n in run()]
    return sum(counts) / len(counts)


def row(device, batch, k, vocab, dtype, provider, seconds, runs, note="", accepted=None) -> dict:
    return {"device": device, "B": batch, "K": k, "V": vocab, "dtype": DTYPE_NAMES[dtype],
            "provider": provider, "median_us": seconds * 1e6,
            "GB/s": must_read_bytes(batch, k, vocab, dtype) / seconds / 1e9, "accepted": accepted,
            "vs_hf": None, "x_floor": None, "runs": runs, "note": note}


def skipped(case, provider, note) -> dict:
    batch, k, vocab, dtype = case
    return {**row("cuda", batch, k, vocab, dtype, provider, 1.0, 0, note), "median_us": None, "GB/s": None}


def bench_cpu_case(specops, case, quick: bool, have_hf: bool) -> list[dict]:
    batch, k, vocab, dtype = case
    x = make_inputs(batch, k, vocab, dtype, "cpu")
    p = Providers(specops, x)
    fast = dict(warmup=2, min_runs=5, min_seconds=0.05) if quick else dict(warmup=3, min_runs=20,
                                                                            min_seconds=0.3)
    # The reference walks every row in Python (~1 s a call at B=8, V=262144): few runs suffice.
    slow = dict(warmup=1, min_runs=3, min_seconds=0.0 if quick else 0.5, max_runs=20)
    accepted = p.specops_accepted()  # also warms up the kernel
    out = []
    t, n = median_time(p.reference_fn(), **slow)
    out.append(row("cpu", batch, k, vocab, dtype, "reference", t, n, accepted=accepted))
    t, n = median_time(p.specops_fn(), **fast)
    out.append(row("cpu", batch, k, vocab, dtype, "cpu", t, n, "validate=True (default)", accepted))
    t, n = median_time(p.specops_fn(validate=False), **fast)
    out.append(row("cpu", batch, k, vocab, dtype, "cpu no-validate", t, n, "validate=False", accepted))
    block_accepted = p.specops_accepted("block")
    t, n = median_time(p.specops_fn(scheme="block"), **fast)
    out.append(row("cpu", batch, k, vocab, dtype, "cpu block", t, n, 'scheme="block", validate=True', block_accepted))
    if have_hf and TOP_P == 1.0:
        run = p.transformers_fn()
        hf_acc = transformers_accepted(run)
        t, n = median_time(run, **fast)
        note = f"{batch} calls (B=1 only)" if batch > 1 else ""
        out.append(row("cpu", batch, k, vocab, dtype, "transformers", t, n, note, accepted=hf_acc))
    return out


def read_bandwidth_cuda() -> float:
    """Achievable read bandwidth in bytes/s: torch.sum over a 1 GiB float32 tensor."""
    big = torch.ones(2**28, dtype=torch.float32, device="cuda")
    seconds = cuda_median_time(big.sum, warmup_ms=50, rep_ms=300)
    del big
    torch.cuda.empty_cache()
    return 2**30 / seconds


def bench_cuda_case(specops, case, quick: bool, have_hf: bool, flashinfer) -> list[dict]:
    batch, k, vocab, dtype = case
    x = make_inputs(batch, k, vocab, dtype, "cuda")
    p = Providers(specops, x)
    sync = torch.cuda.synchronize
    rep_ms = 30 if quick else 100
    accepted = p.specops_accepted()  # also compiles and warms up the kernels
    out = []

    def add(provider, fn, note="", acc=None, events=True, warmup=1):
        try:
            if events:
                t, n = cuda_median_time(fn, rep_ms=rep_ms), None
            else:  # host-bound providers that synchronize inside anyway: wall clock
                t, n = median_time(fn, warmup=warmup, min_runs=3, min_seconds=0.0 if quick else 0.3,
                                   max_runs=50, sync=sync)
            out.append(row("cuda", batch, k, vocab, dtype, provider, t, n, note, acc))
        except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
            out.append(skipped(case, provider, f"failed: {type(error).__name__}: {error}"[:80]))

    if batch <= 8:
        # The reference syncs on every row and draw (seconds a call at V=262144): no warm-up, 3+ runs.
        add("reference", p.reference_fn(), "wall clock", accepted, events=False, warmup=0)
    else:
        out.append(skipped(case, "reference", "skipped above B=8 (host-bound, ~1 s a call)"))
    add("triton", p.specops_fn(validate=False), "eager, validate=False", accepted)
    try:
        # Capture freezes the arguments, so the graph replays draft chain 0 at offset 0.
        graph = cuda_graph_of(functools.partial(p.specops, 0, validate=False))
    except Exception as error:  # noqa: BLE001 - capture is optional; say why it did not happen
        out.append(skipped(case, "triton graph", f"capture failed: {type(error).__name__}: {error}"[:80]))
    else:
        add("triton graph", graph, "CUDA graph, validate=False, chain 0")
    add("triton validate", p.specops_fn(validate=True), "eager, validate=True (one host sync)", accepted)
    add("triton block", p.specops_fn(validate=False, scheme="block"), 'eager, scheme="block", validate=False',
        p.specops_accepted("block"))
    if have_hf and TOP_P == 1.0:
        run = p.transformers_fn()
        hf_acc = transformers_accepted(run)
        add("transformers", run, f"{batch} calls (B=1 only), wall clock" if batch > 1 else "wall clock",
            hf_acc, events=False)
    if flashinfer is not None:
        # FlashInfer verifies probabilities: "flashinfer" is given softmax(target) precomputed (the kernel
        # alone, reading fp32 probabilities), "flashinfer+softmax" starts from the same logits as specops.
        target, draft_probs = x["target"], x["draft_probs"]
        tokens32 = x["draft_tokens"][0].to(torch.int32)
        target_probs = torch.softmax(target.float(), dim=-1)
        verify = flashinfer.sampling.chain_speculative_sampling
        add("flashinfer", lambda: verify(draft_probs, tokens32, target_probs), "given target probs")
        add("flashinfer+softmax",
            lambda: verify(draft_probs, tokens32, torch.softmax(target.float(), dim=-1)))
    del x, p
    torch.cuda.empty_cache()
    return out


def add_ratios(rows: list[dict], bandwidth: float | None) -> None:
    """vs_hf: transformers time / this time (x faster than transformers); x_floor: time / floor."""
    add_speedup(rows, "vs_hf", "transformers", ("B", "K", "V", "dtype"))
    for r in rows:
        if bandwidth and r["median_us"]:
            floor_us = must_read_bytes(r["B"], r["K"], r["V"], DTYPES[r["dtype"]]) / bandwidth * 1e6
            r["x_floor"] = r["median_us"] / floor_us


def find(rows, batch, k, vocab, dtype, provider):
    return find_row(rows, provider, B=batch, K=k, V=vocab, dtype=DTYPE_NAMES[dtype])


def summary_lines(rows, device, bandwidth) -> list[str]:
    lines = []
    batch, k, vocab, dtype = HEADLINE
    spec = find(rows, batch, k, vocab, dtype, "cpu" if device == "cpu" else "triton")
    hf = find(rows, batch, k, vocab, dtype, "transformers")
    if spec and hf:
        ratio = hf["median_us"] / spec["median_us"]
        goal = "" if device != "cpu" else f" (goal >= 10x: {'met' if ratio >= 10 else 'NOT met'})"
        lines.append(f"headline: B={batch} K={k} V={vocab} fp32 ({device}): "
                     f"specops {spec['median_us']:.0f} us, transformers {hf['median_us']:.0f} us, "
                     f"ratio {ratio:.1f}x{goal}")
    if device == "cuda":
        for dt in (torch.float32, torch.bfloat16):
            eager = find(rows, *REQUIRED_CUDA, dt, "triton")
            graph = find(rows, *REQUIRED_CUDA, dt, "triton graph")
            best = graph or eager
            if best:
                floor_us = must_read_bytes(*REQUIRED_CUDA, dt) / bandwidth * 1e6
                b, kk, v = REQUIRED_CUDA
                graph_text = f", graph {graph['median_us']:.1f} us" if graph else ""
                lines.append(f"required: B={b} K={kk} V={v} {DTYPE_NAMES[dt]}: triton eager "
                             f"{eager['median_us'] if eager else float('nan'):.1f} us{graph_text}; floor "
                             f"{floor_us:.1f} us at {bandwidth / 1e9:.0f} GB/s; kernel/floor "
                             f"{best['median_us'] / floor_us:.2f}x")
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "chain_verify", "a tiny grid for smoke runs")
    parser.add_argument("--cases", default=None,
                        help="only these cases, BxKxV[xdtype] comma-separated, e.g. 1x4x262144,64x4x262144 "
                             "(issue 34's block-verification shapes)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for specops and the reference "
                        "(transformers left out below 1)")
    args, csv_path = parse_bench_args(parser, "chain_verify")
    global TOP_P
    TOP_P = args.top_p
    specops = import_specops()
    try:
        import transformers.generation.utils  # noqa: F401
        have_hf = True
    except ImportError:
        have_hf = False
    flashinfer = None
    if args.device == "cuda":
        try:
            import flashinfer
            import flashinfer.sampling  # noqa: F401
        except ImportError:
            flashinfer = None

    info = machine_info(args.device)
    bandwidth = read_bandwidth_cuda() if args.device == "cuda" else None
    if bandwidth:
        info["read_GBps"] = f"{bandwidth / 1e9:.0f}"
    def run_case(case):
        if args.device == "cpu":
            return bench_cpu_case(specops, case, args.quick, have_hf)
        return bench_cuda_case(specops, case, args.quick, have_hf, flashinfer)

    cases = grid(args.device, args.quick)
    if args.cases:
        cases = []
        for text in args.cases.split(","):
            parts = text.split("x")
            dtype = DTYPES[parts[3]] if len(parts) > 3 else torch.float32
            cases.append((int(parts[0]), int(parts[1]), int(parts[2]), dtype))
    rows, elapsed, other_load = run_cases(
        cases, lambda c: f"B={c[0]} K={c[1]} V={c[2]} {DTYPE_NAMES[c[3]]}", run_case, info)
    add_ratios(rows, bandwidth)
    notes = ["GB/s: must-read bytes B*(K+1)*V*sizeof(logits) + B*V*4 over the median time, for every provider. "
             "vs_hf: transformers time / this time."]
    if args.device == "cuda":
        notes.append("x_floor: time / (must-read bytes / measured read bandwidth). triton and flashinfer: "
                     "CUDA events with L2 flushed (triton.testing.do_bench); reference and transformers: "
                     "wall clock with sync.")
        if flashinfer is None:
            notes.append("flashinfer: not installed, skipped")
    if not have_hf:
        notes.append("transformers: not installed, skipped")
    report(rows, COLUMNS, info, csv_path, other_load, args.device,
           notes + summary_lines(rows, args.device, bandwidth), elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
