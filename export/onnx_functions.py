"""ONNX function bodies for the `multimax::*` nodes the models emit under export.

Each use of MultiMax is one node whose attributes carry the 8 learned parameters (plus the TensorRT
plugin's name/version/namespace); its FunctionProto body is the cheapest correct elementwise chain:
squares by Mul (no Pow), the mask added after the modulation, then Softmax. Runtimes without the
plugin (onnxruntime) inline the body. They are attached after export because the exporter's own
passes inline every function they see.
"""

from __future__ import annotations

import onnx
import onnxscript
from onnxscript import FLOAT

from models.multimax import ONNX_DOMAIN

FUNCTION_NAMES = ("MultiMax", "MultiMaxNoMask", "MultiMaxSigma")


def function_protos(opset: int) -> list[onnx.FunctionProto]:
    """The three bodies, written against the model's own default-domain opset (checker requires it)."""
    op = getattr(onnxscript, f"opset{opset}")
    domain = onnxscript.values.Opset(ONNX_DOMAIN, 1)

    # The second-order terms use ranges[2:]/ts[2:]; order 1 nodes carry zeros there, so one body serves both.
    @onnxscript.script(opset=domain, default_opset=op)
    def MultiMaxSigma(
        x: FLOAT, ranges: list[float], ts: list[float], order: int,
        plugin_name: str, plugin_version: str, plugin_namespace: str,
    ) -> FLOAT:  # fmt: skip
        r0, r1, r2, r3 = op.Split(op.Constant(value_floats=ranges), num_outputs=4)
        t0, t1, t2, t3 = op.Split(op.Constant(value_floats=ts), num_outputs=4)
        low2 = op.Relu(op.Sub(r2, x))
        high2 = op.Relu(op.Sub(x, r3))
        y = op.Add(x, op.Mul(t0, op.Relu(op.Sub(r0, x))))
        y = op.Add(y, op.Mul(t1, op.Relu(op.Sub(x, r1))))
        y = op.Add(y, op.Mul(t2, op.Mul(low2, low2)))
        return op.Add(y, op.Mul(t3, op.Mul(high2, high2)))

    @onnxscript.script(opset=domain, default_opset=op)
    def MultiMaxNoMask(
        x: FLOAT, ranges: list[float], ts: list[float], order: int,
        plugin_name: str, plugin_version: str, plugin_namespace: str,
    ) -> FLOAT:  # fmt: skip
        r0, r1, r2, r3 = op.Split(op.Constant(value_floats=ranges), num_outputs=4)
        t0, t1, t2, t3 = op.Split(op.Constant(value_floats=ts), num_outputs=4)
        low2 = op.Relu(op.Sub(r2, x))
        high2 = op.Relu(op.Sub(x, r3))
        y = op.Add(x, op.Mul(t0, op.Relu(op.Sub(r0, x))))
        y = op.Add(y, op.Mul(t1, op.Relu(op.Sub(x, r1))))
        y = op.Add(y, op.Mul(t2, op.Mul(low2, low2)))
        y = op.Add(y, op.Mul(t3, op.Mul(high2, high2)))
        return op.Softmax(y, axis=-1)

    @onnxscript.script(opset=domain, default_opset=op)
    def MultiMax(
        x: FLOAT, mask: FLOAT, ranges: list[float], ts: list[float], order: int,
        plugin_name: str, plugin_version: str, plugin_namespace: str,
    ) -> FLOAT:  # fmt: skip
        r0, r1, r2, r3 = op.Split(op.Constant(value_floats=ranges), num_outputs=4)
        t0, t1, t2, t3 = op.Split(op.Constant(value_floats=ts), num_outputs=4)
        low2 = op.Relu(op.Sub(r2, x))
        high2 = op.Relu(op.Sub(x, r3))
        y = op.Add(x, op.Mul(t0, op.Relu(op.Sub(r0, x))))
        y = op.Add(y, op.Mul(t1, op.Relu(op.Sub(x, r1))))
        y = op.Add(y, op.Mul(t2, op.Mul(low2, low2)))
        y = op.Add(y, op.Mul(t3, op.Mul(high2, high2)))
        return op.Softmax(op.Add(y, mask), axis=-1)  # mask AFTER the modulation: no inf*0, no NaN

    return [f.to_function_proto() for f in (MultiMax, MultiMaxNoMask, MultiMaxSigma)]
