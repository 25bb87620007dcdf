"""The one rule for every comparison the export's validation makes:

    limit = tol x scale,    scale = max(1, max |reference|)

over all the tensors of one kind that a check compares (the logits; the KV cache's `present` outputs; the served
probabilities of a sparse output function, which take the logits' limit; the model's outputs with the fused ops
against the function bodies), `tol` the precision's (`TOLS`). The measured max abs difference is reported beside
its limit, its tol and the scale, and a failure says all four (`failure`).

Why the scale, and why the reference's largest value rather than each element's (allclose's atol + rtol*|ref|):
a logit or a cached key is a sum over a hidden state (a projection, a norm, an attention), and its rounding error
is float rounding of the terms summed, which are as large as the hidden state, not as large as the result: an
element near 0 after cancellation carries the same error as its neighbours. An elementwise rtol fails exactly
those elements of a correct graph. Rounding errors also grow with depth (every layer adds to the residual stream
and rounds it again), so the tols are set with a real model's depth in view (docs/ARCHITECTURE.md, "Comparison
limits"). Below magnitude 1 the scale is 1, so small outputs keep the absolute limit they always had.

The one check that stays elementwise is a fused node against its own function body on identical inputs
(`NODE_ATOL`, `NODE_RTOL`): one op, no depth, each output its own short computation; it is the kernels' check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

# per unit of scale, against the fp32 PyTorch model. fp32: SmolLM2-135M (30 layers, logits up to ~30) differs by
# ~3e-5 of its scale, random 2-layer models by ~1e-6: 1e-4 leaves room for deeper models and catches a 1% weight.
# fp16: one fp16 step is 2^-11 of a value (4.9e-4 near 1), and fp16 layers round every activation: 2e-2 is ~40 steps.
# int8 / int4: quantizing the weights changes the outputs by design; reported (with their scale), not enforced.
TOLS: dict[str, float | None] = {"fp32": 1e-4, "fp16": 2e-2, "int8": None, "int4": None}
# the model's outputs with the fused ops against the function bodies in fp32: float32 rounding of one path
# against another, no approximation in between
FUSED_FP32_TOL = 1e-5
# one fused node against its function body on the same inputs, elementwise (sigma's values grow with x^2)
NODE_ATOL, NODE_RTOL = 1e-5, 1e-6


def scale(references: Iterable[np.ndarray]) -> float:
    """max(1, max |reference|) over all the arrays (NaN is not a size: the validation counts NaNs)."""
    out = 1.0
    for ref in references:
        out = max(out, float(np.nan_to_num(np.abs(ref), nan=0.0).max(initial=0.0)))
    return out


def limit(tol: float | None, size: float) -> float | None:
    """The limit at this scale; None where `tol` is None (reported, not enforced)."""
    return None if tol is None else tol * size


class Measure:
    """The largest difference over the compared pairs of one kind and the scale of their references."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.scale = 1.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """Compares one pair; returns the elementwise |got - ref| (float32 or wider; NaN where either is NaN)."""
        diff = np.abs(got.astype(np.float64) - ref) if got.dtype != ref.dtype else np.abs(got - ref)
        worst = float(diff.max(initial=0.0))
        self.max_abs = worst if np.isnan(worst) or np.isnan(self.max_abs) else max(self.max_abs, worst)
        self.scale = max(self.scale, scale([ref]))
        return diff

    def report(self, tol: float | None) -> dict[str, Any]:
        return judged(self.max_abs, tol, self.scale)


def judged(max_abs: float, tol: float | None, size: float) -> dict[str, Any]:
    """A measured difference beside its limit: {"max_abs", "tol", "scale", "limit", "relative" (max_abs / scale)}."""
    return {"max_abs": max_abs, "tol": tol, "scale": size, "limit": limit(tol, size), "relative": max_abs / size}


def failure(where: str, what: str, entry: dict[str, Any]) -> list[str]:
    """[] within the limit (or where none is enforced), else one line: "ORT_ENABLE_ALL: logits max abs diff
    0.000873 > limit 0.00312 (= 0.0001 x scale 31.2)". NaN fails (it is never within a limit)."""
    if entry["limit"] is None or entry["max_abs"] <= entry["limit"]:
        return []
    return [f"{where}: {what} max abs diff {entry['max_abs']:.3g} > limit {entry['limit']:.3g} "
            f"(= {entry['tol']:g} x scale {entry['scale']:.3g})"]


def describe(entry: dict[str, Any]) -> str:
    """The report's words for one comparison: "8.73e-04 (limit 3.12e-03 = 0.0001 x scale 31.2)", or for a
    precision whose deltas are reported only "0.84 (0.028 x scale 30; reported, not enforced)"."""
    if entry["limit"] is None:
        return f"{entry['max_abs']:.2e} ({entry['relative']:.2g} x scale {entry['scale']:.3g}; reported, not enforced)"
    return f"{entry['max_abs']:.2e} (limit {entry['limit']:.2e} = {entry['tol']:g} x scale {entry['scale']:.3g})"
