"""The n-gram memory's index as it grows: lookups and inserts at 10^5, 10^6 and 10^7 stored tokens.

    python bench/bench_ngram_memory.py [--sizes 100000,1000000,10000000] [--requests 64] [--steps 200]
                                       [--csv PATH] [--plot docs/ngram_memory_cpu.png]

The stored text is real code: the Python standard library's modules, in a fixed shuffled order, encoded by
Gemma-3-270M's tokenizer (262,144 ids), added file by file as finished runs (`NgramMemory.add`, one bulk
insert). Then, as a decoding batch would, `--requests` running requests append 1 to 8 tokens each per step
for `--steps` steps (`NgramMemory.extend`: their followed positions go into the index, which merges levels
as they outgrow each other); their lookups are `--requests` contexts cut from files the memory does not hold,
at random places (the last up-to-256 tokens before a random point), each asking for 8 continuations of 16
tokens among up to 64 occurrences, as `ngram` drafting asks. Reported per size: the bulk insert's seconds,
an insert step's median and largest milliseconds (and per token), a lookup of all the requests' contexts in
milliseconds (median over 30, with 1 and with 2 threads, and with 2 reading 8 occurrences instead of 64), the
mean match length, bytes per stored token after the bulk insert, and the level sizes after the steps. Setup and the random choices stay outside the timed region.
"""

from __future__ import annotations

import argparse
import glob
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from _timing import machine_info, markdown_table, write_csv


def corpus(tokenizer, tokens: int, seed: int = 0) -> list[list[int]]:
    """Token runs of the standard library's modules (shuffled), `tokens` of them at least, then 64 files more
    held out for the queries."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True))
    random.Random(seed).shuffle(files)
    runs, total, held = [], 0, []
    for start in range(0, len(files), 200):
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files[start:start + 200]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            if len(ids) < 2:
                continue
            if total < tokens:
                runs.append(ids)
                total += len(ids)
            elif len(held) < 64:
                held.append(ids)
        if total >= tokens and len(held) >= 64:
            break
    if total < tokens:
        raise SystemExit(f"the standard library holds {total:,} tokens, fewer than {tokens:,}")
    return runs + [held]


def trimmed(runs: list[list[int]], tokens: int) -> list[list[int]]:
    """The first runs holding `tokens` tokens, the last one cut to fit."""
    out, total = [], 0
    for run in runs:
        take = run[:tokens - total]
        if len(take) >= 2:
            out.append(take)
        total += len(take)
        if total >= tokens:
            break
    return out


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(specops, runs: list[list[int]], held: list[list[int]], requests: int, steps: int, vocab: int,
            seed: int) -> dict:
    rng = random.Random(seed)
    memory = specops.NgramMemory(budget_bytes=1 << 34)
    start = time.perf_counter()
    memory.add(runs, vocab_size=vocab)
    bulk = time.perf_counter() - start
    stored = memory.stats()["tokens"]
    per_token = memory.nbytes / stored
    width = 256
    contexts = torch.zeros(requests, width, dtype=torch.int64)
    lengths = torch.zeros(requests, dtype=torch.int64)
    for b in range(requests):
        source = held[b % len(held)]
        end = rng.randint(2, len(source))
        piece = source[max(0, end - width):end]
        contexts[b, :len(piece)] = torch.tensor(piece)
        lengths[b] = len(piece)

    def lookup(occurrences: int = 64):
        return memory.lookup(contexts, lengths, num_candidates=8, width=16, max_occurrences=occurrences)

    handles = memory.open([[]] * requests, [steps * 8 + 1] * requests)
    appended = [[[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(requests)]
                for _ in range(steps)]
    insert_times, inserted = [], 0
    for new in appended:
        start = time.perf_counter()
        memory.extend(handles, new)
        insert_times.append(time.perf_counter() - start)
        inserted += sum(map(len, new))
    threads = torch.get_num_threads()
    try:
        lookups = {}
        for count in (1, 2):
            torch.set_num_threads(count)
            lookup()
            lookups[count] = median_ms(lookup, 30)
        fewer = median_ms(lambda: lookup(8), 30)  # 2 threads, 8 occurrences read: what the 64 reads cost
    finally:
        torch.set_num_threads(threads)
    found = lookup()
    memory.close(handles)
    return {"stored_tokens": stored, "bulk_insert_s": bulk,
            "insert_step_ms": statistics.median(insert_times) * 1e3, "insert_step_max_ms": max(insert_times) * 1e3,
            "insert_us_per_token": sum(insert_times) / inserted * 1e6,
            "lookup_ms_1_thread": lookups[1], "lookup_ms_2_threads": lookups[2], "lookup_ms_8_occurrences": fewer,
            "mean_match": float(found.match.float().mean()), "bytes_per_token": per_token,
            "levels": "/".join(map(str, memory.stats()["levels"]))}


def plot(rows: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["stored_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sizes, [r["lookup_ms_1_thread"] for r in rows], "o-", label="lookup, 64 requests, 1 thread")
    ax.plot(sizes, [r["lookup_ms_2_threads"] for r in rows], "o-", label="lookup, 64 requests, 2 threads")
    ax.plot(sizes, [r["insert_step_ms"] for r in rows], "s--", label="insert step (median), 64 requests")
    ax.plot(sizes, [r["insert_step_max_ms"] for r in rows], "s:", label="insert step (largest)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens stored")
    ax.set_ylabel("milliseconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"n-gram memory index ({machine})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000", help="tokens stored, comma-separated")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", default="gemma-3-270m", help="the model whose tokenizer encodes the text")
    parser.add_argument("--csv", default=str(Path(__file__).parent / "results" / "ngram_memory_cpu.csv"))
    parser.add_argument("--plot", default=None, help="write a PNG of the times against the size")
    args = parser.parse_args()
    import specops
    from transformers import AutoTokenizer

    sizes = [int(v) for v in args.sizes.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(specops.models.path(args.target))
    *runs, held = corpus(tokenizer, max(sizes))
    rows = []
    for size in sizes:
        row = measure(specops, trimmed(runs, size), held, args.requests, args.steps, len(tokenizer), seed=size)
        rows.append(row)
        print(markdown_table([row], list(row)), file=sys.stderr, flush=True)
    info = machine_info("cpu")
    write_csv(args.csv, rows, info)
    print(f"{info['machine']}, {info['cpu_cores']} cores; {args.requests} requests")
    print(markdown_table(rows, list(rows[0])))
    if args.plot:
        plot(rows, Path(args.plot), info["machine"])


if __name__ == "__main__":
    main()
