"""The FunctionProtos of the `multimax::*` nodes the models emit under export, one per op type of the reweighting
family (plugins.family), and the static check of the nodes' attributes.

Each use of a reweighting function is one node whose attributes carry its parameters (plus the TensorRT plugin's
name/version/namespace); runtimes without the plugin or custom op (onnxruntime without plugins/ort_ops) inline the
body (plugins.onnx_bodies). They are attached after export because the exporter's own passes inline every function
they see.
"""

from __future__ import annotations

import onnx
from onnx import helper

from models.onnx_contract import ONNX_DOMAIN, PLUGIN_ATTRIBUTES, REWEIGHTING_ATTRIBUTES, REWEIGHTING_OPS
from plugins.family import MEMBERS
from plugins.onnx_bodies import Body


def function_protos(opset: int, ops: set[str] | None = None) -> list[onnx.FunctionProto]:
    """The bodies of `ops` (op types; default every op of the family), against the model's default-domain opset
    (the checker requires it)."""
    out = []
    for member in MEMBERS.values():
        for op in member.op_types:
            if ops is not None and op not in ops:
                continue
            masked = member.takes_mask(op)
            b = Body(masked)
            b.name_output(member.op_of(op).body(b), "y")
            out.append(helper.make_function(
                ONNX_DOMAIN, op, ["x", "mask"] if masked else ["x"], ["y"], b.nodes, [helper.make_opsetid("", opset)],
                attributes=[*member.attributes, *PLUGIN_ATTRIBUTES],
            ))  # fmt: skip
    return out


def _dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each value's inferred dims (None where symbolic), for the graph's top level."""
    try:
        graph = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception:  # a graph onnx cannot infer: the checks that need shapes are skipped
        graph = model.graph
    out: dict[str, list[int | None]] = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        t = info.type.tensor_type
        if t.HasField("shape"):
            out[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def attribute_problems(model: onnx.ModelProto) -> list[str]:
    """What is wrong with the reweighting nodes' attributes, one line each (empty: nothing).

    The fused ops refuse these at session creation, but a function body inlines whatever it is given and fails
    (or, for k/eps/m, computes nonsense) only when run: this checks the contract statically, for the exporter
    and for the server's load of a file it did not write. Per-head `offset`/`scale` need length 1 or the
    input's axis 1 (the heads of a rank-4 input), where shape inference knows it.
    """
    ops = {op: base for base in REWEIGHTING_OPS.values() for op in (base, base + "NoMask")}
    dims: dict[str, list[int | None]] | None = None
    problems = []
    for node in model.graph.node:
        if node.domain != ONNX_DOMAIN or node.op_type not in ops:
            continue
        where = f"{node.op_type} node {node.name or node.output[0]!r}"
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        missing = [a for a in REWEIGHTING_ATTRIBUTES[ops[node.op_type]] if a not in attrs]
        if missing:
            problems.append(f"{where}: missing attribute(s) {', '.join(missing)}")
            continue
        if "k" in attrs and not attrs["k"] >= 1:
            problems.append(f"{where}: k must be >= 1, got {attrs['k']}")
        if "eps" in attrs and not 0 < attrs["eps"] < 1:
            problems.append(f"{where}: eps must be in (0, 1), got {attrs['eps']}")
        if "m" in attrs and not attrs["m"] >= 0:
            problems.append(f"{where}: m must be >= 0 (0 means sqrt(l)), got {attrs['m']}")
        if "offset" not in attrs:
            continue
        offset, scale = list(attrs["offset"]), list(attrs["scale"])
        if not offset or len(offset) != len(scale):
            problems.append(f"{where}: offset and scale need the same length >= 1, got {len(offset)} and {len(scale)}")
            continue
        if not all(s > 0 for s in scale):
            problems.append(f"{where}: every scale must be > 0, got {min(scale)}")
        if len(offset) > 1:
            dims = _dims(model) if dims is None else dims
            shape = dims.get(node.input[0])
            if shape is not None and len(shape) != 4:
                problems.append(f"{where}: {len(offset)} per-head values need a rank-4 input (B, H, T, S), "
                                f"it has rank {len(shape)}")
            elif shape is not None and shape[1] is not None and shape[1] != len(offset):
                problems.append(f"{where}: {len(offset)} per-head values for {shape[1]} heads (axis 1)")
    return problems
