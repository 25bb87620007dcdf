"""Prometheus text format: parse a /metrics page and diff two of them, for any metric names.

The server's metric names are not fixed, so nothing here knows them: every counter, histogram and summary
family is reported as its change over the run (counts, sums, means, and quantiles estimated from histogram
buckets the way PromQL's histogram_quantile does), and every gauge that moved as before/after.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_gcount", "_gsum")
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class Snapshot:
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter/gauge/histogram/summary/...

    def family_of(self, sample_name: str) -> tuple[str, str]:
        """(family, suffix) for a sample name: `x_bucket` belongs to histogram `x` when `x` is declared."""
        if sample_name in self.types:
            return sample_name, ""
        for suffix in _SUFFIXES:
            base = sample_name[: -len(suffix)]
            if sample_name.endswith(suffix) and base in self.types:
                return base, suffix
        return sample_name, ""


def _labels(text: str | None) -> Labels:
    if not text:
        return ()
    inner = text[1:-1]
    pairs = [(m.group(1), re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(2)))
             for m in _LABEL.finditer(inner)]
    return tuple(sorted(pairs))


def parse_metrics(text: str) -> Snapshot:
    snap = Snapshot()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                snap.types[parts[2]] = parts[3].strip().lower()
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue  # tolerate what we do not understand: this is reporting, not validation
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        snap.samples[(m.group(1), _labels(m.group(2)))] = value
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile from cumulative (upper bound, count) buckets, interpolating linearly inside a bucket."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the open top bucket: its lower bound is all we know
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _clean(value: float) -> float:
    return round(value, 9)


def diff_metrics(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """Per family: {"type", "series": [...]}; only series that changed. A counter that went down (the server
    restarted) reports its value after, flagged `reset`."""
    grouped: dict[tuple[str, Labels], dict[str, Any]] = {}
    families: dict[str, str] = {}
    for (name, labels), value in after.samples.items():
        family, suffix = after.family_of(name)
        kind = after.types.get(family) or ("counter" if name.endswith(("_total", "_count", "_sum")) else "gauge")
        families[family] = kind
        if suffix in ("_created", "_gcount", "_gsum"):
            continue
        old = before.samples.get((name, labels))
        if kind in ("gauge", "unknown", "untyped", "info", "stateset") and not suffix:
            if old is not None and old != value:
                grouped[(family, labels)] = {"labels": dict(labels), "before": old, "after": value}
            continue
        reset = old is not None and value < old
        delta = value if (old is None or reset) else value - old
        if suffix == "_bucket":
            le = dict(labels).get("le")
            key = (family, tuple(kv for kv in labels if kv[0] != "le"))
            grouped.setdefault(key, {"labels": dict(key[1])}).setdefault("_buckets", []).append(
                (float(le) if le is not None else math.inf, delta))
            continue
        key = (family, labels)
        entry = grouped.setdefault(key, {"labels": dict(labels)})
        field_name = {"_count": "count", "_sum": "sum"}.get(suffix, "delta")
        entry[field_name] = _clean(delta)
        if reset:
            entry["reset"] = True
    out: dict[str, Any] = {}
    for (family, _), entry in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        buckets = entry.pop("_buckets", None)
        count = entry.get("count")
        if count:
            if "sum" in entry:
                entry["mean"] = _clean(entry["sum"] / count)
            if buckets:
                for q in (0.5, 0.9, 0.99):
                    est = histogram_quantile(q, buckets)
                    entry[f"p{round(q * 100)}"] = None if est is None else _clean(est)
        changed = any(entry.get(k) for k in ("count", "sum", "delta")) or "before" in entry
        if changed:
            out.setdefault(family, {"type": families.get(family, "untyped"), "series": []})["series"].append(entry)
    return out
