"""Benchmark of `specops::quantized_linear` (weights stored as bfloat16, int8 or int4) against skinny_linear on the
float weight and torch's own kernels, interleaved in one run.

The op: input [M, K] @ W^T with W de-quantized as it is read, for the few rows of a decoding forward.

    python bench/bench_quantized_linear.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--formats dense,bf16,int8,int4] [--shapes smollm2-q,...,gemma-head,NxK] [--ms 1,4,8] [--no-model]
        [--hot] [--seconds S] [--min-rounds R] [--max-rounds R]

Formats, each with `specops` (the op itself, torch.ops.specops.*: the C++ kernel on CPU, Triton on CUDA;
no wrapper, as specops.quantization.QuantizedLinear calls it) and a `torch` peer, float32 input:
- dense: the float32 weight; specops.skinny_linear against F.linear (MKL on CPU, cuBLAS on CUDA).
- bf16: quantized_linear on a bfloat16 weight against F.linear on bfloat16 input and weight (torch has
  no float32-input, bfloat16-weight product; its input rounding makes the outputs differ at 1e-2).
- int8: one scale per output channel; against torch.ops.aten._weight_int8pack_mm(x, q[N, K], scales[N]).
- int4: scales and minimums per group of 32 (GGUF's Q4_1); against aten._weight_int4pack_mm_for_cpu on
  the same weights (CPU only), whose (q - 8) * scale + zero takes zero = min + 8 scale.
Weights from specops.quantization.pack on N(0, 1/K) float weights; inputs N(0, 1).
Shapes: SmolLM2-135M's q/o (576 x 576), gate/up (1536 x 576), down (576 x 1536) and head (49,152 x 576);
Gemma-3-270M's q (1024 x 640), gate/up (2048 x 640), down (640 x 2048) and head (262,144 x 640); or NxK.
M in 1, 4, 8. The `smollm2-model` row (skip with --no-model) runs all 211 of SmolLM2's linear layers back
to back (30 x q, k, v, o, gate, up, down, then the head; inputs of K 576 and 1536), the realistic case of a
decoding forward streaming every weight from memory once.

Timing, interleaved as bench_skinny_linear.py (whose helpers it uses): rounds of one call per provider in
alternating order until --min-rounds and --seconds of timed work; the min and the median over rounds, in
ms. Cold weights: on CPU each call reads the next of enough copies of the weights (of the whole model, for
the model row) to span twice the last-level cache; on CUDA the L2 cache is flushed before each call.
--hot: one copy, no flush. Inputs and weights are built before timing; one untimed call of each provider
(the check) warms up.

weight_MB: the bytes of the stored weights, scales and minimums included (int4: 0.75 byte per weight).
GB/s: weight_MB over the median time. speedup: torch median / specops median. vs_dense: the dense
specops median at the same shape and M / this one (what quantizing the weights gains). rel_diff:
max |specops - torch| / max |torch| on one call (agree: rel_diff <= 1e-4, 2e-2 for bf16). The table is
markdown; the CSV (default bench/results/quantized_linear_<device>.csv) has every column.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

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
from bench_skinny_linear import L2_FLUSH_BYTES, copies_needed, last_level_cache_bytes, time_interleaved

SHAPES = {  # name: (N, K)
    "smollm2-q": (576, 576),
    "smollm2-up": (1_536, 576),
    "smollm2-down": (576, 1_536),
    "smollm2-head": (49_152, 576),
    "gemma-q": (1_024, 640),
    "gemma-up": (2_048, 640),
    "gemma-down": (640, 2_048),
    "gemma-head": (262_144, 640),
}
QUICK_SHAPES = ["smollm2-q", "gemma-up"]
MODEL = "smollm2-model"
# SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down, then the output head: 211 linear layers.
SMOLLM2_LAYERS = 30 * [(576, 576), (192, 576), (192, 576), (576, 576), (1_536, 576), (1_536, 576),
                       (576, 1_536)] + [(49_152, 576)]
FORMATS = ["dense", "bf16", "int8", "int4"]
GROUP = {"dense": None, "bf16": None, "int8": None, "int4": 32}
MS = [1, 4, 8]
QUICK_MS = [1, 4]
TOLERANCE = {"dense": 1e-4, "bf16": 2e-2, "int8": 1e-4, "int4": 1e-4}
SEED = 1234
COLUMNS = ["format", "shape", "N", "K", "M", "weight_MB", "specops_min_ms", "specops_med_ms", "torch_med_ms",
           "speedup", "vs_dense", "specops_GB/s", "torch_GB/s", "rel_diff", "agree", "rounds", "others"]
CSV_COLUMNS = ["device", "cache", "format", "shape", "N", "K", "M", "layers", "weight_MB", "specops_min_ms",
               "specops_med_ms", "torch_min_ms", "torch_med_ms", "speedup", "vs_dense", "specops_GB/s",
               "torch_GB/s", "peer", "rel_diff", "agree", "rounds", "copies", "others", "note"]


@dataclass(frozen=True)
class Case:
    fmt: str
    shape: str
    layers: tuple[tuple[int, int], ...]  # (N, K) of each layer run back to back
    m: int


@dataclass
class Layer:
    """One layer's weights as specops takes them, and as the torch peer takes them (None: no peer)."""
    weight: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None
    peer: tuple | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.mins) if t is not None)


def specops_call(fmt: str) -> Callable[[torch.Tensor, Layer], torch.Tensor]:
    if fmt == "dense":
        return lambda x, layer: torch.ops.specops.skinny_linear(x, layer.weight, None)
    return lambda x, layer: torch.ops.specops.quantized_linear(x, layer.weight, layer.scales, layer.mins, None)


def peer_of(fmt: str, device: str, weight: torch.Tensor, scales, mins) -> tuple | None:
    """The torch peer's own form of the weights (built outside timing), or None where it has none."""
    if fmt in ("dense", "bf16"):
        return (weight,)
    if fmt == "int8":
        return (weight, scales[:, 0].contiguous())
    if device != "cpu":
        return None
    from specops.reference import dequantize  # specops is loaded by then (import_specops)

    q = dequantize(weight, torch.ones_like(scales)).to(torch.int32)  # the 4-bit integers
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack([scales.T, (mins + 8 * scales).T], dim=-1).contiguous()  # [K / 32, N, 2]
    return (packed, scales_and_zeros)


def peer_call(fmt: str) -> Callable[[torch.Tensor, Layer], torch.Tensor]:
    if fmt == "dense":
        return lambda x, layer: F.linear(x, *layer.peer)
    if fmt == "bf16":
        return lambda x, layer: F.linear(x, *layer.peer)  # x: the bfloat16 copy of the input
    if fmt == "int8":
        return lambda x, layer: torch.ops.aten._weight_int8pack_mm(x, *layer.peer)
    return lambda x, layer: torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.peer[0], GROUP["int4"],
                                                                        layer.peer[1])


PEER_NAMES = {"dense": "F.linear", "bf16": "F.linear (bf16 x, W)", "int8": "aten._weight_int8pack_mm",
              "int4": "aten._weight_int4pack_mm_for_cpu"}


def clone_layer(layer: Layer) -> Layer:
    """A copy of `layer` in new memory; a tensor the peer shares with specops stays shared."""
    tensors = (layer.weight, layer.scales, layer.mins) + (layer.peer or ())
    new = {id(t): t.clone() for t in tensors if t is not None}

    def copy(t):
        return None if t is None else new[id(t)]
    return Layer(copy(layer.weight), copy(layer.scales), copy(layer.mins),
                 None if layer.peer is None else tuple(copy(t) for t in layer.peer))


class Weights:
    """The current (format, shape)'s weight copies, each a list of layers (one set held at a time: a
    head's copies take a gigabyte)."""

    def __init__(self):
        self.key = None
        self.copies: list[list[Layer]] = []

    def get(self, specops, case: Case, device: str, hot: bool, llc: int) -> list[list[Layer]]:
        key = (case.fmt, case.layers, device, hot)
        if key != self.key:
            self.clear()  # free the last set first
            if device == "cuda":
                torch.cuda.empty_cache()
            gen = torch.Generator().manual_seed(SEED)
            first = []
            for n, k in case.layers:
                dense = torch.randn(n, k, generator=gen).div_(math.sqrt(k))
                if case.fmt == "dense":
                    weight, scales, mins = dense, None, None
                else:
                    weight, scales, mins = specops.quantization.pack(dense, case.fmt, GROUP[case.fmt])
                del dense
                weight, scales, mins = (None if t is None else t.to(device) for t in (weight, scales, mins))
                first.append(Layer(weight, scales, mins, peer_of(case.fmt, device, weight, scales, mins)))
            total = sum(layer.nbytes for layer in first)
            copies = copies_needed(total, device, hot, llc)
            self.copies = [first] + [[clone_layer(layer) for layer in first] for _ in range(copies - 1)]
            self.key = key
        return self.copies

    def clear(self) -> None:
        self.key, self.copies = None, []


def run_case(specops, case: Case, args, weights: Weights, llc: int, flush: torch.Tensor | None) -> list[dict]:
    device = args.device
    copies = weights.get(specops, case, device, args.hot, llc)
    gen = torch.Generator().manual_seed(SEED + case.m)
    inputs = {k: torch.randn(case.m, k, generator=gen).to(device) for k in sorted({k for _, k in case.layers})}
    peer_inputs = {k: x.to(torch.bfloat16) if case.fmt == "bf16" else x for k, x in inputs.items()}
    weight_bytes = sum(layer.nbytes for layer in copies[0])
    n, k = case.layers[0] if len(case.layers) == 1 else (None, None)
    has_peer = copies[0][0].peer is not None
    row = {"device": device, "cache": "hot" if args.hot else "cold", "format": case.fmt, "shape": case.shape,
           "N": n, "K": k, "M": case.m, "layers": len(case.layers), "weight_MB": weight_bytes / 1e6,
           "peer": PEER_NAMES[case.fmt] if has_peer else "none", "copies": len(copies), "note": ""}
    ours, theirs = specops_call(case.fmt), peer_call(case.fmt)

    # The check (also each provider's warm-up), on the last layer (the head, for the model).
    last = copies[0][-1]
    x, x_peer = inputs[case.layers[-1][1]], peer_inputs[case.layers[-1][1]]
    try:
        got = ours(x, last)
    except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
        row["note"] = f"specops failed: {type(error).__name__}: {error}"[:100]
        print(f"  {row['note']}", file=sys.stderr)
        return [row]
    if has_peer:
        try:
            want = theirs(x_peer, last).float()
            row["rel_diff"] = (got.float() - want).abs().max().item() / (want.abs().max().item() or 1.0)
            row["agree"] = "yes" if row["rel_diff"] <= TOLERANCE[case.fmt] else "NO"
        except Exception as error:  # noqa: BLE001
            row["note"] = f"torch failed: {type(error).__name__}: {error}"[:100]
            print(f"  {row['note']}", file=sys.stderr)
            has_peer = False
    if device == "cuda":
        torch.cuda.synchronize()

    def cycling(call, xs):
        state = {"i": 0}

        def run():
            layers = copies[state["i"]]
            state["i"] = (state["i"] + 1) % len(copies)
            for (_, k), layer in zip(case.layers, layers):
                call(xs[k], layer)
        return run

    fns = {"specops": cycling(ours, inputs)}
    if has_peer:
        fns["torch"] = cycling(theirs, peer_inputs)
    budget = ({"min_rounds": 3, "max_rounds": 10, "min_seconds": 0.1} if args.quick else
              {"min_rounds": 5, "max_rounds": 1000, "min_seconds": 1.5 if device == "cpu" else 0.2})
    budget.update({k: v for k, v in (("min_rounds", args.min_rounds), ("max_rounds", args.max_rounds),
                                     ("min_seconds", args.seconds)) if v is not None})
    times = time_interleaved(fns, device=device, flush=None if args.hot else flush, **budget)
    row["rounds"] = len(times["specops"])
    for name in fns:
        row[f"{name}_min_ms"] = min(times[name]) * 1e3
        row[f"{name}_med_ms"] = statistics.median(times[name]) * 1e3
        row[f"{name}_GB/s"] = weight_bytes / (row[f"{name}_med_ms"] * 1e-3) / 1e9
    if has_peer:
        row["speedup"] = row["torch_med_ms"] / row["specops_med_ms"]
    return [row]


def add_vs_dense(rows: list[dict]) -> None:
    dense = {(r["shape"], r["M"]): r["specops_med_ms"] for r in rows if r["format"] == "dense" and
             r.get("specops_med_ms")}
    for r in rows:
        base = dense.get((r["shape"], r["M"]))
        if base and r.get("specops_med_ms"):
            r["vs_dense"] = base / r["specops_med_ms"]


def summary_lines(rows: list[dict]) -> list[str]:
    """Per format: specops' median GB/s range and its speedup over torch's peer."""
    lines = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        done = [r for r in rows if r["format"] == fmt and r.get("specops_med_ms")]
        if not done:
            continue
        rates = [r["specops_GB/s"] for r in done]
        line = f"{fmt}: specops {min(rates):.1f}-{max(rates):.1f} GB/s"
        speedups = [r["speedup"] for r in done if r.get("speedup")]
        if speedups:
            line += f"; {done[0]['peer']} / specops {min(speedups):.2f}-{max(speedups):.2f}x"
        model = [r for r in done if r["shape"] == MODEL]
        if model:
            line += "; whole model " + " ".join(f"M={r['M']}:{r['specops_med_ms']:.1f} ms" for r in model)
        lines.append(line)
    return lines


def main() -> int:
    parser = bench_parser(__doc__, "quantized_linear",
                          "shapes smollm2-q,gemma-up and the model row, M 1,4, 3 to 10 rounds and 0.1 s a case")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {','.join(FORMATS)} (default all)")
    parser.add_argument("--shapes", default=None, help=f"names ({', '.join(SHAPES)}) or NxK (default all names)")
    parser.add_argument("--ms", type=int_list, default=None, help=f"M values (default {','.join(map(str, MS))})")
    parser.add_argument("--no-model", action="store_true", help=f"skip the {MODEL} row")
    parser.add_argument("--hot", action="store_true",
                        help="one weight copy, no L2 flush: cache-resident weights (default: cold)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of timing per case (default CPU 1.5, CUDA 0.2, quick 0.1)")
    parser.add_argument("--min-rounds", type=int, default=None, help="default 5 (quick 3)")
    parser.add_argument("--max-rounds", type=int, default=None, help="default 1000 (quick 10)")
    args, csv_path = parse_bench_args(parser, "quantized_linear")
    formats = [f for f in args.formats.split(",") if f]
    if not formats or any(f not in FORMATS for f in formats):
        parser.error(f"--formats: each of {', '.join(FORMATS)}, got {args.formats!r}")
    shapes = []
    for name in args.shapes.split(",") if args.shapes else (QUICK_SHAPES if args.quick else list(SHAPES)):
        if name in SHAPES:
            shapes.append((name, SHAPES[name]))
            continue
        try:
            n, k = (int(v) for v in name.lower().split("x"))
        except ValueError:
            parser.error(f"--shapes: {name!r} is neither NxK nor one of {', '.join(SHAPES)}")
        if n < 1 or k < 32 or k % 32:
            parser.error(f"--shapes: {name!r} needs N >= 1 and K a multiple of 32 (int4)")
        shapes.append((name, (n, k)))
    ms = args.ms or (QUICK_MS if args.quick else MS)
    if any(m < 1 for m in ms):
        parser.error("--ms: M must be >= 1")

    specops = import_specops()

    info = machine_info(args.device)
    llc = last_level_cache_bytes()
    info.update(cache="hot" if args.hot else "cold")
    if args.device == "cpu":
        info["llc_MB"] = f"{llc / 2**20:.0f}"
    flush = None
    if args.device == "cuda" and not args.hot:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    cases = [Case(fmt, name, (shape,), m) for fmt in formats for name, shape in shapes for m in ms]
    if not args.no_model:
        model_ms = ms[:1] if args.quick else ms
        cases += [Case(fmt, MODEL, tuple(SMOLLM2_LAYERS), m) for fmt in formats for m in model_ms]
    weights = Weights()
    with torch.inference_mode():
        rows, elapsed, other_load = run_cases(
            cases, lambda c: f"{c.fmt} {c.shape} layers={len(c.layers)} M={c.m}",
            lambda c: run_case(specops, c, args, weights, llc, flush), info)
    weights.clear()
    add_vs_dense(rows)
    write_csv_columns(csv_path, rows, CSV_COLUMNS, info)

    print(markdown_table(rows, COLUMNS))
    print()
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"other processes kept {other_load:.2f} of {info['cpu_cores']} cores busy during the run (per case: others)"
          + ("  <-- shared machine: CPU times are pessimistic" if other_load > 0.3 else ""))
    timing = ("CUDA events per call, L2 flushed before each" if args.device == "cuda" and not args.hot
              else "CUDA events per call" if args.device == "cuda" else "wall clock per call")
    print(f"timing: interleaved rounds, min and median over rounds; {timing}; "
          f"{'hot' if args.hot else 'cold'} weights. weight_MB: stored weights, scales and minimums; "
          "GB/s = weight_MB / median; speedup = torch median / specops median; vs_dense = dense specops "
          "median / this one; rel_diff = max|specops - torch| / max|torch|.")
    for line in summary_lines(rows) + mismatch_lines(rows, ("format", "shape", "M"), "specops != torch"):
        print(line)
    for r in rows:
        if r.get("note"):
            print(f"{r['format']} {r['shape']} M={r['M']}: {r['note']}")
    print(f"wrote {csv_path} ({len(rows)} rows) in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
