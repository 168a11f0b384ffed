"""specops inside vLLM against vLLM's own speculation and against specops' own loop, on the same model,
prompts and settings, in one run.

    python bench/bench_vllm.py [--prompts 8] [--first 0] [--new-tokens 96] [--rounds 2] [--batches 1,4,8]
                               [--temperature 0] [--top-p 1]
                               [--configs vllm,vllm-sync,vllm-ngram,vllm-suffix,vllm-draft-tli,specops-ngram,specops-slem,
                                          decode-ar,decode-ngram,decode-slem]
                               [--csv PATH] [--plot docs/vllm_cpu.png] [--baseline DIR]

Run it in an environment with vLLM and specops (README, "Serving with vLLM"). Target: Gemma-3-270M
(float32), as specops caches it (`specops models path gemma-3-270m`); prompts HumanEval/0.. (code); greedy, or
sampled with --temperature above 0 (and --top-p): vLLM's requests then go unseeded (the engine's seed 0; a seeded
request whose prefill vLLM splits stops its CPU engine, docs/memory.md), specops.decode's with seed 0, so the
texts differ between configurations and only the rates compare; vLLM's sampled requests ignore their
end-of-text token, so that each emits --new-tokens in every configuration (specops.decode's stop there).
Each configuration runs in a process of its own (vLLM's engine holds processes and memory), `--rounds`
times, the order of configurations reversed every other round; after a warm-up prompt, each run decodes
the prompts in groups of each `--batches` size (1: one request at a time; one `generate` call per group,
its requests submitted together). Each size has prompts of its own (the i-th size HumanEval/first +
i x prompts on): vLLM's suffix and specops' NgramProposer keep what their engine decoded, and on the same
prompts they drafted the second size's outputs from the first size's (NgramProposer 1.43x plain vLLM at 8
together, greedy, where on prompts of its own it made 0.96x; 2026-12-04).

  vllm           vLLM, no speculation
  vllm-sync      vLLM, no speculation, async_scheduling=False (as vLLM runs every custom_class proposer: it
                 turns async scheduling off for them)
  vllm-ngram     vLLM's `ngram` proposer, 4 tokens, n-grams of 1 to 4 tokens
  vllm-suffix    vLLM's `suffix` proposer (needs arctic-inference; reported as failed where it cannot run)
  vllm-draft-tli vLLM's own draft model with another vocabulary (`use_heterogeneous_vocab`: token-level
                 intersection), SmolLM2-135M (float32, `specops models path smollm2-135m`), 4 tokens
  specops-ngram  `specops.vllm.NgramProposer` through vLLM's custom_class, num_speculative_tokens 8 (the
                 most; it picks the length each step)
  specops-slem   `specops.vllm.SlemProposer`, drafter SmolLM2-135M (int8), num_speculative_tokens 8
  specops-*-verify-all  the same with SPECOPS_VLLM_EMPTY_ROWS=verify: vLLM's rejection sampler verifies every
                 step and draws its noise for every request, as without specops' shortcut (docs/vllm.md)
  decode-*       `specops.decode` with method ar / ngram / slem (SmolLM2-135M); ngram and NgramProposer
                 both use the target's bigram table where it is cached (`specops models bigram NAME`
                 builds it), context n-grams alone where it is not

--baseline DIR: another checkout of specops (built: its specops/_C*.so in place) run beside this one: every
specops-* and decode-* configuration also runs as CONFIG@baseline with DIR first on the worker's PYTHONPATH,
in the same rounds, so that code before and after a change is timed interleaved on the same host.

Reported per configuration and batch size: tokens/s (new tokens over the wall time of the generate calls,
the median over rounds), tokens per target step (new tokens over the decoding steps of the target: vLLM's
engine iterations, specops.decode's target forwards, less the prefills and the first token each gives;
at batch sizes above one a step serves several requests), how many prompts' greedy tokens equal plain vLLM's
(greedy runs only), and in the CSV each round's tokens/s.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _timing import csv_path, e2e_parser, load_prompts, parse_e2e_args

CONFIGS = ["vllm", "vllm-sync", "vllm-ngram", "vllm-suffix", "vllm-draft-tli", "specops-ngram", "specops-slem",
           "specops-ngram-verify-all", "specops-slem-verify-all", "decode-ar", "decode-ngram", "decode-slem"]
_SPECS = {
    "vllm": None,
    "vllm-sync": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "specops-ngram": {"model": "specops.vllm.NgramProposer", "num_speculative_tokens": 8},
    "specops-slem": {"model": "specops.vllm.SlemProposer", "num_speculative_tokens": 8},
}
WARM_UP = "def add(a, b):\n"
_BASELINE = "@baseline"  # a configuration run with --baseline's checkout of specops


def _groups(prompts: list[str], size: int) -> list[list[str]]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def _per_step(tokens: list[list[int]], steps: int) -> float:
    """Tokens per decoding step of the target: each request's first token comes from its prefill."""
    return (sum(map(len, tokens)) - len(tokens)) / max(steps, 1)


def _vllm_run(config: str, prompts: dict[int, list[str]], new_tokens: int, batches: list[int],
              sampling: dict) -> dict:
    from vllm import LLM, SamplingParams

    from specops import models

    if config.endswith("-verify-all"):
        config = config.removesuffix("-verify-all")
        os.environ["SPECOPS_VLLM_EMPTY_ROWS"] = "verify"
    if config == "specops-slem":
        os.environ.setdefault("SPECOPS_DRAFTER", "smollm2-135m")
    spec = _SPECS.get(config)
    if config == "vllm-draft-tli":
        spec = {"model": str(models.path("smollm2-135m")), "method": "draft_model", "num_speculative_tokens": 4,
                "use_heterogeneous_vocab": True}
    llm = LLM(model=str(models.path("gemma-3-270m")), dtype="float32", enforce_eager=True, max_model_len=2048,
              seed=0, kv_cache_memory_bytes=1 << 30, disable_log_stats=False, speculative_config=spec,
              **({"async_scheduling": False} if config == "vllm-sync" else {}))
    # Sampled, every request runs to max_tokens: the configurations draw different texts, and where some of
    # a batch's requests stopped early at their end-of-text token, the batch's last steps carried fewer
    # requests and its tokens/s fell for that alone (a run of 4 together made 18.0 tokens/s with requests
    # ending at 15-41 tokens where plain vLLM's draws all ran to 48; 2026-12-05).
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=sampling.get("temperature", 0) > 0, **sampling)

    def iterations() -> int:
        return next(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")

    llm.generate([WARM_UP], params, use_tqdm=False)
    out = {}
    for size in batches:
        steps, start = iterations(), time.perf_counter()
        groups = _groups(prompts[size], size)
        results = [r for group in groups for r in llm.generate(group, params, use_tqdm=False)]
        seconds = time.perf_counter() - start
        tokens = [list(r.outputs[0].token_ids) for r in results]
        steps = iterations() - steps - len(groups)  # less one prefill step per call
        out[str(size)] = {"seconds": seconds, "tokens": tokens, "tokens_per_step": _per_step(tokens, steps)}
    return out


def _decode_run(config: str, prompts: dict[int, list[str]], new_tokens: int, batches: list[int],
                sampling: dict) -> dict:
    import specops

    method = config.removeprefix("decode-")
    kwargs = {"method": method, **sampling, **({"seed": 0} if sampling["temperature"] > 0 else {})}
    if method == "slem":
        kwargs["drafter"] = "smollm2-135m"
    specops.decode([WARM_UP], target="gemma-3-270m", max_new_tokens=new_tokens, **kwargs)
    out = {}
    for size in batches:
        start = time.perf_counter()
        results = [specops.decode(group, target="gemma-3-270m", max_new_tokens=new_tokens, **kwargs)
                   for group in _groups(prompts[size], size)]
        seconds = time.perf_counter() - start
        tokens = [t for r in results for t in r.tokens]
        steps = sum(r.stats.target_calls - 1 for r in results)  # less the prefills
        out[str(size)] = {"seconds": seconds, "tokens": tokens, "tokens_per_step": _per_step(tokens, steps)}
    return out


def _worker(config: str, args) -> None:
    # Each batch size decodes prompts of its own: an engine that keeps what it decoded (NgramProposer's
    # memory, vLLM's suffix tree) would otherwise draft the second size's outputs from the first size's.
    batches = _batches(args.batches)
    prompts = {size: load_prompts(args.first + i * args.prompts, args.prompts) for i, size in enumerate(batches)}
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    try:
        run = _decode_run if config.startswith("decode-") else _vllm_run
        result = {"ok": True, **run(config, prompts, args.new_tokens, batches, sampling)}
    except Exception as error:  # a configuration this machine cannot run (vLLM's suffix without its package)
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
    import specops  # which checkout ran (--baseline)

    result["specops"] = str(Path(specops.__file__).parent)
    Path(args.worker[1]).write_text(json.dumps(result))


def main() -> None:
    parser = e2e_parser(__doc__, "vllm", prompts=8, new_tokens=96, modes=None, seed=None, threads=None, device=False)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,4,8", help="requests submitted together: one run per size")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--plot", default=None, help="write a PNG of tokens/s per configuration")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a built checkout of other specops code: its specops-*/decode-* configs run too")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "JSON"), help=argparse.SUPPRESS)
    args = parse_e2e_args(parser)
    args.csv = csv_path(args)
    if not (args.temperature >= 0 and 0 < args.top_p <= 1):
        parser.error(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and {args.top_p}")
    if args.worker:
        _worker(args.worker[0], args)
        return
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if args.baseline:
        if not (Path(args.baseline) / "specops" / "__init__.py").exists():
            parser.error(f"--baseline {args.baseline}: no specops package there")
        configs += [f"{c}{_BASELINE}" for c in configs if c.startswith(("specops-", "decode-"))]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    out_dir = Path(__file__).resolve().parent / "results" / "vllm_runs"  # each run's result and log (not in git)
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            path = out_dir / f"vllm_{config}.json"
            start = time.perf_counter()
            path.unlink(missing_ok=True)
            log = path.with_suffix(".log")
            env = dict(os.environ)
            if config.endswith(_BASELINE):  # the other checkout's specops first on the path
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(args.baseline).resolve()),
                                                                env.get("PYTHONPATH")) if p)
            with open(log, "w") as sink:
                subprocess.run([sys.executable, __file__, "--first", str(args.first), "--prompts", str(args.prompts),
                                "--new-tokens", str(args.new_tokens), "--batches", args.batches,
                                "--temperature", str(args.temperature), "--top-p", str(args.top_p),
                                "--worker", config.removesuffix(_BASELINE), str(path)],
                               check=False, stdout=sink, stderr=subprocess.STDOUT, env=env)
            result = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"}
            if not result["ok"]:  # vLLM's engine logs the root cause; its exception only says start-up failed
                causes = re.findall(r"\b(\w+(?:Error|Exception): .+)$", log.read_text(errors="replace"), re.M)
                result["error"] = causes[0] if causes else result["error"]
            runs[config].append(result)
            status = f"ok ({result['specops']})" if result["ok"] else result["error"][:120]
            print(f"round {r + 1} {config}: {time.perf_counter() - start:.0f} s, {status}", file=sys.stderr)
    _report(runs, args)


def _batches(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def _report(runs: dict[str, list[dict]], args) -> None:
    plain = next((r for r in runs.get("vllm", []) if r["ok"]), None)
    rows = []
    for config, results in runs.items():
        good = [r for r in results if r["ok"]]
        if not good:
            rows.append({"config": config, "mode": "-", "error": results[0]["error"] if results else "not run"})
            continue
        for size in _batches(args.batches):
            mode = str(size)
            tokens = good[0][mode]["tokens"]
            rates = [sum(map(len, r[mode]["tokens"])) / r[mode]["seconds"] for r in good]
            rate = statistics.median(rates)
            greedy = plain is not None and args.temperature == 0
            same = sum(a == b for a, b in zip(tokens, plain[mode]["tokens"])) if greedy else None
            rows.append({"config": config, "mode": "one at a time" if size == 1 else f"{size} together",
                         "tokens_per_s": round(rate, 1), "tokens_per_step": round(good[0][mode]["tokens_per_step"], 2),
                         "same_as_vllm": f"{same}/{len(tokens)}" if same is not None else "",
                         "rounds": " ".join(f"{r:.1f}" for r in rates), "error": ""})
    base = {row["mode"]: row["tokens_per_s"] for row in rows if row["config"] == "vllm" and "tokens_per_s" in row}
    print(f"{'greedy' if args.temperature == 0 else f'sampled, T = {args.temperature}, top-p {args.top_p}'}:")
    print("| configuration | requests | tokens/s | vs vllm | tokens per target step | greedy = vllm |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "tokens_per_s" not in row:
            print(f"| {row['config']} | - | failed: {row['error'][:80]} | | | |")
            continue
        ratio = f"{row['tokens_per_s'] / base[row['mode']]:.2f}x" if row["mode"] in base else ""
        print(f"| {row['config']} | {row['mode']} | {row['tokens_per_s']} | {ratio} | {row['tokens_per_step']} | "
              f"{row['same_as_vllm']} |")
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["config", "mode", "tokens_per_s", "tokens_per_step", "same_as_vllm",
                                               "rounds", "error"])
        writer.writeheader()
        writer.writerows(rows)
    if args.plot:
        title = "greedy" if args.temperature == 0 else f"T = {args.temperature:g}, top-p {args.top_p:g}"
        _plot([row for row in rows if "tokens_per_s" in row], args.plot, title)


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(row["mode"] for row in rows))
    configs = list(dict.fromkeys(row["config"] for row in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 3.8), sharey=False)
    for ax, mode in zip(axes if len(modes) > 1 else [axes], modes):
        values = {row["config"]: row["tokens_per_s"] for row in rows if row["mode"] == mode}
        names = [c for c in configs if c in values]
        colors = ["#888888" if n.startswith("vllm") else "#1f77b4" if n.startswith("specops") else "#2ca02c"
                  for n in names]
        ax.barh(names[::-1], [values[n] for n in names][::-1], color=colors[::-1])
        for i, n in enumerate(names[::-1]):
            ax.text(values[n], i, f" {values[n]:.1f}", va="center", fontsize=8)
        ax.set_title(mode)
        ax.set_xlabel("tokens/s")
    fig.suptitle(f"Gemma-3-270M inside vLLM, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
