"""What runs per served model: its backend, a worker thread, and its batcher or decode loop."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from models.tokenizer import ByteTokenizer
from service.batcher import DynamicBatcher
from service.config import Settings
from service.entry import ModelEntry
from service.errors import ServiceError
from service.generation import TextScheduler
from service.metrics import UNKNOWN_MODEL, Metrics
from service.vision import Preprocess

log = logging.getLogger("service")
ENDPOINTS = {"image-classification": ("classify", "infer"), "text-generation": ("completions", "infer")}


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@dataclass(eq=False)
class ModelRuntime:
    entry: ModelEntry
    executor: ThreadPoolExecutor  # one thread: the model computes one call at a time, off the event loop
    batcher: DynamicBatcher | None = None
    scheduler: TextScheduler | None = None
    preprocess: Preprocess | None = None
    tokenizer: ByteTokenizer | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def task(self) -> str:
        return self.entry.task

    @property
    def problem(self) -> str | None:
        """Why this model is not ready (its worker died or keeps failing), or None."""
        worker = self.batcher or self.scheduler
        return worker.problem if worker is not None else None

    def predict(self, pixel_values: np.ndarray) -> np.ndarray:
        """The batch's logits (float32); classification turns them into probabilities with `softmax`."""
        return self.entry.backend.run_vision(pixel_values).astype(np.float32, copy=False)


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
            rt = ModelRuntime(entry, executor)
            if entry.arch == "deit":
                rt.preprocess = entry.preprocessor or Preprocess.from_metadata(entry.preprocess or {})
            else:
                rt.tokenizer = entry.byte_tokenizer or ByteTokenizer.from_dict(entry.tokenizer or {})
            self.models[name] = rt
            metrics.init_model(name, ENDPOINTS[entry.task])
            metrics.model_ready.labels(name).set_function(lambda rt=rt: float(self.ready and rt.problem is None))
        for name in self.skipped:
            metrics.model_ready.labels(name).set(0)

    def problems(self) -> dict[str, str]:
        """Every model that is not ready, and why (skipped at startup, worker died, keeps failing)."""
        out = dict(self.skipped)
        for name, rt in self.models.items():
            if rt.problem is not None:
                out[name] = rt.problem
        return out

    def start(self) -> None:
        s = self.settings
        for rt in self.models.values():
            if rt.task == "image-classification":
                rt.batcher = DynamicBatcher(rt.name, rt.predict, rt.executor, self.metrics, s.max_batch_size,
                                            s.max_queue_delay_ms / 1000, s.max_queue_size)
                rt.batcher.start()
            else:
                assert rt.tokenizer is not None and rt.entry.context_length is not None
                rt.scheduler = TextScheduler(rt.name, rt.entry.backend, rt.tokenizer, rt.entry.context_length,
                                             rt.executor, self.metrics, s.max_running_sequences,
                                             s.max_waiting_sequences)
                rt.scheduler.start()
        self.ready = True

    async def stop(self) -> None:
        """Finish queued and running work (new work is refused meanwhile), then release the models."""
        self.ready = False
        for rt in self.models.values():
            if rt.batcher is not None:
                await rt.batcher.close()
            if rt.scheduler is not None:
                await rt.scheduler.close()
        for rt in self.models.values():
            rt.executor.shutdown(wait=True)
            rt.entry.backend.close()

    def dead_loops(self) -> list[str]:
        """Models whose batcher or decode loop ended while the server is serving (a health check fails on
        these: the process cannot recover them, a supervisor should replace it)."""
        if not self.ready:
            return []  # not started yet, or stopping: the loops end on purpose
        return [rt.name for rt in self.models.values()
                if (loop := rt.batcher or rt.scheduler) is not None and not loop.alive]

    def get(self, name: str, task: str | None = None) -> ModelRuntime:
        rt = self.models.get(name)
        if rt is None and name in self.skipped:
            raise ServiceError(404, f"model {name!r} is not served: it failed to load ({self.skipped[name]})",
                               code="model_not_found", param="model")
        if rt is None:
            raise ServiceError(404, f"model {name!r} not found (served: {', '.join(self.models)})",
                               code="model_not_found", param="model")
        if task is not None and rt.task != task:
            raise ServiceError(400, f"model {name!r} is a {rt.task} model, not {task}", code="wrong_task",
                               param="model")
        return rt

    def label(self, name: str) -> str:
        """The metrics label for a model name from a request (unknown names share one label)."""
        return name if name in self.models else UNKNOWN_MODEL
