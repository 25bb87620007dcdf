"""ONNX function bodies for the `multimax::*` nodes the models emit under export.

Each use of MultiMax is one node whose attributes carry the 8 learned parameters (plus the TensorRT
plugin's name/version/namespace); its FunctionProto body is the cheapest correct elementwise chain:
squares by Mul (no Pow), the mask added after the modulation, then Softmax. Runtimes without the
plugin (onnxruntime) inline the body. They are attached after export because the exporter's own
passes inline every function they see.

The three bodies share one sigma chain, built here node by node; the node's `ranges`/`ts`
attributes reach it through attribute references (`ref_attr_name`), so the body is written once per
op type and every node's own parameters flow in when a runtime inlines it.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, helper

from models.onnx_contract import ONNX_DOMAIN, PLUGIN_ATTRIBUTES

FUNCTION_NAMES = ("MultiMax", "MultiMaxNoMask", "MultiMaxSigma")
ATTRIBUTES = ("ranges", "ts", "order", *PLUGIN_ATTRIBUTES)


def _param_constant(name: str) -> onnx.NodeProto:
    """Constant whose `value_floats` is the calling node's attribute `name`."""
    node = helper.make_node("Constant", [], [name])
    ref = AttributeProto(name="value_floats", ref_attr_name=name, type=AttributeProto.FLOATS)
    node.attribute.append(ref)
    return node


def _sigma_nodes(x: str, out: str) -> list[onnx.NodeProto]:
    """sigma(x) = x + ts0*relu(r0-x) + ts1*relu(x-r1) + ts2*relu(r2-x)^2 + ts3*relu(x-r3)^2.

    Order-1 nodes carry ts[2:] = 0, so one chain serves both orders.
    """
    n = helper.make_node
    return [
        _param_constant("ranges"),
        _param_constant("ts"),
        n("Split", ["ranges"], ["r0", "r1", "r2", "r3"], axis=0, num_outputs=4),
        n("Split", ["ts"], ["t0", "t1", "t2", "t3"], axis=0, num_outputs=4),
        n("Sub", ["r0", x], ["d0"]), n("Relu", ["d0"], ["low1"]), n("Mul", ["t0", "low1"], ["a0"]),
        n("Sub", [x, "r1"], ["d1"]), n("Relu", ["d1"], ["high1"]), n("Mul", ["t1", "high1"], ["a1"]),
        n("Sub", ["r2", x], ["d2"]), n("Relu", ["d2"], ["low2"]), n("Mul", ["low2", "low2"], ["sq2"]),
        n("Mul", ["t2", "sq2"], ["a2"]),
        n("Sub", [x, "r3"], ["d3"]), n("Relu", ["d3"], ["high2"]), n("Mul", ["high2", "high2"], ["sq3"]),
        n("Mul", ["t3", "sq3"], ["a3"]),
        n("Add", [x, "a0"], ["s0"]), n("Add", ["s0", "a1"], ["s1"]), n("Add", ["s1", "a2"], ["s2"]),
        n("Add", ["s2", "a3"], [out]),
    ]  # fmt: skip


def function_protos(opset: int) -> list[onnx.FunctionProto]:
    """The three bodies, written against the model's own default-domain opset (the checker requires it)."""
    softmax = helper.make_node("Softmax", ["modulated"], ["y"], axis=-1)
    masked = [
        helper.make_node("Add", ["sigma", "mask"], ["modulated"]),  # mask AFTER the modulation: no inf*0, no NaN
        softmax,
    ]
    bodies = {
        "MultiMax": (["x", "mask"], [*_sigma_nodes("x", "sigma"), *masked]),
        "MultiMaxNoMask": (["x"], [*_sigma_nodes("x", "modulated"), softmax]),
        "MultiMaxSigma": (["x"], _sigma_nodes("x", "y")),
    }
    return [
        helper.make_function(
            ONNX_DOMAIN, name, inputs, ["y"], nodes, [helper.make_opsetid("", opset)], attributes=list(ATTRIBUTES)
        )
        for name, (inputs, nodes) in bodies.items()
    ]
