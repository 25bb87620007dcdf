"""The fused MultiMax Triton kernel and its launcher for torch tensors.

`fused_multimax(x, ranges, ts, order, mask)` = softmax(sigma(x) + mask) over the last axis and
`fused_sigma(x, ranges, ts, order)` = sigma(x); fp32/fp16/bf16 in and out, fp32 inside. Rows are the
flattened leading axes ([R, L]); the additive mask is broadcast to x through strides (stride 0 on
size-1 axes), never materialised, except in the rare layouts `_mask_rows` cannot express.

Triton decides once per process, when `triton` is imported, whether `@triton.jit` compiles for the GPU
or builds interpreter functions (TRITON_INTERPRET=1): its own library functions (tl.max, tl.sum) are
decorated at that moment. So CUDA tensors need a process without the variable and CPU tensors one
that set it before importing triton; `plugins.aot` compiles in a process without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows up to MAX_BLOCK_L long are normalised from registers in one pass; longer rows loop over tiles.
MAX_BLOCK_L = 4096
# Elements per program: short rows are packed BLOCK_R to a program so a program moves a useful amount of data.
TILE_ELEMENTS = 2048
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LaunchConfig:
    block_r: int
    block_l: int
    num_warps: int


def choose_config(n_cols: int | None, tile_elements: int = TILE_ELEMENTS, block_l: int | None = None) -> LaunchConfig:
    """Tile shape for rows of `n_cols` (None: unknown at compile time, e.g. a dynamic TensorRT axis)."""
    if block_l is None:
        want = n_cols if n_cols is not None else 1024
        block_l = min(triton.next_power_of_2(want), MAX_BLOCK_L)
    block_l = max(16, block_l)
    block_r = max(1, min(64, tile_elements // block_l))
    num_warps = max(1, min(16, block_r * block_l // 256))  # ~8 elements per thread
    return LaunchConfig(block_r, block_l, num_warps)


@triton.jit
def _modulated_tile(
    x_ptr, mask_ptr, row_off, mask_off, cols, row_ok, n_cols,
    r0, r1, r2, r3, t0, t1, t2, t3,
    ORDER: tl.constexpr, HAS_MASK: tl.constexpr, SOFTMAX: tl.constexpr,
):  # fmt: skip
    """sigma(x) (+ mask) of one [BLOCK_R, BLOCK_L] tile, in fp32.

    Terms are added in the order and association of `models.multimax.sigma`, so fp32 results round like
    the PyTorch reference. Padding columns are -inf for the softmax (exp gives 0); padding rows stay
    finite (they are never stored) so that they do not divide 0 by 0.
    """
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + row_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    low1 = tl.maximum(r0 - x, 0.0)
    high1 = tl.maximum(x - r1, 0.0)
    y = x + t0 * low1 + t1 * high1
    if ORDER == 2:
        low2 = tl.maximum(r2 - x, 0.0)
        high2 = tl.maximum(x - r3, 0.0)
        y = y + t2 * low2 * low2 + t3 * high2 * high2
    if HAS_MASK:
        # The additive mask comes AFTER the modulation: modulating -inf / finfo.min would give NaN.
        y = y + tl.load(mask_ptr + mask_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if SOFTMAX:
        y = tl.where(col_ok[None, :], y, float("-inf"))
    return y, ok


@triton.jit
def _finite_max(m):
    # A row that is -inf everywhere gets max 0: exp(-inf - 0) = 0, its sum is 0 and the row comes out
    # 0/0 = NaN as from torch.softmax, while -inf - -inf cannot poison the running sums.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def multimax_kernel(
    # TensorRT's AOT launch passes input pointers, then int32 scalars, then the output: keep this order.
    x_ptr, mask_ptr, p_ptr,
    n_rows, n_cols, n1, n2, ms0, ms1, ms2,
    r0, r1, r2, r3, t0, t1, t2, t3,
    out_ptr,
    ORDER: tl.constexpr, HAS_MASK: tl.constexpr, SOFTMAX: tl.constexpr, PARAMS_IN_MEMORY: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """out[r, :] = softmax(sigma(x[r, :]) + mask row of r), or sigma(x[r, :]) alone when not SOFTMAX.

    x and out are contiguous [n_rows, n_cols]. Row r = (i0*n1 + i1)*n2 + i2 reads its mask row at
    i0*ms0 + i1*ms1 + i2*ms2 (stride 0 on broadcast axes); the mask's last axis is contiguous. The 8
    learned parameters are fp32 scalars or compile-time constants (r0..t3), or 8 floats at p_ptr
    (PARAMS_IN_MEMORY: parameters that live on the GPU are read there, without a host sync).
    """
    if PARAMS_IN_MEMORY:
        r0 = tl.load(p_ptr + 0)
        r1 = tl.load(p_ptr + 1)
        r2 = tl.load(p_ptr + 2)
        r3 = tl.load(p_ptr + 3)
        t0 = tl.load(p_ptr + 4)
        t1 = tl.load(p_ptr + 5)
        t2 = tl.load(p_ptr + 6)
        t3 = tl.load(p_ptr + 7)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    row_off = rows * n_cols  # int64: R * L passes 2**31 for long contexts
    if HAS_MASK:
        q = rows // n2
        mask_off = (q // n1) * ms0 + (q % n1) * ms1 + (rows % n2) * ms2
    else:
        mask_off = row_off
    lanes = tl.arange(0, BLOCK_L)

    if not SOFTMAX:
        # MultiMaxSigma: elementwise, one read and one write per element.
        for start in range(0, n_cols, BLOCK_L):
            cols = start + lanes
            y, ok = _modulated_tile(
                x_ptr, mask_ptr, row_off, mask_off, cols, row_ok, n_cols,
                r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK, False,
            )  # fmt: skip
            tl.store(out_ptr + row_off[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)
    elif n_cols <= BLOCK_L:
        # Whole rows in registers: each score is read once; sigma, max, sum(exp), normalise; written once.
        y, ok = _modulated_tile(
            x_ptr, mask_ptr, row_off, mask_off, lanes, row_ok, n_cols,
            r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK, True,
        )  # fmt: skip
        e = tl.exp(y - _finite_max(tl.max(y, axis=1))[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
        tl.store(out_ptr + row_off[:, None] + lanes[None, :], p.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        # Rows longer than a tile: online max / sum(exp) over the tiles, then a second pass re-reads the
        # row (recomputing sigma) to normalise. Long rows are read twice and written once.
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, n_cols, BLOCK_L):
            y, ok = _modulated_tile(
                x_ptr, mask_ptr, row_off, mask_off, start + lanes, row_ok, n_cols,
                r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK, True,
            )  # fmt: skip
            m_new = tl.maximum(m, tl.max(y, axis=1))
            shift = _finite_max(m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(y - shift[:, None]), axis=1)
            m = m_new
        shift = _finite_max(m)
        for start in range(0, n_cols, BLOCK_L):
            cols = start + lanes
            y, ok = _modulated_tile(
                x_ptr, mask_ptr, row_off, mask_off, cols, row_ok, n_cols,
                r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK, True,
            )  # fmt: skip
            p = tl.exp(y - shift[:, None]) / s[:, None]
            tl.store(out_ptr + row_off[:, None] + cols[None, :], p.to(out_ptr.dtype.element_ty), mask=ok)


def interpreting() -> bool:
    """True when this process's `@triton.jit` functions are interpreter functions (CPU)."""
    return bool(triton.knobs.runtime.interpret)


def _device_params(
    ranges: torch.Tensor | Sequence[float], ts: torch.Tensor | Sequence[float], device: torch.device
) -> torch.Tensor:
    """The 8 parameters as one fp32 vector on `device`: a view when ranges/ts are halves of one already."""
    if (
        isinstance(ranges, torch.Tensor)
        and isinstance(ts, torch.Tensor)
        and ranges.dtype == ts.dtype == torch.float32
        and ranges.device == ts.device == device
        and ranges.numel() == ts.numel() == 4
        and ranges.is_contiguous()
        and ts.is_contiguous()
        and ts.untyped_storage().data_ptr() == ranges.untyped_storage().data_ptr()
        and ts.data_ptr() == ranges.data_ptr() + 16
    ):
        return ranges.as_strided((8,), (1,))  # the torch op's params[:4], params[4:]: no copy, no extra kernel
    packed = torch.cat([torch.as_tensor(ranges).reshape(4), torch.as_tensor(ts).reshape(4)])
    return packed.to(device=device, dtype=torch.float32).contiguous()


def _mask_rows(mask: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int, int]]:
    """(mask, (n1, n2), (ms0, ms1, ms2)) so that row r = (i0*n1 + i1)*n2 + i2 of x reads its mask row at
    i0*ms0 + i1*ms1 + i2*ms2, with the mask's last axis contiguous."""
    m = mask.expand(shape)
    if m.stride(-1) != 1:  # broadcast (or strided) along the softmax axis: rare, materialise it
        m = m.contiguous()
    # Merge leading axes that address the mask linearly (broadcast runs merge too: stride 0 == 0 * size).
    dims: list[tuple[int, int]] = []
    for size, stride in zip(m.shape[:-1], m.stride()[:-1], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 3:
        m = m.contiguous()
        dims = [(math.prod(shape[:-1]), shape[-1])]
    dims = [(1, 0)] * (3 - len(dims)) + dims
    return m, (dims[1][0], dims[2][0]), (dims[0][1], dims[1][1], dims[2][1])


def mask_args(mask: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """The mask as the kernels read it and (n1, n2, ms0, ms1, ms2) (`_mask_rows`); zeros without a mask."""
    if mask is None:
        return None, (1, 1, 0, 0, 0)
    if not mask.is_floating_point():
        raise TypeError(f"the mask is additive (0 / -inf or finfo.min), got dtype {mask.dtype}")
    try:
        m, (n1, n2), (ms0, ms1, ms2) = _mask_rows(mask.to(x.device), x.shape)
    except RuntimeError as exc:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {tuple(x.shape)}") from exc
    return m, (n1, n2, ms0, ms1, ms2)


def rows_of(x: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(x contiguous, its output buffer, n_rows, n_cols): the [R, L] view every launcher of the family's kernels
    takes; a TypeError / ValueError naming `kernel` for a tensor no kernel takes."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{kernel} supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{kernel} needs at least one axis")
    x = x.contiguous()
    n_cols = x.shape[-1]
    return x, torch.empty_like(x), x.numel() // n_cols if n_cols else 0, n_cols


def require_runnable(x: torch.Tensor) -> None:
    """A launch needs a CUDA tensor, or this process interpreting (a clear error instead of Triton's)."""
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the Triton kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported)"
        )


def _launch(
    x: torch.Tensor,
    ranges: torch.Tensor | Sequence[float],
    ts: torch.Tensor | Sequence[float],
    order: int,
    mask: torch.Tensor | None,
    softmax: bool,
    config: LaunchConfig | None,
) -> torch.Tensor:
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order}")
    x, out, n_rows, n_cols = rows_of(x, "the MultiMax kernel")
    if n_rows == 0 or n_cols == 0:
        return out
    cfg = config or choose_config(n_cols)

    in_memory = isinstance(ranges, torch.Tensor) or isinstance(ts, torch.Tensor)
    params = _device_params(ranges, ts, x.device) if in_memory else None
    scalars = [0.0] * 8 if in_memory else [float(v) for v in (*ranges, *ts)]
    if len(scalars) != 8:
        raise ValueError("ranges and ts must hold 4 values each")

    mask, (n1, n2, ms0, ms1, ms2) = mask_args(mask, x)
    require_runnable(x)
    grid = (math.ceil(n_rows / cfg.block_r),)
    multimax_kernel[grid](
        x, mask, params,
        n_rows, n_cols, n1, n2, ms0, ms1, ms2,
        *scalars,
        out,
        ORDER=order, HAS_MASK=mask is not None, SOFTMAX=softmax, PARAMS_IN_MEMORY=in_memory,
        BLOCK_R=cfg.block_r, BLOCK_L=cfg.block_l, num_warps=cfg.num_warps,
        enable_fp_fusion=False,  # no FMA contraction: round like the reference (and like plugins.aot)
    )  # fmt: skip
    return out


def fused_multimax(
    x: torch.Tensor,
    ranges: torch.Tensor | Sequence[float],
    ts: torch.Tensor | Sequence[float],
    order: int = 2,
    mask: torch.Tensor | None = None,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """softmax(sigma(x) + mask, -1) in one kernel. Tensor parameters are read on the device (no sync)."""
    return _launch(x, ranges, ts, order, mask, True, config)


def fused_sigma(
    x: torch.Tensor,
    ranges: torch.Tensor | Sequence[float],
    ts: torch.Tensor | Sequence[float],
    order: int = 2,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """sigma(x), elementwise (the `MultiMaxSigma` node: output-layer logits)."""
    return _launch(x, ranges, ts, order, None, False, config)
