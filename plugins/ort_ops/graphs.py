"""Small ONNX graphs around one `multimax::*` node (or its Softmax twin), for the tests and the operator
benchmark: the node as the exporter writes it, with its function body, so the same bytes run fused
(library registered) or inlined (not registered). MultiMax's ops and the other reweighting functions'
(models.onnx_contract.REWEIGHTING_OPS, e.g. `SparseMax` / `SparseMaxNoMask`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnx import NodeProto, TensorProto, helper

from models.onnx_contract import MULTIMAX_OP, ONNX_DOMAIN, plugin_attrs
from plugins.onnx_functions import function_protos

OPSET = 18
Shape = Sequence[int | str] | None


def _model(nodes: list, inputs: list, output: str, initializers: Sequence = ()) -> bytes:
    graph = helper.make_graph(
        nodes, "multimax_op", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        list(initializers),
    )  # fmt: skip
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(ONNX_DOMAIN, 1)]
    functions = function_protos(OPSET)
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, ir_version=10)
    return model.SerializeToString()


def _node(op: str, inputs: list[str], output: str, ranges: Sequence[float], ts: Sequence[float], order: int):
    if op == "Softmax":
        return helper.make_node("Softmax", inputs[:1], [output], axis=-1)
    return helper.make_node(
        op, inputs, [output], domain=ONNX_DOMAIN, ranges=list(ranges), ts=list(ts), order=order, **plugin_attrs(op)
    )


def op_model(op: str, ranges: Sequence[float], ts: Sequence[float], order: int, shape: Shape = None) -> bytes:
    """x (and mask for MultiMax) -> the node -> y, graph inputs of the given (default: unknown) shape."""
    names = ["x", "mask"] if op == MULTIMAX_OP else ["x"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]
    return _model([_node(op, names, "y", ranges, ts, order)], inputs, "y")


def reweighting_node(op: str, inputs: list[str], output: str, attrs: Mapping[str, Any]) -> NodeProto:
    """One reweighting node as the contract spells it (op: a masked op type or its NoMask twin)."""
    return helper.make_node(op, inputs, [output], domain=ONNX_DOMAIN, **plugin_attrs(op), **attrs)


def reweighting_model(op: str, attrs: Mapping[str, Any], shape: Shape = None) -> bytes:
    """x (and mask unless `op` ends in NoMask) -> the reweighting node -> y."""
    names = ["x"] if op.endswith("NoMask") else ["x", "mask"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]
    return _model([reweighting_node(op, names, "y", attrs)], inputs, "y")


def scores_model(op: str, ranges: Sequence[float], ts: Sequence[float], order: int = 2, heads: int = 6) -> bytes:
    """The attention's view of the node: scores (B, heads, T, T) * scale -> node -> * 1, so that, as in a
    model, the node's input is an intermediate it may overwrite and its output is read by another node.
    `op` may be "Softmax" (the twin); MultiMax takes a decoder's mask (B, 1, T, T) as a second input."""
    names = ["x", "mask"] if op == MULTIMAX_OP else ["x"]
    return _scores_model(_node(op, names, "p", ranges, ts, order), heads, op == MULTIMAX_OP)


def reweighting_scores_model(op: str, attrs: Mapping[str, Any], heads: int = 6) -> bytes:
    """`scores_model` around a reweighting node (masked ops take the (B, 1, T, T) mask input)."""
    masked = not op.endswith("NoMask")
    return _scores_model(reweighting_node(op, ["x", "mask"] if masked else ["x"], "p", attrs), heads, masked)


def _scores_model(node: NodeProto, heads: int, masked: bool) -> bytes:
    nodes = [helper.make_node("Mul", ["scores", "scale"], ["x"]), node, helper.make_node("Mul", ["p", "one"], ["y"])]
    inputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", heads, "tokens", "tokens"])]
    if masked:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, "tokens", "tokens"]))
    consts = [
        helper.make_tensor("scale", TensorProto.FLOAT, [], [0.125]),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
    ]
    return _model(nodes, inputs, "y", consts)
