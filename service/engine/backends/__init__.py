"""Backends behind one interface (`Backend`; per task `VisionBackend`, `TextBackend`): ONNX Runtime, TensorRT,
PyTorch."""

from service.engine.backends.base import Backend, BackendUnavailable, Past, TensorSpec, TextBackend, VisionBackend

__all__ = ["Backend", "BackendUnavailable", "Past", "TensorSpec", "TextBackend", "VisionBackend"]
