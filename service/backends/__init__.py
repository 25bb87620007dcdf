"""Backends behind one interface (`Backend`): ONNX Runtime, TensorRT, PyTorch."""

from service.backends.base import Backend, BackendUnavailable, Past, TensorSpec

__all__ = ["Backend", "BackendUnavailable", "Past", "TensorSpec"]
