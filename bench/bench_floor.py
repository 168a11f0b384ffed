"""The floor meter: how far a decoding step is from what it must read, for the embedded target and drafter.

    python bench/bench_floor.py [--models gemma-3-270m,smollm2-135m] [--isas native,avx2]
                                [--heads whole,greedy] [--sizes 1,2,4,8,16] [--repeats 15] [--rounds 3]
                                [--context 64] [--csv docs/floor_cpu.csv] [--plot docs/floor_cpu.png]

A step of a float32 model must read every weight once: the floor of a step is those bytes over the machine's
streaming read bandwidth, measured here at the start and at the end of the run (2 threads, the faster of a sum
and a BLAS matrix-vector product over a 512 MiB tensor, the best of five: _timing.read_bandwidth_gbs; the
host's bandwidth can move under a run: the report says so when the two differ by more than 10 %).
Because it moves within minutes (on a 2-vCPU AMD EPYC on 2026-12-05 a one-token step took 24.8 ms in one
run and 37.5 in one two minutes later), every cell also measures it right before and right after its own
steps: `cell ratio` is the step over the floor at the faster of those two, and `vs 1 token` the step over
the one-token chain step of the same process, which no probe enters.
For each model, each step size n (tokens in flight for one request) is timed as a chain (n tokens appended to
a cache of --context tokens of text, HumanEval's first prompts, as a verification of n - 1 drafts) and as a
tree (n nodes: rows of four under the root's last token, as n-gram trees are), through specops' own forward
(the one decoding uses), the median of --repeats steps after a warm-up, then the median over --rounds rounds
that interleave the settings; the ratio to the floor is the figure of merit.

Heads: "whole" computes every logit of every row (what a sampled step needs); "greedy" reads only argmaxes,
as the target of a greedy call does (`CausalLM.argmax_only`): a large float32 head through its int8 screen
(specops/decoding/greedy_head.py) for up to 8 rows (16 where the CPU has VNNI and the screen's rows go in
int8), every row computed (the steps feed text and no `follow`, so this is a verification whose drafts are
all accepted). A greedy step's floor prices the head at its int8 copy's bytes (one int8 weight and one float32
scale a row) where the screen serves it; steps of more rows read the float32 head and keep the float32 floor.

Each instruction-set path runs in a fresh process: "native" is what the CPU has, "avx2" caps the C++ kernels at
their AVX2 copies (SPECOPS_CPU_ISA=avx2), so an AVX-512 machine measures both x86 paths. torch's own kernels
(BLAS, the attention of transformers' layers) do not follow the switch.
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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _timing import load_prompts, machine_info, read_bandwidth_gbs  # noqa: E402

MODELS = ["gemma-3-270m", "smollm2-135m"]
SIZES = [1, 2, 4, 8, 16]
_MOVED = 0.10  # the bandwidth moved when start and end differ by more than this


def weight_bytes(model) -> int:
    """Bytes a step reads: every parameter once (a tied embedding once, as the output layer; the input
    embedding's few looked-up rows are left out where it is untied), and the stored weights, scales and
    minimums of `specops.quantize`'d layers (buffers, not parameters)."""
    from specops.quantization import QuantizedLinear

    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    stored = [t for m in model.modules() if isinstance(m, QuantizedLinear)
              for t in (m.weight, m.scales, m.mins) if t is not None]
    for tensor in [*model.parameters(), *stored]:
        if tensor.data_ptr() in seen or (tensor is embedding and not tied):
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _tree(n: int) -> tuple:
    """n nodes under the root (node 0, at depth 0, the row's last token): rows of four, each hanging from the
    root, so that depth, parents and visibility are those of an n-gram tree of ceil(n / 4) rows."""
    import torch

    nodes = n + 1
    depth = torch.zeros(1, nodes, dtype=torch.long)
    parent = [-1] + [0] * n
    for i in range(1, nodes):
        within = (i - 1) % 4
        parent[i] = 0 if within == 0 else i - 1
        depth[0, i] = depth[0, parent[i]] + 1
    visible = torch.zeros(1, nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            visible[0, i, j] = True
            j = parent[j]
    return depth, visible


def greedy_bytes(model, rows: int) -> int:
    """Bytes a greedy step of `rows` rows must read: weight_bytes, with the output head at its int8 screen's
    bytes where the screen serves that many rows of it (the screen's own rule, and its own copy's bytes)."""
    from specops.decoding import greedy_head
    from specops.quantization import QuantizedLinear

    head = model.get_output_embeddings()
    own = type(head) is QuantizedLinear
    screen = greedy_head._screen(head) if rows <= greedy_head._screen_rows(own) else None
    if screen is None:
        return weight_bytes(model)
    stored = screen.q.numel() * screen.q.element_size() + screen.scales.numel() * screen.scales.element_size()
    return weight_bytes(model) - head.weight.numel() * head.weight.element_size() + stored


def worker(name: str, sizes: list[int], repeats: int, context: int, head: str = "whole") -> list[dict]:
    import torch

    import specops
    from specops import _C
    from specops.decoding.engine import CausalLM, KVState

    torch.set_num_threads(2)
    model, tokenizer = specops.models.load(name)
    lm = CausalLM(model)
    lm.argmax_only = head == "greedy"
    state = KVState(lm, 1)
    # Real text (a greedy head's cost depends on the logits: rows of random tokens have no leading id)
    text = tokenizer("".join(load_prompts(0, 4))).input_ids
    if len(text) < context + max(sizes) + 1:
        raise SystemExit(f"bench_floor: {len(text)} tokens of text, fewer than --context + the largest size "
                         "+ 1")
    with torch.inference_mode():
        state.prefill([text[:context]])
        rows = []
        for kind in ("chain", "tree"):
            for n in sizes:
                if kind == "tree" and n == 1:
                    continue  # one node is the chain of one
                tokens = torch.tensor([text[context:context + (n if kind == "chain" else n + 1)]])

                def step():
                    if kind == "chain":
                        state.append(tokens, keep=n)
                        state.rollback(n, torch.zeros(1, dtype=torch.long))
                    else:
                        depth, visible = _tree(n)
                        state.append_tree(tokens, torch.ones_like(tokens, dtype=torch.bool), depth, visible)
                        state.discard(n + 1)

                for _ in range(3):
                    step()
                bandwidth = read_bandwidth_gbs()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                # the lower of the two floors: never flattered
                bandwidth = max(bandwidth, read_bandwidth_gbs())
                rows.append({"model": name, "isa": _C.cpu_isa(), "head": head, "kind": kind, "tokens": n,
                             "ms": 1e3 * statistics.median(times),
                             "bytes": greedy_bytes(model, n + (kind == "tree")) if head == "greedy" else
                             weight_bytes(model),
                             "cell_gbs": bandwidth,
                             "path": "llama_layers" if lm.llama_forward is not None and lm.llama_forward.fits(n + 1)
                             else "cpu_forward" if lm.cpu_forward is not None else "transformers"})
    one = next((r["ms"] for r in rows if r["kind"] == "chain" and r["tokens"] == 1), None)
    for row in rows:
        row["cell_ratio"] = row["ms"] / (1e3 * row["bytes"] / (row["cell_gbs"] * 1e9))
        row["vs_one"] = row["ms"] / one if one else float("nan")
    return rows


def run(models: list[str], isas: list[str], sizes: list[int], repeats: int, context: int, rounds: int,
        heads: list[str]) -> list[dict]:
    """Every (model, instruction set) in a fresh process, interleaved over `rounds` rounds; each cell's median
    over the rounds (the host's speed drifts within minutes: one pass after another would compare moments)."""
    runs = []
    for round_ in range(rounds):
        runs += _round(models, isas, sizes, repeats, context, round_, heads)
    cells: dict[tuple, list[dict]] = {}
    for row in runs:
        key = (row["setting"], row["head"], row["model"], row["kind"], row["tokens"])
        cells.setdefault(key, []).append(row)
    return [dict(found[0], ms=statistics.median(r["ms"] for r in found),
                 ms_runs=";".join(f"{r['ms']:.1f}" for r in found),
                 **{key: statistics.median(r[key] for r in found)
                    for key in ("cell_gbs", "cell_ratio", "vs_one")})
            for found in cells.values()]


def _round(models: list[str], isas: list[str], sizes: list[int], repeats: int, context: int, round_: int,
           heads: list[str]) -> list[dict]:
    rows = []
    for isa, head in [(isa, head) for isa in isas for head in heads]:
        for name in models:
            env = {k: v for k, v in os.environ.items() if k != "SPECOPS_CPU_ISA"}
            if isa != "native":
                env["SPECOPS_CPU_ISA"] = isa
            command = [sys.executable, __file__, "--worker", name, "--sizes", ",".join(map(str, sizes)),
                       "--repeats", str(repeats), "--context", str(context), "--heads", head]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"bench_floor: {name} ({isa}) failed:\n{done.stderr[-3000:]}")
            rows += [dict(row, setting=isa) for row in json.loads(done.stdout.strip().splitlines()[-1])]
            print(f"round {round_}: {name} ({isa}, {head} head) done", file=sys.stderr, flush=True)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for key in sorted({(r["model"], r["setting"], r["kind"], r["head"]) for r in rows}):
        points = sorted((r["tokens"], r["cell_ratio"]) for r in rows
                        if (r["model"], r["setting"], r["kind"], r["head"]) == key)
        style = "-" if key[1] == "native" else "--"
        if key[3] == "greedy":
            style = ":" if key[1] == "native" else "-."
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o" if key[2] == "chain" else "s",
                  linestyle=style, label=f"{key[0]}, {key[2]}, {key[1]}, {key[3]} head")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(SIZES, [str(s) for s in SIZES])
    axes.set_xlabel("tokens in flight (one request)")
    axes.set_ylabel("step time / floor (weights / bandwidth beside the cell)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--isas", default="native,avx2")
    parser.add_argument("--heads", default="whole,greedy", help="whole, greedy, or both (module docstring)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--csv", default=str(BENCH / "results" / "floor_cpu.csv"))
    parser.add_argument("--plot", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, sizes, args.repeats, args.context, args.heads)))
        return
    before = read_bandwidth_gbs()
    rows = run(args.models.split(","), args.isas.split(","), sizes, args.repeats, args.context, args.rounds,
               args.heads.split(","))
    after = read_bandwidth_gbs()
    info = machine_info("cpu")
    bandwidth = max(before, after)  # the floor at the faster of the two (the lower floor): never flattered
    for row in rows:
        row["floor_ms"] = 1e3 * row["bytes"] / (bandwidth * 1e9)
        row["ratio"] = row["ms"] / row["floor_ms"]
        row.update(bandwidth_start_gbs=round(before, 1), bandwidth_end_gbs=round(after, 1), machine=info["machine"],
                   timestamp=info["timestamp"], torch=info["torch"])
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    moved = abs(after - before) > _MOVED * min(before, after)
    print(f"streaming read bandwidth {before:.1f} GB/s at the start, {after:.1f} at the end"
          + (" (it moved: the floor uses the higher)" if moved else ""))
    if any(r["ratio"] < 1 or r["cell_ratio"] < 1 for r in rows):
        print("some steps ran faster than the floor: this host streams faster than the bandwidth probe reads")
    print("| model | path | ISA | head | kind | tokens | ms | floor ms | ratio | cell GB/s | cell ratio "
          "| vs 1 token |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['path']} | {r['isa']} | {r['head']} | {r['kind']} | {r['tokens']} | "
              f"{r['ms']:.1f} | "
              f"{r['floor_ms']:.1f} | {r['ratio']:.2f} | {r['cell_gbs']:.1f} | {r['cell_ratio']:.2f} | "
              f"{r['vs_one']:.2f} |")
    if args.plot:
        plot(rows, Path(args.plot), f"{info['machine']}, 2 threads, {before:.0f}-{after:.0f} GB/s, {info['timestamp'][:10]}")


if __name__ == "__main__":
    main()
