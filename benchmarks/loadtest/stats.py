"""Aggregate requests into a `Result`: HdrHistograms of latencies, outcome counts, goodput, token rates."""

from __future__ import annotations

import statistics
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from benchmarks.loadtest.client import ERROR_CLASSES, Sample
from benchmarks.loadtest.config import LoadConfig
from benchmarks.loadtest.servertiming import parse_server_timing

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated as numpy's default; nan for no values.
    (The run's own latencies use the HDR histograms below; this is for short lists: progress, benchmarks.)"""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def pct_key(p: float) -> str:
    return f"p{p:g}"


class Hist:
    """Durations, summarised by an HdrHistogram in microseconds from 1 us to 1 h at 3 significant digits (0.1%
    value error at any percentile).

    While a run goes, `record` only appends the value to an array (8 bytes each: about 40 MB per million
    requests): the hdrh package records in pure Python (~2 us a value), which would take CPU from sending.
    The histogram is filled on first read. Mean and stdev come from the exact values."""

    HIGH_US = 3_600_000_000

    def __init__(self) -> None:
        self.values = array("d")
        self._h: HdrHistogram | None = None
        self._recorded = 0

    def record(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def h(self) -> HdrHistogram:
        if self._h is None:
            self._h = HdrHistogram(1, self.HIGH_US, 3)
        if self._recorded < len(self.values):
            record, high = self._h.record_value, self.HIGH_US
            for v in self.values[self._recorded:]:
                record(min(max(int(v * 1e6 + 0.5), 1), high))
            self._recorded = len(self.values)
        return self._h

    @property
    def count(self) -> int:
        return len(self.values)

    def value_ms(self, percentile: float) -> float:
        return self.h.get_value_at_percentile(percentile) / 1000

    def count_above_ms(self, ms: float) -> int:
        """Values above `ms`, exactly."""
        return int((np.frombuffer(self.values, dtype=np.float64) > ms / 1000).sum()) if self.values else 0

    def summary_ms(self) -> dict[str, float] | None:
        if not self.values:
            return None
        exact = np.frombuffer(self.values, dtype=np.float64)
        h = self.h
        out = {"count": self.count, "min": h.get_min_value() / 1000, "mean": float(exact.mean()) * 1000,
               "stdev": float(exact.std()) * 1000}
        values = h.get_percentile_to_value_dict(list(PERCENTILES))
        out.update({pct_key(p): values[p] / 1000 for p in PERCENTILES})
        out["max"] = h.get_max_value() / 1000
        return {k: (v if k == "count" else round(v, 3)) for k, v in out.items()}

    def buckets_ms(self) -> list[tuple[float, int]]:
        """(value ms, count) for every recorded value bucket, for plotting."""
        return [(it.value_iterated_to / 1000, it.count_added_in_this_iter_step)
                for it in self.h.get_recorded_iterator()]

    def encode(self) -> str:
        """The standard compressed HdrHistogram string: decode it with any HdrHistogram library to re-slice."""
        return self.h.encode().decode() if self.values else ""


@dataclass
class Result:
    config: dict[str, Any]
    mode: str  # "closed" (concurrency) or "open" (rate)
    load: float  # the concurrency, or the offered rate in requests/s
    started_at: str
    elapsed_s: float  # measurement window: first send to last response
    sent: int
    ok: int
    errors: dict[str, int]
    status_codes: dict[str, int]
    throughput_rps: float  # successful responses per second
    send_rate_rps: float  # requests sent per second (open loop: should equal the offered rate)
    latency_ms: dict[str, float] | None  # successful requests; open loop: from the scheduled send time
    service_time_ms: dict[str, float] | None  # from the actual send (differs from latency when sends lag)
    send_lag_ms: dict[str, float] | None  # actual send - scheduled send (generator or in-flight-cap delay)
    server_timing_ms: dict[str, dict[str, float]]
    goodput_rps: float | None = None
    good_fraction: float | None = None  # good / sent
    slo_met: bool | None = None  # at least 99% of sent requests were good
    generation: dict[str, Any] | None = None
    metrics_delta: dict[str, Any] | None = None
    metrics_note: str | None = None
    generator: dict[str, Any] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    histogram: str = ""
    hist: Hist | None = field(default=None, repr=False)
    samples: list[Sample] = field(default_factory=list, repr=False)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_fraction(self) -> float:
        return self.error_count / self.sent if self.sent else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("hist", "samples")}
        d["error_fraction"] = round(self.error_fraction, 6)
        return d


class Recorder:
    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.latency, self.service, self.send_lag = Hist(), Hist(), Hist()
        self.server: dict[str, Hist] = {}
        self.timing_headers: list[str] = []  # parsed in result(), off the hot path
        self.ttft, self.itl, self.tpot = Hist(), Hist(), Hist()
        self.stream_rates: list[float] = []
        self.outcomes: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.good = 0
        self.output_tokens = self.prompt_tokens = 0
        self.first_sent: float | None = None
        self.last_sent: float | None = None
        self.last_done: float | None = None
        self.samples: list[Sample] = []
        self.slo_s = None if cfg.slo_ms is None else cfg.slo_ms / 1000
        self.slo_ttft_s = None if cfg.slo_ttft_ms is None else cfg.slo_ttft_ms / 1000

    def add(self, s: Sample) -> None:
        if self.cfg.keep_samples:
            self.samples.append(s)
        self.outcomes[s.outcome] += 1
        if s.status:
            self.statuses[str(s.status)] += 1
        if s.error and s.outcome not in self.examples:
            self.examples[s.outcome] = s.error
        self.first_sent = s.sent if self.first_sent is None else min(self.first_sent, s.sent)
        self.last_sent = s.sent if self.last_sent is None else max(self.last_sent, s.sent)
        self.last_done = s.done if self.last_done is None else max(self.last_done, s.done)
        self.send_lag.record(max(s.sent - s.scheduled, 0.0))
        if s.outcome != "ok":
            return
        latency = s.latency
        self.latency.record(latency)
        self.service.record(s.service_time)
        if s.timing_header is not None:
            self.timing_headers.append(s.timing_header)
        self.output_tokens += s.output_tokens
        self.prompt_tokens += s.prompt_tokens
        if s.ttft is not None:
            self.ttft.record(s.ttft)
        for gap in s.itls or ():
            self.itl.record(gap)
        if s.tpot is not None and s.tpot > 0:
            self.tpot.record(s.tpot)
            self.stream_rates.append(1.0 / s.tpot)
        if (self.slo_s is None or latency <= self.slo_s) and (
                self.slo_ttft_s is None or (s.ttft is not None and s.ttft <= self.slo_ttft_s)):
            self.good += 1

    def add_all(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.add(s)

    def _parse_timings(self) -> None:
        for header in self.timing_headers:
            for name, ms in parse_server_timing(header).items():
                hist = self.server.get(name)
                if hist is None:
                    hist = self.server[name] = Hist()
                hist.record(ms / 1000)
        self.timing_headers = []

    def result(self, start: float, started_at: str, generator: dict[str, Any]) -> Result:
        cfg = self.cfg
        self._parse_timings()
        sent = sum(self.outcomes.values())
        ok = self.outcomes["ok"]
        end = self.last_done if self.last_done is not None else start
        elapsed = max(end - start, 1e-9)
        send_span = (self.last_sent - start) if self.last_sent is not None else 0.0
        res = Result(
            config=cfg.to_dict(), mode=cfg.mode, load=cfg.load, started_at=started_at, elapsed_s=round(elapsed, 6),
            sent=sent, ok=ok, errors={c: self.outcomes[c] for c in ERROR_CLASSES},
            status_codes=dict(sorted(self.statuses.items())),
            throughput_rps=round(ok / elapsed, 3),
            # sends span n-1 gaps; dividing by that span gives the rate they were actually issued at
            send_rate_rps=round((sent - 1) / send_span, 3) if sent > 1 and send_span > 0 else 0.0,
            latency_ms=self.latency.summary_ms(),
            service_time_ms=self.service.summary_ms(),
            send_lag_ms=self.send_lag.summary_ms(),
            server_timing_ms={k: v.summary_ms() for k, v in sorted(self.server.items()) if v.count},  # type: ignore[misc]
            generator=generator, error_examples=dict(self.examples),
            histogram=self.latency.encode(), hist=self.latency, samples=self.samples,
        )
        if cfg.slo_ms is not None or cfg.slo_ttft_ms is not None:
            res.goodput_rps = round(self.good / elapsed, 3)
            res.good_fraction = round(self.good / sent, 6) if sent else 0.0
            res.slo_met = bool(sent) and self.good >= 0.99 * sent
        if cfg.workload in ("generate", "chat"):
            rates = self.stream_rates
            res.generation = {
                "streaming": cfg.stream,
                "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens,
                "output_tokens_per_s": round(self.output_tokens / elapsed, 3),
                "ttft_ms": self.ttft.summary_ms(),
                "itl_ms": self.itl.summary_ms(),
                "tpot_ms": self.tpot.summary_ms(),
                "stream_tokens_per_s": None if not rates else {
                    "mean": round(statistics.fmean(rates), 3), "p50": round(statistics.median(rates), 3),
                    "min": round(min(rates), 3)},
            }
        return res
