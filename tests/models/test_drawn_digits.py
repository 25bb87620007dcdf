"""The drawn-digits set (models.training.drawn_digits): reproducible, varied as promised, apart from the training
drawings, and fed to the models exactly as the server would feed an upload."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.training.drawn_digits import (
    GLYPHS,
    MAX_CANVAS,
    MIN_CANVAS,
    TEST,
    TEST_SIZE,
    TRAIN,
    drawing,
    drawn_batch,
    drawn_test_set,
    sample_grid,
)
from models.training.vision import DIGITS_PREPROCESS
from service.engine.vision import Preprocess, preprocess


def test_the_test_set_is_reproducible_and_balanced() -> None:
    x, y = drawn_test_set()
    x2, y2 = drawn_batch(TEST, 0, 50)  # rendered afresh
    assert x.shape == (TEST_SIZE, 1, 32, 32) and torch.equal(x[:50], x2) and torch.equal(y[:50], y2)
    assert torch.bincount(y, minlength=10).tolist() == [TEST_SIZE // 10] * 10
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def test_drawings_vary_as_people_draw() -> None:
    drawings = [drawing(TEST, 0, i) for i in range(200)]
    sizes = {im.size[0] for im, _ in drawings}
    assert all(im.size[0] == im.size[1] for im, _ in drawings)
    assert min(sizes) >= MIN_CANVAS and max(sizes) <= MAX_CANVAS and len(sizes) > 100
    # Dark ink on white (as paint programs start) and light on dark both occur; the corner is paper.
    corners = [im.getpixel((0, 0)) for im, _ in drawings]
    light = sum(c > 128 for c in corners)  # type: ignore[operator]
    assert 100 < light < 200
    # Every glyph style of every digit is in the first 10 * (most styles) drawings.
    most = max(len(s) for s in GLYPHS.values())
    seen = {(d, (i // 10) % len(GLYPHS[d])) for i in range(10 * most) for d in [drawing(TEST, 0, i)[1]]}
    assert seen == {(d, s) for d, styles in GLYPHS.items() for s in range(len(styles))}
    # The ink covers a real part of the canvas: neither blank nor filled.
    for im, _ in drawings[:50]:
        a = np.asarray(im, dtype=np.float32)
        paper = a[0, 0]
        inked = np.abs(a - paper) > 64
        assert 0.02 < inked.mean() < 0.6


def test_training_drawings_are_not_test_drawings() -> None:
    x_test, _ = drawn_test_set()
    x_train, y_train = drawn_batch(TRAIN, 0, 200)
    assert torch.bincount(y_train, minlength=10).tolist() == [20] * 10
    # No training drawing (first 200 of seed 0's stream) equals any test drawing.
    diffs = (x_train[:, None] - x_test[None]).abs().flatten(2).amax(-1)
    assert float(diffs.min()) > 0.05
    assert not torch.equal(drawn_batch(TRAIN, 1, 10)[0], x_train[:10])  # the seed picks the stream
    assert torch.equal(drawn_batch(TRAIN, 0, 5, start=3)[0], x_train[3:8])  # steps take the next drawings
    empty_x, empty_y = drawn_batch(TRAIN, 0, 0)
    assert empty_x.shape == (0, 1, 32, 32) and empty_y.shape == (0,)


@pytest.mark.parametrize("index", [0, 7, 23, 61])
def test_model_input_is_what_the_server_makes_of_the_uploaded_png(index: int) -> None:
    image, _ = drawing(TEST, 0, index)
    png = io.BytesIO()
    image.convert("RGB").save(png, "PNG")  # what a paint program saves
    served = preprocess(Image.open(io.BytesIO(png.getvalue())), Preprocess.from_metadata(DIGITS_PREPROCESS))
    ours = (drawn_batch(TEST, 0, 1, start=index)[0][0].numpy() - 0.5) / 0.5
    np.testing.assert_allclose(served, ours, atol=1e-6)


def test_sample_grid_writes_one_row_per_digit(tmp_path: Path) -> None:
    out = tmp_path / "grid.png"
    sample_grid(str(out), per_digit=3)
    with Image.open(out) as im:
        assert im.size == (3 * 64, 10 * 64)


def test_plot_drawn_command_writes_the_grid_or_refuses_a_missing_directory(tmp_path: Path) -> None:
    from models.training.cli import main

    out = tmp_path / "drawn.png"
    assert main(["plot-drawn", "-o", str(out)]) == 0
    with Image.open(out) as im:
        assert im.size == (640, 640)
    assert main(["plot-drawn", "-o", str(tmp_path / "nope" / "drawn.png")]) == 2
    assert not (tmp_path / "nope").exists()
