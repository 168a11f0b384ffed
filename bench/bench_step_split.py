"""Where a one-request decoding step of the embedded target goes, and how well its float32 products stream.

    python bench/bench_step_split.py [--methods ar,ngram] [--rounds 3] [--prompts 8] [--new-tokens 48]
                                     [--stream-rounds 15] [--csv PATH]

Two parts, each interleaved in one process:

1. Streaming. The 400 MB of a Gemma-3-270M-sized body (18 layers of q|k|v 1536 x 640, o 640 x 1024, gate|up
   4096 x 640 and down 640 x 2048, random float32) read three ways, alternating, --stream-rounds times: torch's
   sum over one 400 MB tensor (a plain read), skinny_linear for 1 row over one weight of all of it, and the
   72 products of the layers one after another for 1 row (what llama_layers' products read). GB/s medians.
2. The step. Greedy decoding of HumanEval prompts one at a time (--new-tokens each) by each of --methods on
   Gemma-3-270M, under torch's profiler: per target step (the prefill left out), the ms of the layers' op
   (llama_layers), of the head's int8 screen (int8_linear) and of everything else (Python, the screen's other
   work on the logits, drafting, verification). The profiler adds a few microseconds to every op, so "rest"
   is an upper bound; the ops' own times are not inflated. Tokens per step and tokens/s (profiled) too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import load_prompts, machine_info, markdown_table, read_bandwidth_gbs, write_csv_columns  # noqa: E402

import torch  # noqa: E402

LAYERS = 18
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]


def stream(rounds: int) -> list[dict]:
    """GB/s of a plain read, one skinny_linear product and the body's 72 products, medians of `rounds`."""
    import specops  # noqa: F401  (loads the ops)

    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) / k ** 0.5 for n, k in SHAPES] for _ in range(LAYERS)]
    total = sum(n * k for n, k in SHAPES) * LAYERS * 4
    whole = torch.randn(total // 4 // 640, 640, generator=gen)
    inputs = {k: torch.randn(1, k, generator=gen) for k in (640, 1024, 2048)}
    op = torch.ops.specops.skinny_linear

    def products():
        for layer in weights:
            for w in layer:
                op(inputs[w.shape[1]], w, None)

    ways = {"sum": whole.sum, "one product": lambda: op(inputs[640], whole, None), "72 products": products}
    speeds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, read in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            start = time.perf_counter()
            read()
            speeds[name].append(total / (time.perf_counter() - start) / 1e9)
    best = statistics.median(speeds["sum"])
    return [{"part": "stream", "what": name, "gbs": round(statistics.median(v), 1),
             "vs_sum": round(statistics.median(v) / best, 3)} for name, v in speeds.items()]


def steps(methods: list[str], rounds: int, prompts: list[str], new_tokens: int) -> list[dict]:
    """Per-step ms of the layers, the screen and the rest, per method, medians over rounds."""
    import specops
    from torch.profiler import ProfilerActivity, profile

    for method in methods:
        specops.decode(prompts[:1], max_new_tokens=8, target="gemma-3-270m", method=method)
    got: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(rounds):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start, count, prefill, tokens = time.perf_counter(), 0, 0.0, 0
                for prompt in prompts:
                    out = specops.decode([prompt], max_new_tokens=new_tokens, target="gemma-3-270m", method=method)
                    count += out.stats.target_calls - 1
                    prefill += out.stats.prefill_seconds
                    tokens += out.stats.new_tokens
                seconds = time.perf_counter() - start
            ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
            layers, screen = ops.get("specops::llama_layers", 0.0), ops.get("specops::int8_linear", 0.0)
            got[method].append({"tok_s": tokens / seconds, "tokens_per_step": (tokens - len(prompts)) / count,
                                "layers_ms": layers / count * 1e3, "screen_ms": screen / count * 1e3,
                                "rest_ms": (seconds - prefill - layers - screen) / count * 1e3})
    rows = []
    for method, runs in got.items():
        row = {"part": "step", "what": method}
        for key in runs[0]:
            row[key] = round(statistics.median(run[key] for run in runs), 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,ngram")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--stream-rounds", type=int, default=15)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    start_gbs = read_bandwidth_gbs()
    rows = stream(args.stream_rounds)
    rows += steps(args.methods.split(","), args.rounds, load_prompts(0, args.prompts), args.new_tokens)
    end_gbs = read_bandwidth_gbs()
    info = machine_info("cpu") | {"read_gbs_start": f"{start_gbs:.1f}", "read_gbs_end": f"{end_gbs:.1f}"}
    columns = ["part", "what", "gbs", "vs_sum", "tok_s", "tokens_per_step", "layers_ms", "screen_ms", "rest_ms"]
    print(markdown_table(rows, columns))
    print(", ".join(f"{k}={v}" for k, v in info.items()))
    if args.csv:
        write_csv_columns(args.csv, rows, columns, info)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
