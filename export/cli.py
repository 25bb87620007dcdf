"""`python -m export CKPT`: a validated ONNX file with MultiMax as one fused node per use.

A thin command line over `export.pipeline.export_checkpoint`. Exit codes: 0 exported (and validated; also when
a check could not run, which the verdict names: `passed (1 check skipped: ...)`), 1 a validation tolerance was
missed (the report says which), 2 bad input (missing or broken checkpoint, unsupported model, unwritable output).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.onnx_export import DEFAULT_OPSET, ExportError
from export.pipeline import DEFAULT_BATCH_SIZES, MIN_OPSET, ExportOptions, export_checkpoint
from models.cli import add_load_hints
from models.loading import CheckpointError


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
    p.add_argument("--no-fuse", action="store_true", help="onnxruntime-genai folder (-o DIR) only: keep the traced "
                   "graph's RMSNorm, RoPE and projections as separate nodes (slower; for comparing and debugging)")
    p.add_argument("--samples", type=int, help="random inputs for validation (default: 100 vision inputs, fewer for "
                   "large models but every batch size at least once; 100 text cases)")
    p.add_argument("--batch-sizes", type=parse_batch_sizes, default=DEFAULT_BATCH_SIZES, help="e.g. 1,2,8")
    p.add_argument("--labels", type=Path, metavar="FILE", help="class names for a vision model: one a line, a JSON "
                   "list or an ImageNet class index (replaces those the checkpoint stores)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="fp16 model, MultiMax nodes kept in fp32")
    precision.add_argument("--int8", action="store_true", help="dynamic int8 quantization of the weight matmuls")
    precision.add_argument("--int4", action="store_true", help="onnxruntime-genai folder (-o DIR) only: 4-bit weight "
                           "matmuls (onnxruntime's MatMulNBits, blocks of 32)")
    p.add_argument("--trt", action="store_true", help="also build a TensorRT engine with the MultiMax plugin (GPU)")
    p.add_argument("--threads", type=int, help="PyTorch threads for the reference pass (default: the cores idle "
                   "when the export starts)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_load_hints(p)  # the same flags as `python -m models info` for foreign checkpoints
    return p


def options_from(args: argparse.Namespace) -> ExportOptions:
    return ExportOptions(
        output=Path(args.output) if args.output else None,
        opset=args.opset,
        inline=args.inline,
        fuse=not args.no_fuse,
        precision="fp16" if args.fp16 else "int8" if args.int8 else "int4" if args.int4 else "fp32",
        validate=not args.no_validate,
        samples=args.samples,
        batch_sizes=args.batch_sizes,
        num_heads=args.num_heads,
        ln_eps=args.ln_eps,
        qk_scale=args.qk_scale,
        preset=args.preset,
        variant=args.variant,
        use_ema=args.ema,
        labels=args.labels,
        dictionary=Path(args.dictionary) if args.dictionary else None,
        trt=args.trt,
        threads=args.threads,
        progress=not args.quiet,
        notify=lambda line: print(line, file=sys.stderr, flush=True),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = export_checkpoint(args.checkpoint, options_from(args))
    except (CheckpointError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.summary)
    return report.exit_code
