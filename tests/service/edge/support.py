"""What the request-tracing and access-control tests (issue 14) share: the models' names, an upload."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

MODEL = "digits_multimax"
TEXT = "text_multimax"


def png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.arange(64).reshape(8, 8) * 4).astype(np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()
