"""The PyTorch reference the fused kernel must match: `models.multimax`, computed in fp32.

The kernel reads fp16/bf16 and accumulates in fp32, so the reference upcasts, runs the model's own
`sigma` / `multimax` (the formula lives there only) and rounds back to the input dtype once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.multimax import multimax, sigma


def _params(values: torch.Tensor | Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).to(device).reshape(4)


def reference_multimax(
    x: torch.Tensor,
    ranges: torch.Tensor | Sequence[float],
    ts: torch.Tensor | Sequence[float],
    order: int = 2,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(sigma(x) + mask, -1) in fp32, returned in x's dtype."""
    r, t = _params(ranges, x.device), _params(ts, x.device)
    m = None if mask is None else mask.float()
    return multimax(x.float(), r, t, order, m).to(x.dtype)


def reference_sigma(
    x: torch.Tensor, ranges: torch.Tensor | Sequence[float], ts: torch.Tensor | Sequence[float], order: int = 2
) -> torch.Tensor:
    """sigma(x) in fp32, returned in x's dtype."""
    return sigma(x.float(), _params(ranges, x.device), _params(ts, x.device), order).to(x.dtype)


def unfused_multimax(
    x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor, order: int = 2, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """What PyTorch eager runs without the kernel: the elementwise chain in x's dtype, then softmax.

    The baseline the speed target is measured against (one memory pass per elementwise op).
    """
    return multimax(x, ranges, ts, order, mask)
