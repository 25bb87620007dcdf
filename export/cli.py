"""`python -m export CKPT`: a validated ONNX file with MultiMax as one fused node per use.

Exit codes: 0 exported (and validated), 1 a validation tolerance was missed (the report says which),
2 bad input (missing or broken checkpoint, unsupported model, unwritable output).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from export.fused_check import fused_summary
from export.onnx_export import DEFAULT_OPSET, ExportError
from export.progress import Phases, exporter_stages
from export.tasks import export_task
from export.threads import idle_cores
from export.validate import TOLERANCES, check_graph
from models.checkpoint import load
from models.loading import CheckpointError

MIN_OPSET = 18


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="any checkpoint `python -m models info` reads")
    p.add_argument("-o", "--output", help="ONNX file (default: <checkpoint stem>.onnx in the current directory, "
                   "so exporting a shipped or read-only checkpoint never writes beside it)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (>= {MIN_OPSET})")
    p.add_argument("--inline", action="store_true", help="write the flat elementwise graph instead of MultiMax nodes")
    p.add_argument("--no-validate", action="store_true", help="skip the comparison with PyTorch")
    p.add_argument("--samples", type=int, help="random inputs for validation (default: 100 vision inputs, fewer for "
                   "large models but every batch size at least once; 100 text cases)")
    p.add_argument("--batch-sizes", type=parse_batch_sizes, default=(1, 2, 8), help="e.g. 1,2,8")
    p.add_argument("--num-heads", type=int, help="heads, for foreign checkpoints that do not store them")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="fp16 model, MultiMax nodes kept in fp32")
    precision.add_argument("--int8", action="store_true", help="dynamic int8 quantization of the weight matmuls")
    p.add_argument("--trt", action="store_true", help="also build a TensorRT engine with the MultiMax plugin (GPU)")
    p.add_argument("--threads", type=int, help="PyTorch threads for the reference pass (default: the cores idle "
                   "when the export starts)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    if args.opset < MIN_OPSET:
        raise ExportError(f"--opset {args.opset} is too old; MultiMax export needs opset >= {MIN_OPSET}")
    if args.samples is not None and args.samples < 1:
        raise ExportError(f"--samples must be >= 1, got {args.samples}")
    if args.trt:
        reason = trt_unavailable()
        if reason:
            raise ExportError(f"--trt: {reason}")
    if args.threads is not None and args.threads < 1:
        raise ExportError(f"--threads must be >= 1, got {args.threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads or idle_cores())
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous)  # a caller in the same process (tests, export.demos) keeps its own


def _run(args: argparse.Namespace) -> int:
    precision = "fp16" if args.fp16 else "int8" if args.int8 else "fp32"
    phases = Phases(show=not args.quiet)
    ckpt_path = Path(args.checkpoint)
    with phases.phase("load checkpoint"):
        model, ckpt, _ = load(ckpt_path, num_heads=args.num_heads)
    suffix = ".onnx" if precision == "fp32" else f".{precision}.onnx"
    out = Path(args.output) if args.output else Path(ckpt_path.stem + suffix)
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: directory {out.parent} does not exist")
    task = export_task(ckpt.arch)
    exporter = task.export
    label = f"export {ckpt.arch} ({precision})"
    with phases.phase(label) as bar, exporter_stages(bar, label):
        try:
            exporter(model, ckpt, out, opset=args.opset, inline=args.inline, precision=precision, verbose=True)
        except OSError as exc:
            raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    report = {
        "checkpoint": str(ckpt_path),
        "onnx": str(out),
        "arch": ckpt.arch,
        "precision": precision,
        "multimax_places": [p for p in ("attention", "output") if ckpt.config.get(f"multimax_{p}")],
        "inlined": args.inline,
        "export_seconds": round(phases.times[label], 2),
        "torch_threads": torch.get_num_threads(),
    }
    with phases.phase("check graph"):
        report["graph"] = check_graph(out, ckpt.arch)
    if not args.no_validate:
        start = time.perf_counter()
        tolerance = TOLERANCES[precision]
        report["validation"] = task.validate(model, out, ckpt, args.samples, args.batch_sizes, tolerance, phases)
        report["validation_seconds"] = round(time.perf_counter() - start, 2)
    problems = report["graph"]["problems"] + report.get("validation", {}).get("failures", [])
    if args.trt and not problems:
        with phases.phase("TensorRT engine"):
            report["engine"] = build_trt_engine(out, fp16=args.fp16)
        problems += [report["engine"]["error"]] if "error" in report["engine"] else []
    report["problems"] = problems
    report["passed"] = not problems
    report["verdict"] = verdict(report)
    report["phase_seconds"] = {name: round(t, 2) for name, t in phases.times.items()}
    report_path = out.with_name(out.name.removesuffix(".onnx") + ".validation.json")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report, report_path, phases))
    return 0 if not problems else 1


def trt_unavailable() -> str | None:
    """Why no TensorRT engine can be built here (None: it can)."""
    from plugins.build_engine import BuildError, require_tensorrt

    try:
        require_tensorrt()
    except BuildError as exc:
        return str(exc)
    return None


def build_trt_engine(onnx_path: Path, fp16: bool) -> dict:
    """The engine with the MultiMax plugin; a fallback to the elementwise bodies is a failure (exit 1)."""
    from plugins.build_engine import BuildError, PluginFallbackError, build_engine

    start = time.perf_counter()
    try:
        engine = build_engine(onnx_path, onnx_path.with_suffix(".engine"), fp16=fp16)
    except BuildError as exc:
        raise ExportError(f"--trt: {exc}") from None
    except PluginFallbackError as exc:
        return {"error": str(exc)}
    return {"path": str(engine), "seconds": round(time.perf_counter() - start, 2)}


def multimax_line(report: dict) -> str:
    """What the graph holds, said plainly (a model without MultiMax says so)."""
    g, places = report["graph"], report["multimax_places"]
    if not places:
        return "no MultiMax in this model (softmax only)"
    where = " + ".join(places)
    if report["inlined"]:
        return f"MultiMax ({where}) inlined as elementwise ops (--inline)"
    return f"{g['multimax_nodes']} MultiMax nodes ({where}): {', '.join(g['custom_nodes'])}"


def verdict(report: dict) -> str:
    """One honest line: "passed" only when the enforced limits were checked and held."""
    if report["problems"]:
        return "FAILED: " + "; ".join(report["problems"])
    v = report.get("validation")
    if not v:
        return "not validated (--no-validate): graph checked only"
    tol = v["tolerance"]
    if tol["logits_atol"] is None and tol["top1_min"] is None:
        key = export_task(report["arch"]).agreement_key
        worst = min(v[level][key] for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"))
        worst_diff = max(v[level]["max_abs"] for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"))
        return (f"{report['precision']}: deltas reported, not enforced: top-1 {worst:.0%}, "
                f"max|diff| {worst_diff:.2g} (no NaN: checked)")
    return "passed"


def summary(report: dict, report_path: Path, phases: Phases) -> str:
    g = report["graph"]
    lines = [
        f"wrote {report['onnx']} in {report['export_seconds']:.1f} s (opset {g['opset'].get('ai.onnx')}, "
        f"{multimax_line(report)})",
    ]
    v = report.get("validation")
    if v:
        top1 = export_task(report["arch"]).agreement_key
        for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"):
            s = v[level]
            kv = f"  present {s['present_max_abs']:.2e}" if "present_max_abs" in s else ""
            lines.append(
                f"  {level:<17} max|diff| {s['max_abs']:.2e}  mean {s['mean_abs']:.2e}  p99 {s['p99_abs']:.2e}{kv}  "
                f"top-1 agreement {s[top1]:.0%}  NaN {s['nan_count']}"
            )
        if "greedy" in v:
            gen = v["greedy"]
            lines.append(
                f"  greedy generation: {gen['identical']}/{gen['prompts']} identical over {gen['tokens']} tokens"
            )
        if "fused_ops" in v:
            lines.append("  " + fused_summary(v["fused_ops"]))
        shapes = export_task(report["arch"]).shapes(v)
        lines.append(f"  {v['samples']} random inputs, {shapes}; limits: {limits(v['tolerance'], report['arch'])}")
    engine = report.get("engine")
    if engine and "path" in engine:
        lines.append(f"  TensorRT engine with the MultiMax plugin: {engine['path']} ({engine['seconds']:.1f} s)")
    lines.append(f"  times: {phases.summary()} (PyTorch threads {report['torch_threads']})")
    lines.append(report["verdict"])
    lines.append(f"report: {report_path}")
    return "\n".join(lines)


def limits(tolerance: dict, arch: str) -> str:
    parts = []
    if tolerance["logits_atol"] is not None:
        parts.append(f"max|diff| <= {tolerance['logits_atol']:g}")
    if tolerance["top1_min"] is not None:
        parts.append(f"top-1 >= {tolerance['top1_min']:.0%}")
    if tolerance["greedy_exact"] and export_task(arch).greedy_checked:
        parts.append("identical greedy text")
    return ", ".join([*parts, "no NaN"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (CheckpointError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
