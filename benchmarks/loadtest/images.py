"""Images to classify: the files of a directory, or generated digit-like PNGs (the demo models take any size)."""

from __future__ import annotations

import io
import random
from pathlib import Path

from benchmarks.loadtest.config import ConfigError

CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


def load_images(directory: Path, limit: int = 10_000) -> list[tuple[bytes, str]]:
    """(bytes, content type) of the directory's .png/.jpg/.jpeg files, sorted by name, at most `limit`."""
    files = sorted(p for p in Path(directory).iterdir() if p.suffix.lower() in CONTENT_TYPES and p.is_file())
    if not files:
        raise ConfigError(f"--images: no .png/.jpg/.jpeg files in {directory}")
    return [(p.read_bytes(), CONTENT_TYPES[p.suffix.lower()]) for p in files[:limit]]


def generate_images(count: int = 32, size: int = 32, seed: int = 0) -> list[tuple[bytes, str]]:
    """Grayscale PNGs of a digit drawn on light noise: realistic enough for a digits model, and all different."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = []
    for i in range(count):
        img = Image.frombytes("L", (size, size), bytes(rng.randrange(0, 40) for _ in range(size * size)))
        draw = ImageDraw.Draw(img)
        x, y = rng.randrange(size // 4, size // 2), rng.randrange(size // 6, size // 3)
        draw.text((x, y), str(i % 10), fill=255)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append((buf.getvalue(), "image/png"))
    return out
