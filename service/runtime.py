"""What runs per served model: its backend, a worker thread, and its batcher or decode loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from models.registry import TEXT, VISION, Task
from models.tokenizer import ByteTokenizer
from service.backends.base import TextBackend, VisionBackend
from service.batcher import DynamicBatcher
from service.config import Settings
from service.entry import SERVED_TASKS, ModelEntry
from service.errors import ServiceError
from service.generation import TextScheduler
from service.metrics import UNKNOWN_MODEL, Metrics
from service.vision import Preprocess

log = logging.getLogger(__name__)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class _Runtime:
    """One served model: its entry, the one thread it computes on, and its worker (batcher or decode loop)."""

    worker: DynamicBatcher | TextScheduler

    def __init__(self, entry: ModelEntry, executor: ThreadPoolExecutor) -> None:
        self.entry = entry
        self.executor = executor  # one thread: the model computes one call at a time, off the event loop

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def task(self) -> str:
        return self.entry.task

    @property
    def problem(self) -> str | None:
        """Why this model is not ready (its worker died or keeps failing), or None."""
        return self.worker.problem


class VisionRuntime(_Runtime):
    """An image classifier: requests' images go through its dynamic batcher."""

    def __init__(self, entry: ModelEntry, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> None:
        super().__init__(entry, executor)
        assert isinstance(entry.backend, VisionBackend), "a vision model's backend runs vision"
        self.backend: VisionBackend = entry.backend
        self.preprocess = entry.preprocessor or Preprocess.from_metadata(entry.preprocess or {})
        self.labels: list[str] = entry.labels or []
        self.batcher = self.worker = DynamicBatcher(entry.name, self.predict, executor, metrics,
                                                    settings.max_batch_size, settings.max_queue_delay_ms / 1000,
                                                    settings.max_queue_size)

    def predict(self, pixel_values: np.ndarray) -> np.ndarray:
        """The batch's logits (float32); classification turns them into probabilities with `softmax`."""
        return self.backend.run_vision(pixel_values).astype(np.float32, copy=False)


class TextRuntime(_Runtime):
    """A text generator: requests' sequences join its continuous-batching decode loop."""

    def __init__(self, entry: ModelEntry, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> None:
        super().__init__(entry, executor)
        assert isinstance(entry.backend, TextBackend), "a text model's backend runs text"
        assert entry.context_length is not None
        self.backend: TextBackend = entry.backend
        self.tokenizer = entry.byte_tokenizer or ByteTokenizer.from_dict(entry.tokenizer or {})
        self.context_length: int = entry.context_length
        self.scheduler = self.worker = TextScheduler(entry.name, entry.backend, self.tokenizer, self.context_length,
                                                     executor, metrics, settings.max_running_sequences,
                                                     settings.max_waiting_sequences)


ModelRuntime = VisionRuntime | TextRuntime
_RUNTIMES: dict[Task, type[VisionRuntime] | type[TextRuntime]] = {VISION: VisionRuntime, TEXT: TextRuntime}
R = TypeVar("R", VisionRuntime, TextRuntime)


class Runtimes:
    """Every served model's runtime; started and stopped with the app (its lifespan)."""

    def __init__(self, entries: dict[str, ModelEntry], settings: Settings, metrics: Metrics,
                 skipped: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ModelRuntime] = {}
        self.skipped = dict(skipped or {})  # models that failed to load -> why
        self.ready = False
        for name, entry in entries.items():
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{name}")
            rt = _RUNTIMES[entry.kind](entry, executor, settings, metrics)
            self.models[name] = rt
            metrics.init_model(name, entry.served.endpoints)
            metrics.model_ready.labels(name).set_function(self._readiness(rt))
        for name in self.skipped:
            metrics.model_ready.labels(name).set(0)

    def _readiness(self, rt: ModelRuntime) -> Callable[[], float]:
        """multimax_model_ready of one model: 1 while the server serves and its worker is healthy."""
        return lambda: float(self.ready and rt.problem is None)

    def problems(self) -> dict[str, str]:
        """Every model that is not ready, and why (skipped at startup, worker died, keeps failing)."""
        out = dict(self.skipped)
        for name, rt in self.models.items():
            if rt.problem is not None:
                out[name] = rt.problem
        return out

    def start(self) -> None:
        for rt in self.models.values():
            rt.worker.start()
        self.ready = True

    async def stop(self) -> None:
        """Finish queued and running work (new work is refused meanwhile), then release the models."""
        self.ready = False
        for rt in self.models.values():
            await rt.worker.close()
        for rt in self.models.values():
            rt.executor.shutdown(wait=True)
            rt.entry.backend.close()

    def dead_loops(self) -> list[str]:
        """Models whose batcher or decode loop ended while the server is serving (a health check fails on
        these: the process cannot recover them, a supervisor should replace it)."""
        if not self.ready:
            return []  # not started yet, or stopping: the loops end on purpose
        return [rt.name for rt in self.models.values() if not rt.worker.alive]

    def get(self, name: str) -> ModelRuntime:
        rt = self.models.get(name)
        if rt is None and name in self.skipped:
            raise ServiceError(404, f"model {name!r} is not served: it failed to load ({self.skipped[name]})",
                               code="model_not_found", param="model")
        if rt is None:
            raise ServiceError(404, f"model {name!r} not found (served: {', '.join(self.models)})",
                               code="model_not_found", param="model")
        return rt

    def typed(self, name: str, kind: type[R]) -> R:
        """The runtime of `name`, which must be of `kind` (a 400 naming both tasks otherwise)."""
        rt = self.get(name)
        if not isinstance(rt, kind):
            want = SERVED_TASKS[VISION if kind is VisionRuntime else TEXT].name
            raise ServiceError(400, f"model {name!r} is a {rt.task} model, not {want}", code="wrong_task",
                               param="model")
        return rt

    def label(self, name: str) -> str:
        """The metrics label for a model name from a request (unknown names share one label)."""
        return name if name in self.models else UNKNOWN_MODEL
