"""The decode loop's hand-off interval (service.engine.text.delivery): auto coalesces wake-ups only where the
model's threads take every core, counted as ONNX Runtime counts them (physical cores, siblings once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.base.config import Settings
from service.engine.text.delivery import (
    CONTENDED_INTERVAL_MS,
    FREE_INTERVAL_MS,
    model_takes_every_core,
    physical_cores,
    stream_interval_s,
    usable_cpus,
)


def _sysfs(tmp: Path, cores: dict[int, tuple[int, int]]) -> Path:
    """A /sys/devices/system/cpu with cpu N on (package, core)."""
    for cpu, (package, core) in cores.items():
        topology = tmp / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return tmp


def test_hyperthread_siblings_count_as_one_core(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0), 5: (1, 0)})
    assert physical_cores({0, 1, 2, 3, 4, 5}, sysfs) == 3
    assert physical_cores({0, 2}, sysfs) == 1  # a cpuset of two siblings: one core
    assert physical_cores({0, 1}, sysfs) == 2


def test_without_a_topology_every_cpu_is_a_core(tmp_path: Path) -> None:
    assert physical_cores({0, 1, 2}, tmp_path) == 3
    assert physical_cores(set(), tmp_path) == 1


@pytest.mark.parametrize(("threads", "cpus", "takes_all"), [
    (0, {0, 1}, True),  # 2 cores, one thread each (the development machine)
    (0, {0, 1, 2, 3}, False),  # 2 cores with siblings: the pool takes 2 of 4 CPUs
    (1, {0, 1}, False),
    (2, {0, 1}, True),
    (4, {0, 1}, True),  # more threads than CPUs
])
def test_auto_coalesces_only_where_the_model_takes_every_cpu(tmp_path: Path, threads: int, cpus: set[int],
                                                            takes_all: bool) -> None:
    sysfs = _sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert model_takes_every_core(threads, cpus, sysfs) is takes_all
    want = CONTENDED_INTERVAL_MS if takes_all else FREE_INTERVAL_MS
    assert stream_interval_s(Settings(intra_op_threads=threads), cpus, sysfs) == want / 1000


def test_a_given_interval_is_kept(tmp_path: Path) -> None:
    for ms in (0.0, 1.0, 35.0):
        assert stream_interval_s(Settings(stream_interval_ms=ms), {0}, tmp_path) == ms / 1000


def test_this_process_has_cpus() -> None:
    assert usable_cpus() and all(isinstance(c, int) for c in usable_cpus())
