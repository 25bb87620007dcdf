"""Triton kernels of the other reweighting functions (issue 15; contract docs/REWEIGHTING.md, references
models.reweighting), in the manner of plugins.kernel: one kernel, the function a compile-time constant, rows of
the flattened leading axes ([R, L]) held in registers (BLOCK_R rows per program), fp32 inside, the additive mask
broadcast through strides (plugins.kernel.mask_args) and read once.

Per row: y = x + mask; U = entries with mask > -1e4; masked entries get exactly 0, a one-entry row exactly 1,
an empty row uniform. Then:
- evsoftmax, gaussian, laplacian, length_scaled: a softmax over the kept entries of transformed logits (row sums).
- topk_softmax: the k-th largest value found exactly by bisection on the float's order-preserving integer key
  (32 steps of a row count), ties at it all kept.
- sparsemax, entmax15: tau by bisection on [max - 1, max] (30 steps: the support to within 2^-30), then the
  closed form of tau on that support (an exact finish: the weights are the sort-based ones).
Rows longer than MAX_COLS are refused (ValueError): a row must fit in one program's registers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from models import onnx_contract
from plugins.family import REWEIGHT_FNS
from plugins.kernel import MAX_BLOCK_L, choose_config, mask_args, require_runnable, rows_of

FNS = REWEIGHT_FNS  # the kernel's FN constant is the index in this tuple
MAX_COLS = MAX_BLOCK_L  # a whole row in one tile
# Globals a compiled (not interpreted) @triton.jit kernel reads must be constexpr objects.
MASKED_BELOW = tl.constexpr(onnx_contract.MASKED_BELOW)
BISECTION_STEPS = tl.constexpr(30)


@triton.jit
def _softmax_kept(z, kept):
    z = tl.where(kept, z, float("-inf"))
    m = tl.max(z, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.where(kept, tl.exp(z - m[:, None]), 0.0)
    return e / tl.maximum(tl.sum(e, axis=1), 1e-38)[:, None]


@triton.jit
def reweight_kernel(
    x_ptr, mask_ptr, off_ptr, scale_ptr, out_ptr,
    n_rows, n_cols, n1, n2, ms0, ms1, ms2, rows_per_head, heads,
    k, eps, m_attr,
    FN: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
    PARAMS_IN_MEMORY: tl.constexpr = True, OFFSETS: tl.constexpr = (0.0,), SCALES: tl.constexpr = (1.0,),
):  # fmt: skip
    """out[r, :] = the function FN (index into FNS) of x[r, :] + the mask row of r (see plugins.kernel).

    Per-head offsets/scales are read at off_ptr/scale_ptr (PARAMS_IN_MEMORY: the launcher's tensors), or are the
    constexpr tuples OFFSETS/SCALES (the ahead-of-time kernels of the TensorRT plugins, whose attributes must be
    constants of the PTX); k, eps and m_attr may be constants there too. A row longer than BLOCK_L (possible
    only for an AOT kernel on a dynamic axis) is written as NaN rather than cut short."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    row_off = rows * n_cols
    cols = tl.arange(0, BLOCK_L)
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(x_ptr + row_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        q = rows // n2
        mask_off = (q // n1) * ms0 + (q % n1) * ms1 + (rows % n2) * ms2
        mv = tl.load(mask_ptr + mask_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        keep = ok & (mv > MASKED_BELOW)
        y = y + mv
    else:
        keep = ok
    y = tl.where(keep, y, 0.0)
    count = tl.sum(keep.to(tl.float32), axis=1)
    mean = tl.sum(y, axis=1) / tl.maximum(count, 1.0)
    ymax = tl.max(tl.where(keep, y, float("-inf")), axis=1)
    ymax = tl.where(count > 0, ymax, 0.0)

    if FN == 0 or FN == 1:  # sparsemax, entmax15: bisection for the support, closed-form tau on it
        if FN == 1:
            z = tl.where(keep, y * 0.5 - (ymax * 0.5)[:, None], float("-inf"))
        else:
            z = tl.where(keep, y - ymax[:, None], float("-inf"))
        lo = tl.full([BLOCK_R], -1.0, tl.float32)
        hi = tl.zeros([BLOCK_R], tl.float32)
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) * 0.5
            d = tl.maximum(z - mid[:, None], 0.0)
            if FN == 1:
                d = d * d
            big = tl.sum(d, axis=1) >= 1.0
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        s = keep & (z > lo[:, None])
        cnt = tl.maximum(tl.sum(s.to(tl.float32), axis=1), 1.0)
        zs = tl.where(s, z, 0.0)
        s1 = tl.sum(zs, axis=1)
        if FN == 1:
            mu = s1 / cnt
            delta = (1.0 - cnt * (tl.sum(zs * zs, axis=1) / cnt - mu * mu)) / cnt
            tau = mu - tl.sqrt(tl.maximum(delta, 0.0))
            p = tl.maximum(z - tau[:, None], 0.0)
            p = p * p
        else:
            tau = (s1 - 1.0) / cnt
            p = tl.maximum(z - tau[:, None], 0.0)
    elif FN == 2:  # evsoftmax: the entries >= the mean, summed in float64 as everywhere else (the max always)
        mean64 = tl.sum(y.to(tl.float64), axis=1) / tl.maximum(count, 1.0).to(tl.float64)
        # y >= mean64 for a float32 y is y >= the smallest float32 >= mean64: compared in float32, no float64 tile
        t = mean64.to(tl.float32)
        tb = t.to(tl.int32, bitcast=True)
        up = tl.where(t == 0.0, 1, tl.where(tb >= 0, tb + 1, tb - 1)).to(tl.float32, bitcast=True)
        cut = tl.where(t.to(tl.float64) < mean64, up, t)
        p = _softmax_kept(y, keep & ((y >= cut[:, None]) | (y == ymax[:, None])))
    elif FN == 3:  # topk_softmax: the k-th largest by bisection on the order-preserving int key
        bits = y.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        lo_k = tl.min(tl.where(keep, key, 2147483647), axis=1)
        hi_k = tl.max(tl.where(keep, key, -2147483648), axis=1)
        for _ in range(33):  # the largest key with count(key >= it) >= k; the range halves each step
            active = lo_k < hi_k
            mid_k = lo_k + (hi_k - lo_k + 1) // 2
            enough = tl.sum((keep & (key >= mid_k[:, None])).to(tl.int32), axis=1) >= k
            lo_k = tl.where(active & enough, mid_k, lo_k)
            hi_k = tl.where(active & (enough == 0), mid_k - 1, hi_k)
        t_bits = lo_k.to(tl.int32)
        t = tl.where(t_bits >= 0, t_bits, t_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        t = tl.where(count > k, t, float("-inf"))
        p = _softmax_kept(y, keep & (y >= t[:, None]))
    elif FN == 4 or FN == 5:  # gaussian, laplacian: per-head offset/scale (axis 1 of rank-4 x)
        head = (rows // rows_per_head) % heads
        if PARAMS_IN_MEMORY:
            phi = tl.load(off_ptr + head, mask=row_ok, other=0.0)
            sc = tl.load(scale_ptr + head, mask=row_ok, other=1.0)
        else:
            phi = tl.zeros([BLOCK_R], tl.float32)
            sc = tl.full([BLOCK_R], 1.0, tl.float32)
            for h in tl.static_range(len(OFFSETS)):
                phi = tl.where(head == h, OFFSETS[h], phi)
                sc = tl.where(head == h, SCALES[h], sc)
        d = y - (mean + phi)[:, None]
        if FN == 4:  # noqa: SIM108  (a compile-time branch: Triton traces an `if` on a constexpr)
            zz = -(d * d) / (2.0 * sc * sc)[:, None]
        else:
            zz = -tl.abs(d) / sc[:, None]
        p = _softmax_kept(zz, keep)
    else:  # length_scaled: k from the unmasked length
        length = tl.maximum(count, 1.0)
        mm = tl.where(m_attr == 0.0, tl.sqrt(length), m_attr)
        ratio = (1.0 - eps) * (length - mm) / (eps * mm)
        kk = 0.5 * tl.log(tl.maximum(ratio, 1.0))
        p = _softmax_kept(kk[:, None] * y, keep)

    p = tl.where(keep, p, 0.0)
    p = tl.where((count == 1.0)[:, None], keep.to(tl.float32), p)
    p = tl.where((count == 0.0)[:, None], 1.0 / n_cols, p)
    p = tl.where(n_cols > BLOCK_L, float("nan"), p)
    tl.store(out_ptr + row_off[:, None] + cols[None, :], p.to(out_ptr.dtype.element_ty), mask=ok)


def _head_values(values: float | Sequence[float] | torch.Tensor, heads: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32).reshape(-1).to(device)
    if t.numel() not in (1, heads):
        raise ValueError(f"per-head values must be 1 or {heads} (x's axis 1), got {t.numel()}")
    return t.expand(heads).contiguous()


def fused_reweight(
    fn: str,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    k: int = 8,
    offset: float | Sequence[float] | torch.Tensor = 0.0,
    scale: float | Sequence[float] | torch.Tensor = 1.0,
    eps: float = 0.1,
    m: float = 0.0,
    baked: bool = False,
) -> torch.Tensor:
    """The reweighting function `fn` (one of FNS) over x's last axis, with the contract's masking.

    `baked`: per-head offsets/scales as compile-time constants, as the TensorRT plugins' ahead-of-time kernels
    take them (one compile per set of values: for checking that path, not for serving)."""
    if fn not in FNS:
        raise ValueError(f"unknown reweighting function {fn!r}; known: {', '.join(FNS)}")
    x, out, n_rows, n_cols = rows_of(x, "the reweighting kernel")
    if int(k) < 1 or not 0.0 < eps < 1.0 or m < 0:
        raise ValueError(f"need k >= 1, eps in (0, 1), m >= 0; got k={k}, eps={eps}, m={m}")
    if n_rows == 0 or n_cols == 0:
        return out
    if n_cols > MAX_COLS:
        raise ValueError(f"rows of {n_cols} > {MAX_COLS} entries do not fit one program")
    per_head = fn in ("gaussian", "laplacian") and max(torch.as_tensor(v).numel() for v in (offset, scale)) > 1
    if per_head and x.dim() != 4:
        raise ValueError(f"per-head offset/scale need a rank-4 x (batch, heads, q, k), got {tuple(x.shape)}")
    heads = x.shape[1] if per_head else 1
    offs, scales = _head_values(offset, heads, x.device), _head_values(scale, heads, x.device)
    if not bool((scales > 0).all()):
        raise ValueError("scale must be > 0")
    rows_per_head = x.shape[2] if per_head else 1
    mask, (n1, n2, ms0, ms1, ms2) = mask_args(mask, x)
    require_runnable(x)
    cfg = choose_config(n_cols)
    grid = (math.ceil(n_rows / cfg.block_r),)
    reweight_kernel[grid](
        x, mask, offs, scales, out,
        n_rows, n_cols, n1, n2, ms0, ms1, ms2, rows_per_head, heads,
        int(k), float(eps), float(m),
        FN=FNS.index(fn), HAS_MASK=mask is not None, BLOCK_R=cfg.block_r, BLOCK_L=cfg.block_l,
        PARAMS_IN_MEMORY=not baked, OFFSETS=tuple(offs.tolist()) if baked else (0.0,),
        SCALES=tuple(scales.tolist()) if baked else (1.0,), num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
