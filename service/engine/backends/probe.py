"""What accelerators this machine really has (not what a wheel was built for).

onnxruntime-gpu lists the CUDA and TensorRT providers as "available" on any machine; asking for them
where no GPU or library exists makes ONNX Runtime log errors on every session. So a provider counts
as present only if a CUDA device answers and the provider's shared library loads with all its
dependencies (CUDA, cuBLAS, cuDNN; TensorRT's libnvinfer for the TensorRT provider).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)


@functools.cache
def cuda_device_count() -> int:
    """CUDA devices visible through the driver API (0 without a driver or a device); no CUDA toolkit needed."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            return count.value if lib.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0
        except AttributeError:
            return 0
    return 0


def _loads(path: Path) -> str | None:
    """None if the shared library loads (dependencies included), else the loader's reason."""
    try:
        ctypes.CDLL(str(path))
    except OSError as exc:
        return str(exc).split(":")[-1].strip() or "cannot be loaded"
    return None


@functools.cache
def onnxruntime_providers() -> tuple[tuple[str, ...], str]:
    """(providers to request, in order, CPU last; why the GPU ones were left out, or "")."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    gpu = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in available]
    if not gpu:
        return ("CPUExecutionProvider",), "this onnxruntime build has no GPU providers"
    if cuda_device_count() == 0:
        return ("CPUExecutionProvider",), "no CUDA device"
    try:
        ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels, where installed (onnxruntime >= 1.21)
    except Exception as exc:  # best effort: system libraries may still be found
        log.debug("onnxruntime.preload_dlls: %s", exc)
    capi = Path(ort.__file__).parent / "capi"
    chosen: list[str] = []
    reasons: list[str] = []
    for provider, lib in (("TensorrtExecutionProvider", "libonnxruntime_providers_tensorrt.so"),
                          ("CUDAExecutionProvider", "libonnxruntime_providers_cuda.so")):
        if provider not in gpu:
            continue
        why = _loads(capi / lib) if (capi / lib).exists() else None
        if why is None:
            chosen.append(provider)
        else:
            reasons.append(f"{provider}: {why}")
    return (*chosen, "CPUExecutionProvider"), "; ".join(reasons)


@functools.cache
def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


