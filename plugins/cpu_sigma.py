"""MultiMax's modulation (sigma: the LM head's SegLU) on CPU tensors, by the fused library's vectorised kernel.

PyTorch eager runs `models.multimax.sigma` as a dozen elementwise kernels, each paying PyTorch's dispatch: on a
decode step of the demo LLM (4,096 logits) that is about 5% of the step, where the target is 1%. The fused
onnxruntime library (plugins.ort_ops) holds the same sigma as one vectorised pass per row (AVX-512, AVX2 or
portable, MULTIMAX_ORT_ISA forcing one as for onnxruntime); `MultiMaxSigmaRow` exposes it with a C ABI, called
here by ctypes on the tensor's memory (ctypes releases the GIL for the call). Inference only: the models call
it through their `fused_sigma` hook when autograd is off (training keeps the reference, whose gradient is exact).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch
from torch import Tensor

from plugins.ort_ops import library


@functools.cache
def _kernel() -> Any:
    """The library's MultiMaxSigmaRow, or None (no library, or a prebuilt one from before it existed)."""
    lib = library()
    if lib.path is None:
        return None
    fn = getattr(ctypes.CDLL(str(lib.path)), "MultiMaxSigmaRow", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _kernel() is not None


def sigma_cpu(x: Tensor, ranges: Tensor, ts: Tensor) -> Tensor:
    """sigma(x) (second order) for a float32 CPU tensor, written into x where x is contiguous (the logits a
    forward has just made: no one else holds them), else into a new tensor."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the fused MultiMax library is unavailable (python -m plugins.ort_ops says why)")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"sigma_cpu takes float32 CPU tensors, not {x.dtype} on {x.device}")
    y = x if x.is_contiguous() else x.contiguous()
    r, t = (p if p.dtype == torch.float32 and p.is_contiguous() else p.detach().float().contiguous()
            for p in (ranges, ts))
    isa = os.environ.get("MULTIMAX_ORT_ISA", "").encode() or None
    status = fn(y.data_ptr(), y.data_ptr(), y.numel(), r.data_ptr(), t.data_ptr(), isa)
    if status != 0:
        raise RuntimeError(f"MULTIMAX_ORT_ISA={isa!r}: unknown kernel path, or this CPU lacks it")
    return y


def use_cpu_sigma(model: torch.nn.Module) -> bool:
    """Give `model` the fused SegLU where it has the hook (models.llama) and a second-order head; True if set."""
    head = getattr(model, "output_multimax", None)
    if not hasattr(type(model), "fused_sigma") or head is None or getattr(head, "order", None) != 2:
        return False
    if getattr(head, "affine", False) or not available():
        return False
    model.fused_sigma = sigma_cpu  # type: ignore[assignment]
    return True
