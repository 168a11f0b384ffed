"""What a float32 prefill's products cost on a CPU whose BLAS is slow (MKL on a CPU that is not Intel's), through
skinny_linear and through oneDNN (specops/decoding/cpu_forward.py, _ONEDNN_ROWS), in one process, alternating.

    python bench/bench_prefill.py [--rounds 3] [--rows 16,32,48,64,96,128,256,512] [--csv FILE]

Part 1, the products alone: Gemma-3-270M's weight shapes (2048 x 640 gate and up, 640 x 2048 down, 256 x 640 k
and v), 8 random weights of each shape taken in turn (so a weight is not in the cache from the call before), ms
a product (median of 20) and GFLOP/s, at each row count. Part 2, the decoder: 8 HumanEval prompts (33-40,
Gemma-3-270M, 2 threads, `ar`, one new token) one at a time, `Stats.prefill_seconds`, with the switch set to
oneDNN's rows and to none, alternating prompt by prompt; the median and the sum of each per round.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import load_prompts  # noqa: E402

SHAPES = ((2048, 640), (640, 2048), (256, 640))


def _median_seconds(call, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def products(rows: list[int], out: list[dict]) -> None:
    from specops._blas import onednn_linear

    for n, k in SHAPES:
        weights = [torch.randn(n, k) for _ in range(8)]
        turn = iter(range(1 << 30))
        for m in rows:
            x = torch.randn(m, k)
            skinny = _median_seconds(lambda: torch.ops.specops.skinny_linear(x, weights[next(turn) % 8], None))
            onednn = _median_seconds(lambda: onednn_linear(x, weights[next(turn) % 8], None))
            flop = 2 * m * n * k
            print(f"{n} x {k}, {m:4d} rows: skinny_linear {1e3 * skinny:.3f} ms "
                  f"({flop / skinny / 1e9:.0f} GFLOP/s), oneDNN {1e3 * onednn:.3f} ms "
                  f"({flop / onednn / 1e9:.0f} GFLOP/s), {skinny / onednn:.2f}x", flush=True)
            out.append({"part": "product", "shape": f"{n}x{k}", "rows": m, "skinny_ms": 1e3 * skinny,
                        "onednn_ms": 1e3 * onednn})


def prefills(rounds: int, out: list[dict]) -> None:
    import specops
    import specops.models
    from specops.decoding import cpu_forward

    prompts = load_prompts(33, 8)
    tokenizer = specops.models.load_tokenizer("gemma-3-270m")
    print("prompt tokens", [len(tokenizer(p).input_ids) for p in prompts])
    specops.decode(["def add(a, b):\n"], target="gemma-3-270m", method="ar", max_new_tokens=2)  # loads, probes
    rows = cpu_forward._ONEDNN_ROWS
    try:
        for round_ in range(rounds):
            seconds = {"skinny_linear": [], "oneDNN": []}
            for prompt in prompts:
                for path in seconds:
                    cpu_forward._ONEDNN_ROWS = rows if path == "oneDNN" else 1 << 40
                    result = specops.decode([prompt], target="gemma-3-270m", method="ar", max_new_tokens=1)
                    seconds[path].append(result.stats.prefill_seconds)
            line = [f"{path} median {1e3 * statistics.median(values):.1f} ms, sum {sum(values):.3f} s"
                    for path, values in seconds.items()]
            print(f"round {round_}: " + "; ".join(line), flush=True)
            out.append({"part": "prefill, 8 prompts one at a time (sum)", "round": round_,
                        "skinny_ms": 1e3 * sum(seconds["skinny_linear"]),
                        "onednn_ms": 1e3 * sum(seconds["oneDNN"])})
    finally:
        cpu_forward._ONEDNN_ROWS = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="16,32,48,64,96,128,256,512")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    import specops  # noqa: F401  (registers the ops)
    from specops.decoding import cpu_forward

    torch.set_num_threads(2)
    if not cpu_forward._onednn():
        print("note: prefills here do not take oneDNN (a fast BLAS, or no oneDNN linear); part 2 times one path")
    rows: list[dict] = []
    products([int(r) for r in args.rows.split(",")], rows)
    prefills(args.rounds, rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["part", "shape", "rows", "round", "skinny_ms", "onednn_ms"])
            writer.writeheader()
            for row in rows:
                writer.writerow({key: f"{v:.3f}" if isinstance(v, float) else v for key, v in row.items()})


if __name__ == "__main__":
    main()
