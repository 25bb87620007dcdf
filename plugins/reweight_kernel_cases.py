"""Cases for the reweighting Triton kernels against the references (run under TRITON_INTERPRET=1 by
tests/plugins/test_reweight_triton.py, or on a GPU): {case: {"diff", "tol", "finite"}}."""

from __future__ import annotations

import zlib
from typing import Any

from models.reweighting import OTHER_FUNCTIONS as FNS

# Node attributes / keyword options of the test cases: per-head Gaussian (3 heads on axis 1), one Laplacian value.
ATTRS: dict[str, dict[str, Any]] = {
    "topk_softmax": {"k": 3},
    "gaussian": {"offset": [0.1, -0.3, 0.5], "scale": [0.5, 1.0, 2.0]},
    "laplacian": {"offset": [0.2], "scale": [0.7]},
    "length_scaled": {"eps": 0.1, "m": 0.0},
}
CASES = [
    f"{fn}-{kind}-{dt}-L{n}"
    for fn in FNS
    for kind, dt, n in (("plain", "fp32", 1), ("plain", "fp32", 197), ("masked", "fp32", 7), ("masked", "fp32", 197),
                        ("ties", "fp32", 33), ("large", "fp32", 33), ("masked", "fp16", 33))
] + ["evsoftmax-atmean-fp32-L197", "gaussian-baked-fp32-L33", "laplacian-baked-fp32-L33"]  # fmt: skip
TOL = {"fp32": 1e-6, "fp16": 1e-3}


def run_cases(cases: list[str] | None = None, device: str = "cpu") -> dict[str, dict[str, Any]]:
    import torch

    from models import reweighting as rw
    from plugins.reweight_kernel import fused_reweight

    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    low = torch.finfo(torch.float32).min
    out: dict[str, dict[str, Any]] = {}
    for case in cases or CASES:
        fn, kind, dt, n_text = case.rsplit("-", 3)[0], *case.rsplit("-", 3)[1:]
        n = int(n_text[1:])
        g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
        x = torch.randn(2, 3, 6, n, generator=g) * 3
        if kind == "ties":
            x = torch.randint(-2, 3, (2, 3, 6, n), generator=g).float()
        if kind == "large" and fn not in ("gaussian", "laplacian"):  # ill-conditioned there (the mean's rounding)
            x = x * 300
        if kind == "atmean":  # entry 0 at its row's exact mean (the fixed point): float32 sums disagree on its side
            for _ in range(4):
                x[..., 0] = x.double().mean(-1).float()
        mask = None
        if kind in ("masked", "ties", "baked"):  # row 0 fully masked, row 1 one left, row 2 soft biases
            mask = torch.where(torch.rand(2, 1, 6, n, generator=g) < 0.3, low, 0.0)
            mask[..., 0, :] = low
            mask[..., 1, :] = -torch.inf
            mask[..., 1, n // 2] = 0.0
            mask[..., 2, :] = -3.0
        a = ATTRS.get(fn, {})
        if kind == "baked":  # per-head values as compile-time constants (the TensorRT plugins' kernels)
            a = {"offset": [0.1, -0.3, 0.5], "scale": [0.5, 1.0, 2.0]}
        kw = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in a.items()}
        fn_ref = rw.FUNCTIONS[fn].fn
        assert fn_ref is not None
        xd = x.to(dtypes[dt])
        want = fn_ref(xd.float(), mask, -1, **kw)
        got = fused_reweight(fn, xd.to(device), None if mask is None else mask.to(dtypes[dt]).to(device),
                             baked=kind == "baked", **a)
        got = got.float().cpu()
        out[case] = {"diff": float((got - want).abs().max()), "tol": TOL[dt], "finite": bool(got.isfinite().all())}
    return out
