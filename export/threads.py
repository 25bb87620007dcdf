"""How many threads the PyTorch reference pass should use: the cores idle right now, at least one.

PyTorch's intra-op threads meet at a barrier after every operator. On a machine where other processes keep
the cores busy, a descheduled thread stalls the whole pass: the digits reference took 32 s with 2 threads
and 0.8 s with 1 at a load average of 10 on 2 cores (DeiT-small: 65 s against 24 s). So the CLI samples how
idle the CPUs are just before it starts and uses that many threads; `--threads` overrides.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SAMPLE_SECONDS = 0.3


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies over all CPUs, or None where /proc/stat is not there."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user..steal


def idle_cores(sample_seconds: float = SAMPLE_SECONDS) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    first = _cpu_times()
    if first is None:
        return cores
    time.sleep(sample_seconds)
    second = _cpu_times()
    if second is None or second[1] == first[1]:
        return cores
    idle_fraction = (second[0] - first[0]) / (second[1] - first[1])
    machine_cores = os.cpu_count() or cores
    return max(1, min(cores, round(idle_fraction * machine_cores)))
