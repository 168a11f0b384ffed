"""CPU time of the whole machine, for telling how busy other processes keep it (the command line's
`--threads auto`, the Python API's thread count, the benchmarks' `others` column)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

__all__ = ["auto_threads", "busy_seconds", "decoding_threads"]

_IMPORT_THREADS: list[int] = []  # torch's thread count when specops was first asked (its default)
_DECIDED: list[tuple[float, int]] = []  # (when, threads) of the last measurement
_KEEP = 30.0  # seconds a measurement stands


def busy_seconds() -> float:
    """Seconds every core of the machine has spent busy since boot (Linux /proc/stat: all but idle and
    iowait). Raises OSError where /proc/stat is absent."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def auto_threads(window: float = 0.25) -> int:
    """The cores torch would use, less those other processes keep busy now (>= 1): /proc/stat's busy time
    minus this process's own over `window` seconds (the load average would count commands that just
    finished). All of them where /proc/stat is absent."""
    import torch

    cores = torch.get_num_threads()
    try:
        start, own, wall = busy_seconds(), time.process_time(), time.perf_counter()
        time.sleep(window)
        others = (busy_seconds() - start - (time.process_time() - own)) / (time.perf_counter() - wall)
    except (OSError, ValueError, IndexError):
        return cores
    return max(1, min(cores, (os.cpu_count() or cores) - round(max(0.0, others))))


@contextmanager
def decoding_threads(device):
    """For the duration of a decode call on the CPU, torch threads as `--threads auto` picks them: the cores
    other processes leave (on a 2-core machine beside a busy process, one thread instead of two that fight
    it for the same cores). Left alone where the user chose: OMP_NUM_THREADS set, or torch.set_num_threads
    called with another count than torch's default. A measurement (0.1 s) stands for 30 s."""
    import torch

    if not _IMPORT_THREADS:
        _IMPORT_THREADS.append(torch.get_num_threads())
    before = torch.get_num_threads()
    if (getattr(device, "type", str(device)) != "cpu" or os.environ.get("OMP_NUM_THREADS")
            or before != _IMPORT_THREADS[0] or before < 2):
        yield
        return
    now = time.monotonic()
    if not _DECIDED or now - _DECIDED[0][0] > _KEEP:
        _DECIDED[:] = [(now, auto_threads(0.1))]
    torch.set_num_threads(_DECIDED[0][1])
    try:
        yield
    finally:
        torch.set_num_threads(before)
