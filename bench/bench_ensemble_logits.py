"""Benchmark of `specops.ops.ensemble_logits` in ensemble verification: its cost on top of chain_verify.

    python bench/bench_ensemble_logits.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--vocabs 32000,262144] [--batches 1,8] [--drafts 1,4] [--modes weighted,contrastive]
        [--mu 0.1] [--alpha 0.0] [--dtype fp32|bf16|fp16] [--seconds S] [--min-rounds R] [--max-rounds R]

Workload: a speculative-decoding step verifying K drafts for B requests against an ensemble of M = 2
models, each giving logits [B, K+1, V] (rows = B*(K+1)); weighted (weights 0.5 / 0.5) or contrastive
(expert then amateur, mu = --mu, alpha = --alpha, default 0: no plausibility cut). Member 0 is N(0, 3^2),
member 1 member 0 plus N(0, 1) noise; the drafts are sampled from softmax(member 0 + N(0, 0.6^2)) (given
as draft_probs); chain_verify samples at temperature 1 with validate=False.

Providers, per case, timed in interleaved rounds (one call of each per round, the order reversed every
other round, so a slow spell of a shared machine hits all alike):
- `verify`: chain_verify alone on one set of logits [B, K+1, V]: the plain verification. It is given
  the ensemble's output computed beforehand, so it verifies exactly what `ens+verify` verifies (the same
  acceptance, hence the same work: chain_verify reads target rows lazily on the CPU).
- `ens+verify`: ensemble_logits on the two members, then chain_verify on its output.
- `torch+verify`: the unfused torch composition, then chain_verify on its output. Weighted:
  logaddexp(log_softmax(l_0) + log w_0, log_softmax(l_1) + log w_1). Contrastive: the reference's
  expression in float32 (row maxima, -inf masks, the alpha cut, the fallback row).
- `ensemble`: ensemble_logits alone. `torch`: the torch composition alone.
Round r of every provider uses draft chain r % 16 at Philox offset r % 16.

Columns: medians in µs; overhead = (ens+verify - verify) / verify in percent; GB/s = the bytes
ensemble_logits must move, M*rows*V*sizeof(logits) read + rows*V*4 written, over its median time;
speedup = torch / ensemble (the ops alone), e2e_speedup = torch+verify / ens+verify; max_diff = max
|ensemble - torch| over finite entries (agree: <= 1e-4, same -inf pattern). CPU: wall clock per call,
inputs cache-hot (as logits just written by the model's head may be). CUDA: CUDA events per call, the L2
cache flushed before each (256 MB zeroed), as triton.testing.do_bench does. Every input is built before
timing; --warmup rounds (default 2) run untimed. The table is markdown; the CSV (default
bench/results/ensemble_logits_<device>.csv) has every column and the machine info.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _timing import (
    bench_parser,
    import_specops,
    int_list,
    machine_info,
    markdown_table,
    mismatch_lines,
    parse_bench_args,
    run_cases,
    write_csv_columns,
)

VOCABS = [32000, 262144]
BATCHES = [1, 8]
DRAFTS = [1, 4]
MODES = ["weighted", "contrastive"]
QUICK = {"vocabs": [32000], "batches": [1, 8], "drafts": [4]}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = [0.5, 0.5]
MEMBERS = 2
TARGET_SCALE = 3.0
MEMBER_NOISE = 1.0
DRAFT_NOISE = 0.6
NUM_VARIANTS = 16  # draft chains (and Philox offsets) the rounds cycle through
SEED = 1234
L2_FLUSH_BYTES = 256 * 2**20
AGREE = 1e-4
PROVIDERS = ("verify", "ens+verify", "torch+verify", "ensemble", "torch")
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["V", "B", "K", "rows", "mode", "verify_us", "ens+verify_us", "overhead_%", "torch+verify_us",
           "ensemble_us", "torch_us", "GB/s", "speedup", "e2e_speedup", "max_diff", "agree", "rounds", "others"]
CSV_COLUMNS = ["device", "dtype", "V", "B", "K", "rows", "mode", "mu", "alpha", "verify_us", "verify_min_us",
               "ens+verify_us", "ens+verify_min_us", "overhead_%", "torch+verify_us", "torch+verify_min_us",
               "ensemble_us", "ensemble_min_us", "torch_us", "torch_min_us", "must_move_MB", "GB/s", "speedup",
               "e2e_speedup", "max_diff", "agree", "accepted", "rounds", "others", "note"]


@dataclass(frozen=True)
class Case:
    vocab: int
    batch: int
    k: int
    mode: str


def make_inputs(case: Case, dtype: torch.dtype, device: str) -> dict:
    """The two members [B, K+1, V], draft probabilities [B, K, V] (float32), NUM_VARIANTS draft chains
    sampled from them, and per-request seeds, all on `device`."""
    gen = torch.Generator().manual_seed(SEED + case.vocab + 10 * case.batch + case.k)
    shape = (case.batch, case.k + 1, case.vocab)
    first = torch.randn(shape, generator=gen) * TARGET_SCALE
    second = first + MEMBER_NOISE * torch.randn(shape, generator=gen)
    draft_logits = first[:, :case.k] + DRAFT_NOISE * torch.randn(case.batch, case.k, case.vocab, generator=gen)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    del draft_logits
    chains = torch.multinomial(draft_probs.reshape(-1, case.vocab), NUM_VARIANTS, replacement=True,
                               generator=gen).T.reshape(NUM_VARIANTS, case.batch, case.k)
    return {"members": [first.to(device, dtype), second.to(device, dtype)],
            "draft_probs": draft_probs.to(device),
            "draft_tokens": [c.contiguous().to(device) for c in chains],
            "seed": (torch.arange(case.batch, dtype=torch.int64) + SEED).to(device)}


def torch_weighted(members: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """log(sum_i w_i softmax(l_i)), unfused: a log_softmax per member, then logaddexp."""
    out = None
    for w, m in zip(weights, members):
        term = torch.log_softmax(m.float(), dim=-1) + math.log(w)
        out = term if out is None else torch.logaddexp(out, term)
    return out


def torch_contrastive(members: list[torch.Tensor], mu: float, alpha: float) -> torch.Tensor:
    """specops.reference.ensemble_logits' contrastive expression in float32 torch ops."""
    expert, amateur = (m.float() for m in members)
    e = expert - expert.amax(-1, keepdim=True)
    a = amateur - amateur.amax(-1, keepdim=True)
    known = e > float("-inf")
    cut = known & (e >= math.log(alpha)) if alpha > 0 else known
    keep = cut & (a > float("-inf"))
    out = torch.where(keep, e - mu * torch.where(keep, a, 0.0), float("-inf"))
    empty = ~keep.any(-1, keepdim=True)
    return torch.where(empty, torch.where(cut, e, float("-inf")), out)


def max_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """max |got - want| over entries finite in both, and whether the -inf patterns match."""
    got, want = got.float().cpu(), want.float().cpu()
    same_inf = torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(got) & torch.isfinite(want)
    diff = (got - want).abs()[finite]
    return (diff.max().item() if diff.numel() else 0.0), same_inf


def time_interleaved(fns: dict[str, Callable[[int], object]], *, device: str, flush: torch.Tensor | None,
                     warmup: int, min_rounds: int, max_rounds: int, min_seconds: float) -> dict[str, list[float]]:
    """Per provider, the seconds of each of its calls: `warmup` untimed rounds, then rounds of one call per
    provider (fn(round)), in alternating order, until at least `min_rounds` rounds and `min_seconds` of
    timed work (wall clock on CUDA), at most `max_rounds`. CPU: wall clock. CUDA: CUDA events around each
    call, `flush` zeroed before it (if given)."""
    names = list(fns)
    for r in range(warmup):
        for name in names:
            fns[name](r)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    events: dict[str, list] = {name: [] for name in names}
    timed, rounds = 0.0, 0
    started = time.perf_counter()
    while rounds < max_rounds and (rounds < min_rounds or (time.perf_counter() - started if cuda else timed)
                                   < min_seconds):
        for name in names if rounds % 2 == 0 else names[::-1]:
            fn = fns[name]
            if cuda:
                if flush is not None:
                    flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(rounds)
                end.record()
                events[name].append((start, end))
            else:
                t0 = time.perf_counter()
                fn(rounds)
                elapsed = time.perf_counter() - t0
                times[name].append(elapsed)
                timed += elapsed
        rounds += 1
        if cuda and rounds % 50 == 0:
            torch.cuda.synchronize()  # keep the host from queueing far ahead of the device
    if cuda:
        torch.cuda.synchronize()
        times = {name: [s.elapsed_time(e) * 1e-3 for s, e in pairs] for name, pairs in events.items()}
    return times


def run_case(specops, case: Case, args, flush: torch.Tensor | None) -> list[dict]:
    device, dtype = args.device, DTYPES[args.dtype]
    rows = case.batch * (case.k + 1)
    must_move = MEMBERS * rows * case.vocab * dtype.itemsize + rows * case.vocab * 4
    row = {"device": device, "dtype": args.dtype, "V": case.vocab, "B": case.batch, "K": case.k, "rows": rows,
           "mode": case.mode, "mu": args.mu if case.mode == "contrastive" else None,
           "alpha": args.alpha if case.mode == "contrastive" else None, "must_move_MB": must_move / 1e6,
           "note": ""}
    x = make_inputs(case, dtype, device)
    members = x["members"]
    ops = specops.ops
    if case.mode == "weighted":
        def ensemble():
            return ops.ensemble_logits(members, WEIGHTS, validate=False)

        def composed():
            return torch_weighted(members, WEIGHTS)
    else:
        def ensemble():
            return ops.ensemble_logits(members, mode="contrastive", mu=args.mu, alpha=args.alpha, validate=False)

        def composed():
            return torch_contrastive(members, args.mu, args.alpha)

    def verify(logits, r):
        i = r % NUM_VARIANTS
        return ops.chain_verify(logits, x["draft_tokens"][i], x["draft_probs"], temperature=1.0, seed=x["seed"],
                                offset=i, validate=False)

    # The check (also a first warm-up): the op against the torch composition, and the acceptance.
    try:
        fixed = ensemble()
        want = composed()
    except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
        row["note"] = f"failed: {type(error).__name__}: {error}"[:100]
        print(f"  {row['note']}", file=sys.stderr)
        return [row]
    diff, same_inf = max_diff(fixed, want)
    row["max_diff"] = diff
    row["agree"] = "yes" if same_inf and diff <= AGREE else "NO"
    del want
    accepted = [verify(fixed, r)[1] for r in range(NUM_VARIANTS)]
    row["accepted"] = torch.stack(accepted).double().mean().item()

    fns = {
        "verify": lambda r: verify(fixed, r),
        "ens+verify": lambda r: verify(ensemble(), r),
        "torch+verify": lambda r: verify(composed(), r),
        "ensemble": lambda r: ensemble(),
        "torch": lambda r: composed(),
    }
    budget = ({"warmup": 1, "min_rounds": 3, "max_rounds": 50, "min_seconds": 0.2} if args.quick else
              {"warmup": 2, "min_rounds": 15, "max_rounds": 2000, "min_seconds": 1.0 if device == "cpu" else 0.3})
    budget.update({k: v for k, v in (("warmup", args.warmup), ("min_rounds", args.min_rounds),
                                     ("max_rounds", args.max_rounds), ("min_seconds", args.seconds))
                   if v is not None})
    times = time_interleaved(fns, device=device, flush=flush, **budget)
    row["rounds"] = len(times["verify"])
    for name in PROVIDERS:
        row[f"{name}_us"] = statistics.median(times[name]) * 1e6
        row[f"{name}_min_us"] = min(times[name]) * 1e6
    row["overhead_%"] = (row["ens+verify_us"] - row["verify_us"]) / row["verify_us"] * 100
    row["GB/s"] = must_move / (row["ensemble_us"] * 1e-6) / 1e9
    row["speedup"] = row["torch_us"] / row["ensemble_us"]
    row["e2e_speedup"] = row["torch+verify_us"] / row["ens+verify_us"]
    return [row]


def summary_lines(rows: list[dict]) -> list[str]:
    """Per mode: the range of the overhead, of ensemble_logits' GB/s and of the speedups."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        done = [r for r in rows if r["mode"] == mode and r.get("ensemble_us")]
        if not done:
            continue

        def span(key, unit="", done=done):
            values = [r[key] for r in done]
            return f"{min(values):.1f}-{max(values):.1f}{unit}"
        lines.append(f"{mode}: ensemble verification overhead over plain chain_verify {span('overhead_%', '%')}; "
                     f"ensemble_logits {span('GB/s', ' GB/s')}, {span('speedup', 'x')} faster than the torch "
                     f"composition ({span('e2e_speedup', 'x')} with chain_verify)")
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "ensemble_logits", "V 32000, B 1,8, K 4, 3+ rounds and 0.2 s a case")
    parser.add_argument("--vocabs", type=int_list, default=None, help=f"default {','.join(map(str, VOCABS))}")
    parser.add_argument("--batches", type=int_list, default=None, help=f"default {','.join(map(str, BATCHES))}")
    parser.add_argument("--drafts", type=int_list, default=None, help=f"K values, default {','.join(map(str, DRAFTS))}")
    parser.add_argument("--modes", default=",".join(MODES), help="weighted,contrastive (default both)")
    parser.add_argument("--mu", type=float, default=0.1, help="contrastive mu (default 0.1)")
    parser.add_argument("--alpha", type=float, default=0.0, help="contrastive alpha (default 0: no cut)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the members' dtype (default fp32)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2, quick 1)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of timed work per case, all providers (default CPU 1.0, CUDA 0.3, quick 0.2)")
    parser.add_argument("--min-rounds", type=int, default=None, help="default 15 (quick 3)")
    parser.add_argument("--max-rounds", type=int, default=None, help="default 2000 (quick 50)")
    args, csv_path = parse_bench_args(parser, "ensemble_logits")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {','.join(MODES)}")
    if args.mu < 0 or not 0 <= args.alpha < 1:
        parser.error("--mu must be >= 0 and --alpha in [0, 1)")
    vocabs = args.vocabs or (QUICK["vocabs"] if args.quick else VOCABS)
    batches = args.batches or (QUICK["batches"] if args.quick else BATCHES)
    drafts = args.drafts or (QUICK["drafts"] if args.quick else DRAFTS)
    if min(vocabs) < 1 or min(batches) < 1 or min(drafts) < 1:
        parser.error("--vocabs, --batches and --drafts must be >= 1")

    specops = import_specops()
    info = machine_info(args.device)
    info["dtype"] = args.dtype
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if args.device == "cuda" else None
    cases = [Case(v, b, k, mode) for mode in modes for v in vocabs for k in drafts for b in batches]

    def one_case(case: Case) -> list[dict]:
        case_rows = run_case(specops, case, args, flush)  # its inputs are freed on return
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return case_rows

    with torch.inference_mode():
        rows, elapsed, other_load = run_cases(
            cases, lambda c: f"{c.mode} V={c.vocab} B={c.batch} K={c.k}", one_case, info)
    write_csv_columns(csv_path, rows, CSV_COLUMNS, info)

    print(markdown_table(rows, COLUMNS))
    print()
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"other processes kept {other_load:.2f} of {info['cpu_cores']} cores busy during the run (per case: others)"
          + ("  <-- shared machine: CPU times are pessimistic" if other_load > 0.3 else ""))
    timing = "CUDA events per call, L2 flushed before each" if args.device == "cuda" else "wall clock per call"
    print(f"timing: interleaved rounds, medians in us; {timing}. M={MEMBERS} members, weighted {WEIGHTS}, "
          f"contrastive mu={args.mu} alpha={args.alpha}; chain_verify at temperature 1 with draft_probs, "
          "validate=False (ensemble_logits too). overhead = ens+verify / verify - 1; GB/s = (M*rows*V*"
          f"{DTYPES[args.dtype].itemsize} read + rows*V*4 written) / ensemble median; speedup = torch / ensemble; "
          "e2e_speedup = torch+verify / ens+verify; max_diff = max|ensemble - torch| on finite entries.")
    for line in summary_lines(rows) + mismatch_lines(rows, ("mode", "V", "B", "K"), "ensemble_logits != torch"):
        print(line)
    for r in rows:
        if r.get("note"):
            print(f"{r['mode']} V={r['V']} B={r['B']} K={r['K']}: {r['note']}")
    print(f"wrote {csv_path} ({len(rows)} rows) in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
