"""`torch.ops.multimax_serve.reweight`: every reweighting function of the family (plugins.family) as ONE PyTorch
custom op, fused on CUDA.

The member's name is an argument, as it is the kernels' constant. CUDA tensors run the member's Triton kernel
(`plugins.kernel` for MultiMax, `plugins.reweight_kernel` for the others), other devices the fp32 reference
(plugins.reference). `params` holds the member's list attributes one after the other, as many values each
(MultiMax: ranges then ts; Gaussian/Laplacian: per-head offsets then scales; empty for the others), read on the
device so that changing them never recompiles or syncs; the scalar attributes (k, eps, m, order) are arguments.
`softmax=False` is MultiMax's modulation alone (`MultiMaxSigma`). A fake implementation gives shapes to
torch.compile / torch.export, which keep the op as one node. Inference only: no autograd formula is registered
(training runs the references, whose autograd is exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from onnx import AttributeProto
from torch import Tensor

from models.onnx_contract import MULTIMAX_SIGMA_OP, NO_MASK
from plugins.family import MEMBERS, MULTIMAX_KERNEL, member
from plugins.onnx_bodies import ATTRIBUTE_TYPES
from plugins.reference import reference

OP_NAME = "multimax_serve::reweight"


def _lists(fn: str) -> list[str]:
    """The member's attributes that are float lists (packed into `params`)."""
    return [a for a in member(fn).attributes if ATTRIBUTE_TYPES[a] == AttributeProto.FLOATS]


def _op_type(fn: str, masked: bool, softmax: bool) -> str:
    if not softmax:
        if fn != "multimax":
            raise ValueError(f"softmax=False (the modulation alone) is MultiMax's only, not {fn}'s")
        return MULTIMAX_SIGMA_OP
    return member(fn).op + ("" if masked else NO_MASK)


def _attributes(fn: str, params: Tensor, k: int, eps: float, m: float, order: int) -> dict[str, Any]:
    """The member's node attributes from the op's arguments (what plugins.reference and the kernels take)."""
    lists = _lists(fn)
    scalars = {"k": k, "eps": eps, "m": m, "order": order}
    out: dict[str, Any] = {a: scalars[a] for a in member(fn).attributes if a not in lists}
    size = params.numel() // max(1, len(lists))
    for i, name in enumerate(lists):
        out[name] = params[i * size : (i + 1) * size]
    return out


@torch.library.custom_op(OP_NAME, mutates_args=())
def reweight_op(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None,
    order: int = 2, softmax: bool = True,
) -> Tensor:  # fmt: skip
    """The member `fn` of x (+ mask) over the last axis, in fp32, returned in x's dtype."""
    op = _op_type(fn, mask is not None, softmax)
    return reference(op, x, mask, **_attributes(fn, params, k, eps, m, order))


@reweight_op.register_kernel("cuda")
def _reweight_cuda(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None,
    order: int = 2, softmax: bool = True,
) -> Tensor:  # fmt: skip
    attrs = _attributes(fn, params, k, eps, m, order)
    if member(fn).kernel == MULTIMAX_KERNEL:  # imports triton: only where a GPU runs it
        from plugins.kernel import fused_multimax, fused_sigma

        if not softmax:
            return fused_sigma(x, attrs["ranges"], attrs["ts"], order)
        return fused_multimax(x, attrs["ranges"], attrs["ts"], order, mask)
    from plugins.reweight_kernel import fused_reweight

    _op_type(fn, mask is not None, softmax)  # refuses softmax=False
    return fused_reweight(fn, x, mask, **attrs)


@reweight_op.register_fake
def _reweight_fake(
    x: Tensor, params: Tensor, fn: str, k: int = 8, eps: float = 0.1, m: float = 0.0, mask: Tensor | None = None,
    order: int = 2, softmax: bool = True,
) -> Tensor:  # fmt: skip
    torch._check(fn in MEMBERS, lambda: f"unknown reweighting function {fn!r}")
    torch._check(params.numel() % max(1, len(_lists(fn))) == 0, lambda: f"params must hold {_lists(fn)}, as many each")
    torch._check(order in (1, 2), lambda: f"order must be 1 or 2, got {order}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _pack(fn: str, like: Tensor, options: dict[str, Any]) -> Tensor:
    """The member's list attributes from `options` as one fp32 vector on x's device (one value broadcast to the
    length of the others: the kernels expand each to the heads)."""
    values = [options.pop(a, None) for a in _lists(fn)]
    if not values or any(v is None for v in values):
        return torch.empty(0, device=like.device)
    parts = [torch.as_tensor(v, dtype=torch.float32, device=like.device).reshape(-1) for v in values]
    n = max(p.numel() for p in parts)
    return torch.cat([p.expand(n) if p.numel() == 1 else p for p in parts])


def _call(fn: str, x: Tensor, mask: Tensor | None, softmax: bool, options: dict[str, Any]) -> Tensor:
    params = _pack(fn, x, options)
    return reweight_op(x, params, fn, int(options.get("k", 8)), float(options.get("eps", 0.1)),
                       float(options.get("m", 0.0)), mask, int(options.get("order", 2)), softmax)  # fmt: skip


def reweight(fn: str, x: Tensor, mask: Tensor | None = None, **options: Any) -> Tensor:
    """`fn` through the custom op (fused on CUDA); options are the member's node attributes (ranges, ts, order;
    k, eps, m, offset, scale), defaults where left out."""
    return _call(fn, x, mask, True, options)


def multimax(
    x: Tensor, ranges: Tensor | Sequence[float], ts: Tensor | Sequence[float], order: int = 2,
    mask: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """softmax(sigma(x) + mask, -1) through the custom op (fused on CUDA)."""
    return reweight("multimax", x, mask, ranges=ranges, ts=ts, order=order)


def sigma(x: Tensor, ranges: Tensor | Sequence[float], ts: Tensor | Sequence[float], order: int = 2) -> Tensor:
    """sigma(x) through the custom op (fused on CUDA)."""
    return _call("multimax", x, None, False, {"ranges": ranges, "ts": ts, "order": order})


def attention_owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The holders of MultiMax attention parameters: the owners below the model's direct children. (The models keep
    the output layer's parameters on the model itself or a direct child, DeiT's and the fairseq LM's `ranges`,
    GPT's `multimax`, Llama's `output_multimax`, and each attention layer's inside its block.)"""
    from models.multimax import multimax_owners

    owners = {id(m) for m in multimax_owners(model)}
    return [m for name, m in model.named_modules() if "." in name and id(m) in owners]


def use_fused_kernels(model: torch.nn.Module) -> int:
    """Make every attention reweighting step of `model` call this op at inference on CUDA (the Triton kernels):
    each AttentionFunction, and each holder of MultiMax attention parameters (models.multimax.attention_probs
    reads its `fused`). Training and other devices keep the references. Returns how many modules it set."""
    from models.attention_function import AttentionFunction

    modules = [m for m in model.modules() if isinstance(m, AttentionFunction)]
    for module in modules:
        module.fused = reweight
    owners = attention_owners(model)
    for owner in owners:
        vars(owner)["fused"] = multimax  # in the instance dict, as onnx_export_params does: not a submodule
    return len(modules) + len(owners)
