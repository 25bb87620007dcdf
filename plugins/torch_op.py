"""`torch.ops.multimax_serve.multimax`: the fused kernel as a PyTorch custom op.

CUDA tensors run the Triton kernel (parameters read on the device: no host sync, no recompiles when
they change); other devices run the fp32 reference. A fake implementation gives shapes to
torch.compile / export, which treat the op as one opaque node instead of breaking the graph.
Inference only: no autograd formula is registered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from plugins.reference import reference_multimax, reference_sigma

OP_NAME = "multimax_serve::multimax"


@torch.library.custom_op(OP_NAME, mutates_args=())
def multimax_op(x: Tensor, params: Tensor, order: int, softmax: bool, mask: Tensor | None = None) -> Tensor:
    """softmax(sigma(x) + mask, -1) if `softmax` else sigma(x); params = cat(ranges, ts), 8 floats."""
    ranges, ts = params[:4], params[4:]
    if softmax:
        return reference_multimax(x, ranges, ts, order, mask)
    return reference_sigma(x, ranges, ts, order)


@multimax_op.register_kernel("cuda")
def _multimax_cuda(x: Tensor, params: Tensor, order: int, softmax: bool, mask: Tensor | None = None) -> Tensor:
    from plugins.kernel import fused_multimax, fused_sigma  # imports triton: only where a GPU runs it

    ranges, ts = params[:4], params[4:]
    if softmax:
        return fused_multimax(x, ranges, ts, order, mask)
    return fused_sigma(x, ranges, ts, order)


@multimax_op.register_fake
def _multimax_fake(x: Tensor, params: Tensor, order: int, softmax: bool, mask: Tensor | None = None) -> Tensor:
    torch._check(params.numel() == 8, lambda: "params must hold ranges (4) and ts (4)")
    torch._check(order in (1, 2), lambda: f"order must be 1 or 2, got {order}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _pack(ranges: Tensor | Sequence[float], ts: Tensor | Sequence[float], like: Tensor) -> Tensor:
    if isinstance(ranges, Tensor) and isinstance(ts, Tensor):
        return torch.cat([ranges.reshape(4), ts.reshape(4)]).to(device=like.device, dtype=torch.float32)
    return torch.tensor([*ranges, *ts], dtype=torch.float32, device=like.device)


def multimax(
    x: Tensor,
    ranges: Tensor | Sequence[float],
    ts: Tensor | Sequence[float],
    order: int = 2,
    mask: Tensor | None = None,
) -> Tensor:
    """softmax(sigma(x) + mask, -1) through the custom op (fused on CUDA)."""
    return multimax_op(x, _pack(ranges, ts, x), order, True, mask)


def sigma(x: Tensor, ranges: Tensor | Sequence[float], ts: Tensor | Sequence[float], order: int = 2) -> Tensor:
    """sigma(x) through the custom op (fused on CUDA)."""
    return multimax_op(x, _pack(ranges, ts, x), order, False, None)
