"""Image classification as the server serves it: metadata validation, I/O checks, warm-up, runtime and KServe
codec, in one place (the `serve` part of models.tasks' vision row)."""

from __future__ import annotations

from typing import Any

import numpy as np

from models import tasks
from models.labels import index_labels
from models.onnx_contract import LOGITS, PIXEL_VALUES
from models.spec import VISION, VisionSpec
from service.base.config import Settings
from service.base.kserve_codec import bad, exact_input
from service.engine.backends.base import VisionBackend
from service.engine.entry import ModelEntry, ServedTask
from service.engine.runtime import VisionRuntime
from service.engine.tasks.shapes import compare, session_shapes
from service.engine.vision import Preprocess
from service.engine.warmup import batch_buckets


def validate(entry: ModelEntry, source: str) -> None:
    try:
        entry.preprocessor = Preprocess.from_metadata(entry.preprocess or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: unusable preprocess metadata: {exc}") from None
    assert isinstance(entry.spec, VisionSpec)
    if entry.labels is None:  # labels are optional: classes are named by their index until a file gives names
        entry.labels = index_labels(entry.spec.classes)
    labels = entry.labels
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ValueError(f"{source}: labels must be a list of strings")


def check_io(entry: ModelEntry, source: str) -> None:
    spec = entry.spec
    assert isinstance(spec, VisionSpec) and entry.preprocessor is not None
    classes = len(entry.labels or [])
    if spec.classes != classes:
        raise ValueError(f"{source}: {classes} labels for a model of {spec.classes} classes")
    if spec.channels != entry.preprocessor.shape[0]:
        raise ValueError(f"{source}: preprocess gives {entry.preprocessor.shape[0]} channels, the model takes "
                         f"{spec.channels}")
    shapes = session_shapes(entry.backend)
    if shapes is not None:
        inputs, outputs = shapes
        compare(source, f"input {PIXEL_VALUES}", inputs.get(PIXEL_VALUES, []), [None, *entry.preprocessor.shape])
        compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, classes])


def warm_up(entry: ModelEntry, settings: Settings) -> int:
    """One batch of every size bucket the batcher forms (powers of two up to --max-batch-size, and that size)."""
    assert isinstance(entry.backend, VisionBackend) and entry.preprocessor is not None
    rng = np.random.default_rng(0)
    calls = 0
    for size in batch_buckets(settings.max_batch_size):
        x = rng.standard_normal((size, *entry.preprocessor.shape)).astype(np.float32)
        for _ in range(settings.warmup_calls):
            entry.backend.run_vision(x)
            calls += 1
    return calls


def kserve_io(rt: VisionRuntime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([{"name": PIXEL_VALUES, "datatype": "FP32", "shape": [-1, *rt.preprocess.shape]}],
            [{"name": LOGITS, "datatype": "FP32", "shape": [-1, len(rt.labels)]}])


def kserve_decode(rt: VisionRuntime, tensors: dict[str, np.ndarray], max_batch: int) -> np.ndarray:
    """The request's pixel_values, checked: the rows the batcher takes."""
    extra = sorted(set(tensors) - {PIXEL_VALUES})
    if extra:
        raise bad(f"unknown input(s) {', '.join(extra)} (model takes {PIXEL_VALUES})")
    x = exact_input(tensors, PIXEL_VALUES, "FP32")
    want = rt.preprocess.shape
    if x.ndim != 4 or tuple(x.shape[1:]) != want or x.shape[0] < 1:
        raise bad(f"input {PIXEL_VALUES}: shape {list(x.shape)}, expected [n, {', '.join(map(str, want))}] "
                  "with n >= 1")
    if x.shape[0] > max_batch:
        raise bad(f"input {PIXEL_VALUES}: batch {x.shape[0]} exceeds max_batch_size {max_batch}")
    if not np.isfinite(x).all():
        raise bad(f"input {PIXEL_VALUES} holds NaN or Inf")
    return np.ascontiguousarray(x)


TASK = ServedTask(tasks.get(VISION), VisionBackend, validate, check_io, warm_up, VisionRuntime, kserve_io,
                  kserve_decode)
