"""Image preprocessing (service.engine.vision): any image mode to the model's shape, EXIF orientation, resize and
center crop, the training normalisation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from models.training.vision import digits_split
from service.engine.vision import Preprocess, decode_image, preprocess
from tests.service.support import SPEC, _jpeg, png


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P", "I;16", "LA", "1", "CMYK"])
def test_preprocess_takes_any_image_mode_to_the_model_shape(mode: str) -> None:
    image = Image.new("RGB", (48, 40), (200, 100, 50)).convert(mode)
    x = preprocess(decode_image(png(image) if mode != "CMYK" else _jpeg(image), 10**7, 8), SPEC)
    assert x.shape == (1, 32, 32) and x.dtype == np.float32 and np.isfinite(x).all()
    assert -1.0 <= x.min() <= x.max() <= 1.0


def test_exif_orientation_is_honoured() -> None:
    image = Image.new("L", (40, 20), 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: "rotate 90 degrees clockwise to display"
    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif)
    assert decode_image(buf.getvalue(), 10**7, 8).size == (20, 40)


def test_preprocess_resizes_the_shorter_side_and_center_crops() -> None:
    spec = Preprocess.from_metadata({"channels": "RGB", "image_size": 4, "resize": 4, "mean": [0, 0, 0],
                                     "std": [1, 1, 1], "interpolation": "nearest"})
    arr = np.zeros((4, 12, 3), np.uint8)
    arr[:, 4:8] = 255  # white middle third of a wide image
    x = preprocess(Image.fromarray(arr), spec)
    assert x.shape == (3, 4, 4) and np.allclose(x, 1.0)


def test_preprocess_matches_the_training_normalisation(service_digits: list[tuple[bytes, int]]) -> None:
    _, _, x, _ = digits_split(seed=0)
    got = preprocess(decode_image(service_digits[0][0], 10**7, 8), SPEC)
    want = ((x[0].numpy() * 255).round() / 255 - 0.5) / 0.5
    assert np.abs(got - want).max() < 1e-5
