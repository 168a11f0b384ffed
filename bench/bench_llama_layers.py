"""Benchmark of `specops.ops.llama_layers` (a model's decoder layers in one CPU call) against the same
model's forward through transformers' modules, interleaved in one run.

    python bench/bench_llama_layers.py [--quick] [--csv PATH] [--threads N] [--weights float32,int8,int4]
        [--tokens 1,4] [--context 100] [--rounds 15] [--models smollm2-135m,gemma-3-270m]

Models: the embedded drafter SmolLM2-135M (`specops.models.load`, 30 Llama layers, 9 heads over 3
key/value heads) and target Gemma-3-270M (18 layers: q/k norms, four norms a layer, GELU-tanh, sliding-
window and global layers; 4 heads over 1), float32 or `specops.quantize`d. Case: a decoding forward of --tokens new tokens after --context cached
ones, batch 1, logits of every new token. Providers:
- `op`: the engine's Llama-family path (`LlamaForward`): embedding and rotary tables in Python, every
  layer in one `llama_layers` call, the head through skinny_linear / quantized_linear.
- `modules`: the peer, the model's own modules through the engine's `CpuForward` (transformers' layers
  with every linear layer computed by the same skinny_linear / quantized_linear kernels): what the op
  saves is framework time, not arithmetic.
Timing: each round runs both providers once in alternating order, each on its own cache, cut back after
each forward. Reported: min and median over rounds, in ms, and speedup = modules median / op median.
rel_diff: max |op - modules| / max |modules| over the logits of one forward. CPU only (the op has no GPU
implementation: there CUDA graphs remove the same overhead).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import bench_parser, import_specops, parse_bench_args  # noqa: E402

specops = import_specops()
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specops import models  # noqa: E402
from specops.decoding.cpu_forward import CpuForward  # noqa: E402
from specops.decoding.llama_forward import LlamaForward  # noqa: E402


def forward(provider, cache, tokens: torch.Tensor, past: int) -> torch.Tensor:
    n = tokens.shape[1]
    out = provider(n, cache, input_ids=tokens, attention_mask=torch.ones(1, past + n, dtype=torch.long),
                   position_ids=torch.arange(past, past + n)[None], use_cache=True)
    cache.crop(-n)
    return out


def run_case(model, weights: str, n: int, context: int, rounds: int) -> dict:
    general = CpuForward(model)
    lean = LlamaForward.of(model, general)
    if lean is None:
        raise SystemExit(f"the llama_layers path refused the model ({weights})")
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    tokens = torch.randint(0, vocab, (1, n), generator=gen)
    providers = {"op": lean, "modules": general}
    times = {name: [] for name in providers}
    with torch.inference_mode():
        caches = {}
        for name in providers:  # each its own cache, as in decoding (the op's keeps room for new rows)
            caches[name] = DynamicCache()
            general(1, caches[name], input_ids=prompt, position_ids=torch.arange(context)[None],
                    attention_mask=torch.ones(1, context, dtype=torch.long), use_cache=True)
        outs = {name: forward(p, caches[name], tokens, context) for name, p in providers.items()}  # warm-up, check
        for r in range(rounds):
            for name in (list(providers) if r % 2 == 0 else list(providers)[::-1]):
                start = time.perf_counter()
                forward(providers[name], caches[name], tokens, context)
                times[name].append((time.perf_counter() - start) * 1e3)
    rel = float((outs["op"] - outs["modules"]).abs().max() / outs["modules"].abs().max())
    row = {"model": model.config.get_text_config().model_type, "weights": weights, "tokens": n,
           "context": context}
    for name, t in times.items():
        row[f"{name}_min_ms"] = f"{min(t):.2f}"
        row[f"{name}_median_ms"] = f"{statistics.median(t):.2f}"
    row["speedup"] = f"{statistics.median(times['modules']) / statistics.median(times['op']):.2f}"
    row["rel_diff"] = f"{rel:.1e}"
    return row


def main() -> None:
    parser = bench_parser(__doc__, "llama_layers", "one weight format, 1 token, 5 rounds")
    parser.add_argument("--weights", default="float32,int8,int4")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    args, csv_path = parse_bench_args(parser, "llama_layers")
    if args.device != "cpu":  # gpu_suite.sh runs every bench with --device cuda: a skip, not a failure
        print("llama_layers runs on the CPU only (on a GPU, CUDA graphs remove the framework time it saves): "
              "nothing to measure on cuda; use --device cpu")
        return
    weights = ["int8"] if args.quick else args.weights.split(",")
    counts = [1] if args.quick else [int(t) for t in args.tokens.split(",")]
    rounds = 5 if args.quick else args.rounds
    rows = []
    for name in ["smollm2-135m"] if args.quick else args.models.split(","):
        for w in weights:
            model, _ = models.load(name, weights=w)
            for n in counts:
                rows.append(run_case(model, w, n, args.context, rounds))
                print(f"  {name}, {w}, {n} token(s) done", file=sys.stderr, flush=True)
    columns = list(rows[0])
    print(f"llama_layers: batch 1, {args.context} cached tokens, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w") as f:
        f.write(",".join(columns) + "\n")
        for row in rows:
            f.write(",".join(str(row[c]) for c in columns) + "\n")
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()
