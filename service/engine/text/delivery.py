"""How often the decode loop wakes the event loop with its tokens (`--stream-interval-ms`, auto by default).

Every wake-up costs CPU beside the model: the event loop's turn, a socket write per stream, the client's read. On
cores the model's own threads take in full, that CPU is taken from a pool thread, and its partner waits for it
(docs/SERVICE.md, "Threads and spinning"), so the cost counts about twice. There, the loop is woken at most every
CONTENDED_INTERVAL_MS (a 3.4 ms step's tokens then go about six steps to a write: the event loop's CPU a token
0.26 -> 0.11 ms and the client's 0.20 -> 0.08 ms, docs/BENCHMARKS.md); where the model leaves a core free, every
step goes at once (FREE_INTERVAL_MS). Either way each step stays its own stream event, and a sequence's first token
and its end are handed over at once (TextScheduler._hand_off): the interval delays only tokens in mid-stream.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.base.config import Settings

FREE_INTERVAL_MS = 1.0  # a core the model's threads leave free: hand over (nearly) every step
CONTENDED_INTERVAL_MS = 20.0  # the model's threads take every core: 50 wake-ups a second at most
CPU_SYSFS = Path("/sys/devices/system/cpu")


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: a container's or taskset's cpuset)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sysfs: Path = CPU_SYSFS) -> int:
    """Distinct physical cores among `cpus` (hyperthread siblings count once): what ONNX Runtime and PyTorch size
    their pools by when no thread count is given. Without a readable topology, every CPU counts as a core."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def model_takes_every_core(intra_op_threads: int, cpus: set[int], sysfs: Path = CPU_SYSFS) -> bool:
    """Whether a model's operator pool (intra_op_threads, 0: one per physical core) leaves no CPU of `cpus` free."""
    threads = intra_op_threads or physical_cores(cpus, sysfs)
    return threads >= len(cpus)


def stream_interval_s(settings: Settings, cpus: set[int] | None = None, sysfs: Path = CPU_SYSFS) -> float:
    """The decode loop's hand-off interval in seconds: the option's, or auto's choice."""
    if settings.stream_interval_ms is not None:
        return settings.stream_interval_ms / 1000
    contended = model_takes_every_core(settings.intra_op_threads, usable_cpus() if cpus is None else cpus, sysfs)
    return (CONTENDED_INTERVAL_MS if contended else FREE_INTERVAL_MS) / 1000
