"""specops inside transformers' generate(): `model.generate(..., custom_generate=specops.hf.generate)` against
plain `model.generate()` on the same model, prompts and batches, in one run.

    python bench/bench_hf.py [--prompts 4] [--first 0] [--batch 2] [--new-tokens 64] [--modes greedy,sample]
                             [--configs generate,ngram,smollm2] [--rounds 1] [--threads 2] [--device cpu]
                             [--csv PATH] [--plot]

Target Gemma-3-270M (float32, the embedded model), HumanEval prompts <first>.. in batches of --batch
(left-padded, as transformers batches). Configurations, round-robin per batch so machine noise hits them
alike:
  generate   plain `model.generate(**inputs, max_new_tokens=N, do_sample=...)`
  ngram      the same call with `custom_generate=specops.hf.generate` and no drafter: method "auto" is ngram
             (context n-grams and the model's bigram table, computed once per model and cached)
  smollm2    the same with `draft_model="smollm2-135m", target_tokenizer=tokenizer`: the embedded drafter with
             another vocabulary, default weights (int8); "auto" is slem when greedy and tli when sampling
Greedy rows also check the output tensor equals plain generate's, token for token. Sampling is
do_sample=True at temperature 1 with top_k=0 (transformers' default top-k 50 otherwise). tok/s counts each
row's new tokens up to and including its EOS. Writes bench/results/hf_<device>.csv and, with --plot,
docs/hf_generate_<device>.png.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from _timing import (CpuLoad, e2e_parser, format_table, import_specops, load_prompts, machine_info,
                     parse_e2e_args, write_csv_columns)

CONFIGS = ("generate", "ngram", "smollm2")
MODES = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, temperature=1.0, top_k=0)}
COLUMNS = ["mode", "config", "batches", "tokens", "seconds", "tok/s", "vs_generate", "same_as_generate",
           "others"]


def new_tokens(sequences: torch.Tensor, width: int, eos: set[int]) -> int:
    """Tokens the rows generated, each up to and including its first EOS (later positions are padding)."""
    total = 0
    for row in sequences[:, width:].tolist():
        hit = next((i for i, t in enumerate(row) if t in eos), None)
        total += len(row) if hit is None else hit + 1
    return total


def main() -> None:
    parser = e2e_parser(__doc__, "hf", prompts=4, threads=None, seed=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=1, help="times each batch is timed per config")
    parser.add_argument("--plot", action="store_true", help="also draw docs/hf_generate_<device>.png")
    args = parse_e2e_args(parser)
    configs = [c for c in args.configs.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    if set(configs) - set(CONFIGS) or set(modes) - set(MODES) or "generate" not in configs:
        raise SystemExit(f"--configs from {CONFIGS} (generate included), --modes from {tuple(MODES)}")

    specops = import_specops()
    model, tokenizer = specops.models.load("gemma-3-270m", device=args.device, progress=False)
    prompts = load_prompts(args.first, args.prompts)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    eos_ids = model.generation_config.eos_token_id
    eos = {int(t) for t in ([eos_ids] if isinstance(eos_ids, int) else eos_ids)}
    extra = {"generate": {}, "ngram": dict(custom_generate=specops.hf.generate),
             "smollm2": dict(custom_generate=specops.hf.generate, draft_model="smollm2-135m",
                             target_tokenizer=tokenizer)}

    def call(config: str, batch: list[str], mode: str, seed: int, tokens: int) -> tuple[torch.Tensor, int]:
        inputs = tokenizer(batch, return_tensors="pt", padding=True).to(args.device)
        torch.manual_seed(seed)  # generate() samples with torch's generator; specops draws its seed from it
        out = model.generate(**inputs, max_new_tokens=tokens, **MODES[mode], **extra[config])
        return out, inputs["input_ids"].shape[1]

    # Warm-up: every config once on a short generation (first forwards, the bigram table, vocabulary maps).
    for mode in modes:
        for config in configs:
            call(config, batches[0], mode, 0, 4)

    rows = []
    for mode in modes:
        totals = {c: [0, 0.0, 0] for c in configs}  # tokens, seconds, batches
        outputs: dict[str, list[torch.Tensor]] = {c: [] for c in configs}
        load = CpuLoad().start()
        for index, batch in enumerate(batches):
            for _ in range(args.rounds):
                for config in configs:
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    out, width = call(config, batch, mode, index, args.new_tokens)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                    totals[config][0] += new_tokens(out, width, eos)
                    totals[config][1] += seconds
                    totals[config][2] += 1
                    outputs[config].append(out.cpu())
            print(f"[{index + 1}/{len(batches)}] {mode} batch done", file=sys.stderr, flush=True)
        others = load.stop()
        base = totals["generate"][0] / totals["generate"][1]
        for config in configs:
            tokens, seconds, count = totals[config]
            equal = all(torch.equal(a, b) for a, b in zip(outputs[config], outputs["generate"]))
            same = "" if mode != "greedy" else "yes" if equal else "NO"
            rows.append({"mode": mode, "config": config, "batches": count, "tokens": tokens,
                         "seconds": round(seconds, 2), "tok/s": round(tokens / seconds, 1),
                         "vs_generate": round(tokens / seconds / base, 2), "same_as_generate": same,
                         "others": round(others, 2)})

    info = machine_info(args.device)
    info.update({"model": "gemma-3-270m float32",
                 "prompts": f"HumanEval {args.first}..{args.first + args.prompts - 1}",
                 "batch": str(args.batch), "new_tokens": str(args.new_tokens),
                 "threads": str(torch.get_num_threads())})
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print(format_table(rows, COLUMNS))
    csv_path = Path(args.csv) if args.csv else Path(__file__).parent / "results" / f"hf_{args.device}.csv"
    write_csv_columns(csv_path, rows, COLUMNS, info)
    print(f"wrote {csv_path}")
    if any(r["same_as_generate"] == "NO" for r in rows):
        print("FAILED: a greedy specops output differs from plain generate's", file=sys.stderr)
        sys.exit(1)
    if args.plot:
        plot(rows, Path(__file__).parent.parent / "docs" / f"hf_generate_{args.device}.png", info)


def plot(rows: list[dict], png: Path, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    labels = {"generate": "generate()", "ngram": "generate(custom_generate=\nspecops.hf.generate)",
              "smollm2": "... + draft_model=\n\"smollm2-135m\""}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.8 / len(configs)
    colors = ["#9e9e9e", "#1f77b4", "#ff7f0e"]
    for i, config in enumerate(configs):
        values = [next(r["tok/s"] for r in rows if r["mode"] == m and r["config"] == config) for m in modes]
        ratios = [next(r["vs_generate"] for r in rows if r["mode"] == m and r["config"] == config)
                  for m in modes]
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(modes))]
        bars = ax.bar(xs, values, width, label=labels[config], color=colors[i % len(colors)])
        for bar, ratio in zip(bars, ratios):
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([f"{m} (do_sample={m == 'sample'})" for m in modes])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Gemma-3-270M, batches of {info['batch']}, {info['new_tokens']} new tokens, "
                 f"{info['machine']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
