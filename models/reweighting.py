"""Attention reweighting functions besides MultiMax: PyTorch references of /work/notes/REWEIGHTING_SPEC.md.

Every function maps scores `x` (and the project's additive float `mask`) to weights over the last axis
with ONE masking rule (models.onnx_contract.MASKED_BELOW): an entry is masked iff its mask is <= -1e4;
the function is applied to y = x + mask restricted to the row's unmasked entries U, masked entries get
exactly 0, a row with one unmasked entry gives it exactly 1 and a row with none is uniform (never NaN).

SparseMax and EntMax-1.5 run the exact sort-based forward of the `entmax` package (Peters et al.), whose
custom autograd gives their closed-form Jacobians; masked entries are first moved far enough below the
row maximum that they can never enter the support. The others are softmax over a subset or of
transformed scores, so plain autograd differentiates them.

`FUNCTIONS` is the table the models, the exporter and the docs read: config name -> op types, node
attributes, learned parameters, options and whether the output is a distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import entmax
import torch
from torch import Tensor

from models.onnx_contract import FAMILY_OPS as OPS
from models.onnx_contract import MASKED_BELOW

Reweight = Callable[..., Tensor]


# ---- masking -------------------------------------------------------------------------------------


def _masked(x: Tensor, mask: Tensor | None, dim: int) -> tuple[Tensor, Tensor]:
    """(y, keep) with the reduction axis last: y = x + mask, keep = mask > MASKED_BELOW (broadcast to y)."""
    if mask is None:
        y = x.movedim(dim, -1)
        return y, torch.ones_like(y, dtype=torch.bool)
    y = x + mask
    keep = (mask > MASKED_BELOW).expand(y.shape).movedim(dim, -1)
    # masked entries are read nowhere; 0 instead of ~finfo.min keeps every gradient path finite (0 * inf)
    return torch.where(keep, y.movedim(dim, -1), torch.zeros((), dtype=y.dtype, device=y.device)), keep


def _finish(p: Tensor, keep: Tensor, dim: int) -> Tensor:
    """Masked entries exactly 0, a one-entry row exactly 1, an empty row uniform; back to `dim`."""
    n = keep.sum(-1, keepdim=True)
    p = torch.where(keep, p, torch.zeros((), dtype=p.dtype, device=p.device))
    p = torch.where(n == 1, keep.to(p.dtype), p)
    p = torch.where(n == 0, torch.full((), 1.0 / p.shape[-1], dtype=p.dtype, device=p.device), p)
    return p.movedim(-1, dim)


def _row_mean(y: Tensor, keep: Tensor) -> Tensor:
    """Mean of y over the unmasked entries (0 for an empty row)."""
    n = keep.sum(-1, keepdim=True).clamp(min=1).to(y.dtype)
    return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device)).sum(-1, keepdim=True) / n


def _row_max(y: Tensor, keep: Tensor) -> Tensor:
    """Max of y over the unmasked entries (0 for an empty row)."""
    m = y.masked_fill(~keep, -math.inf).amax(-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _softmax_over(z: Tensor, keep: Tensor) -> Tensor:
    """softmax of z over the entries in `keep` (an empty row gives 0s; `_finish` makes it uniform)."""
    any_kept = keep.any(-1, keepdim=True)
    z = torch.where(keep, z, torch.full((), -math.inf, dtype=z.dtype, device=z.device))
    z = torch.where(any_kept, z, torch.zeros_like(z))  # softmax of all -inf is NaN
    return torch.softmax(z, dim=-1)


def _head_param(p: Tensor | float | list[float], y: Tensor) -> Tensor:
    """A per-head parameter (length 1, or H applied along axis 1 of a rank-4 input) shaped to broadcast."""
    t = torch.as_tensor(p, dtype=y.dtype, device=y.device).reshape(-1)
    if t.numel() == 1:
        return t.reshape(())
    if y.dim() != 4 or y.shape[1] != t.numel():
        raise ValueError(
            f"a per-head parameter of length {t.numel()} needs a rank-4 input with {t.numel()} heads on axis 1, "
            f"got shape {tuple(y.shape)}"
        )
    return t.reshape(1, -1, 1, 1)


# ---- the functions (one row of the contract each) -------------------------------------------------


def softmax(x: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    """softmax over U (the baseline; with the project's finfo.min masks this equals torch.softmax(x + mask))."""
    y, keep = _masked(x, mask, dim)
    return _finish(_softmax_over(y, keep), keep, dim)


def _sparse(fn: Callable[[Tensor, int], Tensor], margin: float, x: Tensor, mask: Tensor | None, dim: int) -> Tensor:
    # Any entry more than `margin` below the row max is outside the support (p_max <= 1 bounds tau), so
    # masked entries placed 2*margin below can never enter it, whatever their (finfo.min) value was.
    y, keep = _masked(x, mask, dim)
    y = torch.where(keep, y, _row_max(y, keep) - 2 * margin)
    return _finish(fn(y, -1), keep, dim)


def sparsemax(x: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    """p = max(y - tau, 0), sum p = 1 (Martins & Astudillo 2016): exact, sort-based."""
    return _sparse(entmax.sparsemax, 1.0, x, mask, dim)


def entmax15(x: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    """p = max(y/2 - tau, 0)^2, sum p = 1 (alpha = 1.5, Peters et al. 2019): exact, sort-based."""
    return _sparse(entmax.entmax15, 2.0, x, mask, dim)  # z = y/2: y more than 2 below the max is out


def evsoftmax(x: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    """Ev-SoftMax at inference (Chen et al. 2021): entries below the row mean get 0, softmax over the rest."""
    y, keep = _masked(x, mask, dim)
    # The cut at the mean is a discontinuity: the mean is taken in float64 (exact for the sums of float32
    # scores met in practice), so this, the ONNX body and the fused kernels keep the same entries instead of
    # disagreeing, by a whole weight, on entries within float32 rounding of the mean. y >= mean always
    # holds at the max; `| at max` keeps it should the mean still round above a row of equal entries.
    y64 = y.double()
    kept = keep & ((y64 >= _row_mean(y64, keep)) | (y == _row_max(y, keep)))
    return _finish(_softmax_over(y, kept), keep, dim)


def topk_softmax(x: Tensor, mask: Tensor | None = None, dim: int = -1, k: int = 8) -> Tensor:
    """softmax over the k largest unmasked entries (all ties at the k-th value kept; all of U if |U| <= k)."""
    if int(k) < 1:
        raise ValueError(f"top-k softmax needs k >= 1, got {k}")
    y, keep = _masked(x, mask, dim)
    filled = y.masked_fill(~keep, -math.inf)
    kk = min(int(k), y.shape[-1])
    t = filled.topk(kk, dim=-1).values[..., kk - 1 :]
    return _finish(_softmax_over(y, keep & (y >= t)), keep, dim)


def _adaptive(
    kind: str, x: Tensor, mask: Tensor | None, dim: int, offset: Tensor | float | list[float], scale: Any
) -> Tensor:
    y, keep = _masked(x, mask, dim)
    if dim not in (-1, y.dim() - 1):
        raise ValueError("the per-head Gaussian/Laplacian parameters need the reduction on the last axis")
    phi, s = _head_param(offset, y), _head_param(scale, y)
    d = y - (_row_mean(y, keep) + phi)
    z = -(d * d) / (2 * s * s) if kind == "gaussian" else -d.abs() / s
    return _finish(_softmax_over(z, keep), keep, dim)


def gaussian(x: Tensor, mask: Tensor | None = None, dim: int = -1, offset: Any = 0.0, scale: Any = 1.0) -> Tensor:
    """exp(-(y - mu)^2 / (2 s^2)) normalised over U, mu = mean_U(y) + offset (per head); the density's
    own 1/(s sqrt(2 pi)) cancels in the normalisation."""
    return _adaptive("gaussian", x, mask, dim, offset, scale)


def laplacian(x: Tensor, mask: Tensor | None = None, dim: int = -1, offset: Any = 0.0, scale: Any = 1.0) -> Tensor:
    """exp(-|y - mu| / s) normalised over U, mu = mean_U(y) + offset (per head); 1/(2s) cancels."""
    return _adaptive("laplacian", x, mask, dim, offset, scale)


def length_scale(n: Tensor, eps: float, m: float) -> Tensor:
    """k = 0.5 ln(max((1 - eps)(l - m) / (eps m), 1)) for unmasked length l = n (m = sqrt(l) when m == 0)."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"length-scaled softmax needs eps in (0, 1), got {eps}")
    if m < 0:
        raise ValueError(f"length-scaled softmax needs m >= 0 (0: sqrt(l)), got {m}")
    length = n.clamp(min=1)
    mm = torch.sqrt(length) if m == 0 else torch.full_like(length, float(m))
    ratio = (1 - eps) * (length - mm) / (eps * mm)
    return 0.5 * torch.log(ratio.clamp(min=1.0))


def length_scaled(x: Tensor, mask: Tensor | None = None, dim: int = -1, eps: float = 0.1, m: float = 0.0) -> Tensor:
    """softmax(k y) over U with k from the row's unmasked length (padding does not change it)."""
    y, keep = _masked(x, mask, dim)
    k = length_scale(keep.sum(-1, keepdim=True).to(y.dtype), float(eps), float(m))
    return _finish(_softmax_over(k * y, keep), keep, dim)


# ---- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReweightingSpec:
    """One reweighting function: how it is configured, which ONNX node it becomes and what it promises."""

    name: str  # config name (attention_function)
    fn: Reweight | None  # the reference; None for MultiMax (models.multimax, its own parameters)
    op: str | None  # custom-domain op type with (x, mask); `op + "NoMask"` takes (x). None: standard Softmax
    summary: str
    options: Mapping[str, float | int] = field(default_factory=dict)  # hyperparameters -> defaults (node attrs)
    params: tuple[str, ...] = ()  # learned per-head parameters (node attributes `offset`, `scale`)
    distribution: bool = True  # non-negative, rows sum to 1
    sparse: bool = False  # can give exact zeros to unmasked entries
    # False where an entry's weight jumps as its score crosses a cut (Ev-SoftMax's row mean, top-k's k-th value):
    # float32 rounding upstream can move an entry across it, so two correct runtimes may differ by a weight.
    continuous: bool = True

    @property
    def op_types(self) -> tuple[str, ...]:
        return () if self.op is None else (self.op, self.op + "NoMask")

    def check_options(self, options: Mapping[str, Any] | None) -> dict[str, float | int]:
        """The options with defaults filled in; unknown or out-of-range values are a ValueError."""
        given = dict(options or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise ValueError(f"unknown option(s) {', '.join(unknown)} for {self.name} (known: {known})")
        out: dict[str, float | int] = {**self.options}
        for key, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"option {key} of {self.name} must be a number, got {value!r}")
            if isinstance(self.options[key], int) and value != int(value):
                raise ValueError(f"option {key} of {self.name} must be an integer, got {value!r}")
            out[key] = int(value) if isinstance(self.options[key], int) else float(value)
        if "k" in out and out["k"] < 1:
            raise ValueError(f"top-k softmax needs k >= 1, got {out['k']}")
        if "eps" in out and not 0 < out["eps"] < 1:
            raise ValueError(f"length-scaled softmax needs eps in (0, 1), got {out['eps']}")
        if "m" in out and out["m"] < 0:
            raise ValueError(f"length-scaled softmax needs m >= 0 (0 means sqrt(l)), got {out['m']}")
        return out


FUNCTIONS: dict[str, ReweightingSpec] = {
    s.name: s
    for s in (
        ReweightingSpec("softmax", softmax, None, "softmax over the unmasked entries"),
        # MultiMax's reference is models.multimax (its own parameters); plugins.family runs it like the others
        ReweightingSpec(
            "multimax", None, OPS["multimax"], "softmax after MultiMax's learned modulation (models.multimax)",
            params=("ranges", "ts"),
        ),
        ReweightingSpec("sparsemax", sparsemax, OPS["sparsemax"], "Euclidean projection onto the simplex", sparse=True),
        ReweightingSpec("entmax15", entmax15, OPS["entmax15"], "alpha-entmax with alpha = 1.5", sparse=True),
        ReweightingSpec(
            "evsoftmax", evsoftmax, OPS["evsoftmax"], "softmax over the entries >= the row mean", sparse=True,
            continuous=False,
        ),
        ReweightingSpec(
            "topk_softmax", topk_softmax, OPS["topk_softmax"], "softmax over the k largest entries", {"k": 8},
            sparse=True, continuous=False,
        ),
        ReweightingSpec(
            "gaussian", gaussian, OPS["gaussian"], "exp(-(y-mu)^2/(2s^2)) normalised, mu = mean + offset",
            params=("offset", "scale"),
        ),
        ReweightingSpec(
            "laplacian", laplacian, OPS["laplacian"], "exp(-|y-mu|/s) normalised, mu = mean + offset",
            params=("offset", "scale"),
        ),
        ReweightingSpec(
            "length_scaled", length_scaled, OPS["length_scaled"],
            "softmax(k y), k = 0.5 ln((1-eps)(l-m)/(eps m)), l = unmasked length", {"eps": 0.1, "m": 0.0},
        ),
    )
}  # fmt: skip
# The functions this module adds (MultiMax and softmax are the models' existing two).
OTHER_FUNCTIONS: tuple[str, ...] = tuple(n for n in FUNCTIONS if n not in ("softmax", "multimax"))


def spec(name: str) -> ReweightingSpec:
    """The table row of `name`; an unknown name is a ValueError that lists the known ones."""
    if name not in FUNCTIONS:
        raise ValueError(f"unknown attention function {name!r}; known: {', '.join(FUNCTIONS)}")
    return FUNCTIONS[name]
