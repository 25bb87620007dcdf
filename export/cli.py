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

from export.onnx_export import DEFAULT_OPSET, ExportError, export_vision
from export.validate import check_graph, validate_vision
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
    p.add_argument("-o", "--output", help="ONNX file (default: <checkpoint stem>.onnx next to it)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (>= {MIN_OPSET})")
    p.add_argument("--inline", action="store_true", help="write the flat elementwise graph instead of MultiMax nodes")
    p.add_argument("--no-validate", action="store_true", help="skip the comparison with PyTorch")
    p.add_argument("--samples", type=int, default=100, help="random inputs for validation")
    p.add_argument("--batch-sizes", type=parse_batch_sizes, default=(1, 2, 8), help="e.g. 1,2,8")
    p.add_argument("--num-heads", type=int, help="heads, for foreign checkpoints that do not store them")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    if args.opset < MIN_OPSET:
        raise ExportError(f"--opset {args.opset} is too old; MultiMax export needs opset >= {MIN_OPSET}")
    ckpt_path = Path(args.checkpoint)
    model, ckpt, _ = load(ckpt_path, num_heads=args.num_heads)
    if ckpt.arch != "deit":
        raise ExportError(f"{ckpt_path}: {ckpt.arch} export (decoder with KV cache) is not available yet")
    out = Path(args.output) if args.output else ckpt_path.with_suffix(".onnx")
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: directory {out.parent} does not exist")
    start = time.perf_counter()
    try:
        export_vision(model, ckpt, out, opset=args.opset, inline=args.inline)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    export_s = time.perf_counter() - start
    report = {"checkpoint": str(ckpt_path), "onnx": str(out), "export_seconds": round(export_s, 2)}
    report["graph"] = check_graph(out)
    if not args.no_validate:
        start = time.perf_counter()
        report["validation"] = validate_vision(
            model, out, ckpt.config, samples=args.samples, batch_sizes=args.batch_sizes, progress=not args.quiet
        )
        report["validation_seconds"] = round(time.perf_counter() - start, 2)
    problems = report["graph"]["problems"] + report.get("validation", {}).get("failures", [])
    report["passed"] = not problems
    report_path = out.with_suffix(".validation.json")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report, report_path))
    return 0 if not problems else 1


def summary(report: dict, report_path: Path) -> str:
    g = report["graph"]
    kinds = ", ".join(g["custom_nodes"]) or "inlined"
    lines = [
        f"wrote {report['onnx']} in {report['export_seconds']:.1f} s "
        f"(opset {g['opset'].get('ai.onnx')}, {g['multimax_nodes']} MultiMax nodes: {kinds})",
    ]
    v = report.get("validation")
    if v:
        for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"):
            s = v[level]
            lines.append(
                f"  {level:<17} max|diff| {s['max_abs']:.2e}  mean {s['mean_abs']:.2e}  p99 {s['p99_abs']:.2e}  "
                f"top-1 agreement {s['top1_agreement']:.0%}  NaN {s['nan_count']}"
            )
        lines.append(f"  {v['samples']} random inputs, batch sizes {v['batch_sizes']}, tolerance {v['tolerance_abs']}")
    problems = g["problems"] + (v or {}).get("failures", [])
    lines.append(("FAILED: " + "; ".join(problems)) if problems else "passed")
    lines.append(f"report: {report_path}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (CheckpointError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
