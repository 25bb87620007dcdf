"""Open-loop send times, fixed before the run: a request's time never depends on how fast earlier ones came back.

That independence is what lets the open loop see a slow server: latency is measured from these times, so a
stall delays (and is charged to) every request scheduled during it, not only the one in flight.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator


def send_offsets(rate: float, poisson: bool = False, seed: int = 0) -> Iterator[float]:
    """Endless send times in seconds from the start: every 1/rate s, or with exponential gaps of mean 1/rate s."""
    if poisson:
        rng = random.Random(seed)
        t = 0.0
        while True:
            yield t
            t += rng.expovariate(rate)
    else:
        for i in itertools.count():
            yield i / rate  # from the index, not a running sum: no drift from rounding


def bounded(offsets: Iterator[float], duration_s: float | None, requests: int | None) -> Iterator[float]:
    """The send times before `duration_s`, at most `requests` of them (whichever ends first)."""
    for i, t in enumerate(offsets):
        if (requests is not None and i >= requests) or (duration_s is not None and t >= duration_s):
            return
        yield t
