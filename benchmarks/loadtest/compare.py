"""Run one workload with benchmarks.loadtest and with locust (headless) against the same server; print and write
the numbers side by side.

    python -m benchmarks.loadtest.compare --url http://127.0.0.1:8000 --workload classify --users 8 --duration 10 \\
        --out runs/compare

Order: warm-up, benchmarks.loadtest closed loop (concurrency = users), locust (-u users, no think time), the
closed loop again (how much of a difference is run-to-run noise), then open loops at the rate locust reached
and at 80% of it (the same throughput offered as arrivals, measured without coordinated omission). This
process and locust (a child: it inherits the affinity) run on --cpu, so a server pinned to another core does
not compete with them.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.loadtest.config import WORKLOADS, ConfigError, LoadConfig
from benchmarks.loadtest.runner import run_async
from benchmarks.loadtest.stats import Result

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
ROWS = ("requests", "failures", "ok/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "p99.9 ms", "max ms", "mean ms",
        "generator CPU %")


def _ours(r: Result) -> dict[str, Any]:
    lat = r.latency_ms or {}
    return {"requests": r.sent, "failures": r.error_count, "ok/s": r.throughput_rps, "p50 ms": lat.get("p50"),
            "p90 ms": lat.get("p90"), "p95 ms": lat.get("p95"), "p99 ms": lat.get("p99"),
            "p99.9 ms": lat.get("p99.9"), "max ms": lat.get("max"), "mean ms": lat.get("mean"),
            "generator CPU %": r.generator.get("cpu_percent")}


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_locust(url: str, cfg: LoadConfig, users: int, duration_s: float, prefix: Path) -> dict[str, Any]:
    env = {**os.environ, "LOADTEST_WORKLOAD": cfg.workload, "LOADTEST_MODEL": cfg.model_name,
           "LOADTEST_BATCH": str(cfg.batch), "LOADTEST_SEED": str(cfg.seed),
           "LOADTEST_PROMPT_LEN": str(cfg.prompt_len), "LOADTEST_MAX_TOKENS": str(cfg.max_tokens)}
    if cfg.images is not None:
        env["LOADTEST_IMAGES"] = str(cfg.images)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
           "-t", f"{duration_s:g}s", "--host", url, "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
           "--stop-timeout", "5"]
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    # locust exits 1 when any request failed; the CSV still says what happened
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=duration_s + 120)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    stats = Path(f"{prefix}_stats.csv")
    if not stats.exists():
        raise RuntimeError(f"locust wrote no {stats}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    row = next(r for r in csv.DictReader(stats.open()) if r["Name"] == "Aggregated")
    count, fails = int(row["Request Count"]), int(row["Failure Count"])
    rps = float(row["Requests/s"])
    return {"requests": count, "failures": fails, "ok/s": round(rps * (count - fails) / count, 3) if count else 0.0,
            "p50 ms": float(row["50%"]), "p90 ms": float(row["90%"]), "p95 ms": float(row["95%"]),
            "p99 ms": float(row["99%"]), "p99.9 ms": float(row["99.9%"]), "max ms": float(row["Max Response Time"]),
            "mean ms": float(row["Average Response Time"]),
            # over locust's whole process life (start-up and CSV writing included): an upper bound
            "generator CPU %": round(100 * cpu / wall, 1), "command": " ".join(cmd)}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


def table(columns: dict[str, dict[str, Any]]) -> str:
    names = list(columns)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(_fmt(columns[n].get(row)) for n in names) + " |")
    return "\n".join(lines)


async def _ours_async(cfg: LoadConfig) -> Result:
    return await run_async(cfg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadtest.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", choices=WORKLOADS, default="classify")
    p.add_argument("--model")
    p.add_argument("--users", type=int, default=8, help="locust users = closed-loop concurrency (default 8)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run (default %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--cpu", type=int, help="pin this process and locust to this core")
    p.add_argument("--out", type=Path, default=Path("runs/compare"))
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    args.out.mkdir(parents=True, exist_ok=True)
    base = LoadConfig(url=args.url, workload=args.workload, model=args.model, concurrency=args.users,
                      duration_s=args.duration, stream=False, scrape_metrics=False)
    try:
        base.validate()
        asyncio.run(_ours_async(replace(base, duration_s=args.warmup)))  # warm-up, not reported
    except ConfigError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    columns: dict[str, dict[str, Any]] = {}
    columns["loadtest closed #1"] = _ours(asyncio.run(_ours_async(base)))
    columns["locust"] = run_locust(args.url, base, args.users, args.duration, args.out / "locust")
    columns["loadtest closed #2"] = _ours(asyncio.run(_ours_async(base)))
    rate = columns["locust"]["ok/s"] or columns["loadtest closed #1"]["ok/s"]
    for share in (1.0, 0.8):  # the closed loops' top rate, and a rate with headroom
        opened = replace(base, concurrency=None, rate=round(rate * share, 1))
        columns[f"loadtest open {opened.rate:g}/s"] = _ours(asyncio.run(_ours_async(opened)))
    text = table(columns)
    print(text)
    info = {"url": args.url, "workload": args.workload, "model": base.model_name, "users": args.users,
            "duration_s": args.duration, "cpu": args.cpu, "loadavg_after": os.getloadavg(),
            "locust_command": columns["locust"].pop("command")}
    (args.out / "compare.json").write_text(json.dumps({"info": info, "columns": columns}, indent=2) + "\n")
    (args.out / "compare.md").write_text(text + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
