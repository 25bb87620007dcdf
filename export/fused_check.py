"""The export's check of the fused ops (MultiMax and the other reweighting functions): the same inputs
through onnxruntime with the custom-op library (plugins.ort_ops) and with the function bodies, outputs compared.

Both are what users get (the library where it builds, the bodies elsewhere), so both must agree. Two
measures, because only one of them is independent of the model's precision:

- each fused node against its own function body on the *same* inputs (those the node saw in the bodies' run),
  held to float32 rounding (`NODE_ATOL`, `NODE_RTOL`, elementwise) at every precision: this is the kernels' check;
- the model's outputs with the library against without it, held to the variant's own limit. In float32 that is
  float32 rounding too (`FUSED_FP32_TOL`); in an fp16 graph a 1e-7 difference in a node's float32 output can flip
  the rounding of the fp16 layers after it, a whole fp16 step (4.9e-4 near 1) that then propagates, so there
  the outputs are held to the fp16 variant's limit against PyTorch. Whether any flip happens is chance: on
  one CPU path and one set of inputs the outputs can come out bit-identical, on another a step apart.

The outputs' limit is export.limits' rule, tol x max(1, max|output|) (`limits.scale`), as every comparison of the
validation: rounding differences grow with the values they round, and a model's logits are as large as its
weights make them (~10 for a fairseq LM, where an AVX2 kernel's correct outputs differed by 1.34e-5 from the
bodies' while every node agreed to 1.9e-6). Below magnitude 1 the limit stays the variant's tol.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from export import limits
from export.limits import FUSED_FP32_TOL, NODE_ATOL, NODE_RTOL
from export.onnx_io import graph_session, initializer_arrays, load_graph
from plugins import ort_ops

_INLINE_LIMIT = 1 << 30  # larger models are written to a temporary file: a protobuf stops at 2 GiB


def discontinuous_ops(proto: onnx.ModelProto) -> list[str]:
    """The model's reweighting op types whose weights jump at a cut (models.reweighting `continuous=False`).

    The fused op and its body agree on identical inputs (tested per op, and per node below), but in a whole
    model the float32 rounding of the layers before (a different exp, another summation order) can move an
    entry that sits at the cut across it, which changes that entry's weight by a whole amount: measured up to
    3.5e-5 on the logits of an untrained Ev-SoftMax DeiT-small. Such models' outputs are held to the logits'
    limit instead.
    """
    from models.reweighting import FUNCTIONS

    cut = {op for spec in FUNCTIONS.values() if not spec.continuous for op in spec.op_types}
    return sorted({node.op_type for node in proto.graph.node if node.op_type in cut})


def _open(model: Path | bytes, level: ort.GraphOptimizationLevel, spinning: bool, fused: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if fused:
        ort_ops.register(options)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def cpu_session(
    path: Path | bytes,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    spinning: bool = True,
    fused: bool = True,
) -> ort.InferenceSession:
    """An onnxruntime CPU session; `spinning=False` stops idle threads busy-waiting after each run.

    `fused`: register the fused MultiMax ops (plugins.ort_ops) when available; False runs the function bodies.
    `path` may also be a serialized model.
    """
    return _open(path, level, spinning, fused)


def _fused_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in proto.graph.node if node.domain == ort_ops.DOMAIN]


def _probe_names(proto: onnx.ModelProto, nodes: Sequence[onnx.NodeProto]) -> list[str]:
    """The fused nodes' inputs that only a run can give (not graph inputs, not initializers), in order."""
    known = {i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer}
    return list(dict.fromkeys(name for node in nodes for name in node.input if name and name not in known))


def _bodies_session(path: Path, proto: onnx.ModelProto, probes: list[str], tmp: Path) -> ort.InferenceSession:
    """The function-body session of the model with the fused nodes' inputs as extra outputs."""
    for name in probes:
        if name not in {o.name for o in proto.graph.output}:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    if proto.ByteSize() < _INLINE_LIMIT:
        return graph_session(path, proto.SerializeToString())  # weights from path's folder
    probed = tmp / path.name
    onnx.save(proto, str(probed), save_as_external_data=True, location=probed.name + ".data")
    return cpu_session(probed, fused=False)


def _node_model(proto: onnx.ModelProto, node: onnx.NodeProto, values: dict[str, np.ndarray]) -> bytes:
    """One fused node alone, its inputs graph inputs, with the model's function definitions and opsets."""
    inputs = [
        onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(values[name].dtype), None)
        for name in dict.fromkeys(i for i in node.input if i)
    ]
    outputs = [onnx.helper.make_empty_tensor_value_info(node.output[0])]
    graph = onnx.helper.make_graph([node], "node", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=proto.opset_import, functions=proto.functions)
    model.ir_version = proto.ir_version
    return model.SerializeToString()


def _node_differences(
    proto: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], runs: list[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """Every fused node against its function body on the inputs it saw in each run (`runs`: name -> value)."""
    worst, excess, worst_node = 0.0, 0.0, ""
    for node in nodes:
        model = _node_model(proto, node, runs[0])
        level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        fused, body = _open(model, level, True, fused=True), _open(model, level, True, fused=False)
        for values in runs:
            feed = {name: values[name] for name in dict.fromkeys(i for i in node.input if i)}
            got, want = fused.run(None, feed)[0].astype(np.float64), body.run(None, feed)[0].astype(np.float64)
            diff = np.abs(got - want)
            over = float((diff - NODE_RTOL * np.abs(want)).max(initial=0.0))
            if float(diff.max(initial=0.0)) > worst:
                worst, worst_node = float(diff.max(initial=0.0)), f"{node.op_type} {node.name}".strip()
            excess = max(excess, over)
    return {"count": len(nodes), "max_abs": worst, "worst": worst_node, "atol": NODE_ATOL, "rtol": NODE_RTOL,
            "passed": excess <= NODE_ATOL}  # fmt: skip


def compare_fused(
    path: Path,
    feeds: list[dict[str, np.ndarray]],
    fused_outputs: list[list[np.ndarray]] | None = None,
    atol: float | None = FUSED_FP32_TOL,
    loose_atol: float | None = None,
) -> dict[str, Any]:
    """The library against the function bodies: each fused node on identical inputs (always enforced), and the
    model's outputs over every feed (`failures` if their max abs difference > atol).

    `atol`: the outputs' tol (export.limits: FUSED_FP32_TOL for fp32, the logits' tol for fp16), times `limits.scale`
    of the function bodies' outputs (reported as "limit" and "output_scale");
    None: reported, not enforced (int8 graphs: a float32 rounding difference in front of a dynamic quantization
    can move a value by a whole quantization step, 2.2e-3 on the digits model). `loose_atol` (the logits' limit
    against PyTorch) replaces `atol` for models with discontinuous ops (`discontinuous_ops`), listed under
    "discontinuous_ops".

    `fused_outputs`: the model's outputs for each feed, as a session with the library (ORT_ENABLE_ALL) already
    returned them (the validation's own run), so only the function-body session is built here.
    """
    lib = ort_ops.library()
    if not ort_ops.uses_multimax(path):
        return {"in_use": False, "reason": "the model has no multimax nodes", "failures": []}
    if not lib.available:
        # the check did not run: the export's verdict names it (export.summary.skipped_checks)
        return {"in_use": False, "reason": lib.reason, "failures": []}
    proto = load_graph(path)  # without its weights (export.onnx_io)
    cut_ops = discontinuous_ops(proto)
    if cut_ops and atol is not None:
        atol = max(atol, loose_atol if loose_atol is not None else atol)
    names = [o.name for o in proto.graph.output]
    if fused_outputs is None:
        fused = cpu_session(path, fused=True)
        fused_outputs = [fused.run(None, feed) for feed in feeds]
    nodes = _fused_nodes(proto)
    probes = _probe_names(proto, nodes)
    constants = initializer_arrays(path, proto, (name for node in nodes for name in node.input))
    worst, scale, runs = 0.0, 1.0, []
    with tempfile.TemporaryDirectory(prefix="multimax-fused-check.") as tmp:
        bodies = _bodies_session(path, proto, probes, Path(tmp))
        for feed, outputs in zip(feeds, fused_outputs, strict=True):
            got = bodies.run([*names, *probes], feed)
            for a, b in zip(outputs, got[: len(names)], strict=True):
                worst = max(worst, float(np.abs(a.astype(np.float64) - b).max(initial=0.0)))
            scale = max(scale, limits.scale(got[: len(names)]))
            runs.append(constants | feed | dict(zip(probes, got[len(names) :], strict=True)))
    per_node = _node_differences(proto, nodes, runs)
    judged = limits.judged(worst, atol, scale)
    limit = judged["limit"]
    failures = [line + " vs function bodies" for line in limits.failure("fused ops", "model outputs", judged)]
    if not per_node["passed"]:
        failures.append(
            f"fused ops: {per_node['worst']} max abs diff {per_node['max_abs']:.3g} > {NODE_ATOL} + {NODE_RTOL}*|x| "
            "vs its function body on the same inputs"
        )
    return {
        "in_use": True, "library": str(lib.path), "kernel_path": ort_ops.kernel_path(), "feeds": len(feeds),
        "max_abs_vs_function_bodies": worst, "atol": atol, "output_scale": scale, "limit": limit,
        "discontinuous_ops": cut_ops, "nodes": per_node, "failures": failures,
    }  # fmt: skip


def fused_summary(report: dict[str, Any]) -> str:
    """One line for the export's summary."""
    if not report["in_use"]:
        return f"fused ops (onnxruntime): not used, {report['reason']}"
    if report["atol"] is None:
        limit = "(reported, not enforced)"
    else:
        rule = (f"limit {report['limit']:.2e} = {report['atol']:g} x scale {report['output_scale']:.3g}"
                if "limit" in report else f"limit {report['atol']:g}")  # a report written before the limit scaled
        cut = report.get("discontinuous_ops")
        limit = f"({rule}, the logits' one: {', '.join(cut)} cut rows)" if cut else f"({rule})"
    nodes = report.get("nodes")
    each = "" if nodes is None else (
        f"each of {nodes['count']} nodes on its own inputs {nodes['max_abs']:.2e} (limit {nodes['atol']:g}), "
    )  # fmt: skip
    return (
        f"fused ops (onnxruntime, {report['kernel_path']}) vs function bodies: {each}"
        f"model outputs {report['max_abs_vs_function_bodies']:.2e} {limit}"
    )
