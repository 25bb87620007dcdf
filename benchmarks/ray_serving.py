"""`python -m benchmarks.ray_serving`: `python -m service` against Ray Serve at 1 and 2 replicas, same models and
options, measured side by side with the project's load tester (benchmarks.loadtest).

The single process and the Ray deployment run at the same time; each round measures every server on every
workload, in a rotating order, and the Ray deployment is rescaled between its 1- and 2-replica turns (not
measured). Reported: throughput and latency percentiles per server, and per-round ratios to the single process
(median over rounds). A concurrency-1 workload gives the proxy's added latency per request.

    python -m benchmarks.ray_serving --netns --model-dir /tmp/models --models digits_multimax,deit_tiny \\
        --workload classify:deit_tiny:16 --workload classify:digits_multimax:32 \\
        --workload classify:digits_multimax:1 --seconds 10 --rounds 3 -o ray_bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.loadtest.config import LoadConfig
from benchmarks.loadtest.runner import run_async, run_coroutine
from benchmarks.netns import loopback_namespace
from benchmarks.server import free_port, start, stop, wait_ready
from service.base.config import Settings
from service.edge.ray.options import PROXIES, ScaleOptions

SERVERS = ("single", "ray-1", "ray-2")


@dataclass(frozen=True)
class Workload:
    kind: str  # benchmarks.loadtest workload: classify, infer, generate
    model: str
    concurrency: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        try:
            kind, model, conc = text.split(":")
            return cls(kind, model, int(conc))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected WORKLOAD:MODEL:CONCURRENCY, got {text!r}") from None

    @property
    def label(self) -> str:
        return f"{self.kind} {self.model} c={self.concurrency}"


def _measure(url: str, w: Workload, seconds: float, warmup: float) -> dict[str, Any]:
    cfg = LoadConfig(url=url, workload=w.kind, model=w.model, concurrency=w.concurrency, duration_s=seconds,
                     warmup_s=warmup, scrape_metrics=False, progress=False).validate()
    r = run_coroutine(run_async(cfg))
    lat = r.latency_ms or {}
    return {"ok_per_s": r.throughput_rps, "errors": r.error_count, "p50_ms": lat.get("p50"),
            "p99_ms": lat.get("p99")}


def _ratios(rounds: list[dict[str, dict[str, dict[str, Any]]]], label: str, server: str) -> dict[str, float]:
    thr = [r[label][server]["ok_per_s"] / r[label]["single"]["ok_per_s"] for r in rounds]
    p50 = [r[label][server]["p50_ms"] - r[label]["single"]["p50_ms"] for r in rounds]
    return {"throughput_ratio": round(statistics.median(thr), 3), "added_p50_ms": round(statistics.median(p50), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="models to serve (default: the demo models)")
    p.add_argument("--models", default="", help="comma-separated model names (default: all)")
    p.add_argument("--workload", type=Workload.parse, action="append", required=True,
                   help="WORKLOAD:MODEL:CONCURRENCY, e.g. classify:deit_tiny:16 (repeatable)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per workload and server")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--netns", action="store_true", help="run everything in a new loopback-only network namespace "
                   "(root; Ray then binds to 127.0.0.1 only)")
    p.add_argument("--proxy", choices=PROXIES, default="python", help="Ray's ingress, as python -m service.ray --proxy")
    p.add_argument("-o", "--out", type=Path, help="write every measurement as JSON")
    args = p.parse_args(argv)
    with loopback_namespace("mmx-ray-bench") if args.netns else contextlib.nullcontext():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    for key, value in ScaleOptions(proxy=args.proxy).ray_environment().items():
        os.environ.setdefault(key, value)  # read by Ray at import
    import ray
    from ray import serve

    from service.edge.ray.app import build_app

    service_args: list[str] = []
    if args.model_dir is not None:
        service_args += ["--model-dir", str(args.model_dir)]
    if args.models:
        service_args += ["--models", args.models]
    ray_port = free_port()
    single, single_url = start(*service_args, output=None)  # its log on this terminal
    urls = {"single": single_url}
    urls["ray-1"] = urls["ray-2"] = f"http://127.0.0.1:{ray_port}"
    settings = Settings(port=ray_port, log_level="warning",
                        **({"model_dir": args.model_dir} if args.model_dir is not None else {}),
                        models=tuple(m for m in args.models.split(",") if m))
    ray.init(namespace="multimax-bench", configure_logging=False, log_to_driver=False)
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
        deployed = 0
        for i in range(args.rounds):
            order = SERVERS[i % 3:] + SERVERS[:i % 3]  # rotate: no server always goes first or last
            result: dict[str, dict[str, dict[str, Any]]] = {w.label: {} for w in args.workload}
            for server in order:
                if server != "single":
                    replicas = int(server.split("-")[1])
                    if replicas != deployed:
                        t0 = time.perf_counter()
                        serve.run(build_app(settings, ScaleOptions(replicas=replicas)), name="bench", route_prefix="/")
                        wait_ready(urls[server], timeout=120)
                        print(f"[round {i + 1}] deployed {replicas} replica(s) in {time.perf_counter() - t0:.1f} s",
                              file=sys.stderr)
                        deployed = replicas
                for w in args.workload:
                    m = _measure(urls[server], w, args.seconds, args.warmup)
                    result[w.label][server] = m
                    print(f"[round {i + 1}] {server:6s} {w.label}: {m['ok_per_s']:.1f}/s p50 {m['p50_ms']:.2f} ms "
                          f"p99 {m['p99_ms']:.2f} ms errors {m['errors']}", file=sys.stderr, flush=True)
            rounds.append(result)
    finally:
        stop(single, timeout=60)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    summary = _summary(args.workload, rounds)
    print(_table(summary))
    if args.out:
        args.out.write_text(json.dumps({"rounds": rounds, "summary": summary, "load_average": os.getloadavg(),
                                        "argv": sys.argv}, indent=1))
    return 0


def _summary(workloads: list[Workload], rounds: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in workloads:
        per = {}
        for server in SERVERS:
            vals = [r[w.label][server] for r in rounds]
            per[server] = {k: round(statistics.median(v[k] for v in vals), 2) for k in ("ok_per_s", "p50_ms", "p99_ms")}
            per[server]["errors"] = sum(v["errors"] for v in vals)
            if server != "single":
                per[server] |= _ratios(rounds, w.label, server)
        out[w.label] = per
    return out


def _table(summary: dict[str, Any]) -> str:
    lines = ["| workload | server | ok/s | p50 ms | p99 ms | errors | throughput vs single | added p50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for label, per in summary.items():
        for server, m in per.items():
            lines.append(f"| {label} | {server} | {m['ok_per_s']} | {m['p50_ms']} | {m['p99_ms']} | {m['errors']} | "
                         f"{m.get('throughput_ratio', 1)} | {m.get('added_p50_ms', 0)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
