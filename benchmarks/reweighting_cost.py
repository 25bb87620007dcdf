"""`python -m benchmarks.reweighting_cost`: each reweighting function's inference cost against SoftMax in DeiT-small,
onnxruntime CPU, fused op (plugins.ort_ops) and ONNX function body side by side.

The models: DeiT-small's softmax twin (`python -m models init deit_small --multimax none`, exported once), and
for each function the same graph with every attention Softmax node replaced by the function's `multimax::<Op>NoMask`
node (with its function body; default options, per-head Gaussian/Laplacian parameters for DeiT-small's 6 heads).
The rewrite gives exactly the twin's model with only the reweighting node changed, which is what the cost ratio
needs (an exported model of the function has the same node in the same place). Per function, the twin, the
fused op and the body run interleaved (rounds alternating who goes first); the ratio is the median of the
per-round ratios to the twin. Output max |fused - body| is reported as a check.

`--node STD`: the node alone instead of the model, as DeiT-small's attention sees it (scores (B, 6, 197, 197) of
standard deviation STD scaled by a Mul, the node, a Mul reading its output; plugins.ort_ops.graphs), against
onnxruntime's Softmax in the same place: small STD gives near-uniform rows (an untrained model's), large STD
peaked ones.

Results: a JSON file (default runs/bench_reweighting.json) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.cpu_runtimes import pixels, session
from benchmarks.export_time import interleaved, make_checkpoints, write_results
from export.pipeline import ExportOptions, export_checkpoint
from models.multimax import paper_params
from models.onnx_contract import ONNX_DOMAIN, REWEIGHTING_OPS
from models.reweighting import FUNCTIONS, OTHER_FUNCTIONS
from plugins import ort_ops
from plugins.onnx_functions import function_protos
from plugins.ort_ops.graphs import reweighting_node, scores_model


def node_attributes(name: str, heads: int) -> dict[str, Any]:
    """The node's attributes: the function's default options; per-head offset 0 / scale 1 for `heads` heads."""
    attrs: dict[str, Any] = dict(FUNCTIONS[name].options)
    if FUNCTIONS[name].params:
        attrs |= {"offset": [0.0] * heads, "scale": [1.0] * heads}
    return attrs


def swap_softmax(twin: onnx.ModelProto, name: str, heads: int) -> onnx.ModelProto:
    """The twin with each last-axis Softmax node replaced by `name`'s NoMask node (same input and output)."""
    model = onnx.ModelProto()
    model.CopyFrom(twin)
    op = REWEIGHTING_OPS[name] + "NoMask"
    swapped = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if axis != -1:
            raise ValueError(f"Softmax {node.name!r} reduces over axis {axis}, not the last one")
        new = reweighting_node(op, list(node.input), node.output[0], node_attributes(name, heads))
        new.name = node.name
        model.graph.node[i].CopyFrom(new)
        swapped += 1
    if not swapped:
        raise ValueError("the twin has no Softmax node to replace")
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if not any(o.domain == ONNX_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ONNX_DOMAIN, 1))
    if not any(f.domain == ONNX_DOMAIN and f.name == op for f in model.functions):
        model.functions.extend(function_protos(opset, {op}))
    return model


def bench_function(
    twin: Path, name: str, feed: Mapping[str, np.ndarray], rounds: int, calls: int, threads: int, heads: int,
    workdir: Path,
) -> dict[str, Any]:  # fmt: skip
    """The twin, the fused op and the function body interleaved; ratios to the twin, and max |fused - body|."""
    path = workdir / f"{twin.stem}_{name}.onnx"
    onnx.save(swap_softmax(onnx.load(str(twin)), name, heads), str(path))
    sessions = {
        "softmax": session(twin, None, threads),
        "fused": session(path, ort_ops.register, threads),
        "body": session(path, None, threads),
    }
    runs_before = ort_ops.run_counts()[0]
    fused_out = sessions["fused"].run(None, dict(feed))[0]
    if ort_ops.run_counts()[0] == runs_before:
        raise RuntimeError(f"{name}: the fused op did not run (is the library current?)")
    body_out = sessions["body"].run(None, dict(feed))[0]
    timed = interleaved(
        {k: (lambda s=s: s.run(None, dict(feed))) for k, s in sessions.items()}, rounds, calls, f"{name}"
    )
    return timed | {"max_abs_fused_vs_body": float(np.abs(fused_out - body_out).max())}


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Measured {results['date']} with `{results['command']}` ({results['machine']})", ""]
    lines += [
        f"| function ({results.get('what', 'DeiT-small')}, batch {results['batch']}) | fused op / SoftMax "
        "| function body / SoftMax | SoftMax ms | fused ms | body ms | max abs fused vs body |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["functions"].items():
        lines.append(
            f"| {name} | {r['fused']['ratio_to_softmax']:.3f} | {r['body']['ratio_to_softmax']:.3f} "
            f"| {r['softmax']['median_ms']:.1f} | {r['fused']['median_ms']:.1f} | {r['body']['median_ms']:.1f} "
            f"| {r['max_abs_fused_vs_body']:.1e} |"
        )
    return "\n".join(lines)


def export_twin(tmp: Path) -> Path:
    """DeiT-small's softmax twin (random init: the cost does not depend on the weights' values) as ONNX."""
    _, sm_ckpt = make_checkpoints(tmp)
    options = ExportOptions(output=sm_ckpt.with_suffix(".onnx"), validate=False, progress=False)
    if export_checkpoint(sm_ckpt, options).exit_code:
        raise RuntimeError(f"could not export {sm_ckpt.name}")
    return sm_ckpt.with_suffix(".onnx")


def run(
    twin: Path, feed: Mapping[str, np.ndarray], names: list[str], rounds: int, calls: int, threads: int, heads: int,
    workdir: Path,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    return {name: bench_function(twin, name, feed, rounds, calls, threads, heads, workdir) for name in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reweighting_cost", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds per function")
    p.add_argument("--calls", type=int, default=2, help="model runs per contender and round")
    p.add_argument("--only", nargs="+", choices=OTHER_FUNCTIONS, default=list(OTHER_FUNCTIONS), metavar="FUNCTION",
                   help=f"functions to measure (default all: {', '.join(OTHER_FUNCTIONS)})")  # fmt: skip
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: one per core)")
    p.add_argument("--twin", type=Path, help="an exported DeiT-small softmax twin (default: initialise and export one)")
    p.add_argument("--heads", type=int, default=6, help="attention heads of the twin (per-head Gaussian/Laplacian)")
    p.add_argument("--node", type=float, metavar="STD", help="time the node alone on scores of this std (see above)")
    p.add_argument("-o", "--output", default="runs/bench_reweighting.json")
    args = p.parse_args(argv)
    if min(args.rounds, args.calls, args.batch, args.heads) < 1:
        p.error("--rounds, --calls, --batch and --heads must be >= 1")
    if args.node is not None and args.node <= 0:
        p.error("--node needs a standard deviation > 0")
    if args.twin is not None and not args.twin.is_file():
        p.error(f"--twin {args.twin}: no such file")
    lib = ort_ops.library()
    if not lib.available:
        print(f"fused ops unavailable: {lib.reason}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "python -m benchmarks.reweighting_cost " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start, onnxruntime "
        f"{ort.__version__} (fused ops: {ort_ops.kernel_path()})",
        "batch": args.batch,
        "what": f"the node alone, (B, 6, 197, 197) scores of std {args.node}" if args.node else "DeiT-small",
    }
    with tempfile.TemporaryDirectory(prefix="multimax-bench-reweighting.") as tmp_name:
        tmp = Path(tmp_name)
        twin = args.twin
        if args.node:
            twin = tmp / "node_softmax.onnx"
            twin.write_bytes(scores_model("Softmax", *paper_params(0), heads=args.heads))
            scores = np.random.default_rng(0).standard_normal((args.batch, args.heads, 197, 197)) * args.node
            feed = {"scores": scores.astype(np.float32)}
        else:
            if twin is None:
                print("exporting DeiT-small's softmax twin (once) ...", file=sys.stderr)
                twin = export_twin(tmp)
            feed = {"pixel_values": pixels(args.batch)}
        results["functions"] = run(twin, feed, args.only, args.rounds, args.calls, args.threads, args.heads, tmp)
    results["machine"] += f"; load average {os.getloadavg()[0]:.1f} at the end"
    return write_results(results, Path(args.output), markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
