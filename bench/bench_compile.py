"""What torch.compile gives a decoding step of the embedded target: inductor's CPU code against transformers'
eager forward and against specops' own CPU forward.

    python bench/bench_compile.py [--model gemma-3-270m] [--sizes 1,4,8,16] [--context 64] [--repeats 15]
                                  [--mode default] [--inductor-cache DIR] [--csv PATH]

One request (batch 1, float32, 2 threads, inference mode) holds --context random tokens in its cache; a step
appends n more (a verification of n - 1 drafts) and returns the logits of all n. Three configurations run
the same step on the same tokens:

  eager     transformers' forward with a StaticCache of context + max(sizes) slots, rewound after each step
            (cache.crop(-n): the next step overwrites the same slots, so every step sees --context tokens);
  compiled  torch.compile(model.forward, dynamic=False) on that same cache: shapes are static, so each n is
            compiled once, by its first call (the "compile_s" column: one bucket per size);
  specops   CausalLM / KVState as decoding uses them (append n, roll back n), as bench/bench_floor.py times it.

Within a size the three are interleaved step by step (the host's speed drifts within minutes: one after the
other would compare moments), each the median of --repeats steps after a warm-up. Exactness: the compiled and
the specops logits against eager's on the same inputs, as the largest absolute difference over the largest
absolute eager logit, and whether every row's argmax agrees (eager's own row: its step after the timed ones
against its first, which checks the rewinding). "graphs" and "breaks" count what dynamo built for that size
(more than one graph means the step runs partly eager, between graph breaks).

The floor is what a step must read, every weight once (a tied embedding once), over the machine's streaming
read bandwidth, measured at the start and the end of the run (_timing.read_bandwidth_gbs); the higher of the
two (the lower floor) is used. "others" is how many cores other processes kept busy while a size was timed
(_timing.CpuLoad): on two cores, anything above a few tenths makes the times meaningless. Inductor's on-disk
cache is a fresh temporary folder unless --inductor-cache names one, so the compile times are those of a
first run.
`--model zoo:gemma3` runs a tiny random model from python_tests/arch_zoo.py instead (its 6-token window is
widened to cover the cache, which must be rewindable).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import torch
from _timing import CpuLoad, machine_info, read_bandwidth_gbs
from bench_floor import weight_bytes

CONFIGS = ("eager", "compiled", "specops")
_WARMUP = 2  # untimed steps per configuration after the compiled one's first (compiling) call
_MOVED = 0.10  # the bandwidth moved when start and end differ by more than this


def load_model(name: str):
    """The float32 causal LM named: an embedded model (specops.models.load) or `zoo:<builder>` from
    python_tests/arch_zoo.py (with its sliding window widened to its positions, so a StaticCache can be
    rewound: transformers' static sliding layers cannot be cropped once past their window)."""
    if name.startswith("zoo:"):
        sys.path.insert(0, str(BENCH.parent / "python_tests"))
        import arch_zoo

        model = getattr(arch_zoo, name[4:])()
        if getattr(model.config, "sliding_window", None):
            model.config.sliding_window = arch_zoo.POSITIONS
        return model
    import specops

    model, _ = specops.models.load(name)
    return model


def static_cache(model, prompt: torch.Tensor, slots: int):
    """A transformers StaticCache of `slots` slots holding `prompt` [1, context] (read by eager forward)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=slots)
    model(input_ids=prompt, cache=cache, use_cache=True)
    stuck = [i for i, layer in enumerate(cache.layers) if not getattr(layer, "is_croppable", True)]
    if stuck:
        raise SystemExit(f"bench_compile: the static cache's layers {stuck} cannot be rewound (a sliding window "
                         f"smaller than {slots} slots); use a smaller --context or larger window")
    return cache


def hf_step(forward, cache, tokens: torch.Tensor, context: int):
    """A step of transformers' `forward` (eager or compiled): tokens [1, n] at positions context.., logits
    [n, V]; the cache is rewound by n afterwards, so the next step overwrites the same slots."""
    n = tokens.shape[1]
    positions = torch.arange(context, context + n).unsqueeze(0)

    def step() -> torch.Tensor:
        logits = forward(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True).logits
        cache.crop(-n)
        return logits[0].float()
    return step


def specops_step(state, tokens: torch.Tensor):
    """A step of specops' forward as decoding takes it: append n tokens (logits of all n), roll all back."""
    n = tokens.shape[1]

    def step() -> torch.Tensor:
        logits = state.append(tokens, keep=n)
        state.rollback(n, torch.zeros(1, dtype=torch.long))
        return logits[0]
    return step


def agreement(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, bool]:
    """max |logits - reference| / max |reference|, and whether every row's argmax is the same."""
    diff = (logits.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    same = bool((logits.argmax(-1) == reference.argmax(-1)).all())
    return diff / scale if scale else diff, same


def first_call(step) -> tuple[torch.Tensor, float, int, int]:
    """The compiled step's first call: its logits, its seconds (tracing and compiling included), and the
    graphs and graph breaks dynamo recorded meanwhile."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    start = time.perf_counter()
    logits = step()
    seconds = time.perf_counter() - start
    return (logits, seconds, counters["stats"]["unique_graphs"] - graphs,
            sum(counters["graph_break"].values()) - breaks)


def measure_size(steps: dict, repeats: int) -> dict[str, float]:
    """Each configuration's median step in ms, the configurations interleaved step by step."""
    for _ in range(_WARMUP):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def run(model, sizes: list[int], context: int, repeats: int, mode: str) -> list[dict]:
    """The rows of the table: per size, each configuration's time, compile time and agreement with eager."""
    from specops.decoding.engine import CausalLM, KVState

    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    cache = static_cache(model, prompt, context + max(sizes))
    compiled = torch.compile(model.forward, dynamic=False, mode=mode)
    lm = CausalLM(model)
    state = KVState(lm, 1)
    state.prefill([prompt[0].tolist()])
    path = ("llama_layers" if lm.llama_forward is not None and lm.llama_forward.fits(max(sizes)) else
            "cpu_forward" if lm.cpu_forward is not None else "transformers")
    rows = []
    for n in sizes:
        tokens = torch.randint(0, vocab, (1, n), generator=generator)
        steps = {"eager": hf_step(model.forward, cache, tokens, context),
                 "compiled": hf_step(compiled, cache, tokens, context),
                 "specops": specops_step(state, tokens)}
        print(f"n={n}: compiling ...", file=sys.stderr, flush=True)
        logits, compile_s, graphs, breaks = first_call(steps["compiled"])
        print(f"n={n}: compiled in {compile_s:.1f} s ({graphs} graphs, {breaks} breaks); timing",
              file=sys.stderr, flush=True)
        reference = steps["eager"]()
        found = {"eager": reference, "compiled": logits, "specops": steps["specops"]()}
        load = CpuLoad().start()
        ms = measure_size(steps, repeats)
        others = load.stop()
        found["eager"] = steps["eager"]()  # eager's own row: the rewound cache still gives the first logits
        for name in CONFIGS:
            rel, same = agreement(found[name], reference)
            rows.append({"config": name, "tokens": n, "ms": ms[name], "x_eager": ms[name] / ms["eager"],
                         "compile_s": compile_s if name == "compiled" else None,
                         "graphs": graphs if name == "compiled" else None,
                         "breaks": breaks if name == "compiled" else None,
                         "max_rel_diff": rel, "argmax_equal": same, "others": others,
                         "path": {"eager": "transformers", "compiled": f"inductor ({mode})"}.get(name, path)})
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.1e}" if value < 0.01 and value != 0 else f"{value:.2f}" if value < 10 else f"{value:.1f}"
    return str(value)


def print_report(rows: list[dict], before: float, after: float, floor_ms: float, name: str) -> None:
    moved = abs(after - before) > _MOVED * min(before, after)
    print(f"streaming read bandwidth {before:.1f} GB/s at the start, {after:.1f} at the end"
          + (" (it moved: the floor uses the higher)" if moved else ""))
    print(f"{name}: floor {floor_ms:.3g} ms per step (every weight once / {max(before, after):.1f} GB/s)")
    columns = ["config", "tokens", "ms", "x_eager", "x_floor", "compile_s", "graphs", "breaks",
               "max_rel_diff", "argmax_equal", "others", "path"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" if c in ("config", "path") else "---:" for c in columns) + "|")
    for row in rows:
        print("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    busiest = max(row["others"] for row in rows)
    print(f"other processes kept up to {busiest:.2f} cores busy while a size was timed (column others)"
          + ("  <-- shared machine: the times are not to be trusted" if busiest > 0.3 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="embedded model, or zoo:<arch_zoo builder>")
    parser.add_argument("--sizes", default="1,4,8,16", help="tokens appended per step (one request)")
    parser.add_argument("--context", type=int, default=64, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per configuration and size")
    parser.add_argument("--mode", default="default", help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    parser.add_argument("--inductor-cache", default=None, help="inductor's cache folder (default: a fresh one)")
    parser.add_argument("--csv", default=None, help="write the rows here too")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache or tempfile.mkdtemp(prefix="bench_compile_")
    torch.set_num_threads(2)
    before = read_bandwidth_gbs()
    with torch.inference_mode():
        model = load_model(args.model)
        rows = run(model, sizes, args.context, args.repeats, args.mode)
    after = read_bandwidth_gbs()
    floor_ms = 1e3 * weight_bytes(model) / (max(before, after) * 1e9)
    info = machine_info("cpu")
    for row in rows:
        row.update(model=args.model, context=args.context, x_floor=row["ms"] / floor_ms, floor_ms=floor_ms,
                   bandwidth_start_gbs=round(before, 1), bandwidth_end_gbs=round(after, 1), **info)
    print_report(rows, before, after, floor_ms, args.model)
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
