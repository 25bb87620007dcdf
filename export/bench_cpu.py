"""`python -m export.bench_cpu`: MultiMax DeiT-small on the CPU with the fused onnxruntime ops (plugins.ort_ops).

1. overhead: MultiMax DeiT-small (paper parameters, attention + output) vs its softmax twin in onnxruntime,
   with the fused ops and with the function bodies, batch 1 and 8 (interleaved rounds, median of
   per-round ratios to the twin).
2. profile: onnxruntime's profiler, per operator: the MultiMax nodes' kernel time vs the twin's Softmax
   nodes', as a share of a run (less noisy than end-to-end times on a shared machine).
3. runtimes: the same MultiMax model in onnxruntime (fused ops; function bodies), PyTorch eager,
   torch.compile and OpenVINO (on the inlined graph; its CPU plugin fuses the elementwise chain
   itself), batch 1 and 8, interleaved.

Results: a JSON file (default runs/bench_cpu.json) and a markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import torch

from export.bench import interleaved, make_checkpoints, timing_tables, write_results
from export.pipeline import ExportOptions, export_checkpoint
from export.validate import cpu_session
from models.checkpoint import load
from plugins import ort_ops

BATCHES = ((1, 8), (8, 2))  # (batch, calls per round)
SECTIONS = ("overhead", "profile", "runtimes")


def pixels(batch: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)


def session(path: Path, fused: bool) -> ort.InferenceSession:
    # Idle threads spinning after each run would steal the cores of whoever runs next.
    return cpu_session(path, spinning=False, fused=fused)


def bench_overhead(mm: Path, sm: Path, rounds: int) -> dict[str, Any]:
    sessions = {"softmax": session(sm, False), "multimax_fused": session(mm, True)}
    sessions["multimax_bodies"] = session(mm, False)
    out = {}
    for batch, calls in BATCHES:
        feed = {"pixel_values": pixels(batch)}
        contenders = {name: (lambda s=s, feed=feed: s.run(None, feed)) for name, s in sessions.items()}
        out[f"batch_{batch}"] = interleaved(contenders, rounds, calls, f"overhead b{batch}")
    return out


def profile_ops(path: Path, fused: bool, batch: int, runs: int, tmp: Path) -> dict[str, float]:
    """Mean microseconds per run: each operator type's kernel time, and the whole run."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp / f"profile_{path.stem}_{fused}")
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if fused:
        ort_ops.register(options)
    s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {"pixel_values": pixels(batch)}
    s.run(None, feed)  # warm-up, excluded below
    for _ in range(runs):
        s.run(None, feed)
    events = json.loads(Path(s.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    model_runs = [e["dur"] for e in events if e.get("name") == "model_run"][1:]
    warm_end = next(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= warm_end:
            per_op[e["args"]["op_name"]] += e["dur"] / runs
    return {"model_run_us": float(np.median(model_runs)), **per_op}


def bench_profile(mm: Path, sm: Path, runs: int, tmp: Path) -> dict[str, Any]:
    out = {}
    for batch, _ in BATCHES:
        fused, twin = profile_ops(mm, True, batch, runs, tmp), profile_ops(sm, False, batch, runs, tmp)
        mm_us = sum(v for k, v in fused.items() if k in ort_ops.OPS)
        sm_us = twin.get("Softmax", 0.0)
        out[f"batch_{batch}"] = {
            "runs": runs,
            "multimax_nodes_us": mm_us,
            "softmax_nodes_us": sm_us,
            "multimax_model_run_us": fused["model_run_us"],
            "softmax_model_run_us": twin["model_run_us"],
            # What replacing the 12 Softmax nodes by the MultiMax nodes costs, as a share of a twin's run.
            "op_cost_pct_of_run": 100 * (mm_us - sm_us) / twin["model_run_us"],
        }
    return out


def inlined_copy(path: Path, out: Path) -> Path:
    """The graph with every multimax function body inlined (what runtimes without the ops load)."""
    proto = onnx.inliner.inline_local_functions(onnx.load(str(path)))
    onnx.save(proto, str(out))
    return out


def bench_runtimes(mm_ckpt: Path, mm: Path, rounds: int, tmp: Path) -> dict[str, Any]:
    model, _, _ = load(mm_ckpt)
    model.eval()
    compiled = torch.compile(model)
    fused, bodies = session(mm, True), session(mm, False)
    ov_model, ov_error = None, None
    try:
        import openvino as ov

        core = ov.Core()
        ov_model = core.compile_model(str(inlined_copy(mm, tmp / "inlined.onnx")), "CPU")
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
    lines += timing_tables(results, {"overhead": "MultiMax DeiT-small vs softmax twin, onnxruntime CPU",
                                     "runtimes": "MultiMax DeiT-small, CPU runtimes"})
    p = results.get("profile")
    if p:
        lines += ["| profiler (onnxruntime, fused ops) | batch | MultiMax nodes µs/run | twin's Softmax nodes µs/run "
                  "| twin run µs | op cost, % of a run |", "|---|---|---|---|---|---|"]  # fmt: skip
        for batch, r in p.items():
            lines.append(f"| | {batch.split('_')[1]} | {r['multimax_nodes_us']:.0f} | {r['softmax_nodes_us']:.0f} "
                         f"| {r['softmax_model_run_us']:.0f} | {r['op_cost_pct_of_run']:+.2f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.bench_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds per comparison")
    p.add_argument("--profile-runs", type=int, default=20, help="profiled runs per model and batch")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("-o", "--output", default="runs/bench_cpu.json")
    args = p.parse_args(argv)
    lib = ort_ops.library()
    if not lib.available:
        print(f"fused MultiMax ops unavailable: {lib.reason}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    load1 = os.getloadavg()[0]
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "python -m export.bench_cpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load average {load1:.1f} "
        f"at the start, onnxruntime {ort.__version__} (fused ops: {ort_ops.kernel_path()}), torch {torch.__version__}",
    }
    with tempfile.TemporaryDirectory(prefix="multimax-bench-cpu.") as tmp_name:
        tmp = Path(tmp_name)
        mm_ckpt, sm_ckpt = make_checkpoints(tmp)
        for ckpt in (mm_ckpt, sm_ckpt):
            options = ExportOptions(output=ckpt.with_suffix(".onnx"), validate=False, progress=False)
            if export_checkpoint(ckpt, options).exit_code:
                raise RuntimeError(f"could not export {ckpt.name}")
        mm, sm = mm_ckpt.with_suffix(".onnx"), sm_ckpt.with_suffix(".onnx")
        sections = {
            "overhead": lambda: bench_overhead(mm, sm, args.rounds),
            "profile": lambda: bench_profile(mm, sm, args.profile_runs, tmp),
            "runtimes": lambda: bench_runtimes(mm_ckpt, mm, args.rounds, tmp),
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
