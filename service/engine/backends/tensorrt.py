"""TensorRT backend: a serialized engine (.engine / .plan, e.g. from `plugins.build_engine`) with the
MultiMax plugins.

TensorRT is imported only when an engine is loaded, so CPU machines never need it. Device buffers
are torch CUDA tensors (no pycuda / cuda-python dependency). Vision engines only: serving a text
engine would need the KV-cache inputs bound per step, which this backend does not do yet.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from models import registry as architectures
from models.onnx_contract import LOGITS, PIXEL_VALUES
from plugins.trt_plugin import tensorrt_unavailable
from service.engine.backends.base import BackendUnavailable, VisionBackend

log = logging.getLogger(__name__)
PLUGIN_ENV = "MULTIMAX_TRT_PLUGIN_LIB"


_registered = False


def register_plugins(explicit_lib: str = "") -> str:
    """Make the MultiMax plugins known to TensorRT before an engine is deserialized; says what was done.

    The project's plugins (`plugins.trt_plugin`) are ahead-of-time Python plugins: their kernels live in the
    engine, and registering them is harmless either way. A C++ plugin library (the option or
    $MULTIMAX_TRT_PLUGIN_LIB) is loaded with RTLD_GLOBAL so its creators register themselves.
    """
    global _registered
    done = []
    lib = explicit_lib or os.environ.get(PLUGIN_ENV, "")
    if lib:
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise BackendUnavailable(f"MultiMax plugin library {lib}: {exc}") from None
        done.append(f"loaded {lib}")
    if not _registered:
        try:
            from plugins.trt_plugin import register
        except ImportError:
            pass
        else:
            try:
                register()
                _registered = True
                done.append("registered plugins.trt_plugin")
            except Exception as exc:  # e.g. an older TensorRT: engines with AOT plugins may still load
                log.warning("MultiMax TensorRT plugins not registered: %s", exc)
    return ", ".join(done) or "no plugin registration"


class TensorRTBackend(VisionBackend):
    kind = "tensorrt"
    platform = "tensorrt_plan"

    def __init__(self, path: Path, arch: str, plugin_lib: str = "") -> None:
        why = tensorrt_unavailable()
        if why:
            raise BackendUnavailable(f"{path.name}: TensorRT unavailable: {why}")
        if architectures.task_or_none(arch) != architectures.VISION:
            raise BackendUnavailable(f"{path.name}: the TensorRT backend serves vision engines only (arch {arch})")
        import tensorrt as trt
        import torch

        self.torch = torch
        self.path, self.arch = path, arch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.plugins = register_plugins(plugin_lib)
        trt.init_libnvinfer_plugins(self.logger, "")
        runtime = trt.Runtime(self.logger)
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BackendUnavailable(f"{path.name}: TensorRT could not deserialize the engine ({self.plugins}; a C++ "
                                     f"plugin library can be given with --trt-plugin-lib or {PLUGIN_ENV})")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.lock = threading.Lock()  # one execution context: one call at a time
        self.provider = f"TensorRT {trt.__version__} on {torch.cuda.get_device_name()}"
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        if self.inputs != [PIXEL_VALUES] or LOGITS not in self.outputs:
            raise BackendUnavailable(f"{path.name}: expected input {PIXEL_VALUES} and output {LOGITS}, got "
                                     f"{self.inputs} -> {self.outputs}")

    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        torch = self.torch
        with self.lock, torch.cuda.stream(self.stream):
            x = torch.from_numpy(pixel_values).to("cuda", non_blocking=True)
            self.context.set_input_shape(PIXEL_VALUES, tuple(x.shape))
            self.context.set_tensor_address(PIXEL_VALUES, x.data_ptr())
            out = {}
            for name in self.outputs:
                shape = tuple(self.context.get_tensor_shape(name))
                out[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
                self.context.set_tensor_address(name, out[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            logits = out[LOGITS].cpu()  # synchronises the stream
        return logits.numpy()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "provider": self.provider, "file": self.path.name}
