"""The interface every backend implements, whatever runs the model underneath.

Arrays cross this boundary as numpy (vision, token ids, masks). A text backend's KV cache stays in
its own array type (numpy for ONNX Runtime, torch tensors for PyTorch) so a GPU cache never makes a
round trip through host memory between decode steps; each text backend declares that type's row and column
operations (`TextBackend.cache`: service.engine.backends.cache_numpy, cache_torch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from models.cache_growth import room
from service.engine.backends.cache_ops import CacheOps, Past

__all__ = ["Backend", "BackendUnavailable", "CacheOps", "CachedDecoder", "Past", "TensorSpec", "TextBackend",
           "VisionBackend", "grown_length"]


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (library or device missing); one line for the user."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe V2 datatype name: FP32, INT64, ...
    shape: tuple[int, ...]  # -1 for dynamic dimensions


class Backend(ABC):
    """What every backend is, whatever its task: `VisionBackend` and `TextBackend` say what it runs."""

    kind: str  # "onnxruntime" | "tensorrt" | "torch"
    platform: str  # KServe/Triton platform name
    provider: str  # what really executes: an ORT execution provider, "cuda", "cpu", ...
    arch: str  # an architecture of models.registry
    # The onnxruntime InferenceSession it runs, if it runs one (the startup checks compare its graph's input and
    # output shapes with the model's description: service.engine.tasks.shapes); None for the others.
    session: Any = None

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What /v1/models and the logs say about this backend."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing that needs closing
        pass


class VisionBackend(Backend):
    """Runs an image classifier."""

    @abstractmethod
    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        """(B, C, H, W) float32 -> logits (B, classes) float32."""


RESERVE_FACTOR = 4  # a growing cache buffer takes at most this many times what it must hold, whatever the hint


def grown_length(total: int, reserved: int, context: int) -> int:
    """Positions a full cache buffer that must now hold `total` grows to (`TextBackend.reserve`): what the rows
    may reach (`reserved`) where the hint goes beyond `total`, but at most RESERVE_FACTOR times `total` (a chat
    without max_tokens may reach the whole context, which must not be allocated on its first step) and never past
    the context (0: unknown); without such a hint, twice `total` (models.cache_growth.room)."""
    if reserved <= total:
        return room(total, context)
    size = min(reserved, max(RESERVE_FACTOR * total, room(total, context)))
    return min(size, context) if context else size


class TextBackend(Backend):
    """Runs a decoder with a KV cache."""

    # True where `run_text(..., last_only=True)` computes only the last position's logits (B, 1, V); callers that
    # need one row take logits[:, -1] either way.
    keeps_last_logits: bool = False
    # The cache's array type's operations, laid out as the graph reads it ("left-padded" or "right-padded")
    cache: CacheOps
    reserved: int = 0  # the decode loop's last `reserve` hint (0: none)

    @abstractmethod
    def run_text(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past,
        last_only: bool = False,
    ) -> tuple[Any, Past]:
        """One forward: logits (B, T, V) in the backend's array type, and presents = concat(past, new). The logits
        may be a buffer that the backend's next call overwrites (decode steps on onnxruntime): use them first.
        `last_only`: (B, 1, V) will do, where the backend `keeps_last_logits` (others ignore it)."""

    @abstractmethod
    def empty_past(self, batch: int) -> Past:
        """A cache of length 0 for `batch` rows, in the backend's array type."""

    def reserve(self, positions: int) -> None:
        """The decode loop's hint: the running rows may reach `positions` cache positions (their prompts and the
        tokens they may still ask for). A backend whose cache buffers grow sizes its next growth to it
        (`grown_length(total, self.reserved, context)`), so a batch copies its cache once instead of at every
        doubling (onnxruntime-genai sizes its buffers to max_length up front); the others ignore it."""
        self.reserved = positions

    def host_logits(self, logits: Any) -> Any:
        """A step's logits where the sampler reads them: a numpy array as it is (no copy), a tensor on the CPU."""
        return logits

    def to_numpy(self, logits: Any) -> np.ndarray:
        """Logits in the backend's array type -> float32 numpy (what the protocols see)."""
        return np.asarray(logits, dtype=np.float32)

    def forward_stateless(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Logits (B, T, V) float32 of one forward from an empty cache (left padding masked)."""
        positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
        logits, _ = self.run_text(input_ids, attention_mask, positions, self.empty_past(len(input_ids)))
        return self.to_numpy(logits)


class CachedDecoder(Protocol):
    """What the decode loop calls: a `TextBackend`, or anything with its methods (test doubles)."""

    keeps_last_logits: bool
    cache: CacheOps

    def run_text(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past,
        last_only: bool = False,
    ) -> tuple[Any, Past]: ...

    def empty_past(self, batch: int) -> Past: ...

    def reserve(self, positions: int) -> None: ...

    def host_logits(self, logits: Any) -> Any: ...
