"""What people send the digits demo, made from the held-out 8x8 digits: the input variants it is scored on.

Each variant is a PIL image the way a user would produce it (an upscaled PNG, blocky pixel art, a
black digit on white, the raw 8x8 file), then the checkpoint's own preprocessing: resize to 32x32
with its interpolation, scale to [0, 1]. That is what the server does to a square upload
(`service.engine.vision.preprocess`; tests/test_digit_inputs.py checks the two agree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

IMAGE_SIZE = 32
Variant = Callable[[Image.Image], Image.Image]


def _upscaled(resample: Image.Resampling) -> Variant:
    return lambda im: im.resize((IMAGE_SIZE, IMAGE_SIZE), resample)


# name -> what the user sends, from an 8x8 grayscale digit (light ink on dark, as scikit-learn stores it).
VARIANTS: dict[str, Variant] = {
    "bilinear": _upscaled(Image.Resampling.BILINEAR),
    "nearest": _upscaled(Image.Resampling.NEAREST),
    "bicubic": _upscaled(Image.Resampling.BICUBIC),
    "inverted": lambda im: ImageOps.invert(im.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)),
    "8x8-raw": lambda im: im,
}


def as_pil(digit: torch.Tensor) -> Image.Image:
    """A (1, 8, 8) or (8, 8) tensor in [0, 1] as an 8-bit grayscale image."""
    return Image.fromarray((digit.squeeze().numpy() * 255).round().astype(np.uint8), "L")


def model_input(image: Image.Image, interpolation: Image.Resampling = Image.Resampling.BILINEAR) -> torch.Tensor:
    """(1, 32, 32) in [0, 1]: a square image resized as the checkpoint's preprocessing says."""
    image = image.convert("L")
    if image.size != (IMAGE_SIZE, IMAGE_SIZE):
        image = image.resize((IMAGE_SIZE, IMAGE_SIZE), interpolation)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]


def variant_batch(digits8: torch.Tensor, name: str) -> torch.Tensor:
    """(N, 1, 32, 32) model inputs in [0, 1] for the (N, 1, 8, 8) digits, as variant `name`."""
    return torch.stack([model_input(VARIANTS[name](as_pil(d))) for d in digits8])


@torch.no_grad()
def variant_accuracies(model: torch.nn.Module, digits8: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Held-out accuracy on every variant (inputs normalised to [-1, 1] as the demo checkpoints say)."""
    model.eval()
    out = {}
    for name in VARIANTS:
        x = (variant_batch(digits8, name) - 0.5) / 0.5
        out[name] = float((model(x).argmax(-1) == labels).float().mean())
    return out
