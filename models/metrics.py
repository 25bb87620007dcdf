"""The paper's multi-modality and sparsity metrics (definitions 3.2 and 3.3) for any reweighting function.

A reweighting function phi maps scores (..., K) to a distribution over the last axis. The metrics
are computed per row and return a tensor of shape (...); rows with no entry in the metric's
support (no relevant competitor for M, no entry below eps for S) give NaN rather than a made-up
value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.multimax import sigma

Reweighting = Callable[[torch.Tensor], torch.Tensor]


def softmax_fn(temperature: float = 1.0) -> Reweighting:
    """SoftMax at a temperature: phi(x) = softmax(x / temperature)."""
    return lambda x: torch.softmax(x / temperature, dim=-1)


def multimax_fn(ranges: torch.Tensor | list[float], ts: torch.Tensor | list[float], order: int = 2) -> Reweighting:
    """MultiMax with fixed parameters: phi(x) = softmax(sigma(x))."""
    r = torch.as_tensor(ranges, dtype=torch.float64)
    t = torch.as_tensor(ts, dtype=torch.float64)
    return lambda x: torch.softmax(sigma(x, r.to(x.dtype), t.to(x.dtype), order), dim=-1)


def multimax_l_fn(t_b: float, b: float) -> Reweighting:
    """MultiMax-l (the paper's term (1) only): temperature t_b applied below b, identity above."""
    return multimax_fn([b, 0.0, 0.0, 0.0], [1.0 - t_b, 0.0, 0.0, 0.0], order=1)


def sparsemax_fn() -> Reweighting:
    """SparseMax (Martins & Astudillo, 2016): Euclidean projection onto the simplex."""

    def phi(x: torch.Tensor) -> torch.Tensor:
        z, _ = torch.sort(x, dim=-1, descending=True)
        k = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)
        cumsum = z.cumsum(-1)
        support = (1 + k * z) > cumsum
        k_max = support.sum(-1, keepdim=True)
        tau = (cumsum.gather(-1, k_max - 1) - 1) / k_max.to(x.dtype)
        return torch.clamp(x - tau, min=0)

    return phi


def multimodality(x: torch.Tensor, phi: Reweighting, eps: float | torch.Tensor) -> torch.Tensor:
    """Definition 3.2: M(x) = 1 - mean over eps < x_n < x_max of (phi(x)_max - phi(x)_n).

    `eps` may be a tensor (..., 1): one threshold per row (e.g. the row mean of attention scores).
    """
    p = phi(x)
    x_max, idx = x.max(dim=-1, keepdim=True)
    p_max = p.gather(-1, idx)
    relevant = (x > eps) & (x < x_max)
    gaps = torch.where(relevant, p_max - p, torch.zeros_like(p))
    count = relevant.sum(-1)
    mean_gap = gaps.sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, 1 - mean_gap, torch.full_like(mean_gap, float("nan")))


def sparsity(
    x: torch.Tensor, phi: Reweighting, eps: float | torch.Tensor, s: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Definition 3.3: S(x) = mean over x_l < eps of exp((s - phi(x)_l)/s - 1).

    `s` is the reference value in [0, 1]; by default the paper's suggestion, the smallest
    SoftMax (temperature 1) probability of x, so that two functions are scored on one scale.
    """
    p = phi(x)
    if s is None:
        s = torch.softmax(x, dim=-1).min(dim=-1, keepdim=True).values
    s_t = torch.as_tensor(s, dtype=p.dtype, device=p.device)
    if s_t.dim() == x.dim() - 1:
        s_t = s_t.unsqueeze(-1)
    irrelevant = x < eps
    scores = torch.where(irrelevant, torch.exp((s_t - p) / s_t - 1), torch.zeros_like(p))
    count = irrelevant.sum(-1)
    mean = scores.sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
