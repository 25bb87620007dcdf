"""A sweep over concurrencies or rates, and what it shows: the saturation knee and the goodput under an SLO.

Definitions (docs/LOADTEST.md explains them with examples). Between sweep points k and k+1, with load x
(concurrency or offered rate), throughput T (successful responses/s), median latency L and error fraction E:

* load step         r = x[k+1] / x[k] - 1
* scaling           s = (T[k+1] / T[k] - 1) / r    1: throughput grew as much as the load, 0: not at all
* latency growth    g = (L[k+1] / L[k] - 1) / r    0: latency flat; 1: it absorbed the whole step

Point k is the knee (the highest load before saturation) at the first step that is saturated in one of
two ways:

1. by throughput: s < 0.10 and (g >= 0.5 or E[k+1] > 1%), and no later point has more than 10% more
   throughput than T[k]. Throughput stopped following the load while latency (or errors, for a server that
   sheds load with 429s) took it up: the closed-loop signature, where Little's law turns lost scaling into
   latency. The look-ahead matters for batching servers, whose throughput can stall at a low concurrency
   and grow again once batches fill.
2. by latency: g > 2, the median latency grew more than twice as fast as the load: the open-loop
   signature, where the server still keeps up with the arrivals on average over a short run while its
   queue, and the latency, explode.

The median is used because it is stable over a short run; the p99 of a few thousand requests is not.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.loadtest.config import ConfigError, LoadConfig
from benchmarks.loadtest.progress import Progress
from benchmarks.loadtest.runner import run_async, run_coroutine
from benchmarks.loadtest.stats import Result

MAX_ERRORS = 0.01
SCALING_BELOW = 0.10
PLATEAU_GAIN = 0.10  # a later point with more than this much extra throughput: not saturated yet
LATENCY_GROWTH_ABOVE = 2.0


@dataclass
class Knee:
    index: int | None
    reason: str
    steps: list[dict[str, Any]] = field(default_factory=list)


def find_knee(loads: Sequence[float], throughputs: Sequence[float], latencies: Sequence[float | None],
              error_fractions: Sequence[float], scaling_below: float = SCALING_BELOW,
              latency_growth_above: float = LATENCY_GROWTH_ABOVE) -> Knee:
    """`latencies`: the median latency of each point (None where nothing succeeded)."""
    steps: list[dict[str, Any]] = []
    knee: int | None = None
    for k in range(len(loads) - 1):
        r = loads[k + 1] / loads[k] - 1
        t0, t1 = throughputs[k], throughputs[k + 1]
        l0 = latencies[k] if latencies[k] is not None else math.inf
        l1 = latencies[k + 1] if latencies[k + 1] is not None else math.inf
        s = (t1 / t0 - 1) / r if t0 > 0 else None
        if 0 < l0 < math.inf:
            g: float | None = math.inf if l1 == math.inf else (l1 / l0 - 1) / r
        else:
            g = None
        errors = error_fractions[k + 1]
        plateau = max(throughputs[k + 1:]) <= (1 + PLATEAU_GAIN) * t0
        by_throughput = (s is not None and s < scaling_below and plateau
                         and ((g is not None and g >= 0.5) or errors > MAX_ERRORS))
        by_latency = g is not None and g > latency_growth_above
        steps.append({"from": loads[k], "to": loads[k + 1], "scaling": None if s is None else round(s, 4),
                      "latency_growth": None if g is None or math.isinf(g) else round(g, 4),
                      "errors_next": round(errors, 6), "saturated": by_throughput or by_latency})
        if knee is None and (by_throughput or by_latency):
            knee = k
    if knee is not None:
        st = steps[knee]
        parts = [f"throughput scaled by {st['scaling']:.2f}" if st["scaling"] is not None else "",
                 f"median latency grew by {st['latency_growth']:.2f}" if st["latency_growth"] is not None else
                 "nothing succeeded at the next point"]
        why = f"from {st['from']:g} to {st['to']:g}, " + " and ".join(p for p in parts if p) + " of the load step"
        if st["errors_next"] > MAX_ERRORS:
            why += f", and {100 * st['errors_next']:.1f}% of requests failed"
        return Knee(knee, why, steps)
    if len(loads) < 2:
        return Knee(None, "one point: no knee to find", steps)
    if throughputs[0] <= 0:
        return Knee(None, "no successful requests at the first point", steps)
    last = steps[-1]
    gained = "" if last["scaling"] is None else f" (its throughput still scaled by {last['scaling']:.2f} of the step)"
    return Knee(None, f"no saturated step up to {last['to']:g}{gained}: extend the sweep", steps)


@dataclass
class SweepResult:
    mode: str
    points: list[Result]
    knee: Knee
    slo_ms: float | None = None
    best_goodput: int | None = None  # index of the point with the highest goodput
    max_load_meeting_slo: int | None = None  # index of the highest load whose SLO was met

    def to_dict(self) -> dict[str, Any]:
        knee_point = self.points[self.knee.index] if self.knee.index is not None else None
        best = self.points[self.best_goodput] if self.best_goodput is not None else None
        meet = self.points[self.max_load_meeting_slo] if self.max_load_meeting_slo is not None else None
        return {
            "mode": self.mode,
            "loads": [p.load for p in self.points],
            "knee": None if knee_point is None else {"load": knee_point.load,
                                                     "throughput_rps": knee_point.throughput_rps,
                                                     "p99_ms": (knee_point.latency_ms or {}).get("p99")},
            "knee_reason": self.knee.reason,
            "steps": self.knee.steps,
            "slo_ms": self.slo_ms,
            "best_goodput": None if best is None else {"load": best.load, "goodput_rps": best.goodput_rps},
            "max_load_meeting_slo": None if meet is None else {"load": meet.load, "goodput_rps": meet.goodput_rps,
                                                               "throughput_rps": meet.throughput_rps},
        }


def analyse(points: list[Result], scaling_below: float = SCALING_BELOW,
            latency_growth_above: float = LATENCY_GROWTH_ABOVE, slo_ms: float | None = None) -> SweepResult:
    knee = find_knee([p.load for p in points], [p.throughput_rps for p in points],
                     [(p.latency_ms or {}).get("p50") for p in points], [p.error_fraction for p in points],
                     scaling_below, latency_growth_above)
    out = SweepResult(points[0].mode if points else "closed", points, knee, slo_ms)
    with_goodput = [i for i, p in enumerate(points) if p.goodput_rps is not None]
    if with_goodput:
        out.best_goodput = max(with_goodput, key=lambda i: points[i].goodput_rps or 0.0)
        met = [i for i in with_goodput if points[i].slo_met]
        out.max_load_meeting_slo = max(met, key=lambda i: points[i].load) if met else None
    return out


def sweep_configs(base: LoadConfig, values: Sequence[float], kind: str) -> list[LoadConfig]:
    if not values:
        raise ConfigError("a sweep needs at least one value")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ConfigError(f"sweep values must be strictly increasing, got {','.join(f'{v:g}' for v in values)}")
    if kind == "concurrency":
        return [replace(base, concurrency=int(v), rate=None).validate() for v in values]
    return [replace(base, rate=float(v), concurrency=None).validate() for v in values]


async def run_sweep_async(configs: list[LoadConfig], progress: Progress | None = None, **knee: float) -> SweepResult:
    points = [await run_async(cfg, progress) for cfg in configs]
    return analyse(points, slo_ms=configs[0].slo_ms, **knee)


def run_sweep(base: LoadConfig, values: Sequence[float], kind: str = "concurrency",
              progress: Progress | None = None, **knee: float) -> SweepResult:
    """Run `base` once per value (kind "concurrency" or "rate"), in order, and analyse the curve. `knee` may
    set scaling_below and latency_growth_above (see find_knee)."""
    return run_coroutine(run_sweep_async(sweep_configs(base, values, kind), progress, **knee), base.event_loop)
