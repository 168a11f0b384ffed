"""CPU time of the whole machine, for telling how busy other processes keep it (the command line's
`--threads auto`, the benchmarks' `others` column)."""

from __future__ import annotations

import os

__all__ = ["busy_seconds"]


def busy_seconds() -> float:
    """Seconds every core of the machine has spent busy since boot (Linux /proc/stat: all but idle and
    iowait). Raises OSError where /proc/stat is absent."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
