"""Image bytes -> model input, with the preprocessing the model's metadata prescribes (Pillow only).

Every way an upload can be wrong ends in a ServiceError with a 4xx status: not an image, truncated,
too small, too many pixels (checked from the header, before any pixel is decoded, so a decompression
bomb costs nothing), or an image that decodes to something unusable.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from service.errors import ServiceError

RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}


@dataclass(frozen=True)
class Preprocess:
    channels: str  # Pillow mode: "L" or "RGB"
    image_size: int
    resize: int
    interpolation: Image.Resampling
    mean: np.ndarray  # (C, 1, 1)
    std: np.ndarray

    @classmethod
    def from_metadata(cls, spec: dict[str, Any]) -> Preprocess:
        channels = spec.get("channels", "RGB")
        if channels not in ("L", "RGB"):
            raise ValueError(f"preprocess channels must be L or RGB, got {channels!r}")
        n = 1 if channels == "L" else 3
        mean = np.asarray(spec.get("mean", [0.0] * n), np.float32).reshape(-1, 1, 1)
        std = np.asarray(spec.get("std", [1.0] * n), np.float32).reshape(-1, 1, 1)
        if mean.shape[0] != n or std.shape[0] != n or np.any(std == 0):
            raise ValueError(f"preprocess mean/std must have {n} entries and std no zero")
        if spec.get("crop", "center") != "center":
            raise ValueError(f"only center crop is supported, got {spec.get('crop')!r}")
        size = int(spec["image_size"])
        return cls(channels, size, int(spec.get("resize", size)), RESAMPLING[spec.get("interpolation", "bilinear")],
                   mean, std)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (1 if self.channels == "L" else 3, self.image_size, self.image_size)


def decode_image(data: bytes, max_pixels: int, min_side: int) -> Image.Image:
    """Decoded image, or a 4xx ServiceError saying what is wrong with the bytes."""
    if not data:
        raise ServiceError(400, "empty image", code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise ServiceError(422, f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels",
                                   code="image_too_large")
            if min(width, height) < min_side:
                raise ServiceError(422, f"image of {width}x{height} pixels is too small (sides must be at least "
                                        f"{min_side})", code="image_too_small")
            image.load()
            if image.getexif().get(0x0112, 1) != 1:  # phone photos: honour the orientation tag
                image = ImageOps.exif_transpose(image)
    except ServiceError:
        raise
    except UnidentifiedImageError:
        raise ServiceError(422, "not an image Pillow can read (JPEG, PNG, WebP, BMP, GIF, TIFF, ...)",
                           code="invalid_image") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ServiceError(422, f"image rejected as a decompression bomb: {exc}", code="image_too_large") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as exc:
        # Pillow reports damaged files through all of these ("image file is truncated", "broken PNG file", ...).
        raise ServiceError(422, f"corrupt or truncated image: {str(exc) or type(exc).__name__}",
                           code="invalid_image") from None
    return image


def preprocess(image: Image.Image, spec: Preprocess) -> np.ndarray:
    """(C, H, W) float32: convert channels, resize the shorter side, center crop, scale to [0, 1], normalise."""
    if image.mode not in ("L", "RGB"):
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            # Transparent pixels carry arbitrary colour; put them on black (the digits' background).
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
            image = Image.alpha_composite(background, rgba)
        elif image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
            arr = np.asarray(image, dtype=np.float32)
            hi = float(arr.max()) or 1.0
            image = Image.fromarray(np.clip(arr / hi * 255.0, 0, 255).astype(np.uint8), "L")
    image = image.convert(spec.channels)
    width, height = image.size
    scale = spec.resize / min(width, height)
    new_size = (max(spec.image_size, round(width * scale)), max(spec.image_size, round(height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, spec.interpolation)
    if new_size != (spec.image_size, spec.image_size):
        left, top = (new_size[0] - spec.image_size) // 2, (new_size[1] - spec.image_size) // 2
        image = image.crop((left, top, left + spec.image_size, top + spec.image_size))
    arr = np.asarray(image, dtype=np.float32) * (1.0 / 255.0)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return ((arr - spec.mean) / spec.std).astype(np.float32, copy=False)


def load_and_preprocess(data: bytes, spec: Preprocess, max_pixels: int, min_side: int) -> np.ndarray:
    image = decode_image(data, max_pixels, min_side)
    try:
        return preprocess(image, spec)
    except (OSError, ValueError) as exc:  # e.g. a mode Pillow cannot convert
        raise ServiceError(422, f"cannot convert the image to {spec.channels}: {exc}", code="invalid_image") from None
