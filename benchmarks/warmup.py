"""`python -m benchmarks.warmup`: what warm-up at load buys, measured side by side.

Each round starts the server twice on the demo models (`python -m service --models digits_multimax,text_multimax`,
ONNX Runtime or, with `--backend torch`, PyTorch eager), once with `--warmup-calls 0` and once with warm-up (order
alternating between rounds), each a fresh process on a loopback port, and times over HTTP (one keep-alive
connection):
  startup   from starting the process until /v2/health/ready answers 200 (polled every 50 ms)
  first     the first requests the fresh server answers, one after another: a one-image and an eight-image KServe
            V2 classification and a 16-token completion of a 40-byte prompt
  second    the same requests again (what every later client sees)
Reported: per figure the median over rounds, and the median of the per-round ratios cold / warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.server import running
from service.base.config import Settings

BACKENDS = ("onnxruntime", "torch")

MODELS = ("digits_multimax", "text_multimax")
PROMPT = "The quick brown fox jumps over the lazy d"


def _infer(n: int) -> dict[str, Any]:
    x = np.random.default_rng(n).uniform(-1, 1, (n, 1, 32, 32)).astype(np.float32)
    return {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}


REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "classify_1": ("/v2/models/digits_multimax/infer", _infer(1)),
    "classify_8": ("/v2/models/digits_multimax/infer", _infer(8)),
    "complete_16": ("/v1/completions", {"model": "text_multimax", "prompt": PROMPT, "max_tokens": 16,
                                        "temperature": 0}),
}


def _timed(client: httpx.Client, path: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    r = client.post(path, json=body)
    elapsed = time.perf_counter() - start
    assert r.status_code == 200, r.text
    return elapsed


def one_server(warmup_calls: int, backend: str) -> dict[str, float]:
    start = time.perf_counter()
    with running("--models", ",".join(MODELS), "--warmup-calls", str(warmup_calls), "--backend", backend) as url:
        out = {"startup": time.perf_counter() - start}
        with httpx.Client(base_url=url, timeout=60) as client:
            for turn in ("first", "second"):
                for name, (path, body) in REQUESTS.items():
                    out[f"{turn}_{name}"] = _timed(client, path, body)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds of (no warm-up, warm-up) pairs")
    parser.add_argument("--warmup-calls", type=int, default=Settings().warmup_calls, help="the warm side's setting")
    parser.add_argument("--backend", choices=BACKENDS, default="onnxruntime",
                        help="the demo models' .onnx (onnxruntime) or .pt (torch) files")
    parser.add_argument("-o", "--output", type=Path, help="write every round's figures as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup_calls < 1:
        parser.error("--rounds and --warmup-calls must be at least 1")
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        pair: dict[str, dict[str, float]] = {}
        for side in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
            pair[side] = one_server(0 if side == "cold" else args.warmup_calls, args.backend)
        rounds.append(pair)
        print(f"round {i + 1}/{args.rounds}: first classify_1 cold {pair['cold']['first_classify_1'] * 1000:.1f} ms, "
              f"warm {pair['warm']['first_classify_1'] * 1000:.1f} ms", file=sys.stderr, flush=True)
    figures = list(rounds[0]["cold"])
    print(f"{'figure':<22} {'no warm-up ms':>14} {'warm-up ms':>11} {'ratio':>7}")
    table = {}
    for f in figures:
        cold = statistics.median(r["cold"][f] for r in rounds)
        warm = statistics.median(r["warm"][f] for r in rounds)
        ratio = statistics.median(r["cold"][f] / r["warm"][f] for r in rounds)
        table[f] = {"no_warmup_ms": round(cold * 1000, 2), "warmup_ms": round(warm * 1000, 2), "ratio": round(ratio, 2)}
        print(f"{f:<22} {cold * 1000:>14.1f} {warm * 1000:>11.1f} {ratio:>7.2f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"backend {args.backend}, rounds {args.rounds}, warm-up calls {args.warmup_calls}, cpus {os.cpu_count()}, "
          f"load average {load:.1f}, {platform.processor() or platform.machine()}")
    if args.output:
        args.output.write_text(json.dumps({"table": table, "rounds": rounds, "load_average": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
