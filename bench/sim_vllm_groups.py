"""specops.vllm.NgramProposer's choices for requests decoded together, replayed without vLLM and
without noise.

    python bench/sim_vllm_groups.py [--workloads refine,again,unrelated] [--policies plain,auto,8,4]
                                    [--cost 62,2.75,3.45] [--seeds 8] [--jitter 0.05]
                                    [--csv PATH] [--verbose]

Greedy outputs do not depend on the drafts, so a batch of requests decoded together can be replayed: the
target's greedy tokens are fixed once (specops.decode's `ar`, Gemma-3-270M, 96 new tokens, 8 HumanEval prompts
together, the prompts and workloads of bench_memory.py), and vLLM's side of the loop is reduced to what the
proposer sees. Each step every running request's row holds its prompt and the tokens emitted so far; the
proposer drafts; a draft is accepted up to its first token that differs from the fixed output, and the request
emits the accepted tokens plus one (vLLM's rejection sampler, greedy); the step then takes a modelled time,
a + b * requests + c * draft tokens ms, and the proposer reads that clock where it reads the wall clock. A
request leaves when its output is all emitted. Same inputs, same choices, where vLLM runs of the same cell
scatter by 5-20 % (docs/vllm.md). But a choice that changes one step sends the rest of the batch down another
path, so one replay of a policy is one sample of it: with --seeds N each step's modelled time is jittered by a
seeded draw (--jitter, relative), the N replays of every cell see the same draws, and the report gives their
median, least and most.

Workloads: refine (8 prompts, then 8 requests quoting their outputs: the second batch is timed), again (8
prompts twice: the second time is timed), unrelated (8 prompts, nothing before them). Policies: auto
(SPECOPS_DRAFT_LENGTH=auto, the proposer's default) or a fixed draft length (as vLLM's `suffix` drafts up to 8
on every step its match allows). Plain vLLM is the same loop with no drafts. The default cost is what vLLM's
engine took in the calling process on the 2-vCPU Xeon (2026-12-05: a plain step of 8 requests 84 ms, 8 draft
tokens each 305 ms, 2 requests with 8 each 122 ms); the model and the drafts' acceptance are what this replay
measures, not the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _timing import load_prompts, markdown_table, write_csv_columns  # noqa: E402

import bench_memory  # noqa: E402

WORKLOADS = ["refine", "again", "unrelated"]


def fixed_outputs(path: Path) -> dict:
    """workload -> (first batch or None, timed batch), each a list of (prompt ids, greedy output ids);
    computed once with specops.decode (`ar`) and kept in `path`."""
    if path.exists():
        return json.loads(path.read_text())
    import specops

    _, tokenizer = specops.models.load("gemma-3-270m")

    def greedy(prompts: list[str]) -> tuple[list, list[str]]:
        result = specops.decode(prompts, target="gemma-3-270m", method="ar",
                                max_new_tokens=bench_memory.NEW_TOKENS)
        return [(tokenizer(p)["input_ids"], t) for p, t in zip(prompts, result.tokens)], result.text

    out = {}
    prompts = load_prompts(bench_memory.PROMPTS["refine", "together8"], 8)
    first, texts = greedy(prompts)
    out["refine"] = (first, greedy([bench_memory.revision(p, t) for p, t in zip(prompts, texts)])[0])
    again, _ = greedy(load_prompts(bench_memory.PROMPTS["again", "together8"], 8))
    out["again"] = (again, again)
    out["unrelated"] = (None, greedy(load_prompts(bench_memory.PROMPTS["unrelated", "together8"], 8))[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


class Clock:
    """The modelled time, read by the proposer in place of `time.perf_counter`."""

    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.now


def replay(proposer, clock: Clock, batch: list, cost, verbose: bool = False) -> dict:
    """One batch decoded together (module docstring); proposer None: plain decoding."""
    import numpy as np

    running = [{"prompt": list(p), "out": list(o), "emitted": 1, "last": [o[0]]} for p, o in batch]
    start, steps, drafted, accepted = clock.now, 0, 0, 0
    while running:
        width = max(len(r["prompt"]) + len(r["out"]) for r in running)
        tokens = np.zeros((len(running), width), dtype=np.int32)
        lengths = np.zeros(len(running), dtype=np.int32)
        for row, r in enumerate(running):
            context = r["prompt"] + r["out"][:r["emitted"]]
            tokens[row, :len(context)] = context
            lengths[row] = len(context)
        drafts = ([[] for _ in running] if proposer is None
                  else proposer.propose([r["last"] for r in running], lengths, tokens))
        clock.now += cost(len(running), sum(map(len, drafts)))
        steps += 1
        took = []
        for r, draft in zip(running, drafts):
            rest = r["out"][r["emitted"]:]
            n = 0
            while n < len(draft) and n < len(rest) and draft[n] == rest[n]:
                n += 1
            r["last"] = rest[:n + 1]
            r["emitted"] += len(r["last"])
            drafted, accepted = drafted + len(draft), accepted + n
            took.append(n)
        if verbose:
            print(f"  step {steps}: drafts {[len(d) for d in drafts]} accepted {took}")
        running = [r for r in running if r["emitted"] < len(r["out"])]
    return {"seconds": clock.now - start, "steps": steps, "drafted": drafted, "accepted": accepted}


def new_proposer(policy: str):
    """NgramProposer as vLLM builds it for Gemma-3-270M, with SPECOPS_DRAFT_LENGTH=policy while it reads its
    settings (the environment is put back after); None for plain decoding."""
    from specops import models
    from specops.vllm.ngram import NgramProposer

    if policy == "plain":
        return None
    folder = str(models.path("gemma-3-270m"))
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=8),
        model_config=SimpleNamespace(max_model_len=2048, model=folder, tokenizer=folder,
                                     trust_remote_code=False, get_vocab_size=lambda: 262144))
    setting = os.environ.get("SPECOPS_DRAFT_LENGTH")
    os.environ["SPECOPS_DRAFT_LENGTH"] = policy
    try:
        return NgramProposer(config)
    finally:
        os.environ.pop("SPECOPS_DRAFT_LENGTH")
        if setting is not None:
            os.environ["SPECOPS_DRAFT_LENGTH"] = setting


def simulate(outputs: dict, workload: str, policy: str, cost, verbose: bool = False) -> dict:
    import specops.vllm._requests as requests_module

    clock = Clock()
    proposer = new_proposer(policy)
    wall = requests_module.time
    requests_module.time = clock  # the proposer's step times come from the modelled clock
    try:
        first, timed = outputs[workload]
        if first is not None:
            replay(proposer, clock, first, cost)
        result = replay(proposer, clock, timed, cost, verbose)
    finally:
        requests_module.time = wall
    if proposer is not None and not clock.reads:
        raise RuntimeError("the proposer never read the modelled clock: specops.vllm._requests no longer "
                           "times steps through its module's `time`; this replay must follow it")
    tokens = sum(len(o) for _, o in timed)
    return {"workload": workload, "policy": policy, **result, "tokens": tokens,
            "tok_s": tokens / result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default="plain,auto,8,4",
                        help="plain (vLLM without a proposer), auto, or a fixed draft length 1-8")
    parser.add_argument("--cost", default="62,2.75,3.45",
                        help="a,b,c: a step's ms = a + b * requests + c * drafts")
    parser.add_argument("--outputs", default=str(BENCH / "results" / "sim_vllm_groups_outputs.json"),
                        help="where the fixed greedy outputs are kept (computed on the first run)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="replays per cell, each step's modelled time jittered by a seeded draw "
                             "(--jitter)")
    parser.add_argument("--jitter", type=float, default=0.05,
                        help="relative spread (one standard deviation) of a step's time when --seeds > 1")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--verbose", action="store_true",
                        help="every step's draft lengths and accepted tokens")
    args = parser.parse_args()
    a, b, c = (float(x) / 1e3 for x in args.cost.split(","))
    jitter = args.jitter if args.seeds > 1 else 0.0
    outputs = fixed_outputs(Path(args.outputs))
    rows = []
    for workload in args.workloads.split(","):
        for policy in args.policies.split(","):
            runs = []
            for seed in range(args.seeds):
                draw = random.Random(seed)

                def cost(requests: int, drafts: int) -> float:
                    return (a + b * requests + c * drafts) * max(0.5, 1.0 + jitter * draw.gauss(0.0, 1.0))

                runs.append(simulate(outputs, workload, policy, cost, args.verbose))
            row = {"workload": workload, "policy": policy, "seeds": args.seeds,
                   **{key: statistics.median(r[key] for r in runs) for key in ("seconds", "steps", "drafted",
                                                                              "accepted", "tok_s")},
                   "min_s": min(r["seconds"] for r in runs), "max_s": max(r["seconds"] for r in runs)}
            plain = next((r for r in rows if r["workload"] == workload and r["policy"] == "plain"), None)
            row["vs_plain"] = plain["seconds"] / row["seconds"] if plain else None
            rows.append(row)
            print(f"{workload} {policy}: {row['seconds']:.3f} s ({row['min_s']:.3f}-{row['max_s']:.3f}), "
                  f"{row['steps']} steps, {row['drafted']} drafted, {row['accepted']} accepted", flush=True)
    columns = ["workload", "policy", "seeds", "seconds", "min_s", "max_s", "steps", "drafted", "accepted",
               "tok_s", "vs_plain"]
    print(markdown_table(rows, columns))
    if args.csv:
        write_csv_columns(args.csv, rows, columns, {"cost_ms": args.cost, "jitter": jitter})


if __name__ == "__main__":
    main()
