"""Prometheus text format: parse a /metrics page and diff two of them, for any metric names.

The server's metric names are not fixed, so nothing here knows them: every counter, histogram and summary
family is reported as its change over the run (counts, sums, means, and quantiles estimated from histogram
buckets the way PromQL's histogram_quantile does), and every gauge that moved as before/after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_gcount", "_gsum")


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


def parse_metrics(text: str) -> Snapshot:
    """A /metrics page (Prometheus text format), parsed by prometheus_client. Lines it rejects are left out
    instead of failing the page: this is reporting, not validation."""
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:  # the parser raises ValueError, and on some garbage IndexError/KeyError
        families = list(text_string_to_metric_families(_parsable(text)))
    snap = Snapshot()
    for family in families:
        if family.type != "unknown":  # undeclared (or untyped) families are typed by their suffix in the diff
            snap.types[family.name] = family.type
        for sample in family.samples:
            snap.samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return snap


def _parsable(text: str) -> str:
    good = []
    for line in text.splitlines():
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception:
            continue
        good.append(line)
    return "\n".join(good) + "\n"


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name` whose labels include `labels`, from a /metrics page; KeyError if there
    is none or more than one."""
    found = [value for (sample, have), value in parse_metrics(text).samples.items()
             if sample == name and labels.items() <= dict(have).items()]
    if len(found) != 1:
        raise KeyError(f"{len(found)} samples {name}{labels} on the page")
    return found[0]


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
