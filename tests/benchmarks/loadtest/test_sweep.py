"""benchmarks.loadtest's sweep analysis: knee detection, goodput and SLOs over a sweep."""

from __future__ import annotations

import pytest

from benchmarks.loadtest import LoadConfig, find_knee, run
from benchmarks.loadtest.sweep import analyse
from tests.benchmarks.loadtest.fake_server import FakeServer

pytestmark = pytest.mark.timeout(120)


def test_knee_on_synthetic_curves() -> None:
    # closed loop: throughput doubles with concurrency up to ~400/s, then latency absorbs the load (Little's law)
    conc = [1, 2, 4, 8, 16]
    thr = [100, 200, 390, 410, 415]
    p50 = [c / t * 1000 for c, t in zip(conc, thr, strict=True)]  # Little's law
    knee = find_knee(conc, thr, p50, [0.0] * 5)
    assert knee.index == 2 and "scaled" in knee.reason
    assert [st["saturated"] for st in knee.steps] == [False, False, True, True]
    # 4 -> 8 gains 5%, but if 16 then reached 500/s the server was not saturated at 4 yet
    assert find_knee(conc, [100, 200, 390, 410, 500], p50, [0.0] * 5).index is None
    # open loop, coarse rate grid: 40 -> 80 still gains a quarter of the step, but the queue explodes
    assert find_knee([10, 20, 40, 80], [10, 20, 40, 50], [5, 5, 6, 900], [0] * 4).index == 2
    # open loop near capacity: throughput still follows the rate while median latency takes off
    assert find_knee([100, 200, 300, 400, 500], [100, 200, 300, 397, 487], [7, 9, 12.8, 16.7, 89],
                     [0] * 5).index == 3
    # a batching server: throughput stalls from 1 to 2, grows again as batches fill, peaks at 8
    batching = find_knee([1, 2, 4, 8, 16, 32], [420, 455, 624, 768, 676, 662], [2.2, 3.9, 6.1, 9.6, 22.9, 45.3],
                         [0] * 6)
    assert batching.index == 3 and [st["saturated"] for st in batching.steps] == [False, False, False, True, True]
    # fine grid: the knee is the last point that still scaled
    assert find_knee([40, 45, 50, 55, 60], [40, 45, 50, 50.5, 50.6], [5, 5, 6, 300, 900], [0] * 5).index == 2
    # load shedding: 429s instead of latency
    assert find_knee([1, 2, 4], [100, 200, 205], [10, 10, 10.5], [0, 0, 0.3]).index == 1
    # still scaling, and noise in latency alone does not make a knee
    none = find_knee([1, 2, 4, 8], [100, 199, 401, 790], [10, 12, 10, 11], [0] * 4)
    assert none.index is None and "extend the sweep" in none.reason
    assert find_knee([1, 2], [0, 0], [None, None], [1, 1]).index is None


def test_goodput_and_slo_over_a_sweep(fake: tuple[str, FakeServer]) -> None:
    url, _ = fake
    points = [run(LoadConfig(url=url, model="fake", concurrency=c, requests=20, slo_ms=60_000)) for c in (1, 2)]
    points.append(run(LoadConfig(url=url, model="errs", concurrency=4, requests=10, timeout_s=0.5,
                                 slo_ms=60_000)))
    sw = analyse(points)
    assert all(p.goodput_rps is not None for p in points)
    assert points[0].slo_met and points[1].slo_met and not points[2].slo_met  # 80% errors
    assert sw.max_load_meeting_slo == 1
    assert sw.best_goodput in (0, 1)
    assert sw.to_dict()["max_load_meeting_slo"]["load"] == 2
