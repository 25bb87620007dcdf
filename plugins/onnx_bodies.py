"""ONNX function bodies of the reweighting family's ops, in standard ONNX ops only, so that onnxruntime (or any
runtime) without a fused kernel inlines them. One builder per function (plugins.family names which is whose); the
node's attributes reach the body through attribute references (`ref_attr_name`), so a body is written once per op
type and every node's own values flow in when a runtime inlines it.

MultiMax: the cheapest correct elementwise chain, squares by Mul (no Pow), the mask added AFTER the modulation, then
Softmax (`MultiMaxSigma` is the chain alone). The others reduce over the last axis in float32 and follow the
contract's masking rule (docs/REWEIGHTING.md): masked iff mask <= -1e4, masked entries 0, a one-entry row exactly 1,
an empty row uniform. SparseMax and EntMax-1.5 are the exact sort-based algorithms: a full-length TopK sorts each row,
CumSum gives the prefix sums, the support size is a ReduceSum over a comparison and GatherElements reads tau at it:
the cheapest exact standard-op graph (no loop, no bisection). The others are softmax over a subset or of transformed
scores.
"""

from __future__ import annotations

import itertools
from typing import Any

import onnx
from onnx import AttributeProto, TensorProto, helper

from models.onnx_contract import MASKED_BELOW

ATTRIBUTE_TYPES = {"k": AttributeProto.INT, "offset": AttributeProto.FLOATS, "scale": AttributeProto.FLOATS,
              "eps": AttributeProto.FLOAT, "m": AttributeProto.FLOAT, "ranges": AttributeProto.FLOATS,
              "ts": AttributeProto.FLOATS, "order": AttributeProto.INT}  # fmt: skip
_REF_VALUE = {
    AttributeProto.INT: "value_int", AttributeProto.FLOATS: "value_floats", AttributeProto.FLOAT: "value_float"
}


class Body:
    """Node-by-node builder of one function body; every op returns its (fresh) output name."""

    def __init__(self, masked: bool) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.masked = masked
        self._names = itertools.count()

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        return self.ops(op_type, 1, *inputs, **attrs)[0]

    def ops(self, op_type: str, n_out: int, *inputs: str, **attrs: Any) -> list[str]:
        """A node with `n_out` outputs (fresh names)."""
        outs = [f"t{next(self._names)}" for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs

    def named(self, op_type: str, inputs: list[str], outs: list[str], **attrs: Any) -> str:
        """A node whose outputs have the given names (a body that must keep the names it always had)."""
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0]

    def name_output(self, result: str, name: str) -> None:
        """Give the body's result the name `name`: the last node's output renamed where it produced it (no extra
        node), else an Identity."""
        last = self.nodes[-1] if self.nodes else None
        if last is not None and result in last.output:
            last.output[list(last.output).index(result)] = name
        else:
            self.nodes.append(helper.make_node("Identity", [result], [name]))

    def const(self, value: float | int | list[int]) -> str:
        if isinstance(value, list):
            return self.op("Constant", value_ints=value)
        if isinstance(value, int):
            return self.op("Constant", value_int=value)
        return self.op("Constant", value_float=float(value))

    def attr(self, name: str, out: str | None = None) -> str:
        """A Constant holding the calling node's attribute `name` (output `out`, else a fresh name)."""
        out = out or f"t{next(self._names)}"
        node = helper.make_node("Constant", [], [out])
        kind = ATTRIBUTE_TYPES[name]
        node.attribute.append(AttributeProto(name=_REF_VALUE[kind], ref_attr_name=name, type=kind))
        self.nodes.append(node)
        return out

    # ---- shared pieces ----------------------------------------------------------------------------------

    def reduce(self, op_type: str, x: str) -> str:
        return self.op(op_type, x, self.const([-1]), keepdims=1)

    def prologue(self) -> tuple[str, str | None, str | None]:
        """(y, keep, count): y = x + mask with masked entries 0; keep (bool) and the unmasked count (float)."""
        if not self.masked:
            return "x", None, None
        y = self.op("Add", "x", "mask")
        keep = self.op("Expand", self.op("Greater", "mask", self.const(MASKED_BELOW)), self.op("Shape", y))
        y = self.op("Where", keep, y, self.const(0.0))
        count = self.reduce("ReduceSum", self.op("Cast", keep, to=TensorProto.FLOAT))
        return y, keep, count

    def row_size(self, x: str) -> str:
        """The row length as a float scalar-ish (1-D of 1)."""
        return self.op("Cast", self.op("Shape", x, start=-1), to=TensorProto.FLOAT)

    def row_max(self, y: str, keep: str | None) -> str:
        return self.reduce("ReduceMax", y if keep is None else self.op("Where", keep, y, self.const(float("-inf"))))

    def row_mean(self, y: str, keep: str | None, count: str | None, to: int = TensorProto.FLOAT) -> str:
        """Mean of y (masked entries 0) over the unmasked count; `to` is y's type (FLOAT or DOUBLE)."""
        if keep is None or count is None:
            return self.reduce("ReduceMean", y)
        n = self.op("Max", count, self.const(1.0))
        return self.op("Div", self.reduce("ReduceSum", y), n if to == TensorProto.FLOAT else self.op("Cast", n, to=to))

    def softmax_over(self, z: str, kept: str | None) -> str:
        """softmax of z over `kept` (all entries when None)."""
        if kept is not None:
            z = self.op("Where", kept, z, self.const(float("-inf")))
        return self.op("Softmax", z, axis=-1)

    def finish(self, p: str, keep: str | None, count: str | None) -> str:
        """Masked entries 0, a one-entry row its keep pattern (exactly 1), an empty row uniform."""
        if keep is None or count is None:
            return p
        p = self.op("Where", keep, p, self.const(0.0))
        p = self.op("Where", self.op("Equal", count, self.const(1.0)), self.op("Cast", keep, to=TensorProto.FLOAT), p)
        uniform = self.op("Reciprocal", self.row_size("x"))
        return self.op("Where", self.op("Equal", count, self.const(0.0)), uniform, p)

    def head_param(self, name: str) -> str:
        """Attribute `name` (length 1 or H) reshaped to [1, len, 1, ...] so it runs along axis 1 of x."""
        p = self.attr(name)
        rank = self.op("Size", self.op("Shape", "x"))
        axes = self.op("Range", self.const(0), rank, self.const(1))
        length = self.op("Size", p)
        target = self.op("Where", self.op("Equal", axes, self.const(1)), length, self.const(1))
        return self.op("Reshape", p, target)

    def sorted_desc(self, z: str) -> tuple[str, str]:
        """(z sorted descending along the last axis, ranks 1..n as floats)."""
        n = self.op("Shape", z, start=-1)
        zs = self.ops("TopK", 2, z, n, axis=-1, largest=1, sorted=1)[0]
        n_scalar = self.op("Squeeze", n, self.const([0]))
        ranks = self.op("Range", self.const(1), self.op("Add", n_scalar, self.const(1)), self.const(1))
        return zs, self.op("Cast", ranks, to=TensorProto.FLOAT)

    def fill_out_of_support(self, y: str, keep: str | None, margin: float) -> str:
        """Masked entries moved 2*margin below the row max: outside any sparse support (p_max <= 1 bounds tau)."""
        if keep is None:
            return y
        low = self.op("Sub", self.row_max(y, keep), self.const(2 * margin))
        return self.op("Where", keep, y, low)


    def sigma(self, x: str) -> str:
        """sigma(x) = x + ts0*relu(r0-x) + ts1*relu(x-r1) + ts2*relu(r2-x)^2 + ts3*relu(x-r3)^2 from the node's
        `ranges`/`ts`; order-1 nodes carry ts[2:] = 0, so one chain serves both orders."""
        r = self.ops("Split", 4, self.attr("ranges"), axis=0, num_outputs=4)
        t = self.ops("Split", 4, self.attr("ts"), axis=0, num_outputs=4)
        low1 = self.op("Relu", self.op("Sub", r[0], x))
        high1 = self.op("Relu", self.op("Sub", x, r[1]))
        low2 = self.op("Relu", self.op("Sub", r[2], x))
        high2 = self.op("Relu", self.op("Sub", x, r[3]))
        terms = [self.op("Mul", t[0], low1), self.op("Mul", t[1], high1),
                 self.op("Mul", t[2], self.op("Mul", low2, low2)), self.op("Mul", t[3], self.op("Mul", high2, high2))]
        y = x
        for term in terms:  # added in the order of models.multimax.sigma
            y = self.op("Add", y, term)
        return y

    def sigma_as_shipped(self, x: str, out: str) -> str:
        """The same sigma, node for node and name for name as MultiMax's bodies have always been written, so a
        MultiMax model exports byte for byte as before the family (tests/export/test_reweighting_export.py); a body that
        uses it names every other node itself too (its names would meet the fresh t0, t1, ...)."""
        n = self.named
        self.attr("ranges", "ranges"), self.attr("ts", "ts")
        n("Split", ["ranges"], ["r0", "r1", "r2", "r3"], axis=0, num_outputs=4)
        n("Split", ["ts"], ["t0", "t1", "t2", "t3"], axis=0, num_outputs=4)
        for i, (a, b, relu) in enumerate((("r0", x, "low1"), (x, "r1", "high1"), ("r2", x, "low2"),
                                          (x, "r3", "high2"))):
            n("Sub", [a, b], [f"d{i}"])
            n("Relu", [f"d{i}"], [relu])
            if i < 2:
                n("Mul", [f"t{i}", relu], [f"a{i}"])
            else:
                n("Mul", [relu, relu], [f"sq{i}"])
                n("Mul", [f"t{i}", f"sq{i}"], [f"a{i}"])
        n("Add", [x, "a0"], ["s0"])
        n("Add", ["s0", "a1"], ["s1"])
        n("Add", ["s1", "a2"], ["s2"])
        return n("Add", ["s2", "a3"], [out])


# ---- the ops ------------------------------------------------------------------------------------------


def multimax(b: Body) -> str:
    """softmax(sigma(x) + mask): the mask AFTER the modulation (modulating -inf would give NaN)."""
    if b.masked:
        modulated = b.named("Add", [b.sigma_as_shipped("x", "sigma"), "mask"], ["modulated"])
    else:
        modulated = b.sigma_as_shipped("x", "modulated")
    return b.named("Softmax", [modulated], ["y"], axis=-1)


def multimax_sigma(b: Body) -> str:
    """sigma(x) alone (`MultiMaxSigma`: the output layer's logits)."""
    return b.sigma_as_shipped("x", "y")



def sparsemax(b: Body) -> str:
    y, keep, count = b.prologue()
    z = b.fill_out_of_support(y, keep, 1.0)
    zs, k = b.sorted_desc(z)
    cs = b.op("CumSum", zs, b.const(-1))
    support = b.op("Greater", b.op("Add", b.op("Mul", k, zs), b.const(1.0)), cs)  # 1 + k z_(k) > sum_{j<=k} z_(j)
    ksup = b.reduce("ReduceSum", b.op("Cast", support, to=TensorProto.FLOAT))
    at = b.op("Cast", b.op("Sub", ksup, b.const(1.0)), to=TensorProto.INT64)
    tau = b.op("Div", b.op("Sub", b.op("GatherElements", cs, at, axis=-1), b.const(1.0)), ksup)
    return b.finish(b.op("Relu", b.op("Sub", z, tau)), keep, count)


def entmax15(b: Body) -> str:
    y, keep, count = b.prologue()
    z = b.op("Mul", b.fill_out_of_support(y, keep, 2.0), b.const(0.5))  # z = y/2; masked 2 below max(z)
    z = b.op("Sub", z, b.reduce("ReduceMax", z))  # tau relative to the max: no cancellation in the squares
    zs, k = b.sorted_desc(z)
    mean = b.op("Div", b.op("CumSum", zs, b.const(-1)), k)
    meansq = b.op("Div", b.op("CumSum", b.op("Mul", zs, zs), b.const(-1)), k)
    ss = b.op("Mul", k, b.op("Sub", meansq, b.op("Mul", mean, mean)))
    delta = b.op("Div", b.op("Sub", b.const(1.0), ss), k)
    tau_k = b.op("Sub", mean, b.op("Sqrt", b.op("Relu", delta)))
    ksup = b.reduce("ReduceSum", b.op("Cast", b.op("LessOrEqual", tau_k, zs), to=TensorProto.FLOAT))
    at = b.op("Cast", b.op("Sub", ksup, b.const(1.0)), to=TensorProto.INT64)
    tau = b.op("GatherElements", tau_k, at, axis=-1)
    d = b.op("Relu", b.op("Sub", z, tau))
    return b.finish(b.op("Mul", d, d), keep, count)


def evsoftmax(b: Body) -> str:
    y, keep, count = b.prologue()
    # The mean in float64, as models.reweighting.evsoftmax takes it (the cut is a discontinuity).
    y64 = b.op("Cast", y, to=TensorProto.DOUBLE)
    above = b.op("GreaterOrEqual", y64, b.row_mean(y64, keep, count, to=TensorProto.DOUBLE))
    kept = b.op("Or", above, b.op("Equal", y, b.row_max(y, keep)))  # the max is >= the mean even if it rounds
    if keep is not None:
        kept = b.op("And", kept, keep)
    return b.finish(b.softmax_over(y, kept), keep, count)


def topk_softmax(b: Body) -> str:
    y, keep, count = b.prologue()
    filled = y if keep is None else b.op("Where", keep, y, b.const(float("-inf")))
    n = b.op("Shape", y, start=-1)
    kk = b.op("Min", b.op("Reshape", b.attr("k"), b.const([1])), n)
    values = b.ops("TopK", 2, filled, kk, axis=-1, largest=1)[0]
    t = b.op("Gather", values, b.op("Sub", kk, b.const([1])), axis=-1)  # the k-th largest (-inf if |U| < k)
    kept = b.op("GreaterOrEqual", y, t)  # ties at t all kept
    if keep is not None:
        kept = b.op("And", kept, keep)
    return b.finish(b.softmax_over(y, kept), keep, count)


def gaussian(b: Body) -> str:
    return _adaptive(b, laplacian=False)


def laplacian(b: Body) -> str:
    return _adaptive(b, laplacian=True)


def _adaptive(b: Body, laplacian: bool) -> str:
    y, keep, count = b.prologue()
    mu = b.op("Add", b.row_mean(y, keep, count), b.head_param("offset"))
    d = b.op("Sub", y, mu)
    s = b.head_param("scale")
    if laplacian:
        z = b.op("Neg", b.op("Div", b.op("Abs", d), s))
    else:
        z = b.op("Neg", b.op("Div", b.op("Mul", d, d), b.op("Mul", b.const(2.0), b.op("Mul", s, s))))
    return b.finish(b.softmax_over(z, keep), keep, count)


def length_scaled(b: Body) -> str:
    y, keep, count = b.prologue()
    length = b.op("Max", count if count is not None else b.row_size("x"), b.const(1.0))
    eps, m = b.attr("eps"), b.attr("m")
    mm = b.op("Where", b.op("Equal", m, b.const(0.0)), b.op("Sqrt", length), m)
    ratio = b.op("Div", b.op("Mul", b.op("Sub", b.const(1.0), eps), b.op("Sub", length, mm)), b.op("Mul", eps, mm))
    k = b.op("Mul", b.const(0.5), b.op("Log", b.op("Max", ratio, b.const(1.0))))
    return b.finish(b.softmax_over(b.op("Mul", k, y), keep), keep, count)
