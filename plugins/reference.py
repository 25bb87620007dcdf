"""The PyTorch references the fused kernels must match, for every op type of the reweighting family (plugins.family):
the models' own functions (`models.multimax`, `models.reweighting`: the formulas live there only), computed in fp32.

The kernels read fp16/bf16 and accumulate in fp32, so the reference upcasts, runs the member's reference and rounds
back to the input dtype once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from models.multimax import multimax
from models.onnx_contract import MULTIMAX_OP, MULTIMAX_SIGMA_OP, NO_MASK
from plugins.family import member_of


def reference(op: str, x: torch.Tensor, mask: torch.Tensor | None = None, **attrs: Any) -> torch.Tensor:
    """The op type `op` of x (+ mask) in fp32 with the node attributes `attrs`, returned in x's dtype."""
    fn = member_of(op).op_of(op).reference
    return fn(x.float(), None if mask is None else mask.float(), **attrs).to(x.dtype)


def reference_multimax(
    x: torch.Tensor,
    ranges: torch.Tensor | Sequence[float],
    ts: torch.Tensor | Sequence[float],
    order: int = 2,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(sigma(x) + mask, -1) in fp32, returned in x's dtype."""
    op = MULTIMAX_OP if mask is not None else MULTIMAX_OP + NO_MASK
    return reference(op, x, mask, ranges=ranges, ts=ts, order=order)


def reference_sigma(
    x: torch.Tensor, ranges: torch.Tensor | Sequence[float], ts: torch.Tensor | Sequence[float], order: int = 2
) -> torch.Tensor:
    """sigma(x) in fp32, returned in x's dtype."""
    return reference(MULTIMAX_SIGMA_OP, x, ranges=ranges, ts=ts, order=order)


def unfused_multimax(
    x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor, order: int = 2, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """What PyTorch eager runs without the kernel: the elementwise chain in x's dtype, then softmax.

    The baseline the speed target is measured against (one memory pass per elementwise op).
    """
    return multimax(x, ranges, ts, order, mask)
