"""Digits as people draw them in a paint program, rendered from stroke paths: a test set and training data.

Every digit has a few glyph styles (a 7 straight, curvy, with a crossbar or a serif; a 1 bare, with a flag, with
a base; a 4 open or closed; ...), each a list of pen strokes in a unit box. A drawing is one style with a wobbly
hand (smooth random displacement of the path), a random slant, rotation, width and size, placed on a square canvas
of 28-300 px with a round pen 3-11% of the canvas wide, antialiased or not, dark ink on white (as paint programs
start) or light on dark. The test set and the training pool come from separate seed streams (`SeedSequence`
entropy `(PURPOSE, seed)`), so no training drawing is ever a test drawing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from models.training.digit_inputs import IMAGE_SIZE, model_input

Stroke = list[tuple[float, float]]
TEST, TRAIN = 0, 1  # seed streams: the first entropy word of every drawing's SeedSequence
TEST_SIZE = 1000  # 100 per digit
MIN_CANVAS, MAX_CANVAS = 28, 300


def _arc(cx: float, cy: float, rx: float, ry: float, deg0: float, deg1: float, n: int = 28) -> Stroke:
    """Points along an ellipse from deg0 to deg1 (0 = right, 90 = up; y grows downwards as in images)."""
    t = np.radians(np.linspace(deg0, deg1, n))
    return [(cx + rx * float(np.cos(a)), cy - ry * float(np.sin(a))) for a in t]


def _curve(p0: tuple[float, float], c: tuple[float, float], p1: tuple[float, float], n: int = 16) -> Stroke:
    """A quadratic Bezier curve from p0 to p1 pulled towards c."""
    t = np.linspace(0, 1, n)[:, None]
    pts = (1 - t) ** 2 * np.array(p0) + 2 * (1 - t) * t * np.array(c) + t**2 * np.array(p1)
    return [(float(x), float(y)) for x, y in pts]


# digit -> styles -> strokes, in a unit box (x right, y down).
GLYPHS: dict[int, list[list[Stroke]]] = {
    0: [[_arc(0.5, 0.5, 0.5, 0.5, 90, 450, 40)], [_arc(0.5, 0.5, 0.5, 0.5, 70, 440, 40)]],
    1: [
        [[(0.5, 0.0), (0.5, 1.0)]],
        [[(0.15, 0.3), (0.5, 0.0), (0.5, 1.0)]],
        [[(0.15, 0.3), (0.5, 0.0), (0.5, 1.0)], [(0.15, 1.0), (0.85, 1.0)]],
    ],
    2: [
        [[*_arc(0.5, 0.28, 0.47, 0.28, 160, -40), (0.0, 1.0), (1.0, 1.0)]],
        [_arc(0.5, 0.3, 0.45, 0.3, 150, -10) + _curve((0.94, 0.35), (0.55, 0.75), (0.0, 1.0))[1:] + [(1.0, 0.95)]],
    ],
    3: [
        [_arc(0.5, 0.25, 0.45, 0.25, 150, -90) + _arc(0.5, 0.73, 0.5, 0.27, 90, -150)[1:]],
        [[(0.05, 0.0), (0.95, 0.0), (0.4, 0.4), *_arc(0.5, 0.7, 0.5, 0.3, 110, -150)]],
    ],
    4: [
        [[(0.65, 0.0), (0.0, 0.68), (1.0, 0.68)], [(0.75, 0.3), (0.75, 1.0)]],
        [[(0.75, 1.0), (0.75, 0.0), (0.0, 0.68), (1.0, 0.68)]],
        [[(0.1, 0.0), (0.05, 0.6), (1.0, 0.6)], [(0.75, 0.05), (0.75, 1.0)]],
    ],
    5: [
        [[(0.95, 0.0), (0.15, 0.0), (0.1, 0.45), *_arc(0.48, 0.7, 0.5, 0.3, 145, -150)]],
        [[(0.15, 0.0), (0.1, 0.45), *_arc(0.48, 0.7, 0.5, 0.3, 145, -150)], [(0.15, 0.0), (0.95, 0.02)]],
    ],
    6: [
        [_curve((0.85, 0.0), (0.05, 0.15), (0.05, 0.7)) + _arc(0.5, 0.7, 0.45, 0.3, 180, 520)[1:]],
        [[(0.75, 0.0), (0.08, 0.62), *_arc(0.5, 0.7, 0.45, 0.3, 160, 520)[1:]]],
    ],
    7: [
        [[(0.0, 0.0), (1.0, 0.0), (0.35, 1.0)]],
        [[(0.0, 0.0), (1.0, 0.0), *_curve((1.0, 0.0), (0.45, 0.45), (0.4, 1.0))[1:]]],
        [[(0.0, 0.0), (1.0, 0.0), (0.35, 1.0)], [(0.4, 0.5), (0.95, 0.5)]],
        [[(0.0, 0.2), (0.0, 0.0), (1.0, 0.0), (0.35, 1.0)]],
    ],
    8: [
        [_arc(0.5, 0.25, 0.38, 0.25, -90, 270, 36), _arc(0.5, 0.73, 0.48, 0.27, 90, 450, 36)],
        [_arc(0.5, 0.25, 0.4, 0.25, 200, -160, 36) + _curve((0.12, 0.33), (0.9, 0.55), (0.98, 0.75))[1:]
         + _arc(0.5, 0.75, 0.48, 0.25, 0, -180)[1:] + _curve((0.02, 0.75), (0.1, 0.55), (0.88, 0.33))[1:]],
    ],
    9: [
        [[*_arc(0.45, 0.28, 0.45, 0.28, 0, 360, 36), (0.9, 0.28), (0.88, 1.0)]],
        [_arc(0.45, 0.28, 0.45, 0.28, 0, 360, 36) + _curve((0.9, 0.28), (0.95, 0.9), (0.35, 1.0))[1:]],
    ],
}


def _hand(strokes: Sequence[Stroke], rng: np.random.Generator) -> list[np.ndarray]:
    """The glyph as one hand draws it: wobble, width, slant, rotation; returned in a unit box (max side 1)."""
    freq, phase = rng.uniform(1, 3, (2, 2)), rng.uniform(0, 2 * np.pi, (2, 2))
    amp = rng.uniform(0, 0.04)
    aspect = rng.uniform(0.5, 0.8)
    shear = rng.uniform(-0.35, 0.35)  # positive leans right (italic)
    angle = np.radians(rng.uniform(-10, 10))
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    out = []
    for stroke in strokes:
        p = np.array(stroke, dtype=np.float64)
        # Low-frequency wobble: a function of the position, so strokes that meet keep meeting.
        p = p + amp * np.sin(freq[None, :, 0] * 2 * np.pi * p[:, ::-1] + phase[None, :, 0])
        p[:, 0] = (p[:, 0] - 0.5) * aspect + shear * (0.5 - p[:, 1])
        p[:, 1] -= 0.5
        out.append(p @ rot.T)
    lo = np.min([s.min(0) for s in out], axis=0)
    hi = np.max([s.max(0) for s in out], axis=0)
    return [(s - (lo + hi) / 2) / max(hi - lo) for s in out]


def draw(digit: int, style: int, rng: np.random.Generator) -> Image.Image:
    """One drawing of `digit` in glyph `style` on a square grayscale canvas, as a paint program would save it."""
    strokes = _hand(GLYPHS[digit][style], rng)
    canvas = int(rng.integers(MIN_CANVAS, MAX_CANVAS + 1))
    height = rng.uniform(0.5, 0.85) * canvas  # the digit's larger side
    pen = max(1.5, rng.uniform(0.03, 0.11) * canvas)
    free = (canvas - height - pen) / 2
    centre = canvas / 2 + rng.uniform(-0.8, 0.8, 2) * max(free, 0)
    dark_on_light = rng.random() < 0.75
    paper, ink = (int(rng.integers(225, 256)), int(rng.integers(0, 60))) if dark_on_light else (
        int(rng.integers(0, 30)), int(rng.integers(200, 256)))
    antialias = 4 if rng.random() < 0.6 else 1  # MS Paint's pencil draws aliased lines; most brushes antialias
    scale = antialias
    image = Image.new("L", (canvas * scale, canvas * scale), paper)
    width = pen * scale
    painter = ImageDraw.Draw(image)
    for stroke in strokes:
        pts = [(float(x), float(y)) for x, y in (stroke * height + centre) * scale]
        painter.line(pts, fill=ink, width=max(1, round(width)), joint="curve")
        r = width / 2
        for x, y in (pts[0], pts[-1]):  # round caps
            painter.ellipse((x - r, y - r, x + r, y + r), fill=ink)
    if scale > 1:
        image = image.resize((canvas, canvas), Image.Resampling.BOX)
    return image


def drawing(purpose: int, seed: int, index: int) -> tuple[Image.Image, int]:
    """Drawing number `index` of a seed stream, and its digit: digits in turn, each digit's styles in turn."""
    digit = index % 10
    style = (index // 10) % len(GLYPHS[digit])
    rng = np.random.default_rng(np.random.SeedSequence((purpose, seed, index)))
    return draw(digit, style, rng), digit


def drawn_batch(purpose: int, seed: int, count: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawings start..start+count-1 as (count, 1, 32, 32) model inputs in [0, 1] (the checkpoint's
    preprocessing) and their labels."""
    if count == 0:  # train_vision(drawn_per_batch=0): the recipe without drawings
        return torch.zeros(0, 1, IMAGE_SIZE, IMAGE_SIZE), torch.zeros(0, dtype=torch.long)
    images, labels = [], []
    for index in range(start, start + count):
        image, digit = drawing(purpose, seed, index)
        images.append(model_input(image))
        labels.append(digit)
    return torch.stack(images), torch.tensor(labels)


def drawn_test_set() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed drawn test set: TEST_SIZE drawings, every digit equally often (copies: callers may modify them)."""
    x, y = _test_set()
    return x.clone(), y.clone()


@functools.cache
def _test_set() -> tuple[torch.Tensor, torch.Tensor]:
    return drawn_batch(TEST, 0, TEST_SIZE)  # about 2 s of rendering: once per process


@torch.no_grad()
def drawn_accuracy(model: torch.nn.Module) -> float:
    """Accuracy on the drawn test set (inputs normalised to [-1, 1] as the demo checkpoints say)."""
    model.eval()
    x, y = _test_set()
    return float((model((x - 0.5) / 0.5).argmax(-1) == y).float().mean())


def sample_grid(path: str, per_digit: int = 10) -> None:
    """A PNG of test drawings: one row per digit, each drawing at its own canvas size shown at 64x64."""
    cell = 64
    grid = Image.new("L", (per_digit * cell, 10 * cell), 128)
    found: dict[int, int] = {d: 0 for d in range(10)}
    index = 0
    while min(found.values()) < per_digit:
        image, digit = drawing(TEST, 0, index)
        index += 1
        if found[digit] < per_digit:
            grid.paste(image.resize((cell - 4, cell - 4), Image.Resampling.BILINEAR),
                       (found[digit] * cell + 2, digit * cell + 2))
            found[digit] += 1
    grid.save(path)
