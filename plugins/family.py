"""The family of reweighting functions: MultiMax and the seven others, one entry each, that every layer iterates.

A member is described here once: its config name (models.reweighting.FUNCTIONS; its op type and node attributes
come from the contract, models.onnx_contract.FAMILY_OPS / FAMILY_ATTRIBUTES), its PyTorch reference, its ONNX
function-body builder (plugins.onnx_bodies) and which Triton kernel runs it. From this table:

- `plugins.reference.reference`: the fp32 reference of any op type;
- `plugins.onnx_functions.function_protos`: the FunctionProtos the exporter attaches;
- `plugins.aot.KernelSpec` / `plugins.fused.fused`: the Triton kernel and its ahead-of-time compilation;
- `plugins.torch_op`: the PyTorch custom op (fused on CUDA);
- `plugins.trt_plugin.register`: the TensorRT plugins;
- plugins/ort_ops: the onnxruntime custom ops (C++, one table in multimax_ops.cc; tests check it against this one).

Every member has a masked op `<Op>(x, mask)` and `<Op>NoMask(x)`; MultiMax adds `MultiMaxSigma(x)`, its modulation
alone (output layers). Triton and TensorRT are not imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from models import multimax as mm
from models import onnx_contract as contract
from models import reweighting
from plugins import onnx_bodies

Reference = Callable[..., Tensor]  # (x, mask or None, **node attributes) -> weights over the last axis, fp32
BodyBuilder = Callable[[onnx_bodies.Body], str]  # appends a body's nodes, returns the output's name

# The two Triton kernels (plugins.kernel.multimax_kernel, plugins.reweight_kernel.reweight_kernel).
MULTIMAX_KERNEL, REWEIGHT_KERNEL = "multimax_kernel", "reweight_kernel"


@dataclass(frozen=True)
class Op:
    """One op type of a member: its reference and its body."""

    reference: Reference
    body: BodyBuilder


@dataclass(frozen=True)
class Member:
    """One reweighting function through every layer."""

    name: str  # config name: models.reweighting.FUNCTIONS and the contract's FAMILY_OPS key
    reference: Reference
    body: BodyBuilder  # builds both the masked and the NoMask body (`Body.masked` says which)
    kernel: str  # MULTIMAX_KERNEL or REWEIGHT_KERNEL
    extra_ops: Mapping[str, Op] = field(default_factory=dict)  # op types beyond masked/NoMask, input (x) only

    @property
    def op(self) -> str:
        """The masked op type."""
        return contract.FAMILY_OPS[self.name]

    @property
    def attributes(self) -> tuple[str, ...]:
        """The node attributes every op type of this member carries (besides the plugin attributes)."""
        return contract.FAMILY_ATTRIBUTES[self.op]

    @property
    def op_types(self) -> tuple[str, ...]:
        return (self.op, self.op + contract.NO_MASK, *self.extra_ops)

    def takes_mask(self, op_type: str) -> bool:
        return op_type == self.op

    def op_of(self, op_type: str) -> Op:
        """Reference and body of one of this member's op types."""
        if op_type in self.extra_ops:
            return self.extra_ops[op_type]
        if op_type not in self.op_types:
            raise ValueError(f"{op_type!r} is not an op of {self.name} ({', '.join(self.op_types)})")
        return Op(self.reference, self.body)


def _floats(values: Any, like: Tensor) -> Tensor:
    return torch.as_tensor(values, dtype=torch.float32, device=like.device).reshape(-1)


def _multimax(x: Tensor, mask: Tensor | None = None, *, ranges: Any, ts: Any, order: int = 2) -> Tensor:
    return mm.multimax(x, _floats(ranges, x), _floats(ts, x), int(order), mask)


def _sigma(x: Tensor, mask: Tensor | None = None, *, ranges: Any, ts: Any, order: int = 2) -> Tensor:
    if mask is not None:
        raise ValueError("MultiMaxSigma takes no mask")
    return mm.sigma(x, _floats(ranges, x), _floats(ts, x), int(order))


def _other(name: str) -> Reference:
    """models.reweighting's reference of `name`, over the last axis, keywords = node attributes."""
    fn = reweighting.FUNCTIONS[name].fn
    assert fn is not None

    def reference(x: Tensor, mask: Tensor | None = None, **attrs: Any) -> Tensor:
        return fn(x, mask, -1, **attrs)

    return reference


MEMBERS: dict[str, Member] = {
    m.name: m
    for m in (
        Member("multimax", _multimax, onnx_bodies.multimax, MULTIMAX_KERNEL,
               {contract.MULTIMAX_SIGMA_OP: Op(_sigma, onnx_bodies.multimax_sigma)}),
        Member("sparsemax", _other("sparsemax"), onnx_bodies.sparsemax, REWEIGHT_KERNEL),
        Member("entmax15", _other("entmax15"), onnx_bodies.entmax15, REWEIGHT_KERNEL),
        Member("evsoftmax", _other("evsoftmax"), onnx_bodies.evsoftmax, REWEIGHT_KERNEL),
        Member("topk_softmax", _other("topk_softmax"), onnx_bodies.topk_softmax, REWEIGHT_KERNEL),
        Member("gaussian", _other("gaussian"), onnx_bodies.gaussian, REWEIGHT_KERNEL),
        Member("laplacian", _other("laplacian"), onnx_bodies.laplacian, REWEIGHT_KERNEL),
        Member("length_scaled", _other("length_scaled"), onnx_bodies.length_scaled, REWEIGHT_KERNEL),
    )
}  # fmt: skip
# The members the reweighting kernel runs, in the order of its FN constant (the kernel's `if FN == i` branches).
REWEIGHT_FNS: tuple[str, ...] = tuple(n for n, m in MEMBERS.items() if m.kernel == REWEIGHT_KERNEL)
_BY_OP = {op: m for m in MEMBERS.values() for op in m.op_types}


def member(name: str) -> Member:
    """The member called `name`; an unknown name is a ValueError that lists the known ones."""
    if name not in MEMBERS:
        raise ValueError(f"unknown reweighting function {name!r}; known: {', '.join(MEMBERS)}")
    return MEMBERS[name]


def member_of(op_type: str) -> Member:
    """The member an op type belongs to (a ValueError for anything else)."""
    if op_type not in _BY_OP:
        raise ValueError(f"unknown reweighting op {op_type!r}; known: {', '.join(_BY_OP)}")
    return _BY_OP[op_type]


def op_types() -> tuple[str, ...]:
    """Every op type of the family, member by member."""
    return tuple(_BY_OP)
