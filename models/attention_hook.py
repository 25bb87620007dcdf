"""The attention hook of the text models: what an exporter needs to replace each layer's attention by one node.

Every text model's forward takes an optional `attend`: with it, each layer hands its new tokens' projections
(after whatever the architecture does to them: RoPE, q/k norm) to `attend(layer, q, k, v, past, attention_mask)`
instead of attending itself, and uses the (output, present) it returns. q is (B, T, heads * head_dim), k and v
(B, T, kv_heads * head_dim); `attention_mask` is the caller's (B, total) 0/1 mask, not an additive one. The
model's `attention_layers()` says per layer what such a node must know (heads, scale, MultiMax parameters), so
code outside models/ needs no architecture's config fields (export.genai_graph is its user).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

KV = tuple[Tensor, Tensor]
# (layer index, q, k, v, past (key, value) or None, attention_mask (B, total) or None) -> (output, present)
Attend = Callable[[int, Tensor, Tensor, Tensor, "KV | None", "Tensor | None"], tuple[Tensor, KV]]
LayerAttend = Callable[[Tensor, Tensor, Tensor, "KV | None", "Tensor | None"], tuple[Tensor, KV]]


@dataclass(frozen=True)
class MultiMaxParams:
    """One attention MultiMax as plain numbers: sigma(x) with `ranges`/`ts` (first order: ts[2:] are 0)."""

    ranges: tuple[float, ...]
    ts: tuple[float, ...]
    order: int


@dataclass(frozen=True)
class AttentionLayer:
    """What one layer's attention node needs: scores = (q . k) * scale, sigma where `multimax`, mask, softmax."""

    num_heads: int
    kv_heads: int
    head_dim: int
    scale: float
    multimax: MultiMaxParams | None = None


def multimax_params(owner: torch.nn.Module, scale: float) -> tuple[float, MultiMaxParams]:
    """(scale, parameters) of a module holding `ranges`/`ts` (and `order`; V2's affine `t`, `b`), read to floats.

    V2's t*x + b is folded in: t into the scale, b into the thresholds (sigma(x - b') with ranges - b).
    """
    ranges = [float(v) for v in cast(Tensor, owner.ranges).detach().tolist()]
    ts = [float(v) for v in cast(Tensor, owner.ts).detach().tolist()]
    order = int(getattr(owner, "order", 2))
    if order == 1:
        ts = [*ts[:2], 0.0, 0.0]
    if getattr(owner, "affine", False):
        t, b = float(cast(Tensor, owner.t).detach()), float(cast(Tensor, owner.b).detach())
        scale, ranges = scale * t, [r - b for r in ranges]
    return scale, MultiMaxParams(tuple(ranges), tuple(ts), order)


def attention_layer(num_heads: int, kv_heads: int, head_dim: int, scale: float,
          owner: torch.nn.Module | None) -> AttentionLayer:
    """The AttentionLayer of a layer whose MultiMax parameters (if any) `owner` holds."""
    if owner is None:
        return AttentionLayer(num_heads, kv_heads, head_dim, scale)
    scale, params = multimax_params(owner, scale)
    return AttentionLayer(num_heads, kv_heads, head_dim, scale, params)


def for_layer(attend: Attend | None, index: int) -> LayerAttend | None:
    """`attend` bound to one layer (what the model hands each block)."""
    if attend is None:
        return None
    return lambda q, k, v, past, mask: attend(index, q, k, v, past, mask)
