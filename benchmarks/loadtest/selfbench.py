"""How many requests/s the load generator itself sustains: it drives a trivial server on loopback, with the
server pinned to one core and the generator to another, and reports who ran out of CPU.

    python -m benchmarks.loadtest.selfbench --duration 10 --rates 2000,3000 --concurrency 64 --out runs/selfbench

Rows: a closed loop (the generator's top rate against this server) and open loops at fixed rates (does it
keep the schedule?). CPU % is of one core: the generator from getrusage, the server from /proc/<pid>/stat,
and everything else on the machine from /proc/stat, so a busy neighbour shows up instead of hiding in the
numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.loadtest.config import LoadConfig
from benchmarks.loadtest.runner import run_async, run_coroutine
from benchmarks.server import start, stop

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _core_busy_s(core: int | None) -> float:
    """Busy CPU seconds of one core (or of the whole machine for None) since boot, from /proc/stat."""
    name = "cpu" if core is None else f"cpu{core}"
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields[0] == name:
            values = [int(v) for v in fields[1:9]]
            return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait
    return 0.0


def _verdict(row: dict[str, Any]) -> str:
    if row["other_cpu_gen_core_pct"] > 20:
        return (f"CONTENDED: other processes took {row['other_cpu_gen_core_pct']:.0f}% of the generator's core; "
                "rerun on a quiet machine")
    if row["mode"] == "open":
        kept = row["send_rate_rps"] >= 0.99 * row["load"] and row["send_lag_p99_ms"] < 10
        return "kept the schedule" if kept else "fell behind the schedule"
    gen, srv = row["generator_cpu_pct"], row["server_cpu_pct"]
    if gen >= 90 > srv:
        return "generator-bound"
    if srv >= 90 > gen:
        return "server-bound"
    return "both busy" if gen >= 90 else "neither saturated (latency-bound)"


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _measure(cfg: LoadConfig, server_pid: int, cores: tuple[int | None, int | None]) -> dict[str, Any]:
    if cfg.warmup_s:  # warm up in a run of its own, so every CPU figure below spans the same window
        await run_async(replace(cfg, duration_s=cfg.warmup_s, warmup_s=0.0, requests=None))
        cfg = replace(cfg, warmup_s=0.0)
    gen_core, srv_core = cores
    srv0, gen0, t0 = _proc_cpu_s(server_pid), _self_cpu_s(), time.perf_counter()
    busy_gen0, busy_srv0 = _core_busy_s(gen_core), _core_busy_s(srv_core)
    res = await run_async(cfg)
    wall = time.perf_counter() - t0
    srv_s, gen_s = _proc_cpu_s(server_pid) - srv0, _self_cpu_s() - gen0
    busy_gen, busy_srv = _core_busy_s(gen_core) - busy_gen0, _core_busy_s(srv_core) - busy_srv0
    if gen_core is None:  # not pinned: all we can say is what the machine did besides us
        other_gen = other_srv = max(100 * (busy_gen - gen_s - srv_s) / wall, 0.0)
    else:
        other_gen = max(100 * (busy_gen - gen_s) / wall, 0.0)
        other_srv = max(100 * (busy_srv - srv_s) / wall, 0.0)
    lat = res.latency_ms or {}
    row = {
        "mode": cfg.mode, "load": cfg.load, "loop": cfg.event_loop, "duration_s": cfg.duration_s,
        "throughput_rps": res.throughput_rps, "send_rate_rps": res.send_rate_rps, "ok": res.ok,
        "errors": res.error_count, "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
        "send_lag_p99_ms": (res.send_lag_ms or {}).get("p99", 0.0),
        "generator_cpu_pct": round(100 * gen_s / wall, 1),
        "server_cpu_pct": round(100 * srv_s / wall, 1),
        # what other processes took from each core: a busy neighbour shows here instead of hiding in the numbers
        "other_cpu_gen_core_pct": round(other_gen, 1),
        "other_cpu_srv_core_pct": round(other_srv, 1),
    }
    row["verdict"] = _verdict(row)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| load model | loop | achieved ok/s | sent/s | p50 ms | p99 ms | send lag p99 ms | generator CPU % | "
            "server CPU % | others on gen core % | others on server core % | errors | verdict |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        load = f"closed, concurrency {int(r['load'])}" if r["mode"] == "closed" else f"open, {r['load']:g}/s"
        lines.append(f"| {load} | {r['loop']} | {r['throughput_rps']:.0f} | {r['send_rate_rps']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['send_lag_p99_ms']:.2f} | "
                     f"{r['generator_cpu_pct']:.0f} | {r['server_cpu_pct']:.0f} | {r['other_cpu_gen_core_pct']:.0f} | "
                     f"{r['other_cpu_srv_core_pct']:.0f} | "
                     f"{r['errors']} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadtest.selfbench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per row (default %(default)s)")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop row (default %(default)s)")
    p.add_argument("--rates", default="2000,3000", help="open-loop rows, requests/s (default %(default)s)")
    p.add_argument("--server-cpu", type=int, default=0, help="core for the trivial server (default 0)")
    p.add_argument("--generator-cpu", type=int, default=1, help="core for the generator (default 1)")
    p.add_argument("--loops", default="asyncio,uvloop", help="event loops to try (default %(default)s)")
    p.add_argument("--out", type=Path, help="write selfbench.json and selfbench.md here")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r]
    loops = [name for name in args.loops.split(",") if name in ("asyncio", "uvloop")]
    if "uvloop" in loops and importlib.util.find_spec("uvloop") is None:
        print("uvloop is not installed: asyncio only", file=sys.stderr)
        loops = [n for n in loops if n != "uvloop"]
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    budget = (args.duration + args.warmup + 5) * (1 + len(rates)) * len(loops) + 30
    cmd = [sys.executable, "-m", "benchmarks.loadtest.trivial_server"]
    if pin:
        cmd = ["taskset", "-c", str(args.server_cpu), *cmd]
        os.sched_setaffinity(0, {args.generator_cpu})
    server, url = start("--duration", f"{budget:g}", command=cmd, ready_timeout=20, output=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = []
    try:
        base = LoadConfig(url=url, workload="infer", model="trivial",
                          duration_s=args.duration, warmup_s=args.warmup, scrape_metrics=False)
        configs = [replace(base, concurrency=args.concurrency)] + [replace(base, rate=r) for r in rates]
        cores = (args.generator_cpu, args.server_cpu) if pin else (None, None)
        for loop_name in loops:
            for cfg in configs:
                cfg = replace(cfg, event_loop=loop_name)  # type: ignore[arg-type]
                row = run_coroutine(_measure(cfg, server.pid, cores), loop_name)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        stop(server, 10)
    info = {"pinned": pin, "server_cpu": args.server_cpu if pin else None,
            "generator_cpu": args.generator_cpu if pin else None, "cpus": os.cpu_count(),
            "loadavg_after": os.getloadavg(), "python": sys.version.split()[0]}
    text = _table(rows)
    print(text)
    print(f"\n{json.dumps(info)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "selfbench.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
        (args.out / "selfbench.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
