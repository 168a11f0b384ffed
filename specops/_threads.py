"""CPU time of the whole machine, for telling how busy other processes keep it (the command line's
`--threads auto`, `decode(threads="auto")`, the benchmarks' `others` column)."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from specops._kept import process_wide

__all__ = ["auto_threads", "busy_seconds", "check_threads", "decoding_threads"]

_DECIDED: list[tuple[float, int]] = []  # (when, threads) of the last "auto" measurement
_LOCK = threading.Lock()
_KEEP = 30.0  # seconds a measurement stands
process_wide("auto threads", "the cores threads='auto' found free, for 30 s after it measured them", _DECIDED.clear)


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


def check_threads(threads) -> None:
    """Raises ValueError unless `threads` is None, "auto" or an int >= 1 (decode's `threads`)."""
    if threads is None or threads == "auto":
        return
    if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        return
    raise ValueError(f"decode: threads must be None, 'auto' or an int >= 1, got {threads!r}")


@contextmanager
def decoding_threads(device, threads=None):
    """torch's CPU threads for the duration of a decode call on the CPU, as the caller asked: None leaves them
    alone, an int sets them, "auto" takes the cores other processes leave (`auto_threads`, a measurement of
    0.1 s that stands for 30 s). Restored afterwards. Nothing changes on another device."""
    import torch

    check_threads(threads)
    if threads is None or getattr(device, "type", str(device)) != "cpu":
        yield
        return
    if threads == "auto":
        now = time.monotonic()
        with _LOCK:
            if not _DECIDED or now - _DECIDED[0][0] > _KEEP:
                _DECIDED[:] = [(now, auto_threads(0.1))]
            threads = _DECIDED[0][1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
