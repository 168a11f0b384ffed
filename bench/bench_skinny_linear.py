"""Benchmark of `specops.ops.skinny_linear` against torch.nn.functional.linear, interleaved in one run.

The op: input [M, K] @ weight[N, K]^T for the few rows of a decoding forward.

    python bench/bench_skinny_linear.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--shapes gemma-head,smollm2-head,gemma-up,gemma-down,llama7b-head,NxK] [--ms 1,2,3,4,8,16]
        [--dtype fp32|bf16|fp16] [--bias] [--hot] [--seconds S] [--min-rounds R] [--max-rounds R]

Providers, per case (a weight [N, K], M input rows):
- `skinny`: specops.ops.skinny_linear through the public wrapper (the C++ kernel on CPU: it reads the
  weight once whatever M is; the Triton kernel on CUDA).
- `linear`: torch.nn.functional.linear, the peer (MKL on CPU: for a few rows it re-reads the weight about
  once per three rows on an Intel Xeon; cuBLAS on CUDA).
Shapes, from the project's models: `gemma-head` (Gemma-3-270M's output head, N 262,144, K 640: 671 MB in
float32), `smollm2-head` (SmolLM2-135M's head, N 49,152, K 576), `gemma-up` (a Gemma-3-270M MLP gate/up
projection, N 2,048, K 640), `gemma-down` (its down projection, N 640, K 2,048) and, on CUDA,
`llama7b-head` (N 32,000, K 4,096); or any `NxK`. M in 1,2,3,4,5,8,9,12,16,24,32 (the rows a forward of
one token, a draft chain or a draft tree carries). float32 on CPU, bfloat16 on CUDA (--dtype). No bias
(the models' layers have none; --bias adds one). Weights are N(0, 1/K), inputs N(0, 1).

Timing, interleaved: each round calls both providers once, in alternating order (skinny first in even
rounds, linear first in odd ones), so a slow spell of a shared machine hits both alike; rounds go on until
at least --min-rounds rounds and --seconds of timed work per case (at most --max-rounds), so the big head
gets few rounds and the body layers many. Reported per provider: the min and the median over rounds, in
ms. CPU: wall clock per call. CUDA: CUDA events per call, with the L2 cache flushed (a 256 MB buffer
zeroed) before each call, as triton.testing.do_bench does. Cold weights, as in a decoding forward (whose
weights do not fit in the last-level cache, so every layer's weights come from memory): on CPU each call
reads the next of enough copies of the weight to span twice the last-level cache (one copy where the
weight alone exceeds it), so no call finds its weight cached; --hot reads one copy every call (and skips
the L2 flush on CUDA), measuring cache-resident weights instead.

floor_MB: the bytes any implementation must move, (N*K + M*K + M*N (+ N with a bias)) * element size.
GB/s: floor bytes over the median time (skinny's, and linear's). speedup: linear median / skinny median
(speedup_min: the same with the mins, CSV only). rel_diff: max |skinny - linear| / max |linear| on one call
per case (agree: rel_diff <= 1e-4 in float32, 2e-2 in bf16 / fp16). Inputs are built before timing; one
untimed call of each provider (the check) warms up. The table is markdown; the CSV (default
bench/results/skinny_linear_<device>.csv) has every column.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
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

SHAPES = {  # name: (N, K)
    "gemma-head": (262_144, 640),
    "smollm2-head": (49_152, 576),
    "gemma-up": (2_048, 640),
    "gemma-down": (640, 2_048),
    "llama7b-head": (32_000, 4_096),
}
CPU_SHAPES = ["gemma-head", "smollm2-head", "gemma-up", "gemma-down"]
CUDA_SHAPES = CPU_SHAPES + ["llama7b-head"]
QUICK_SHAPES = ["gemma-head", "gemma-up"]
MS = [1, 2, 3, 4, 5, 8, 9, 12, 16, 24, 32]
QUICK_MS = [1, 4, 16]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
SEED = 1234
L2_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench zeroes between CUDA calls
DEFAULT_LLC_BYTES = 32 * 2**20
PROVIDERS = ("skinny", "linear")
# others: cores kept busy by other processes while the case ran (a shared machine inflates CPU times).
COLUMNS = ["shape", "N", "K", "M", "floor_MB", "skinny_min_ms", "skinny_med_ms", "linear_min_ms", "linear_med_ms",
           "speedup", "skinny_GB/s", "linear_GB/s", "rel_diff", "agree", "rounds", "others"]
CSV_COLUMNS = ["device", "dtype", "cache", "shape", "N", "K", "M", "floor_MB", "skinny_min_ms", "skinny_med_ms",
               "linear_min_ms", "linear_med_ms", "speedup", "speedup_min", "skinny_GB/s", "linear_GB/s",
               "rel_diff", "agree", "rounds", "copies", "others", "note"]


@dataclass(frozen=True)
class Case:
    shape: str
    n: int
    k: int
    m: int


def parse_shapes(text: str | None, device: str, quick: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) for each entry of --shapes: a name of SHAPES or NxK."""
    names = [s for s in text.split(",") if s] if text else (
        QUICK_SHAPES if quick else CPU_SHAPES if device == "cpu" else CUDA_SHAPES)
    shapes = []
    for name in names:
        if name in SHAPES:
            shapes.append((name, *SHAPES[name]))
            continue
        try:
            n, k = (int(v) for v in name.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {name!r} is neither NxK nor one of {', '.join(SHAPES)}") from None
        if n < 1 or k < 1:
            raise ValueError(f"--shapes: {name!r} needs N, K >= 1")
        shapes.append((name, n, k))
    return shapes


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), or DEFAULT_LLC_BYTES where unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return max(sizes) if sizes else DEFAULT_LLC_BYTES


class Weights:
    """The current shape's weight copies, bias and inputs (one shape held at a time: the big head's
    copies take a gigabyte)."""

    def __init__(self):
        self.key = None
        self.copies: list[torch.Tensor] = []
        self.bias: torch.Tensor | None = None

    def get(self, n: int, k: int, dtype: torch.dtype, device: str, copies: int, bias: bool):
        key = (n, k, dtype, device, copies, bias)
        if key != self.key:
            self.key, self.copies, self.bias = None, [], None  # free the last shape's first
            if device == "cuda":
                torch.cuda.empty_cache()
            gen = torch.Generator().manual_seed(SEED)
            weight = torch.randn(n, k, generator=gen).div_(math.sqrt(k)).to(device, dtype)
            self.copies = [weight] + [weight.clone() for _ in range(copies - 1)]
            self.bias = (torch.randn(n, generator=gen) * 0.1).to(device, dtype) if bias else None
            self.key = key
        return self.copies, self.bias

    def clear(self) -> None:
        self.key, self.copies, self.bias = None, [], None


def copies_needed(weight_bytes: int, device: str, hot: bool, llc: int) -> int:
    """How many weight copies to cycle through so that no call finds its weight cached (CPU)."""
    if hot or device != "cpu" or weight_bytes >= llc:
        return 1
    return math.ceil(2 * llc / weight_bytes)


def time_interleaved(fns: dict[str, Callable[[], object]], *, device: str, flush: torch.Tensor | None,
                     min_rounds: int, max_rounds: int, min_seconds: float) -> dict[str, list[float]]:
    """Per provider, the seconds of each of its calls: rounds of one call per provider, in alternating
    order, until at least `min_rounds` rounds and `min_seconds` of timed work (at most `max_rounds`).
    CPU: wall clock. CUDA: CUDA events around each call, `flush` zeroed before it (if given)."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    events: dict[str, list] = {name: [] for name in names}
    cuda = device == "cuda"
    timed, rounds = 0.0, 0
    started = time.perf_counter()
    while rounds < max_rounds and (rounds < min_rounds or (timed if not cuda else time.perf_counter() - started)
                                   < min_seconds):
        order = names if rounds % 2 == 0 else names[::-1]
        for name in order:
            fn = fns[name]
            if cuda:
                if flush is not None:
                    flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[name].append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
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


def run_case(specops, case: Case, args, weights: Weights, llc: int, flush: torch.Tensor | None) -> list[dict]:
    device, dtype = args.device, DTYPES[args.dtype]
    size = dtype.itemsize
    copies = copies_needed(case.n * case.k * size, device, args.hot, llc)
    ws, bias = weights.get(case.n, case.k, dtype, device, copies, args.bias)
    gen = torch.Generator().manual_seed(SEED + case.m)
    x = torch.randn(case.m, case.k, generator=gen).to(device, dtype)
    floor = (case.n * case.k + case.m * case.k + case.m * case.n + (case.n if bias is not None else 0)) * size
    row = {"device": device, "dtype": args.dtype, "cache": "hot" if args.hot else "cold", "shape": case.shape,
           "N": case.n, "K": case.k, "M": case.m, "floor_MB": floor / 1e6, "copies": len(ws), "note": ""}

    # The check (also each provider's warm-up).
    try:
        got = specops.ops.skinny_linear(x, ws[0], bias)
    except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
        row["note"] = f"skinny failed: {type(error).__name__}: {error}"[:100]
        print(f"  {row['note']}", file=sys.stderr)
        return [row]
    want = F.linear(x, ws[0], bias)
    scale = want.abs().max().float().item()
    row["rel_diff"] = (got.float() - want.float()).abs().max().item() / (scale or 1.0)
    row["agree"] = "yes" if row["rel_diff"] <= TOLERANCE[args.dtype] else "NO"
    del got, want
    if device == "cuda":
        torch.cuda.synchronize()

    def cycling(call):
        state = {"i": 0}

        def run():
            w = ws[state["i"]]
            state["i"] = (state["i"] + 1) % len(ws)
            return call(x, w, bias)
        return run

    fns = {"skinny": cycling(specops.ops.skinny_linear), "linear": cycling(F.linear)}
    budget = ({"min_rounds": 3, "max_rounds": 50, "min_seconds": 0.2} if args.quick else
              {"min_rounds": 5, "max_rounds": 1000, "min_seconds": 1.5 if device == "cpu" else 0.2})
    budget.update({k: v for k, v in (("min_rounds", args.min_rounds), ("max_rounds", args.max_rounds),
                                     ("min_seconds", args.seconds)) if v is not None})
    times = time_interleaved(fns, device=device, flush=None if args.hot else flush, **budget)
    row["rounds"] = len(times["skinny"])
    for name in PROVIDERS:
        row[f"{name}_min_ms"] = min(times[name]) * 1e3
        row[f"{name}_med_ms"] = statistics.median(times[name]) * 1e3
        row[f"{name}_GB/s"] = floor / (row[f"{name}_med_ms"] * 1e-3) / 1e9
    row["speedup"] = row["linear_med_ms"] / row["skinny_med_ms"]
    row["speedup_min"] = row["linear_min_ms"] / row["skinny_min_ms"]
    return [row]


def summary_lines(rows: list[dict]) -> list[str]:
    """Per shape: the speedup at each M, and skinny's median GB/s range."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        done = [r for r in rows if r["shape"] == shape and r.get("speedup")]
        if not done:
            continue
        speedups = " ".join(f"M={r['M']}:{r['speedup']:.2f}x" for r in done)
        rates = [r["skinny_GB/s"] for r in done]
        lines.append(f"{shape}: speedup (linear/skinny, median) {speedups}; skinny {min(rates):.1f}-"
                     f"{max(rates):.1f} GB/s")
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "skinny_linear",
                          "shapes gemma-head,gemma-up, M 1,4,16, 3+ rounds and 0.2 s a case")
    parser.add_argument("--shapes", default=None,
                        help=f"names ({', '.join(SHAPES)}) or NxK; default CPU {','.join(CPU_SHAPES)}, "
                             "CUDA also llama7b-head")
    parser.add_argument("--ms", type=int_list, default=None, help=f"M values (default {','.join(map(str, MS))})")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--bias", action="store_true", help="add a bias [N] (default none, as the models)")
    parser.add_argument("--hot", action="store_true",
                        help="one weight copy, no L2 flush: cache-resident weights (default: cold)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of timing per case, both providers (CUDA: wall clock, flushes included; "
                             "default CPU 1.5, CUDA 0.2, quick 0.2)")
    parser.add_argument("--min-rounds", type=int, default=None, help="default 5 (quick 3)")
    parser.add_argument("--max-rounds", type=int, default=None, help="default 1000 (quick 50)")
    args, csv_path = parse_bench_args(parser, "skinny_linear")
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    if args.device == "cpu" and args.dtype != "fp32":
        parser.error("--dtype: the CPU kernel takes fp32 only")
    try:
        shapes = parse_shapes(args.shapes, args.device, args.quick)
    except ValueError as error:
        parser.error(str(error))
    ms = args.ms or (QUICK_MS if args.quick else MS)
    if any(m < 1 for m in ms):
        parser.error("--ms: M must be >= 1")

    specops = import_specops()
    info = machine_info(args.device)
    llc = last_level_cache_bytes()
    info.update(dtype=args.dtype, cache="hot" if args.hot else "cold", bias=str(args.bias))
    if args.device == "cpu":
        info["llc_MB"] = f"{llc / 2**20:.0f}"
    flush = None
    if args.device == "cuda" and not args.hot:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    cases = [Case(name, n, k, m) for name, n, k in shapes for m in ms]
    weights = Weights()
    with torch.inference_mode():
        rows, elapsed, other_load = run_cases(
            cases, lambda c: f"{c.shape} N={c.n} K={c.k} M={c.m}",
            lambda c: run_case(specops, c, args, weights, llc, flush), info)
    weights.clear()
    write_csv_columns(csv_path, rows, CSV_COLUMNS, info)

    print(markdown_table(rows, COLUMNS))
    print()
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"other processes kept {other_load:.2f} of {info['cpu_cores']} cores busy during the run (per case: others)"
          + ("  <-- shared machine: CPU times are pessimistic" if other_load > 0.3 else ""))
    timing = ("CUDA events per call, L2 flushed before each" if args.device == "cuda" and not args.hot
              else "CUDA events per call" if args.device == "cuda" else "wall clock per call")
    cache = ("hot: one weight copy" if args.hot else
             "cold: each call reads the next of `copies` weight copies spanning 2x the last-level cache"
             if args.device == "cpu" else "cold: L2 flushed")
    print(f"timing: interleaved rounds (skinny and linear alternate first), min and median over rounds; {timing}; "
          f"{cache}. floor_MB = (N*K + M*K + M*N) * {DTYPES[args.dtype].itemsize} B; GB/s = floor / median; "
          "speedup = linear median / skinny median; rel_diff = max|skinny - linear| / max|linear|.")
    for line in summary_lines(rows) + mismatch_lines(rows, ("shape", "M"), "skinny != linear"):
        print(line)
    failed = [r for r in rows if r.get("note")]
    for r in failed:
        print(f"{r['shape']} M={r['M']}: {r['note']}")
    print(f"wrote {csv_path} ({len(rows)} rows) in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
