"""PNG plots: latency percentiles against throughput (one point per run or sweep point), and the latency
histogram (one line per run). matplotlib's object API with the Agg canvas: no pyplot state, no display."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from benchmarks.loadtest.stats import Result

CURVES = ("p50", "p90", "p99", "p99.9")


def _load_label(r: Result) -> str:
    return f"c={int(r.load)}" if r.mode == "closed" else f"{r.load:g}/s"


def _minor_label(value: float, _: object) -> str:
    """Label minor log ticks at 2x and 5x only: enough to read values off, without clutter."""
    lead = f"{value:.0e}"[0]
    return f"{value:g}" if lead in "25" else ""


def plot_latency_vs_throughput(results: Sequence[Result], path: Path, knee: int | None = None,
                               slo_ms: float | None = None, title: str = "") -> None:
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    pts = [r for r in results if r.latency_ms]
    x = [r.throughput_rps for r in pts]
    for key in CURVES:
        ax.plot(x, [r.latency_ms[key] for r in pts], marker="o", label=key)  # type: ignore[index]
    for r in pts:
        ax.annotate(_load_label(r), (r.throughput_rps, r.latency_ms["p99"]), textcoords="offset points",  # type: ignore[index]
                    xytext=(4, 6), fontsize=8)
    if knee is not None and results[knee].latency_ms:
        k = results[knee]
        ax.axvline(k.throughput_rps, color="grey", linestyle=":", label=f"knee ({_load_label(k)})")
    if slo_ms is not None:
        ax.axhline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 20, not 2x10^1
    ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title or "latency percentiles vs throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def plot_histogram(results: Sequence[Result], path: Path, title: str = "") -> None:
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    hists = [(r, r.hist.buckets_ms()) for r in results if r.hist is not None and r.hist.count]
    if hists:
        lo = min(b[0][0] for _, b in hists)
        hi = max(b[-1][0] for _, b in hists)
        edges = np.geomspace(max(lo * 0.9, 1e-3), hi * 1.1, 60)
        for r, buckets in hists:
            values, counts = zip(*buckets, strict=True)
            density, _ = np.histogram(values, bins=edges, weights=counts)
            ax.stairs(density / max(sum(counts), 1), edges, label=_load_label(r))
        if len(hists) == 1:
            r = hists[0][0]
            for key, style in (("p50", "--"), ("p99", ":"), ("p99.9", "-.")):
                ax.axvline(r.latency_ms[key], color="black", linestyle=style, linewidth=1,  # type: ignore[index]
                           label=f"{key} {r.latency_ms[key]:.1f} ms")  # type: ignore[index]
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("latency (ms, log bins)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title or "latency distribution")
    ax.grid(True, which="both", alpha=0.3)
    if hists:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
