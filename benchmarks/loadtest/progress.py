"""Live progress on stderr while a run goes: a tqdm bar on a terminal, a plain line every few seconds in logs."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from benchmarks.loadtest.stats import percentile


@dataclass
class LiveState:
    """Counters the runner updates as requests go and come back (one event loop: no locking needed)."""

    sent: int = 0
    done: int = 0
    ok: int = 0
    errors: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    cap_hits: int = 0
    recent_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))  # latencies of the last requests

    def started(self) -> None:
        self.sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def finished(self, ok: bool, latency_s: float) -> None:
        self.in_flight -= 1
        self.done += 1
        if ok:
            self.ok += 1
            self.recent_ms.append(latency_s * 1000)
        else:
            self.errors += 1


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class Progress:
    """Shows one phase at a time. `total` is seconds (duration bound) or requests (count bound)."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 0.5, log_every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() and _columns(self.stream) > 0  # a 0-column pty would show nothing
        self.interval_s = interval_s if self.tty else log_every_s

    async def watch(self, label: str, state: LiveState, total: float, by_count: bool) -> None:
        """Refresh until cancelled."""
        bar = None
        if self.tty:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=label, unit="req" if by_count else "s", file=self.stream, leave=False,
                       dynamic_ncols=True, bar_format="{percentage:3.0f}%|{bar:20}| {desc}")
        start = time.perf_counter()
        last_done, last_t = 0, start
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                now = time.perf_counter()
                rate = (state.done - last_done) / max(now - last_t, 1e-9)
                last_done, last_t = state.done, now
                recent = list(state.recent_ms)
                text = (f"{now - start:6.1f}s sent {state.sent} ok {state.ok} err {state.errors} "
                        f"in-flight {state.in_flight} | {rate:8.1f} req/s | p50 {percentile(recent, 50):.1f} ms "
                        f"p99 {percentile(recent, 99):.1f} ms")
                if bar is not None:
                    bar.n = min(state.sent if by_count else now - start, total)
                    bar.set_description_str(f"{label} {text}", refresh=True)
                else:
                    print(f"[{label}] {text}", file=self.stream, flush=True)
        finally:
            if bar is not None:
                bar.close()
