"""How many random inputs the default vision validation uses: 100, fewer for models where that is slow.

Every batch size is always covered (whole rounds of `batch_sizes`); only the number of rounds shrinks, so a
DeiT-small check costs about as much as ten images per phase instead of a hundred. `--samples N` overrides.
"""

from __future__ import annotations

from torch import nn

from models.spec import VisionSpec

MAX_SAMPLES = 100
# Multiply-accumulates the reference may spend (~1-2 s for PyTorch on 2 cores; onnxruntime similar per level).
MAC_BUDGET = 60e9


def macs_per_image(model: nn.Module, spec: VisionSpec) -> float:
    """Rough MACs of one image: every weight is used once per token (exact enough for a budget); a model without
    tokens counts as one per pixel row."""
    tokens = spec.tokens or spec.image_size
    return float(sum(p.numel() for p in model.parameters())) * tokens


def default_samples(model: nn.Module, spec: VisionSpec, batch_sizes: tuple[int, ...]) -> int:
    round_size = sum(batch_sizes)
    rounds = max(1, int(MAC_BUDGET // (macs_per_image(model, spec) * round_size)))
    return max(round_size, min(MAX_SAMPLES, rounds * round_size))
