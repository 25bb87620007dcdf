"""Results as files and text: JSON (everything), CSV (one row per run, perf_analyzer's columns as a guide),
per-request CSV, and the one-screen summary printed at the end."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadtest.client import Sample
from benchmarks.loadtest.stats import PERCENTILES, Result, pct_key
from benchmarks.loadtest.sweep import SweepResult

# Latencies in microseconds, as perf_analyzer writes them. Columns perf_analyzer has keep its names
# (Concurrency, Request Rate, Inferences/Second, Server Queue, Server Compute Infer, pXX latency, Avg latency).
CSV_COLUMNS = (
    "Concurrency", "Request Rate", "Inferences/Second", "Goodput/Second", "Send Rate",
    "Server Queue", "Server Compute Infer", "Server Total", "Network+Client",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency", "p99.9 latency", "Max latency", "Avg latency",
    "Request Count", "Success Count", "Errors 4xx", "Errors 429", "Errors 5xx", "Timeouts", "Connection Errors",
    "Stream Errors", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT Avg", "Output Tokens/Second",
    "Send Lag p99", "Generator CPU %",
)


def _us(summary: dict[str, float] | None, key: str) -> int | str:
    return "" if not summary or summary.get(key) is None else round(summary[key] * 1000)


def csv_row(r: Result) -> dict[str, Any]:
    st = r.server_timing_ms
    total = st.get("total")
    svc = r.service_time_ms
    net = "" if not (total and svc) else round((svc["mean"] - total["mean"]) * 1000)
    gen = r.generation or {}
    return {
        "Concurrency": int(r.load) if r.mode == "closed" else "",
        "Request Rate": r.load if r.mode == "open" else "",
        "Inferences/Second": r.throughput_rps,
        "Goodput/Second": "" if r.goodput_rps is None else r.goodput_rps,
        "Send Rate": r.send_rate_rps,
        "Server Queue": _us(st.get("queue"), "mean"),
        "Server Compute Infer": _us(st.get("compute"), "mean"),
        "Server Total": _us(total, "mean"),
        "Network+Client": net,
        **{f"{pct_key(p)} latency": _us(r.latency_ms, pct_key(p)) for p in PERCENTILES},
        "Max latency": _us(r.latency_ms, "max"),
        "Avg latency": _us(r.latency_ms, "mean"),
        "Request Count": r.sent,
        "Success Count": r.ok,
        "Errors 4xx": r.errors["4xx"], "Errors 429": r.errors["429"], "Errors 5xx": r.errors["5xx"],
        "Timeouts": r.errors["timeout"], "Connection Errors": r.errors["connection"],
        "Stream Errors": r.errors["stream"],
        "TTFT p50": _us(gen.get("ttft_ms"), "p50"), "TTFT p99": _us(gen.get("ttft_ms"), "p99"),
        "ITL p50": _us(gen.get("itl_ms"), "p50"), "ITL p99": _us(gen.get("itl_ms"), "p99"),
        "TPOT Avg": _us(gen.get("tpot_ms"), "mean"),
        "Output Tokens/Second": gen.get("output_tokens_per_s", ""),
        "Send Lag p99": _us(r.send_lag_ms, "p99"),
        "Generator CPU %": r.generator.get("cpu_percent", ""),
    }


def write_csv(path: Path, results: Sequence[Result]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results:
            w.writerow(csv_row(r))


def write_requests_csv(path: Path, samples: Sequence[Sample]) -> None:
    """One row per request, times in ms from the first scheduled send."""
    t0 = min((s.scheduled for s in samples), default=0.0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "scheduled_ms", "sent_ms", "done_ms", "latency_ms", "service_time_ms", "status",
                    "outcome", "server_queue_ms", "server_compute_ms", "ttft_ms", "output_tokens", "error"])
        for s in sorted(samples, key=lambda s: s.scheduled):
            st = s.server_timing or {}
            w.writerow([s.index, f"{(s.scheduled - t0) * 1000:.3f}", f"{(s.sent - t0) * 1000:.3f}",
                        f"{(s.done - t0) * 1000:.3f}", f"{s.latency * 1000:.3f}", f"{s.service_time * 1000:.3f}",
                        s.status, s.outcome, st.get("queue", ""), st.get("compute", ""),
                        "" if s.ttft is None else f"{s.ttft * 1000:.3f}", s.output_tokens, s.error or ""])


def report_dict(results: Sequence[Result], sweep: SweepResult | None, meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "results": [r.to_dict() for r in results], "sweep": None if sweep is None else sweep.to_dict()}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# ---- text --------------------------------------------------------------------------------------------------

_COLS = ("p50", "p90", "p95", "p99", "p99.9", "max", "mean")


def _load_text(r: Result) -> str:
    cfg = r.config
    if r.mode == "closed":
        load = f"closed loop, concurrency {int(r.load)}"
    else:
        load = f"open loop, {'Poisson' if cfg['poisson'] else 'constant'} rate {r.load:g}/s"
    bound = []
    if cfg["duration_s"] is not None:
        bound.append(f"{cfg['duration_s']:g} s")
    if cfg["requests"] is not None:
        bound.append(f"{cfg['requests']} requests")
    warm = f" after {cfg['warmup_s']:g} s warm-up" if cfg["warmup_s"] else ""
    return f"{load} | {' or '.join(bound)}{warm} | measured {r.elapsed_s:.2f} s from {r.started_at}"


def _row(name: str, s: dict[str, float] | None) -> str:
    if not s:
        return f"  {name:<15}" + "        -" * len(_COLS)
    return f"  {name:<15}" + "".join(f"{s[k]:9.2f}" for k in _COLS)


def _metrics_lines(delta: dict[str, Any] | None, limit: int = 8) -> list[str]:
    if not delta:
        return []
    lines = []
    for family, info in delta.items():
        for series in info["series"]:
            labels = ",".join(f"{k}={v}" for k, v in series["labels"].items())
            name = f"{family}{{{labels}}}" if labels else family
            if "count" in series and info["type"] in ("histogram", "summary"):
                extra = ""
                if series.get("mean") is not None:
                    extra += f" mean {series['mean'] * 1000:.2f} ms" if "seconds" in family else \
                        f" mean {series['mean']:.3g}"
                if series.get("p99") is not None and "seconds" in family:
                    extra += f", p99 ~{series['p99'] * 1000:.1f} ms"
                lines.append(f"  {name}: +{series['count']:g}{extra}")
            elif "delta" in series:
                lines.append(f"  {name}: +{series['delta']:g}")
            elif "before" in series:
                lines.append(f"  {name}: {series['before']:g} -> {series['after']:g}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"  ... {len(lines) - limit} more series in results.json"]
    return lines


def summary(r: Result) -> str:
    cfg = r.config
    out = [f"benchmarks.loadtest: {cfg['workload']} {cfg['model']} at {cfg['url']}", f"load       {_load_text(r)}"]
    errs = ", ".join(f"{k} {v}" for k, v in r.errors.items())
    out.append(f"requests   {r.sent} sent, {r.ok} ok, {r.error_count} failed ({errs})")
    for cls, example in r.error_examples.items():
        out.append(f"           e.g. {cls}: {example}")
    line = f"rate       {r.throughput_rps:.1f} ok/s, sent at {r.send_rate_rps:.1f}/s"
    if r.goodput_rps is not None:
        slo = " and ".join(x for x in (f"latency <= {cfg['slo_ms']:g} ms" if cfg["slo_ms"] else "",
                                       f"TTFT <= {cfg['slo_ttft_ms']:g} ms" if cfg["slo_ttft_ms"] else "") if x)
        line += (f" | goodput {r.goodput_rps:.1f}/s ({100 * (r.good_fraction or 0):.2f}% of requests had {slo}: "
                 f"SLO {'met' if r.slo_met else 'MISSED'})")
    out.append(line)
    out.append("ms" + " " * 15 + "".join(f"{c:>9}" for c in _COLS))
    # Open loop: latency counts from the scheduled send (the number to use); from the actual send it is what a
    # closed-loop tool would show; the difference is the send lag.
    out.append(_row("from schedule" if r.mode == "open" else "latency", r.latency_ms))
    if r.mode == "open":
        out.append(_row("from send", r.service_time_ms))
        out.append(_row("send lag", r.send_lag_ms))
    for name, s in r.server_timing_ms.items():
        out.append(_row(f"server {name}", s))
    gen = r.generation
    if gen:
        out.append(_row("TTFT", gen["ttft_ms"]))
        out.append(_row("inter-token", gen["itl_ms"]))
        out.append(_row("per token", gen["tpot_ms"]))
        per = gen["stream_tokens_per_s"]
        per_text = f", per stream {per['p50']:.1f} tok/s median ({per['min']:.1f} slowest)" if per else ""
        out.append(f"tokens     {gen['output_tokens']} out, {gen['output_tokens_per_s']:.1f} tok/s in total{per_text}")
    metrics = _metrics_lines(r.metrics_delta)
    if metrics:
        out.append("server     /metrics change over the measured phase:")
        out.extend(metrics)
    elif r.metrics_note:
        out.append(f"server     {r.metrics_note}")
    g = r.generator
    machine = g.get("machine_cpu_percent")
    out.append(f"generator  {g.get('cpu_percent', 0):.0f}% of one core, at most {g.get('max_in_flight', 0)} in flight"
               + ("" if machine is None else f" | whole machine {machine:.0f}% of one core ({g.get('cpus')} cores)"))
    out.extend(f"warning    {w}" for w in g.get("warnings", ()))
    return "\n".join(out)


def sweep_summary(sw: SweepResult) -> str:
    kind = "concurrency" if sw.mode == "closed" else "rate/s"
    head = (f"{kind:>11} {'ok/s':>9} {'goodput':>9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'p99.9 ms':>9} "
            f"{'err %':>7} {'queue ms':>9} {'compute':>9}")
    out = [head]
    for i, r in enumerate(sw.points):
        lat = r.latency_ms or {}
        q = r.server_timing_ms.get("queue", {}).get("mean")
        c = r.server_timing_ms.get("compute", {}).get("mean")

        def f(v: float | None, w: int = 9) -> str:
            return f"{v:{w}.2f}" if v is not None else " " * (w - 1) + "-"

        mark = " <- knee" if i == sw.knee.index else ""
        out.append(f"{r.load:>11g} {r.throughput_rps:9.1f} {f(r.goodput_rps)} {f(lat.get('p50'))} "
                   f"{f(lat.get('p90'))} {f(lat.get('p99'))} {f(lat.get('p99.9'))} {100 * r.error_fraction:7.2f} "
                   f"{f(q)} {f(c)}{mark}")
    if sw.knee.index is not None:
        k = sw.points[sw.knee.index]
        lat = k.latency_ms or {}
        out.append(f"knee       {kind} {k.load:g}: {k.throughput_rps:.1f} ok/s, p50 {lat.get('p50', float('nan')):.1f} "
                   f"ms, p99 {lat.get('p99', float('nan')):.1f} ms")
        out.append(f"           ({sw.knee.reason})")
    else:
        out.append(f"knee       none: {sw.knee.reason}")
    if sw.slo_ms is not None or sw.best_goodput is not None:
        if sw.best_goodput is not None:
            b = sw.points[sw.best_goodput]
            out.append(f"goodput    best {b.goodput_rps:.1f}/s at {kind} {b.load:g}")
        if sw.max_load_meeting_slo is not None:
            m = sw.points[sw.max_load_meeting_slo]
            out.append(f"SLO        met up to {kind} {m.load:g} ({m.throughput_rps:.1f} ok/s, "
                       f"{100 * (m.good_fraction or 0):.2f}% good)")
        else:
            out.append("SLO        met at no point of the sweep")
    return "\n".join(out)
