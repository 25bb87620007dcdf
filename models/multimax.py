"""MultiMax (Zhou, Fritz, Keuper, ICML 2024): softmax after a learned piecewise modulation.

sigma(x) = x + ts[0]*relu(ranges[0]-x) + ts[1]*relu(x-ranges[1])
             + ts[2]*relu(ranges[2]-x)**2 + ts[3]*relu(x-ranges[3])**2

Parameter names (`ranges`, `ts`, and `t`, `b` for the "V2" variant) match the official code so that
official state dicts load key for key. Paper notation: ts = [1-t_b1, t_d1-1, 1-t_b2, t_d2-1] and
ranges = [b1, d1, b2, d2].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from models.onnx_contract import MULTIMAX_OP, MULTIMAX_SIGMA_OP, NO_MASK, ONNX_DOMAIN, plugin_attrs

Variant = Literal["second", "first", "v2"]
VARIANTS: tuple[str, ...] = ("second", "first", "v2")

# Paper Table 7 (DeiT-small, ImageNet) and Table 8 (6-layer LM, WikiText-103), one row per layer:
# t_b1, t_d1, t_b2, t_d2, b1, d1, b2, d2.
PAPER_TABLE_7: tuple[tuple[float, ...], ...] = (
    (1.8347933, 2.815388, 0.9864913, 0.68440557, 1.185235, -1.208543, -2.1076407, 1.9158255),
    (1.9773115, 1.9971638, 0.985555, 0.74650276, -0.8580209, 0.02481092, -0.49835142, 1.9772723),
    (-1.1411996, 1.4711196, 1.9901285, 0.8758977, 0.18852632, 2.8039892, 2.9608543, 1.0462786),
    (0.6694808, 1.206692, 1.8682657, 0.93786246, 3.4023566, -1.5490056, 2.500237, 0.986331),
    (0.8902384, 1.5881691, 1.8920481, 0.72857785, 2.5070796, -1.1942928, 1.8854694, 1.2248528),
    (0.6015882, 0.87738, 2.818536, 0.96271396, 2.6490533, 0.8454426, 1.6205754, 0.89434063),
    (0.8023207, 1.2427123, 3.040797, 0.84531546, 2.6984618, 1.2127148, 1.2652112, 1.2134424),
    (0.64486825, 0.79173684, 2.5263662, 0.968745, 3.0230901, 0.62191963, 1.6307493, 1.6259384),
    (0.5796288, 0.6852025, 3.500835, 0.99119073, 2.675157, 0.68776745, 1.3239485, 1.5808712),
    (0.54873073, 0.8240905, 3.5563424, 0.9692498, 2.176066, 0.39797062, 0.9276044, 1.5223614),
    (0.38645744, 0.6951747, 4.0935583, 0.9958999, 1.6583583, 0.29572898, 0.77263904, 2.9975116),
    (0.16383016, 0.25565386, 3.2074118, 0.99102634, 1.6852132, -0.04795134, 0.9796309, 2.1836245),
)
PAPER_TABLE_8: tuple[tuple[float, ...], ...] = (
    (0.6467285, 0.7980957, 0.98324585, 0.9649048, 0.7475586, -0.87939453, 0.3395996, -0.14501953),
    (0.69018555, 0.8063965, 0.98350525, 0.9720764, 0.25073242, 0.15991211, 0.2956543, -0.17687988),
    (0.8557129, 0.79797363, 0.98939514, 0.9855194, -0.12609863, 0.06817627, 0.14794922, -0.14428711),
    (0.9662781, 0.83569336, 1.0231781, 1.0240021, -0.07574463, 0.8510742, -0.13220215, 0.27368164),
    (0.9260864, 0.9187622, 0.98670197, 1.039093, -0.5239258, 0.51416016, 0.23999023, 0.09521484),
    (1.1514893, 1.152832, 0.98441315, 1.0156403, 0.1751709, 0.05374146, -0.13269043, -0.08825684),
)


def paper_row_to_params(row: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """Convert one paper table row (t_b1, t_d1, t_b2, t_d2, b1, d1, b2, d2) to (ranges, ts)."""
    t_b1, t_d1, t_b2, t_d2, b1, d1, b2, d2 = row
    return [b1, d1, b2, d2], [1 - t_b1, t_d1 - 1, 1 - t_b2, t_d2 - 1]


def paper_params(layer: int, table: tuple[tuple[float, ...], ...] = PAPER_TABLE_7) -> tuple[list[float], list[float]]:
    """Learned (ranges, ts) for `layer`; models deeper than the table reuse its last rows cyclically."""
    return paper_row_to_params(table[layer % len(table)])


def sigma(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor, order: int = 2) -> torch.Tensor:
    """The modulation, term for term as the official `SeLU`; squares by multiplying (no Pow)."""
    low1 = torch.relu(ranges[0] - x)
    high1 = torch.relu(x - ranges[1])
    out = x + ts[0] * low1 + ts[1] * high1
    if order == 2:
        low2 = torch.relu(ranges[2] - x)
        high2 = torch.relu(x - ranges[3])
        out = out + ts[2] * low2 * low2 + ts[3] * high2 * high2
    return out


def multimax(
    x: torch.Tensor,
    ranges: torch.Tensor,
    ts: torch.Tensor,
    order: int = 2,
    mask: torch.Tensor | None = None,
    dim: int = -1,
) -> torch.Tensor:
    """softmax(sigma(x) + mask): the additive mask comes AFTER the modulation.

    Modulating a -inf (or finfo.min) mask would give inf*0 or inf-inf, i.e. NaN.
    """
    y = sigma(x, ranges, ts, order)
    if mask is not None:
        y = y + mask
    return torch.softmax(y, dim=dim)


class Modulation(nn.Module):
    """Learned sigma with the official parameter names.

    `variant`: "second" (official, eq. 6), "first" (eq. 4) or "v2" (x -> t*x + b, then first order;
    only attention layers carry `t`/`b` in the official V2 code, so `affine` is separate).
    """

    def __init__(self, variant: Variant = "second", affine: bool | None = None, init_std: float = 0.02) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown MultiMax variant {variant!r}; expected one of {VARIANTS}")
        self.variant = variant
        self.order = 2 if variant == "second" else 1
        self.ranges = nn.Parameter(torch.zeros(4))
        self.ts = nn.Parameter(torch.zeros(4))
        nn.init.trunc_normal_(self.ranges, std=init_std)
        nn.init.trunc_normal_(self.ts, std=init_std)
        self.affine = variant == "v2" if affine is None else affine
        if self.affine:
            self.t = nn.Parameter(torch.tensor(1.0))
            self.b = nn.Parameter(torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return modulate(x, self)

    @torch.no_grad()
    def set_params(self, ranges: list[float], ts: list[float]) -> None:
        self.ranges.copy_(torch.tensor(ranges, dtype=self.ranges.dtype))
        self.ts.copy_(torch.tensor(ts, dtype=self.ts.dtype))

    def extra_repr(self) -> str:
        return f"variant={self.variant}"


class Owner(Protocol):
    """A module holding one set of MultiMax parameters (a `Modulation`, or an attention layer that keeps them
    itself as the official code does); V2 owners also hold `t` and `b`, most hold their `order`."""

    @property
    def ranges(self) -> torch.Tensor: ...

    @property
    def ts(self) -> torch.Tensor: ...


def _order(owner: Owner, order: int | None) -> int:
    """The order asked for, else the owner's own."""
    if order is not None:
        return order
    own = getattr(owner, "order", None)
    if not isinstance(own, int):
        raise TypeError(f"{type(owner).__name__} holds no MultiMax order; pass one")
    return own


def _affine(owner: Owner, x: torch.Tensor) -> torch.Tensor:
    """V2's t*x + b where the owner has them, else x."""
    t, b = getattr(owner, "t", None), getattr(owner, "b", None)
    return x if t is None or b is None else t * x + b


def modulate(x: torch.Tensor, owner: Owner, order: int | None = None) -> torch.Tensor:
    """sigma with the parameters of `owner` (a module holding `ranges`, `ts` and, for V2, `t`, `b`).

    Under ONNX export (inside `onnx_export_params`) this is one `multimax::MultiMaxSigma` node.
    """
    order = _order(owner, order)
    x = _affine(owner, x)
    frozen = _export_attrs(owner, order, MULTIMAX_SIGMA_OP)
    if frozen is not None:
        return _export_node(MULTIMAX_SIGMA_OP, x, None, frozen)
    return sigma(x, owner.ranges, owner.ts, order)


def attention_probs(
    scores: torch.Tensor, owner: Owner | None, mask: torch.Tensor | None = None, order: int | None = None
) -> torch.Tensor:
    """Attention weights from raw scaled scores: modulate, then mask, then softmax.

    `owner` holds the MultiMax parameters (None: plain softmax). Half-precision scores are modulated and
    normalised in fp32 (squares and the exp-sum overflow fp16); fp32/fp64 stay as they are. Under ONNX export
    (inside `onnx_export_params`) the whole step is one `multimax::MultiMax` node (with the mask)
    or `multimax::MultiMaxNoMask` (without). At inference on CUDA, an owner given a fused implementation
    (`fused(scores, ranges, ts, order, mask)`, set by plugins.torch_op.use_fused_kernels; models never import
    plugins) runs it instead: one Triton kernel for the whole step.
    """
    if owner is not None:
        order = _order(owner, order)
        op = MULTIMAX_OP if mask is not None else MULTIMAX_OP + NO_MASK
        frozen = _export_attrs(owner, order, op)
        if frozen is not None:
            return _export_node(op, _affine(owner, scores), mask, frozen)
        fused = getattr(owner, "fused", None)
        if fused is not None and scores.is_cuda and not torch.is_grad_enabled():
            return fused(_affine(owner, scores), owner.ranges, owner.ts, order, mask)
    half = scores.dtype in (torch.float16, torch.bfloat16)
    y = scores.float() if half else scores  # sigma's squared terms overflow fp16: fp32 like the fused kernel
    y = y if owner is None else modulate(y, owner, order)
    if mask is not None:
        y = y + mask
    return F.softmax(y, dim=-1).to(scores.dtype) if half else F.softmax(y, dim=-1)


# --- ONNX export -------------------------------------------------------------------------------------
# The exporter traces with fake tensors, so the learned parameters are read to Python floats first
# and written as node attributes (what the TensorRT plugin and the ONNX function body consume).



ExportAttrs = dict[str, Any]  # ONNX node attributes: floats, ints, strings and lists of them


def _export_attrs(owner: Owner, order: int, op: str) -> ExportAttrs | None:
    frozen = getattr(owner, "_onnx_params", None)
    if frozen is None or not torch.onnx.is_in_onnx_export():
        return None
    ranges, ts = frozen
    if order == 1:
        ts = [*ts[:2], 0.0, 0.0]  # one body for both orders: zero second-order terms contribute nothing
    return {"ranges": ranges, "ts": ts, "order": order, **plugin_attrs(op)}


def _export_node(op: str, x: torch.Tensor, mask: torch.Tensor | None, attrs: ExportAttrs) -> torch.Tensor:
    """One `multimax::<op>` node, always computed in fp32: the squared terms overflow fp16."""
    dtype = x.dtype
    inputs = (x.float(),) if mask is None else (x.float(), mask.float())
    y = torch.onnx.ops.symbolic(f"{ONNX_DOMAIN}::{op}", inputs, attrs, dtype=torch.float32, shape=x.shape, version=1)
    return y.to(dtype)


def multimax_owners(model: nn.Module) -> list[nn.Module]:
    """Every module that holds a set of MultiMax parameters (`ranges` and `ts`)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "ranges", None), nn.Parameter) and isinstance(getattr(m, "ts", None), nn.Parameter)
    ]


@contextmanager
def onnx_export_params(model: nn.Module) -> Iterator[list[nn.Module]]:
    """While active, a traced MultiMax becomes one custom-domain node carrying its parameters."""
    owners = multimax_owners(model)
    for m in owners:
        ranges, ts = cast(torch.Tensor, m.ranges), cast(torch.Tensor, m.ts)
        # in the instance dict (not a module attribute): read by _export_attrs while tracing
        vars(m)["_onnx_params"] = ([float(v) for v in ranges.detach().tolist()],
                                   [float(v) for v in ts.detach().tolist()])
    # the other reweighting functions (models.attention_function) freeze their node attributes the same way
    others = [m for m in model.modules() if callable(getattr(m, "onnx_attrs", None))]
    for m in others:
        vars(m)["_onnx_attrs"] = m.onnx_attrs()  # type: ignore[operator]
    try:
        yield owners
    finally:
        for m in owners:
            vars(m).pop("_onnx_params", None)
        for m in others:
            vars(m).pop("_onnx_attrs", None)
