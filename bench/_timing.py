"""Timing, machine-info, CSV and table helpers shared by the bench/bench_*.py scripts.

Callers build every input (and draw every random number) before timing; the timed callables only
launch the work. Times are medians over many runs after a warm-up.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch


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
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

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
           device: str) -> None:
    """Write the CSV, then print the table, the machine line and how busy other processes kept it."""
    write_csv(csv_path, rows, info)
    print(format_table(rows, columns))
    print()
    print("machine: " + ", ".join(f"{key}={value}" for key, value in info.items()))
    print(f"other processes kept {other_load:.2f} of {info['cpu_cores']} cores busy during the run "
          "(per case: others)"
          + ("  <-- shared machine: CPU times are pessimistic" if other_load > 0.3 else "")
          + ("; --threads 1 avoids waiting on a descheduled worker thread"
             if other_load > 0.3 and device == "cpu" and torch.get_num_threads() > 1 else ""))
