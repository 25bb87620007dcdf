"""`python -m benchmarks.export_headline --before DIR`: the headline export, this tree against another, side by side.

Runs `python -m models init deit_small --multimax attention,output --params paper` once, then
`python -m export deit_small_multimax.pt` (default validation) from each source tree in interleaved rounds
(alternating who goes first), each in a fresh process as a user runs it. Reports the median wall time and
per-phase times of each, the median of the per-round ratios after/before, the load average around each run,
and whether both wrote the same ONNX content (nodes, weights,
functions, metadata; the nodes' debug stack traces aside). DIR is a checkout of the code to compare with, e.g.
`git worktree add /tmp/before <commit>` or `git archive <commit> | tar x -C /tmp/before`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CKPT = "deit_small_multimax.pt"


def content_digest(path: Path) -> str:
    """Hash of the file without the nodes' debug metadata (the exporter's stack traces name source paths and
    line numbers, which differ between two checkouts): nodes, weights, functions and model metadata count."""
    import onnx

    model = onnx.load(str(path))
    for graph_nodes in [model.graph.node, *(f.node for f in model.functions)]:
        for node in graph_nodes:
            del node.metadata_props[:]
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def run_export(tree: Path, workdir: Path, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "export", CKPT, "-o", f"{name}.onnx", "--quiet"], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    report = json.loads((workdir / f"{name}.validation.json").read_text())
    return {
        "wall": wall,
        "phases": report["phase_seconds"],
        "in_phases": sum(report["phase_seconds"].values()),
        "load": (load_before + os.getloadavg()[0]) / 2,
        "content_sha256": content_digest(workdir / f"{name}.onnx"),
        "verdict": report["verdict"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_headline", description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the source tree to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-o", "--output", default="runs/export_headline.json")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory(prefix="multimax-headline.") as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "-m", "models", "init", "deit_small", "--multimax", "attention,output",
                        "--params", "paper", "-o", CKPT], cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       check=True, capture_output=True)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                runs[name].append(run_export(trees[name], tmp, name))
                last = runs[name][-1]
                print(f"round {r + 1} {name:<6} wall {last['wall']:6.1f} s  in phases {last['in_phases']:6.1f} s  "
                      f"load {last['load']:.1f}", file=sys.stderr)
    phases = list(runs["after"][0]["phases"])
    result = {
        "command": "python -m benchmarks.export_headline " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpus": os.cpu_count(),
        "identical_onnx_content": len({run["content_sha256"] for v in runs.values() for run in v}) == 1,
        "verdicts": sorted({run["verdict"] for v in runs.values() for run in v}),
        "load_average": {name: [round(run["load"], 1) for run in v] for name, v in runs.items()},
        "median_seconds": {
            name: {"wall": statistics.median(run["wall"] for run in v),
                   "in_phases": statistics.median(run["in_phases"] for run in v),
                   **{ph: statistics.median(run["phases"].get(ph, 0.0) for run in v) for ph in phases}}
            for name, v in runs.items()
        },
        "ratio_after_before": {
            key: statistics.median(a[key] / b[key] for a, b in zip(runs["after"], runs["before"], strict=True))
            for key in ("wall", "in_phases")
        } | {
            ph: statistics.median(a["phases"][ph] / b["phases"][ph]
                                  for a, b in zip(runs["after"], runs["before"], strict=True) if b["phases"].get(ph))
            for ph in phases
        },
        "runs": runs,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
