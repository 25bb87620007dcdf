"""benchmarks.loadtest against a small fake server (raw ASGI on uvicorn, in a thread,
tests/benchmarks/loadtest/fake_server.py): bounds and open-loop schedules, and the coordinated omission a closed loop
hides. No assertion depends on how fast this machine is: they count requests."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter

import pytest

from benchmarks.loadtest import LoadConfig, run
from benchmarks.loadtest.schedule import bounded, send_offsets
from tests.benchmarks.loadtest.fake_server import FakeServer

pytestmark = pytest.mark.timeout(120)


def test_closed_loop_count_bound_sends_exactly_n(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, model="fake", concurrency=4, requests=37, warmup_s=0.2))
    assert res.sent == res.ok == 37
    warmup = app.counts["fake"] - 37
    assert warmup >= 1  # the warm-up ran, and was not counted
    app.reset()
    res = run(LoadConfig(url=url, model="fake", concurrency=5, requests=3))
    assert res.sent == 3 and app.counts["fake"] == 3  # fewer requests than workers


def test_open_loop_count_bound_and_infer_workload(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, workload="infer", model="fake", rate=200, requests=25))
    assert res.sent == res.ok == 25 == app.counts["fake"]
    assert res.send_lag_ms is not None and res.service_time_ms is not None


def test_constant_schedule_is_exact() -> None:
    offsets = list(bounded(send_offsets(50.0), duration_s=10.0, requests=None))
    assert len(offsets) == 500
    assert all(math.isclose(t, i / 50.0) for i, t in enumerate(offsets))
    assert len(list(bounded(send_offsets(50.0), duration_s=10.0, requests=7))) == 7


def test_poisson_schedule_has_the_mean_rate_and_exponential_gaps() -> None:
    rate, n = 100.0, 20_000
    offsets = list(bounded(send_offsets(rate, poisson=True, seed=3), None, n))
    assert len(offsets) == n and offsets == sorted(offsets)
    assert (n - 1) / offsets[-1] == pytest.approx(rate, rel=0.03)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # CV of exp = 1
    # counted in fixed windows, arrivals scatter like Poisson counts (variance ~ mean), unlike constant spacing
    windows = Counter(int(t) for t in offsets if t < 150)
    counts = [windows[i] for i in range(150)]
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.35)
    assert list(bounded(send_offsets(rate, True, 3), None, 50)) == offsets[:50]  # seeded: reproducible


def test_open_loop_latency_includes_a_stall_that_closed_loop_hides(fake: tuple[str, FakeServer]) -> None:
    """Coordinated omission. The server pauses ~1 s once. A closed loop (one request at a time) sees one slow
    request; an open loop charges the pause to every request scheduled during it, even when it could not send
    them (in-flight cap 1), because their latency counts from the schedule."""
    url, app = fake
    slow = 0.3  # s: well under the 1 s stall, far above a normal response
    app.reset()
    closed = run(LoadConfig(url=url, model="stall", concurrency=1, requests=120, keep_samples=True))
    closed_slow = sum(s.latency > slow for s in closed.samples)
    app.reset()
    cfg = LoadConfig(url=url, model="stall", rate=50, requests=120, max_in_flight=1, keep_samples=True)
    opened = run(cfg)
    open_slow = sum(s.latency > slow for s in opened.samples)
    open_slow_from_send = sum(s.service_time > slow for s in opened.samples)
    assert closed.ok == opened.ok == 120
    assert closed_slow <= 2
    assert open_slow_from_send <= 2  # measured from the actual send, the stall looks like one slow request...
    assert open_slow >= 15  # ...from the schedule, the ~50 requests due during it were late (~35 by > 0.3 s)
    assert opened.generator["cap_hits"] > 0 and opened.generator["warnings"]
    assert opened.hist is not None and opened.hist.count_above_ms(slow * 1000) >= 15
