"""Image classification as the server serves it: metadata validation, I/O checks, warm-up, runtime and KServe
codec, in one place (the `serve` part of models.tasks' vision row)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from models import tasks
from models.labels import index_labels
from models.onnx_contract import LOGITS, PIXEL_VALUES
from models.spec import VISION, VisionSpec
from service.base.config import Settings
from service.base.kserve_codec import bad, exact_input
from service.base.metrics import Metrics
from service.engine.backends.base import VisionBackend
from service.engine.batcher import DynamicBatcher
from service.engine.entry import InferCall, InferResult, ModelEntry, ModelRuntime, ServedTask, TaskModel
from service.engine.tasks.shapes import compare, session_shapes
from service.engine.vision import Preprocess
from service.engine.warmup import batch_buckets

MIN_AUTO_PIXELS, MAX_AUTO_PIXELS = 4_000_000, 40_000_000


def load(entry: ModelEntry, source: str) -> VisionModel:
    """The entry as an image classifier: its preprocessing built from its metadata, its labels (the classes'
    indexes where the file names none) checked."""
    spec, backend = entry.spec, entry.backend
    if not isinstance(spec, VisionSpec) or not isinstance(backend, VisionBackend):  # the registry chose it by both
        raise ValueError(f"{source}: a {spec.TASK} model on the {backend.kind} backend is no image classifier")
    try:
        preprocess = Preprocess.from_metadata(entry.preprocess or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: unusable preprocess metadata: {exc}") from None
    if entry.labels is None:  # labels are optional: classes are named by their index until a file gives names
        entry.labels = index_labels(spec.classes)
    labels = entry.labels
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ValueError(f"{source}: labels must be a list of strings")
    return VisionModel(entry, spec, backend, preprocess, labels)


class VisionModel(TaskModel):
    """An image classifier, loaded: its description, backend, preprocessing and class names."""

    def __init__(self, entry: ModelEntry, spec: VisionSpec, backend: VisionBackend, preprocess: Preprocess,
                 labels: list[str]) -> None:
        super().__init__(entry)
        self.spec, self.backend, self.preprocess, self.labels = spec, backend, preprocess, labels

    def check_io(self, source: str) -> None:
        spec, preprocess = self.spec, self.preprocess
        classes = len(self.labels)
        if spec.classes != classes:
            raise ValueError(f"{source}: {classes} labels for a model of {spec.classes} classes")
        if spec.channels != preprocess.shape[0]:
            raise ValueError(f"{source}: preprocess gives {preprocess.shape[0]} channels, the model takes "
                             f"{spec.channels}")
        shapes = session_shapes(self.backend)
        if shapes is not None:
            inputs, outputs = shapes
            compare(source, f"input {PIXEL_VALUES}", inputs.get(PIXEL_VALUES, []), [None, *preprocess.shape])
            compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, classes])

    def warm_up(self, settings: Settings) -> int:
        """One batch of every size bucket the batcher forms (powers of two up to --max-batch-size, and that size)."""
        rng = np.random.default_rng(0)
        calls = 0
        for size in batch_buckets(settings.max_batch_size):
            x = rng.standard_normal((size, *self.preprocess.shape)).astype(np.float32)
            for _ in range(settings.warmup_calls):
                self.backend.run_vision(x)
                calls += 1
        return calls

    def runtime(self, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> VisionRuntime:
        return VisionRuntime(self, executor, settings, metrics)


def image_pixel_limit(settings: Settings, spec: Preprocess) -> tuple[int, int]:
    """(largest image, pixels of one request's images) a model decodes: the settings', else from the model's input.
    A model resizing to 256 px needs nothing near 40 megapixels: 256 x its resize side squared (16.7 MP for
    a 224/256 DeiT) is far more than any detail it can see, bounded by 4 MP (a phone photo scaled down) and
    40 MP; a request may hold 4 such images."""
    per_image = settings.max_image_pixels or min(MAX_AUTO_PIXELS, max(MIN_AUTO_PIXELS, 256 * spec.resize ** 2))
    return per_image, settings.max_request_pixels or 4 * per_image


class VisionRuntime(ModelRuntime):
    """An image classifier: requests' images go through its dynamic batcher."""

    TASK = VISION

    def __init__(self, model: VisionModel, executor: ThreadPoolExecutor, settings: Settings,
                 metrics: Metrics) -> None:
        entry = model.entry
        super().__init__(entry, executor)
        self.backend = model.backend
        self.preprocess = model.preprocess
        self.labels = model.labels
        self.output_function: str | None = entry.config.get("output_function")
        self.max_image_pixels, self.max_request_pixels = image_pixel_limit(settings, self.preprocess)
        self.batcher = self.worker = DynamicBatcher(entry.name, self.predict, executor, metrics,
                                                    settings.max_batch_size, settings.max_queue_delay_ms / 1000,
                                                    settings.max_queue_size)

    def predict(self, pixel_values: np.ndarray) -> np.ndarray:
        """The batch's logits (float32); classification turns them into probabilities (`output_probabilities`)."""
        return self.backend.run_vision(pixel_values).astype(np.float32, copy=False)

    # ---- KServe V2: pixel_values FP32 [n, C, H, W] -> logits FP32 [n, classes], through the batcher ----

    def kserve_io(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return ([{"name": PIXEL_VALUES, "datatype": "FP32", "shape": [-1, *self.preprocess.shape]}],
                [{"name": LOGITS, "datatype": "FP32", "shape": [-1, len(self.labels)]}])

    def kserve_config(self, settings: Settings) -> dict[str, Any]:
        return {"dynamic_batching": {"max_queue_delay_microseconds": int(settings.max_queue_delay_ms * 1000),
                                     "default_queue_policy": {"max_queue_size": settings.max_queue_size}}}

    def check_infer_room(self) -> None:
        self.batcher.check_room()

    def kserve_call(self, header: dict[str, Any], tensors: dict[str, np.ndarray], settings: Settings) -> InferCall:
        rows = self.kserve_decode(tensors, settings.max_batch_size)

        async def run(deadline: float) -> InferResult:
            future = self.batcher.enqueue(rows, deadline)
            try:
                result = await future
            finally:
                future.cancel()
            return InferResult(result.output, result.queue_s, result.compute_s)

        return run

    def kserve_decode(self, tensors: dict[str, np.ndarray], max_batch: int) -> np.ndarray:
        """The request's pixel_values, checked: the rows the batcher takes."""
        extra = sorted(set(tensors) - {PIXEL_VALUES})
        if extra:
            raise bad(f"unknown input(s) {', '.join(extra)} (model takes {PIXEL_VALUES})")
        x = exact_input(tensors, PIXEL_VALUES, "FP32")
        want = self.preprocess.shape
        if x.ndim != 4 or tuple(x.shape[1:]) != want or x.shape[0] < 1:
            raise bad(f"input {PIXEL_VALUES}: shape {list(x.shape)}, expected [n, {', '.join(map(str, want))}] "
                      "with n >= 1")
        if x.shape[0] > max_batch:
            raise bad(f"input {PIXEL_VALUES}: batch {x.shape[0]} exceeds max_batch_size {max_batch}")
        if not np.isfinite(x).all():
            raise bad(f"input {PIXEL_VALUES} holds NaN or Inf")
        return np.ascontiguousarray(x)


TASK = ServedTask(tasks.get(VISION), VisionBackend, load)
