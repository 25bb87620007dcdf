"""`torch.ops.multimax_serve.reweight`: the other reweighting functions' Triton kernel as a PyTorch custom op.

One op for the seven functions (the function's name is an argument, as it is the kernel's FN constant): CUDA
tensors run `plugins.reweight_kernel.fused_reweight`, other devices the fp32 reference of models.reweighting.
`params` holds the Gaussian/Laplacian per-head offsets then scales (1 or H each; empty for the others), read on
the device so that changing them never recompiles. A fake implementation gives shapes to torch.compile /
torch.export, which keep the op as one node. Inference only: no autograd formula is registered (training runs
the references, whose autograd is exact).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.reweighting import FUNCTIONS, OTHER_FUNCTIONS

OP_NAME = "multimax_serve::reweight"


def _keywords(fn: str, params: Tensor, k: int, eps: float, m: float) -> dict[str, Any]:
    """The function's keyword arguments (models.reweighting / fused_reweight) from the op's arguments."""
    if fn not in OTHER_FUNCTIONS:
        raise ValueError(f"unknown reweighting function {fn!r}; known: {', '.join(OTHER_FUNCTIONS)}")
    spec = FUNCTIONS[fn]
    out: dict[str, Any] = {name: value for name, value in (("k", k), ("eps", eps), ("m", m)) if name in spec.options}
    if spec.params:
        half = params.numel() // 2
        out["offset"], out["scale"] = params[:half], params[half:]
    return out


@torch.library.custom_op(OP_NAME, mutates_args=())
def reweight_op(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None
) -> Tensor:
    """models.reweighting's `fn` of x (+ mask) over the last axis, in fp32, returned in x's dtype."""
    reference = FUNCTIONS[fn].fn if fn in OTHER_FUNCTIONS else None
    kwargs = _keywords(fn, params, k, eps, m)
    assert reference is not None
    y = reference(x.float(), None if mask is None else mask.float(), -1, **kwargs)
    return y.to(x.dtype)


@reweight_op.register_kernel("cuda")
def _reweight_cuda(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None
) -> Tensor:
    from plugins.reweight_kernel import fused_reweight  # imports triton: only where a GPU runs it

    return fused_reweight(fn, x, mask, **_keywords(fn, params, k, eps, m))


@reweight_op.register_fake
def _reweight_fake(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None
) -> Tensor:
    torch._check(fn in OTHER_FUNCTIONS, lambda: f"unknown reweighting function {fn!r}")
    torch._check(params.numel() % 2 == 0, lambda: "params must hold offsets then scales, as many of each")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def reweight(fn: str, x: Tensor, mask: Tensor | None = None, **options: Any) -> Tensor:
    """`fn` through the custom op (fused on CUDA); options as models.reweighting takes them (k, eps, m, offset,
    scale)."""
    offset, scale = options.pop("offset", None), options.pop("scale", None)
    if offset is None:
        params = torch.empty(0, device=x.device)
    else:
        o = torch.as_tensor(offset, dtype=torch.float32, device=x.device).reshape(-1)
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
        if o.numel() != s.numel():  # the kernel expands each to the heads: make them the same length here
            n = max(o.numel(), s.numel())
            o, s = o.expand(n), s.expand(n)
        params = torch.cat([o, s])
    return reweight_op(x, params, fn, int(options.get("k", 8)), float(options.get("eps", 0.1)),
                       float(options.get("m", 0.0)), mask)  # fmt: skip


def use_fused_kernels(model: torch.nn.Module) -> int:
    """Make every AttentionFunction of `model` call this op at inference on CUDA (the Triton kernel); training
    and other devices keep the reference. Returns how many modules it set."""
    from models.attention_function import AttentionFunction

    modules = [m for m in model.modules() if isinstance(m, AttentionFunction)]
    for module in modules:
        module.fused = reweight
    return len(modules)
