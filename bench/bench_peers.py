"""specops against its peers on the embedded target, Gemma-3-270M: transformers' generate() (plain, and static
cache with torch.compile) and llama.cpp's server (F32 and Q8_0 GGUFs, plain and with its n-gram drafters), in
one interleaved run (issue 48, "Measure").

    python bench/bench_peers.py [--rounds 2] [--prompts 8] [--first 0] [--new-tokens 48]
                                [--configs ar,ngram,ngram-context,slem,tli,rsd-s,ar-int8,ngram-int8,
                                 hf,hf-compiled,
                                 llama-f32,llama-f32-ngram-simple,llama-f32-ngram-mod,
                                 llama-q8,llama-q8-ngram-simple,llama-q8-ngram-mod]
                                [--modes alone,together8] [--gguf F32.gguf] [--gguf-q8 Q8_0.gguf]
                                [--llama-server PATH] [--csv bench/results/peers_cpu.csv] [--plot PATH]
    python bench/bench_peers.py --summarize bench/results/peers_cpu.csv [--plot PATH]

Greedy decoding of HumanEval's prompts <first>.. (--prompts of them, --new-tokens each), 2 threads everywhere:

  alone      each prompt in a call of its own, one after another; tokens/s = all new tokens / all seconds
  together8  all the prompts in one call: one batch for specops and transformers (left-padded), as many
             concurrent requests to llama-server (one slot each)

Configurations:
  ar, ngram, slem, tli,   specops.decode(prompts, target="gemma-3-270m", method=...), float32: plain decoding,
  rsd-s                   n-gram drafting, and the embedded drafter SmolLM2-135M (its default int8 weights)
                          with another vocabulary: text re-encoded (slem), shared tokens (tli), draft trees
                          of Stochastic Beam Search (rsd-s)
  ngram-context           ngram drafting from the context alone (options={"tables": "none"}); `ngram`
                          also drafts from the model's bigram table where it is cached (`specops models
                          bigram gemma-3-270m` builds it)
  ar-int8, ngram-int8     the same with target="gemma-3-270m:int8"
  ar-full, ngram-full,    the same as ar, ngram, slem, tli with the target's output head read whole at every
  slem-full, tli-full     greedy step (without its int8 screen, specops/decoding/greedy_head.py): a switch
  ngram-all-rows,         the same as ngram, slem, tli, ngram-int8 with every row of a greedy verification
  slem-all-rows,          computed (greedy_head.py computes only the rows verification can read: a switch)
  tli-all-rows,
  ngram-int8-all-rows
  ar-float-rows,          the same as ar, ngram, ar-int8, ngram-int8 with the screen's rows kept in float32
  ngram-float-rows,       (greedy_head.py quantizes them to int8 where the CPU has AVX-512 VNNI, and then
  ar-int8-float-rows,     screens an int8 head too: a switch; the same as without it on other CPUs)
  ngram-int8-float-rows
  ar-skinny-prefill,      the same as ar, ngram with a float32 prefill's products through skinny_linear where
  ngram-skinny-prefill    they go through oneDNN (MKL on a CPU not Intel's: specops/decoding/cpu_forward.py,
                          _ONEDNN_ROWS): a switch
  ar-int8-mkl-prefill,    the same as ar-int8, ngram-int8 with a long prefill chunk's products (more than 256
  ngram-int8-mkl-prefill  rows: 8 prompts together) through F.linear where they go through oneDNN (MKL on a
                          CPU not Intel's: specops/_blas.py): a switch
  hf                      transformers' model.generate() on specops.models.load("gemma-3-270m"), dynamic cache
  hf-compiled             its own fast path: cache_implementation="static" (sized once, for the longest prompt
                          of the run plus --new-tokens, so no prompt recompiles) and its automatic
                          torch.compile of the decoding step (CompileConfig's defaults, allowed on a CPU)
  llama-f32, llama-q8     llama.cpp's llama-server (bench/_llama_server.py, 2 threads, 1024 tokens a slot) on
  llama-*-ngram-simple,   an F32 GGUF (--gguf, its convert_hf_to_gguf.py) and a Q8_0 one (--gguf-q8, its
  llama-*-ngram-mod       llama-quantize): plain, ngram-simple (n 3, m 8) and ngram-mod (n_match 8, n_min 2,
                          n_max 16), the settings of bench/bench_memory.py

A configuration whose GGUF or server is missing is reported as skipped, with the reason. Each configuration
runs in a fresh process per round, the configurations in a new random order every round. In each process,
each mode starts with an untimed warm-up call of that mode's batch shape (transformers compiles its step
there, llama-server starts that many slots); then the mode's calls are timed with a wall clock around each
call, model loading and warm-up outside. Greedy outputs are compared token for token with specops' ar of the
same round and mode (ar-int8 for the int8 configurations and llama-q8-*: Q8_0 is another quantization, so
its agreement is reported, not expected), a trailing end-of-sequence token aside. The host's streaming
bandwidth (copy and read) is measured at the start and at the end of the run; a move of more than 10 % is
flagged. The table gives medians over rounds, and the checks issue 48 asks of these ratios.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _timing import (
    bandwidth_gbs,
    load_prompts,
    machine_info,
    markdown_table,
    read_bandwidth_gbs,
    shuffled_rounds,
)
from bench_memory import Llama as _ServerEngine  # its _LLAMA_SPECS: the llama.cpp settings

BENCH = Path(__file__).resolve().parent
TARGET = "gemma-3-270m"
DRAFTER = "smollm2-135m"
# config -> (target, method, drafter) of specops.decode
SPECOPS = {"ar": (TARGET, "ar", None), "ngram": (TARGET, "ngram", None),
           "ngram-context": (TARGET, "ngram", None), "slem": (TARGET, "slem", DRAFTER),
           "tli": (TARGET, "tli", DRAFTER), "rsd-s": (TARGET, "rsd-s", DRAFTER),
           "ar-int8": (f"{TARGET}:int8", "ar", None), "ngram-int8": (f"{TARGET}:int8", "ngram", None)}
SPECOPS.update({f"{config}-full": SPECOPS[config] for config in ("ar", "ngram", "slem", "tli")})
SPECOPS.update({f"{config}-all-rows": SPECOPS[config] for config in ("ngram", "slem", "tli", "ngram-int8")})
SPECOPS.update({f"{config}-float-rows": SPECOPS[config] for config in ("ar", "ngram", "ar-int8", "ngram-int8")})
SPECOPS.update({f"{config}-skinny-prefill": SPECOPS[config] for config in ("ar", "ngram")})
SPECOPS.update({f"{config}-mkl-prefill": SPECOPS[config] for config in ("ar-int8", "ngram-int8")})
OPTIONS = {"ngram-context": {"tables": "none"}}  # config -> specops.decode's options
HF = ("hf", "hf-compiled")
# config -> (which GGUF, bench_memory's name of its llama.cpp setting)
LLAMA = {f"llama-{weights}{suffix}": (weights, setting) for weights in ("f32", "q8")
         for suffix, setting in (("", "llama"), ("-ngram-simple", "llama-ngram-simple"),
                                 ("-ngram-mod", "llama-ngram-mod"))}
CONFIGS = [*SPECOPS, *HF, *LLAMA]
MODES = ("alone", "together8")
INT8 = ("ar-int8", "ngram-int8", "ngram-int8-all-rows", "ar-int8-float-rows", "ngram-int8-float-rows",
        "ar-int8-mkl-prefill", "ngram-int8-mkl-prefill", "llama-q8", "llama-q8-ngram-simple", "llama-q8-ngram-mod")
WARM_UP = "def add(a, b):\n"
_MOVED = 0.10  # the bandwidth moved when start and end differ by more than this
# issue 48's "Must reach" on these configurations: (config, factor, peers); the config's tokens/s must be at
# least factor x the best of the peers, in each mode
TARGETS = [("ar-int8", 1.0, ["llama-q8"]),
           ("ngram-int8", 1.2, ["llama-q8-ngram-simple", "llama-q8-ngram-mod"]),
           ("ar", 1.1, ["llama-f32"]), ("ar", 1.0, ["hf-compiled"]), ("ngram", 1.6, ["ar"]),
           ("ngram", 1.3, ["llama-f32-ngram-simple", "llama-f32-ngram-mod"]), ("slem", 1.3, ["ar"]),
           ("tli", 1.3, ["ar"])]


def reference_of(config: str) -> str:
    """The configuration whose greedy tokens this one's are compared with."""
    return "ar-int8" if config in INT8 else "ar"


# ---- engines: each decodes a list of prompts in one call, greedy, and returns their new token lists ----

class Specops:
    def __init__(self, config: str, new_tokens: int):
        import torch

        import specops

        torch.set_num_threads(2)
        if config.endswith("-full"):  # a bench switch: every greedy step reads the whole float32 head
            from specops.decoding import greedy_head

            greedy_head._SCREEN_WEIGHTS = 1 << 62
        if config.endswith("-all-rows"):  # a bench switch: greedy verification computes every row
            from specops.decoding import greedy_head

            greedy_head._FOLLOW = False
        if config.endswith("-float-rows"):  # a bench switch: the screen multiplies float32 rows
            from specops.decoding import greedy_head

            greedy_head._int8_rows = lambda: False
        if config.endswith("-skinny-prefill"):  # a bench switch: no product goes through oneDNN
            from specops.decoding import cpu_forward

            cpu_forward._ONEDNN_ROWS = 1 << 62
        if config.endswith("-mkl-prefill"):  # a bench switch: QuantizedLinear's long chunks through F.linear
            from specops import _blas

            _blas.slow_here = lambda: False
        self.decode = specops.decode
        self.target, self.method, self.drafter = SPECOPS[config]
        self.options = OPTIONS.get(config)
        self.new_tokens = new_tokens

    def run(self, prompts: list[str]) -> list[list[int]]:
        result = self.decode(prompts, target=self.target, drafter=self.drafter, method=self.method,
                             max_new_tokens=self.new_tokens, options=self.options)
        return result.tokens


class Hf:
    """transformers' generate(); "hf-compiled" with its static cache and compiled decoding step."""

    def __init__(self, config: str, new_tokens: int, prompts: list[str]):
        import torch

        import specops

        torch.set_num_threads(2)
        self.model, self.tokenizer = specops.models.load(TARGET)
        self.new_tokens = new_tokens
        self.extra = {}
        if config == "hf-compiled":
            from transformers import CompileConfig

            compile_config = CompileConfig()
            # generate() compiles only on accelerators unless told this (transformers' own switch for CPUs).
            compile_config._compile_all_devices = True
            # One cache size for every call (a size per call recompiles the step); beyond Gemma-3's 512-token
            # window its sliding layers would take another branch, and compile again, inside a timed call.
            longest = max(len(ids) for ids in self.tokenizer(prompts + [WARM_UP])["input_ids"])
            self.extra = {"cache_implementation": "static", "compile_config": compile_config,
                          "max_cache_len": longest + new_tokens}
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def run(self, prompts: list[str]) -> list[list[int]]:
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        out = self.model.generate(**inputs, max_new_tokens=self.new_tokens, do_sample=False, **self.extra)
        rows = out[:, inputs["input_ids"].shape[1]:].tolist()
        return [row[:next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))] for row in rows]


class Llama(_ServerEngine):
    """bench_memory's llama-server engine (a server restarted for more slots), greedy, --new-tokens."""

    def __init__(self, config: str, new_tokens: int, gguf: str):
        super().__init__(LLAMA[config][1], gguf)
        self.new_tokens = new_tokens

    def run(self, prompts: list[str]) -> list[list[int]]:
        return super().run(prompts)[0]  # greedy: temperature 0

    def fresh(self) -> None:
        """A new server for the next mode: one keeps what it saw (its prompt cache, the ngram-mod pool)."""
        self.close()
        self.server = None


def engine(config: str, args, prompts: list[str]):
    if config in SPECOPS:
        return Specops(config, args.new_tokens)
    if config in HF:
        return Hf(config, args.new_tokens, prompts)
    return Llama(config, args.new_tokens, gguf_of(config, args))


def gguf_of(config: str, args) -> str:
    return args.gguf if LLAMA[config][0] == "f32" else args.gguf_q8


# ---- a worker: one configuration, every mode ----

def measure(runner, mode: str, prompts: list[str]) -> dict:
    """One mode: an untimed warm-up of its batch shape, then its calls, each timed."""
    groups = [[p] for p in prompts] if mode == "alone" else [prompts]
    if hasattr(runner, "fresh"):
        runner.fresh()
    runner.run([WARM_UP] * len(groups[0]))
    tokens, seconds = [], 0.0
    for group in groups:
        start = time.perf_counter()
        tokens += runner.run(group)
        seconds += time.perf_counter() - start
    return {"mode": mode, "tokens": sum(map(len, tokens)), "seconds": seconds, "greedy": tokens}


def worker(config: str, args) -> None:
    results, path = [], Path(args.out)
    try:
        prompts = load_prompts(args.first, args.prompts)
        runner = engine(config, args, prompts)
        for mode in args.modes.split(","):
            try:
                results.append(measure(runner, mode, prompts))
            except Exception as error:  # noqa: BLE001 - reported in the results
                results.append({"mode": mode, "error": f"{type(error).__name__}: {error}"[:400]})
            path.write_text(json.dumps(results))
        if hasattr(runner, "close"):
            runner.close()
    except Exception as error:  # noqa: BLE001 - a configuration this machine cannot run
        results.append({"error": f"{type(error).__name__}: {error}"[:400]})
    path.write_text(json.dumps(results))


# ---- the run ----

def llama_server(args) -> str:
    """The llama-server binary the run uses ("" when there is none)."""
    import _llama_server

    if args.llama_server:
        return args.llama_server if Path(args.llama_server).is_file() else ""
    return str(_llama_server.find_server() or "")


def skip_reason(config: str, args) -> str:
    """Why a configuration cannot run here ("" when it can)."""
    if config not in LLAMA:
        return ""
    gguf = gguf_of(config, args)
    if not gguf or not Path(gguf).is_file():
        flag = "--gguf" if LLAMA[config][0] == "f32" else "--gguf-q8"
        return f"skipped: no GGUF ({flag} {gguf!r})"
    if not llama_server(args):
        where = f"at {args.llama_server}" if args.llama_server else "(give --llama-server or $LLAMA_SERVER)"
        return f"skipped: no llama-server {where}"
    return ""


def run_config(config: str, args, out: Path) -> list[dict]:
    """One configuration in a fresh process: its results per mode (or one error)."""
    reason = skip_reason(config, args)
    if reason:
        return [{"error": reason}]
    path, log = out / f"{config}.json", out / f"{config}.log"
    path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, "--out", str(path),
               "--prompts", str(args.prompts), "--first", str(args.first),
               "--new-tokens", str(args.new_tokens), "--modes", args.modes,
               "--gguf", args.gguf, "--gguf-q8", args.gguf_q8]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.llama_server:
        env["LLAMA_SERVER"] = args.llama_server
    with open(log, "w") as f:
        subprocess.run(command, check=False, stdout=f, stderr=subprocess.STDOUT, env=env)
    if not path.exists():
        return [{"error": f"the worker wrote nothing; see {log}"}]
    return json.loads(path.read_text())


def bandwidth() -> dict[str, float]:
    """The host's streaming bandwidth now, GB/s: a copy (read and write counted) and a read."""
    return {"copy": bandwidth_gbs(), "read": read_bandwidth_gbs()}


def run_rounds(args, configs: list[str], out: Path) -> list[dict]:
    """Every round's rows: one per configuration and mode (or one per configuration that failed)."""
    rows = []
    for round_, config in shuffled_rounds(configs, args.rounds):
        start = time.perf_counter()
        results = run_config(config, args, out)
        for r in results:
            tok_s = r["tokens"] / r["seconds"] if r.get("seconds") else None
            rows.append({"round": round_, "config": config, "mode": r.get("mode", ""),
                         "tokens": r.get("tokens"), "seconds": r.get("seconds"), "tok_s": tok_s,
                         "greedy": r.get("greedy"), "error": r.get("error", "")})
        done = [f"{r['mode']} {r['tokens'] / r['seconds']:.1f} tok/s" if r.get("seconds")
                else r.get("error") for r in results]
        print(f"round {round_} {config}: {time.perf_counter() - start:.0f} s {done}", file=sys.stderr,
              flush=True)
    return rows


# ---- greedy agreement, CSV, table, plot ----

def eos_ids() -> set[int]:
    """The target's end-of-sequence ids (engines differ in whether they return the one that ended a row)."""
    import specops

    config = json.loads((Path(specops.models.path(TARGET)) / "generation_config.json").read_text())
    eos = config.get("eos_token_id", [])
    return set(eos if isinstance(eos, list) else [eos])


def agreement(rows: list[dict]) -> None:
    """row["same_as_reference"]: the prompts whose greedy tokens equal the reference's (same round, mode)."""
    eos = eos_ids()

    def strip(tokens: list[int]) -> list[int]:
        return tokens[:-1] if tokens and tokens[-1] in eos else tokens

    greedy = {(r["round"], r["mode"], r["config"]): r["greedy"] for r in rows if r.get("greedy")}
    for r in rows:
        r["reference"] = reference_of(r["config"])
        want = greedy.get((r["round"], r["mode"], r["reference"]))
        if r.get("greedy") and want:
            r["same_as_reference"] = sum(strip(a) == strip(b) for a, b in zip(r["greedy"], want))


CSV_FIELDS = ["round", "config", "mode", "prompts", "new_tokens", "tokens", "seconds", "tok_s",
              "same_as_reference", "reference", "error"]


def write_csv(path: Path, rows: list[dict], info: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS + list(info), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**info, **r})


def read_csv(path: Path) -> tuple[list[dict], dict[str, str]]:
    """A run's rows (numbers as numbers) and its info columns, from the CSV it wrote."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    info = {k: v for k, v in rows[0].items() if k not in CSV_FIELDS}
    for r in rows:
        r["round"] = int(r["round"])
        for key in ("prompts", "tokens", "same_as_reference"):
            r[key] = int(r[key]) if r[key] else None
        for key in ("seconds", "tok_s"):
            r[key] = float(r[key]) if r[key] else None
    return rows, info


def cell(rows: list[dict], config: str, mode: str) -> dict | None:
    """A configuration's tokens/s in a mode over the rounds (median, min, max) and its worst agreement."""
    mine = [r for r in rows if r["config"] == config and r["mode"] == mode and r.get("tok_s")]
    if not mine:
        return None
    values = [r["tok_s"] for r in mine]
    same = [r["same_as_reference"] for r in mine if r.get("same_as_reference") is not None]
    prompts = mine[0].get("prompts") or len(mine[0].get("greedy") or []) or "?"
    return {"tok_s": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values),
            "same": f"{min(same)}/{prompts}" if same else ""}


def summarize(rows: list[dict], modes: list[str]) -> list[dict]:
    """One table row per configuration: each mode's median tokens/s, its ratio to ar, its agreement."""
    table = []
    for config in [c for c in CONFIGS if any(r["config"] == c for r in rows)]:
        row = {"config": config, "reference": reference_of(config)}
        for mode in modes:
            mine, ar = cell(rows, config, mode), cell(rows, "ar", mode)
            if mine:
                row[f"{mode} tok/s"] = mine["tok_s"]
                row[f"{mode} vs ar"] = mine["tok_s"] / ar["tok_s"] if ar else None
                row[f"{mode} same"] = mine["same"]
                row[mode] = mine
        errors = [r["error"] for r in rows if r["config"] == config and r.get("error")]
        row["note"] = errors[0][:70] if errors else ""
        table.append(row)
    return table


def target_lines(table: list[dict], modes: list[str]) -> list[str]:
    """Issue 48's ratios on these configurations, per mode, as a markdown table (those measured)."""
    by_config = {r["config"]: r for r in table}
    lines = []
    for mode in modes:
        for config, factor, peers in TARGETS:
            mine = by_config.get(config, {}).get(mode)
            rates = {p: by_config[p][mode]["tok_s"] for p in peers if mode in by_config.get(p, {})}
            if not mine or not rates:
                continue
            best = max(rates, key=rates.get)
            ratio = mine["tok_s"] / rates[best]
            lines.append(f"| {mode} | {config} vs {best} | {ratio:.2f} | >= {factor:.1f} | "
                         f"{'yes' if ratio >= factor else 'NO'} |")
    if not lines:
        return []
    return ["| mode | ratio | measured | needed | met |", "|---|---|---:|---:|---|", *lines]


def plot(table: list[dict], modes: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = {"specops": "tab:blue", "specops int8": "tab:cyan", "transformers": "tab:orange",
                "llama.cpp F32": "tab:red", "llama.cpp Q8_0": "tab:pink"}
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in table if mode in r]
        for i, r in enumerate(rows):
            c = r[mode]
            ax.bar(i, c["tok_s"], color=families[family(r["config"])])
            ax.errorbar(i, c["tok_s"], yerr=[[c["tok_s"] - c["min"]], [c["max"] - c["tok_s"]]], color="black",
                        capsize=3, lw=0.8)
            ax.text(i, c["max"], f"{c['tok_s']:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["config"] for r in rows], rotation=60, ha="right", fontsize=8)
        ax.set_title(mode, fontsize=10)
        ax.set_ylabel("tokens/s (median over rounds; whiskers: min-max)", fontsize=8)
    shown = [f for f in families if any(family(r["config"]) == f and set(modes) & set(r) for r in table)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=families[f]) for f in shown]
    fig.legend(handles, shown, loc="lower center", ncol=len(shown), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def family(config: str) -> str:
    if config in HF:
        return "transformers"
    if config in LLAMA:
        return "llama.cpp F32" if LLAMA[config][0] == "f32" else "llama.cpp Q8_0"
    return "specops int8" if config in INT8 else "specops"


def report(rows: list[dict], info: dict[str, str], modes: list[str], plot_path: str | None) -> None:
    """The summary table, the bandwidth note, issue 48's ratios and the plot of a run's rows."""
    first = next((r for r in rows if r.get("prompts")), {})
    header = (f"{info['machine']}, {info['cpu_cores']} cores, torch {info['torch']}, transformers "
              f"{info['transformers']}; HumanEval x{first.get('prompts', '?')}, greedy, "
              f"{first.get('new_tokens', '?')} new tokens; {len({r['round'] for r in rows})} rounds; "
              f"{info['timestamp']}")
    print(header)
    notes = bandwidth_notes(info)
    print("\n".join(notes))
    table = summarize(rows, modes)
    notes_column = ["note"] if any(r["note"] for r in table) else []
    columns = ["config", *[f"{m} {c}" for m in modes for c in ("tok/s", "vs ar")],
               *[f"{m} same" for m in modes], "reference", *notes_column]
    print(markdown_table(table, columns))
    targets = target_lines(table, modes)
    if targets:
        print("\nIssue 48's targets:\n" + "\n".join(targets))
    if plot_path:
        title = (f"Gemma-3-270M, HumanEval x{first.get('prompts', '?')}, greedy, "
                 f"{first.get('new_tokens', '?')} new tokens, 2 threads "
                 f"({info['machine']}, {info['cpu_cores']} cores)\n{notes[0]}")
        plot(table, modes, Path(plot_path), title)


def bandwidth_notes(info: dict[str, str]) -> list[str]:
    """The bandwidth line, and a warning per measure that moved by more than _MOVED during the run."""
    notes = [(f"streaming bandwidth {info['copy_gbs_start']} -> {info['copy_gbs_end']} GB/s (copy), "
              f"{info['read_gbs_start']} -> {info['read_gbs_end']} GB/s (read), start -> end of the run")]
    for kind in ("copy", "read"):
        start, end = info[f"{kind}_gbs_start"], info[f"{kind}_gbs_end"]
        if start and end and abs(float(end) - float(start)) > _MOVED * float(start):
            notes.append(f"WARNING: the {kind} bandwidth moved by more than {_MOVED:.0%} during the run "
                         f"({start} -> {end} GB/s): the configurations did not all see the same machine")
    return notes


def measure_run(args) -> None:
    """The run: bandwidth, the rounds, bandwidth again; then the CSV and the report."""
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {','.join(CONFIGS)}")
    # the workers' results and logs, under bench/results (ignored by git: beside a CSV in docs/ they were
    # committed with it twice)
    out = BENCH / "results" / Path(args.csv).stem
    out.mkdir(parents=True, exist_ok=True)
    before = bandwidth()
    print(f"streaming bandwidth at the start: {before['copy']:.1f} GB/s copy, {before['read']:.1f} GB/s read",
          file=sys.stderr, flush=True)
    rows = run_rounds(args, configs, out)
    after = bandwidth()
    print(f"streaming bandwidth at the end: {after['copy']:.1f} GB/s copy, {after['read']:.1f} GB/s read",
          file=sys.stderr, flush=True)
    agreement(rows)
    for r in rows:
        r.update(prompts=args.prompts, new_tokens=args.new_tokens)
    info = {**machine_info("cpu"), "transformers": importlib.metadata.version("transformers"),
            **{f"{k}_gbs_start": f"{v:.1f}" for k, v in before.items()},
            **{f"{k}_gbs_end": f"{v:.1f}" for k, v in after.items()},
            "gguf": args.gguf, "gguf_q8": args.gguf_q8, "llama_server": llama_server(args)}
    write_csv(Path(args.csv), rows, info)
    print(f"CSV: {args.csv}", file=sys.stderr)
    report(rows, info, args.modes.split(","), args.plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="number of HumanEval prompts")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: alone, together8")
    parser.add_argument("--gguf", default=os.environ.get("GEMMA_F32_GGUF", ""),
                        help="Gemma-3-270M as an F32 GGUF (llama.cpp's convert_hf_to_gguf.py)")
    parser.add_argument("--gguf-q8", default=os.environ.get("GEMMA_Q8_GGUF", ""),
                        help="Gemma-3-270M as a Q8_0 GGUF (llama.cpp's llama-quantize)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""),
                        help="llama-server (default: $LLAMA_SERVER, else bench/_llama_server.py's)")
    parser.add_argument("--csv", default=str(BENCH / "results" / "peers_cpu.csv"))
    parser.add_argument("--plot", default=None, help="a PNG: tokens/s per configuration, a panel per mode")
    parser.add_argument("--summarize", default=None, metavar="CSV",
                        help="print the table (and --plot) of an earlier run's CSV, without running")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: choose from {','.join(MODES)}")
    if args.worker:
        worker(args.worker, args)
    elif args.summarize:
        rows, info = read_csv(Path(args.summarize))
        modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
        report(rows, info, modes, args.plot)
    else:
        measure_run(args)


if __name__ == "__main__":
    main()
