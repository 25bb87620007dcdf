"""A KV cache that grows in place: `present = concat(past, new)` without copying the past at every step.

The text models' cache is a list of per-layer (key, value) tensors of shape (B, heads, length, head_dim) (the
interface the server, `models.generate` and the ONNX export share). Concatenating at every decode step copies the
whole cache, so a step's cost grows with batch x context (issue 24: 1.9x at 256 tokens, batch 8). Here the
present is a view of the first `length + T` positions of a buffer with room to spare: the new keys are written
after the past, in place, and the buffer is reallocated (to twice what it must hold, at most the model's context)
only when full, so the copies cost O(1) per step amortised, as a vector's append does; a prefill's cache starts
with room for as many steps as its prompt has tokens.

The one rule this adds: a past may be extended once. Extending the same past twice writes the second step's
keys where the first present has its last position (the server's scheduler, `models.generate` and the
benchmarks extend each past once; row selection and merging copy). Under autograd, tracing or export the plain
concatenation runs (the exported graph's `present = concat(past, new)` does not change).
"""

from __future__ import annotations

import torch
from torch import Tensor

MIN_CAPACITY = 64  # positions: a short prompt's first buffer


def traced() -> bool:
    """Tracing, compiling or exporting: the plain operations, whatever else is set."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def room(total: int, max_length: int) -> int:
    """Positions a buffer that must hold `total` gets when (re)allocated: twice that, at least MIN_CAPACITY, at
    most the context `max_length` (0: none known), never less than `total`. The server's in-place onnxruntime
    buffers (service.engine.model_folders) grow by the same rule."""
    return max(total, min(max(2 * total, MIN_CAPACITY), max_length or 2 * total))


def capacity(past: Tensor) -> int:
    """How many positions the buffer behind `past` (B, H, L, D) holds from its start: L for a tensor of its own,
    more for a view made by `extend`."""
    B, H, L, D = past.shape
    s = past.stride()
    if past.storage_offset() != 0 or s[3] != 1 or s[2] != D or D == 0 or s[1] % D:
        return L
    cap = s[1] // D
    if cap < L or (B > 1 and s[0] != H * s[1]):
        return L
    needed = ((B - 1) * s[0] + (H - 1) * s[1] + cap * D) * past.element_size()
    return cap if past.untyped_storage().nbytes() >= needed else L


def extend(past: Tensor, new: Tensor, max_length: int) -> Tensor:
    """concat(past, new) along the time axis (2), in place in `past`'s buffer when it has room."""
    if (torch.is_grad_enabled() or traced() or past.requires_grad or new.requires_grad
            or (past.is_inference() and not torch.is_inference_mode_enabled())):  # PyTorch forbids that write
        return torch.cat([past, new], dim=2)
    B, H, L, D = past.shape
    total = L + new.shape[2]
    if capacity(past) >= total:
        out = past.as_strided((B, H, total, D), past.stride())
    else:
        buffer = past.new_empty((B, H, room(total, max_length), D))
        buffer[:, :, :L] = past
        out = buffer[:, :, :total]
    out[:, :, L:] = new
    return out
