"""One /metrics for the whole deployment: every replica sends its registry's samples to a hub, and any
replica answers GET /metrics with all of them, each series labelled with the `replica` it came from.

Why not sum across replicas: a replica that goes away would make the summed counters go down (Prometheus
would read a reset and `rate()` would spike). Per-replica series behave like per-pod series in Kubernetes:
`sum by (model) (rate(multimax_requests_total[1m]))` is the deployment's rate, and a replaced replica's
series simply end. Nothing here imports Ray: the hub is a plain class that service.edge.ray.app deploys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"
# (sample name, labels, value) of one family; families as (name, type, help, unit, samples)
Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, str, list[Sample]]


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """A registry's current samples in a small picklable form."""
    return [(m.name, m.type, m.documentation, m.unit, [(s.name, dict(s.labels), s.value) for s in m.samples])
            for m in registry.collect()]


@dataclass
class ReplicaReport:
    families: list[Family]
    node: str
    pid: int
    received: float  # time.monotonic() on the hub


class _Merged(Collector):
    def __init__(self, reports: dict[str, ReplicaReport], now: float) -> None:
        self.reports, self.now = reports, now

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        info = Metric("multimax_replica", "Replicas whose metrics this page holds (1 per live replica)", "info")
        age = Metric("multimax_replica_metrics_age_seconds", "Time since the replica last sent its metrics",
                     "gauge")
        for replica, report in sorted(self.reports.items()):
            info.add_sample("multimax_replica_info", {REPLICA_LABEL: replica, "node": report.node,
                                                      "pid": str(report.pid)}, 1.0)
            age.add_sample(age.name, {REPLICA_LABEL: replica}, round(self.now - report.received, 3))
            for name, typ, doc, unit, samples in report.families:
                family = merged.setdefault(name, Metric(name, doc, typ, unit))
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, {**labels, REPLICA_LABEL: replica}, value)
        yield info
        yield age
        yield from merged.values()


class MetricsHub:
    """Latest samples of every replica; a replica silent for `expire_s` (it died) drops out of the page."""

    def __init__(self, expire_s: float = 15.0) -> None:
        self.expire_s = expire_s
        self.reports: dict[str, ReplicaReport] = {}

    def push(self, replica: str, node: str, pid: int, families: list[Family]) -> None:
        self.reports[replica] = ReplicaReport(families, node, pid, time.monotonic())

    def forget(self, replica: str) -> None:
        """A replica that stops on purpose (scale-down, redeploy, shutdown) leaves the page at once."""
        self.reports.pop(replica, None)

    def replicas(self) -> list[str]:
        self._expire()
        return sorted(self.reports)

    def render(self) -> tuple[bytes, str]:
        self._expire()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(dict(self.reports), time.monotonic()))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def _expire(self) -> None:
        now = time.monotonic()
        for replica in [r for r, rep in self.reports.items() if now - rep.received > self.expire_s]:
            del self.reports[replica]
