"""Image bytes -> model input, with the preprocessing the model's metadata prescribes (Pillow only).

Every way an upload can be wrong ends in a ServiceError with a 4xx status: not an image, truncated,
too small, too many pixels (checked from the header, before any pixel is decoded, so a decompression
bomb costs nothing), or an image that decodes to something unusable.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from service.base.errors import ServiceError
from service.base.pngcheck import missing_rows
from service.engine import jpeg

# Pillow's default, but a library imported into the process may turn it on: then a file cut short would be
# decoded with its missing part filled in, and every such upload would get a prediction on made-up pixels.
ImageFile.LOAD_TRUNCATED_IMAGES = False

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


def _open_checked(data: bytes, max_pixels: int, min_side: int) -> Image.Image:
    """The image with only its header read, its size within the limits (a 4xx ServiceError otherwise)."""
    if not data:
        raise ServiceError(400, "empty image", code="invalid_image")
    image: Image.Image = Image.open(io.BytesIO(data))  # reads the header only
    width, height = image.size
    if width * height > max_pixels:
        raise ServiceError(422, f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels",
                           code="image_too_large")
    if min(width, height) < min_side:
        raise ServiceError(422, f"image of {width}x{height} pixels is too small (sides must be at least "
                                f"{min_side})", code="image_too_small")
    return image


def header_pixels(data: bytes, max_pixels: int, min_side: int) -> int:
    """width x height from the image's header alone (what admission counts before anything is decoded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            width, height = _open_checked(data, max_pixels, min_side).size
    except Exception as exc:
        raise _as_service_error(exc) from None
    return width * height


def _as_service_error(exc: Exception) -> ServiceError:
    """What a client is told about an image Pillow could not open or decode."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, UnidentifiedImageError):
        return ServiceError(422, "not an image Pillow can read (JPEG, PNG, WebP, BMP, GIF, TIFF, ...)",
                            code="invalid_image")
    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return ServiceError(422, f"image rejected as a decompression bomb: {exc}", code="image_too_large")
    if isinstance(exc, (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError)):
        # Pillow reports damaged files through all of these ("image file is truncated", "broken PNG file", ...).
        return ServiceError(422, f"corrupt or truncated image: {str(exc) or type(exc).__name__}",
                            code="invalid_image")
    raise exc


def decode_image(data: bytes, max_pixels: int, min_side: int) -> Image.Image:
    """Decoded image, or a 4xx ServiceError saying what is wrong with the bytes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open_checked(data, max_pixels, min_side)
            decoded = jpeg.decode(data, image) if image.format == "JPEG" else None  # refuses data that ends early
            if decoded is not None:
                decoded.info.update(image.info)  # the EXIF orientation below
                image = decoded
            else:
                image.load()
            short = missing_rows(data) if image.format == "PNG" else None
            if short is not None:
                raise ServiceError(422, f"image data ends early: the compressed rows stop after about {short[0]} "
                                        f"of {short[1]} rows", code="invalid_image")
            if image.getexif().get(0x0112, 1) != 1:  # phone photos: honour the orientation tag
                image = ImageOps.exif_transpose(image)
    except Exception as exc:
        raise _as_service_error(exc) from None
    return image


def _to_channels(image: Image.Image, channels: str, high: float) -> Image.Image:
    """`image` in Pillow mode `channels`; transparency goes on black, 16-bit and float scale by `high`."""
    if image.mode not in ("L", "RGB"):
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            # Transparent pixels carry arbitrary colour; put them on black (the digits' background).
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
            image = Image.alpha_composite(background, rgba)
        elif image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
            arr = np.asarray(image, dtype=np.float32)
            image = Image.fromarray(np.clip(arr / high * 255.0, 0, 255).astype(np.uint8), "L")
    return image.convert(channels)


def crop_box(width: int, height: int, spec: Preprocess) -> tuple[float, float, float, float]:
    """The region of the source image that "resize the shorter side to spec.resize, then center-crop
    spec.image_size" keeps, in source pixels."""
    scale = spec.resize / min(width, height)
    size = spec.image_size
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    sx, sy = new_w / width, new_h / height
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return left / sx, top / sy, (left + size) / sx, (top + size) / sy


def preprocess(image: Image.Image, spec: Preprocess) -> np.ndarray:
    """(C, H, W) float32: convert channels, resize the shorter side, center crop, scale to [0, 1], normalise.

    The crop is taken from the source first and only that region is resampled: no intermediate image is
    ever larger than the source region plus the filter's support, whatever the aspect ratio (a 8 x 5,000,000
    image resized as a whole would be 224 x 140,000,000 pixels on the way)."""
    width, height = image.size
    size = spec.image_size
    box = crop_box(width, height, spec)
    # Keep the pixels the resampling filter reaches beyond the box (3 output pixels for Lanczos, in source pixels).
    margin = 3 * max((box[2] - box[0]) / size, (box[3] - box[1]) / size) + 1
    x0, y0 = max(0, math.floor(box[0] - margin)), max(0, math.floor(box[1] - margin))
    x1, y1 = min(width, math.ceil(box[2] + margin)), min(height, math.ceil(box[3] + margin))
    high = 1.0
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        extrema = image.getextrema()
        high = float(extrema[1]) if isinstance(extrema[1], (int, float)) and extrema[1] else 1.0
    region = _to_channels(image.crop((x0, y0, x1, y1)), spec.channels, high)
    inner = (box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0)
    if region.size != (size, size) or inner != (0, 0, size, size):
        region = region.resize((size, size), spec.interpolation, box=inner)
    arr = np.asarray(region, dtype=np.float32) * (1.0 / 255.0)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return ((arr - spec.mean) / spec.std).astype(np.float32, copy=False)


def load_and_preprocess(data: bytes, spec: Preprocess, max_pixels: int, min_side: int) -> np.ndarray:
    image = decode_image(data, max_pixels, min_side)
    try:
        return preprocess(image, spec)
    except (OSError, ValueError) as exc:  # e.g. a mode Pillow cannot convert
        raise ServiceError(422, f"cannot convert the image to {spec.channels}: {exc}", code="invalid_image") from None
