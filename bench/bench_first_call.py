"""What the first call costs: transformers' `generate()` against `generate(custom_generate=specops.hf.generate)`,
each in a fresh process, so that every probe, path choice and table load specops makes once per model is paid
inside the first call.

    python bench/bench_first_call.py [--rounds 2] [--calls 3] [--new-tokens 48] [--model gemma-3-270m]

Each round starts one process per configuration (plain, then specops; the order alternates between rounds),
which loads the embedded model (float32, 2 threads), left-pads a batch of two Python prompts and calls
`generate()` greedily --calls times, timing each call. The model's loading is not timed. Reported: every
call's seconds, and per configuration the median first call, the median later call, and specops' first call
against plain's (the ratio issue 48 asks to be at least 1.0: plain first / specops first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import machine_info  # noqa: E402

_WORKER = r"""
import json, sys, time
import torch, specops
from transformers import AutoModelForCausalLM, AutoTokenizer
which, calls, new_tokens, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
folder = specops.models.path(name)
model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
tokenizer.padding_side = "left"
inputs = tokenizer(["def fibonacci(n):\n    ", 'def is_prime(n):\n    \"\"\"Return'], return_tensors="pt",
                   padding=True)
kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
if which == "specops":
    kwargs["custom_generate"] = specops.hf.generate
times = []
for _ in range(calls):
    start = time.perf_counter()
    model.generate(**inputs, **kwargs)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--model", default="gemma-3-270m")
    args = parser.parse_args()
    runs: dict[str, list[list[float]]] = {"plain": [], "specops": []}
    for round_ in range(args.rounds):
        order = ["plain", "specops"] if round_ % 2 == 0 else ["specops", "plain"]
        for which in order:
            done = subprocess.run([sys.executable, "-c", _WORKER, which, str(args.calls), str(args.new_tokens), args.model],
                                  capture_output=True, text=True, check=True)
            times = json.loads(done.stdout.strip().splitlines()[-1])
            runs[which].append(times)
            print(f"round {round_ + 1} {which}: " + ", ".join(f"{t:.2f}" for t in times) + " s", flush=True)
    first = {which: statistics.median(times[0] for times in r) for which, r in runs.items()}
    later = {which: statistics.median(t for times in r for t in times[1:]) for which, r in runs.items()}
    print("\n| configuration | first call (s) | later calls (s) |\n| --- | ---: | ---: |")
    for which in runs:
        print(f"| {which} | {first[which]:.2f} | {later[which]:.2f} |")
    print(f"\nspecops' first call against plain's first call: {first['plain'] / first['specops']:.2f}x; "
          f"its first call against its later ones: {first['specops'] / later['specops']:.2f}x")
    import torch

    torch.set_num_threads(2)  # as the workers run
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine_info("cpu").items()))


if __name__ == "__main__":
    main()
