"""`python -m benchmarks.cpu_runtimes`: MultiMax DeiT-small on the CPU with the fused onnxruntime ops (plugins.ort_ops).

0. op: the node alone, as DeiT-small's attention sees it (scores of (B, 6, 197, 197) scaled by a Mul,
   the node, a Mul reading its output): MultiMaxNoMask (fused) vs onnxruntime's Softmax, batch 1 and 8;
   graphs interleaved, and the nodes' own time from onnxruntime's profiler in ns per element.
1. overhead: MultiMax DeiT-small (paper parameters, attention + output) vs its softmax twin in onnxruntime,
   with the fused ops and with the function bodies, batch 1 and 8 (interleaved rounds, median of
   per-round ratios to the twin).
2. profile: onnxruntime's profiler, per operator: the MultiMax nodes' kernel time vs the twin's Softmax
   nodes', as a share of a run (less noisy than end-to-end times on a shared machine); the two
   sessions' runs interleaved, medians of per-pair ratios.
3. runtimes: the same MultiMax model in onnxruntime (fused ops; function bodies), PyTorch eager,
   torch.compile and OpenVINO (on the inlined graph; its CPU plugin fuses the elementwise chain
   itself), batch 1 and 8, interleaved.

Results: a JSON file (default runs/bench_cpu.json) and a markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import torch

from benchmarks.export_time import interleaved, make_checkpoints, timing_tables, write_results
from export.pipeline import ExportOptions, export_checkpoint
from models.checkpoint import load
from models.multimax import paper_params
from plugins import ort_ops
from plugins.ort_ops.graphs import scores_model

BATCHES = ((1, 8), (8, 2))  # (batch, calls per round)
SECTIONS = ("op", "overhead", "profile", "runtimes")
OP_SHAPE = (6, 197, 197)  # DeiT-small's heads and a 197-token row (odd: the vector tails run too)


def pixels(batch: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)


def bench_overhead(mm: Path, sm: Path, rounds: int, threads: int) -> dict[str, Any]:
    sessions = {"softmax": session(sm, None, threads), "multimax_fused": session(mm, ort_ops.register, threads)}
    sessions["multimax_bodies"] = session(mm, None, threads)
    out = {}
    for batch, calls in BATCHES:
        feed = {"pixel_values": pixels(batch)}
        contenders = {name: (lambda s=s, feed=feed: s.run(None, feed)) for name, s in sessions.items()}
        out[f"batch_{batch}"] = interleaved(contenders, rounds, calls, f"overhead b{batch}")
    return out


Register = Callable[[ort.SessionOptions], object] | None  # what a session registers: the fused ops, or nothing


def register_library(path: Path) -> Register:
    """Registers a given build of the custom-op library (--baseline-lib: an older build, compared side by side)."""
    return lambda options: options.register_custom_ops_library(str(path))


def session(model: Path, register: Register, threads: int = 0, profile: Path | None = None) -> ort.InferenceSession:
    """A CPU session; `register` adds the fused ops (or a given build of them); `profile` turns on the profiler."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # 0: onnxruntime's default (one per core)
    # Idle threads spinning after each run would steal the cores of whoever runs next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    if register:
        register(options)
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


@dataclass
class Profile:
    """One session's profile after the warm-up run: per run, the run's µs and the summed kernel µs of the
    chosen nodes; per node, its kernel µs in each run."""

    run_us: list[float]
    nodes_us: list[float]
    per_node: dict[str, list[float]]

    @property
    def typical_nodes_us(self) -> float:
        """The sum over nodes of each node's median: what the nodes cost when no thread of theirs is
        descheduled (on a shared machine one node in a run may wait a scheduler tick for a worker)."""
        return sum(statistics.median(v) for v in self.per_node.values())


def profile_of(session: ort.InferenceSession, ops: set[str]) -> Profile:
    """Ends the session's profile and reads the runs after the first (the warm-up) for nodes of `ops`."""
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]
    nodes_us = [0.0] * len(runs)
    per_node: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["args"].get("op_name") in ops:
            i = next((i for i, (a, b) in enumerate(runs) if a <= e["ts"] <= b), None)
            if i is not None:
                nodes_us[i] += e["dur"]
                per_node.setdefault(e["name"], []).append(e["dur"])
    return Profile([b - a for a, b in runs], nodes_us, per_node)


def profile_side_by_side(
    twin: Path,
    contenders: dict[str, tuple[Path, Register]],
    feed: dict[str, np.ndarray],
    runs: int,
    prefix: Path,
    threads: int = 0,
) -> dict[str, Any]:
    """The twin's Softmax nodes vs each contender's MultiMax nodes, from onnxruntime's profiler, all
    sessions' runs interleaved: medians, and medians of the per-round ratios and costs against the twin."""
    named = {"softmax": (twin, None), **contenders}
    sessions = {name: session(path, reg, threads, prefix.with_name(f"{prefix.name}_{name}"))
                for name, (path, reg) in named.items()}  # fmt: skip
    order = list(sessions.values())
    for s in order:
        s.run(None, feed)  # warm-up, excluded by profile_of
    for i in range(runs):
        for s in order if i % 2 == 0 else order[::-1]:
            s.run(None, feed)
    med = statistics.median
    twin = profile_of(sessions.pop("softmax"), {"Softmax"})
    out: dict[str, Any] = {
        "runs": runs,
        "softmax_nodes_us": med(twin.nodes_us),
        "softmax_typical_nodes_us": twin.typical_nodes_us,
        "softmax_model_run_us": med(twin.run_us),
    }
    for name, s in sessions.items():
        p = profile_of(s, set(ort_ops.OPS))
        pairs = list(zip(p.nodes_us, twin.nodes_us, twin.run_us, strict=True))
        out[name] = {
            "nodes_us": med(p.nodes_us),
            "node_ratio": med(m / t for m, t, _ in pairs),
            # What replacing the Softmax nodes by the MultiMax nodes costs, as a share of the twin's run.
            "op_cost_pct_of_run": med(100 * (m - t) / r for m, t, r in pairs),
            "typical_nodes_us": p.typical_nodes_us,
            "typical_node_ratio": p.typical_nodes_us / twin.typical_nodes_us,
            "typical_op_cost_pct_of_run": 100 * (p.typical_nodes_us - twin.typical_nodes_us) / med(twin.run_us),
        }
    return out


def bench_op(rounds: int, runs: int, tmp: Path, baseline: Path | None, threads: int = 0) -> dict[str, Any]:
    ranges, ts = paper_params(3)  # paper Table 7, layer 4
    twin, mm = tmp / "op_softmax.onnx", tmp / "op_multimax.onnx"
    twin.write_bytes(scores_model("Softmax", ranges, ts))
    mm.write_bytes(scores_model("MultiMaxNoMask", ranges, ts))
    contenders: dict[str, tuple[Path, Register]] = {"multimax_fused": (mm, ort_ops.register)}
    if baseline:
        contenders["multimax_baseline_lib"] = (mm, register_library(baseline))
    in_place_before = ort_ops.run_counts()[1]
    out: dict[str, Any] = {"shape": ["batch", *OP_SHAPE], "parameters": "paper Table 7, layer 4",
                           "baseline_lib": str(baseline) if baseline else None}  # fmt: skip
    for batch, calls in ((1, 40), (8, 6)):
        scores = (np.random.default_rng(0).standard_normal((batch, *OP_SHAPE)) * 24).astype(np.float32)
        feed = {"scores": scores}
        sessions = {"softmax": session(twin, None, threads)}
        for name, (path, reg) in contenders.items():
            sessions[name] = session(path, reg, threads)
        timed = interleaved({n: (lambda s=s, f=feed: s.run(None, f)) for n, s in sessions.items()}, rounds, calls,
                            f"op b{batch}")  # fmt: skip
        prof = profile_side_by_side(twin, contenders, feed, runs, tmp / f"op_{batch}", threads)
        prof["softmax_ns_per_element"] = 1e3 * prof["softmax_nodes_us"] / scores.size
        for name in contenders:
            prof[name]["ns_per_element"] = 1e3 * prof[name]["nodes_us"] / scores.size
        out[f"batch_{batch}"] = timed | {"profiler": prof}
    out["fused_runs_in_place"] = ort_ops.run_counts()[1] > in_place_before
    return out


def bench_profile(mm: Path, sm: Path, runs: int, tmp: Path, threads: int) -> dict[str, Any]:
    contenders: dict[str, tuple[Path, Register]] = {"multimax_fused": (mm, ort_ops.register)}
    out = {}
    for b, _ in BATCHES:
        feed = {"pixel_values": pixels(b)}
        out[f"batch_{b}"] = profile_side_by_side(sm, contenders, feed, runs, tmp / f"deit_{b}", threads)
    return out


def inlined_copy(path: Path, out: Path) -> Path:
    """The graph with every multimax function body inlined (what runtimes without the ops load)."""
    proto = onnx.inliner.inline_local_functions(onnx.load(str(path)))
    onnx.save(proto, str(out))
    return out


def bench_runtimes(mm_ckpt: Path, mm: Path, rounds: int, tmp: Path, threads: int) -> dict[str, Any]:
    model, _, _ = load(mm_ckpt)
    model.eval()
    compiled = torch.compile(model)
    fused, bodies = session(mm, ort_ops.register, threads), session(mm, None, threads)
    ov_model, ov_error = None, None
    try:
        import openvino as ov

        core = ov.Core()
        config = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        ov_model = core.compile_model(str(inlined_copy(mm, tmp / "inlined.onnx")), "CPU", config)
    except ImportError:
        ov_error = "openvino is not installed (pip install openvino)"
    out: dict[str, Any] = {"openvino": ov_error or f"openvino {ov.__version__}"}
    for batch, calls in BATCHES:
        x = torch.from_numpy(pixels(batch))
        xn = x.numpy()
        contenders = {
            "onnxruntime_fused": lambda xn=xn: fused.run(None, {"pixel_values": xn}),
            "onnxruntime_bodies": lambda xn=xn: bodies.run(None, {"pixel_values": xn}),
            "torch_eager": lambda x=x: model(x),
            "torch_compile": lambda x=x: compiled(x),
        }
        if ov_model is not None:
            request = ov_model.create_infer_request()
            contenders["openvino"] = lambda xn=xn, r=request: r.infer({0: xn})
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(x)  # compile for this shape outside the timed rounds
            compile_s = time.perf_counter() - start
            ref = model(x).numpy()
            diffs = {"onnxruntime_fused": float(np.abs(fused.run(None, {"pixel_values": xn})[0] - ref).max())}
            if ov_model is not None:
                diffs["openvino"] = float(np.abs(ov_model({0: xn})[0] - ref).max())
            out[f"batch_{batch}"] = interleaved(contenders, rounds, calls, f"runtimes b{batch}")
        out[f"batch_{batch}"]["torch_compile"]["compile_seconds"] = compile_s
        out[f"max_abs_vs_torch_batch_{batch}"] = diffs
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Measured {results['date']} with `{results['command']}` ({results['machine']})", ""]
    lines += timing_tables(
        results,
        {
            "overhead": "MultiMax DeiT-small vs softmax twin, onnxruntime CPU",
            "runtimes": "MultiMax DeiT-small, CPU runtimes",
        },
    )
    op = results.get("op")
    if op:
        lines += ["| the node alone (B, 6, 197, 197) | batch | graph ms/call | graph ratio | profiler ns/element "
                  "| node ratio (profiler) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for batch in ("batch_1", "batch_8"):
            r, prof = op[batch], op[batch]["profiler"]
            lines.append(f"| Softmax | {batch[6:]} | {r['softmax']['median_ms']:.2f} | 1.000 "
                         f"| {prof['softmax_ns_per_element']:.2f} | 1.000 |")  # fmt: skip
            for name in (n for n in r if n.startswith("multimax")):
                lines.append(f"| {name} | {batch[6:]} | {r[name]['median_ms']:.2f} | {r[name]['ratio_to_softmax']:.3f} "
                             f"| {prof[name]['ns_per_element']:.2f} | {prof[name]['node_ratio']:.3f} |")  # fmt: skip
        lines.append("")
    p = results.get("profile")
    if p:
        lines += ["| profiler (onnxruntime, fused ops) | batch | MultiMax nodes µs/run | twin's Softmax nodes µs/run "
                  "| node ratio | twin run µs | op cost, % of a run |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for batch, r in p.items():
            f, b = r["multimax_fused"], batch.split("_")[1]
            lines.append(f"| median of per-run sums | {b} | {f['nodes_us']:.0f} | {r['softmax_nodes_us']:.0f} "
                         f"| {f['node_ratio']:.2f} | {r['softmax_model_run_us']:.0f} "
                         f"| {f['op_cost_pct_of_run']:+.2f}% |")  # fmt: skip
            lines.append(f"| sum of per-node medians | {b} | {f['typical_nodes_us']:.0f} "
                         f"| {r['softmax_typical_nodes_us']:.0f} | {f['typical_node_ratio']:.2f} "
                         f"| {r['softmax_model_run_us']:.0f} | {f['typical_op_cost_pct_of_run']:+.2f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_runtimes", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds per comparison")
    p.add_argument("--profile-runs", type=int, default=20, help="profiled runs per model and batch")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("-o", "--output", default="runs/bench_cpu.json")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of every runtime (0: each one's default, one per core)")  # fmt: skip
    p.add_argument("--baseline-lib", type=Path, help="op section: also time this build of the custom-op library")
    args = p.parse_args(argv)
    lib = ort_ops.library()
    if not lib.available:
        print(f"fused MultiMax ops unavailable: {lib.reason}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    load1 = os.getloadavg()[0]
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "python -m benchmarks.cpu_runtimes " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load average {load1:.1f} "
        f"at the start, onnxruntime {ort.__version__} (fused ops: {ort_ops.kernel_path()}), torch {torch.__version__}",
    }
    with tempfile.TemporaryDirectory(prefix="multimax-bench-cpu.") as tmp_name:
        tmp = Path(tmp_name)
        mm_ckpt, sm_ckpt = make_checkpoints(tmp)
        if set(args.only) - {"op"}:  # the op section needs no model
            for ckpt in (mm_ckpt, sm_ckpt):
                options = ExportOptions(output=ckpt.with_suffix(".onnx"), validate=False, progress=False)
                if export_checkpoint(ckpt, options).exit_code:
                    raise RuntimeError(f"could not export {ckpt.name}")
        mm, sm = mm_ckpt.with_suffix(".onnx"), sm_ckpt.with_suffix(".onnx")
        sections = {
            "op": lambda: bench_op(args.rounds, args.profile_runs, tmp, args.baseline_lib, args.threads),
            "overhead": lambda: bench_overhead(mm, sm, args.rounds, args.threads),
            "profile": lambda: bench_profile(mm, sm, args.profile_runs, tmp, args.threads),
            "runtimes": lambda: bench_runtimes(mm_ckpt, mm, args.rounds, tmp, args.threads),
        }
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            results[name] = sections[name]()
            out.write_text(json.dumps(results, indent=2) + "\n")  # kept if a later section is interrupted
    results["machine"] += f"; load average {os.getloadavg()[0]:.1f} at the end"
    return write_results(results, Path(args.output), markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
