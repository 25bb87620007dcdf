"""What runs per served model: its backend, a worker thread, and its batcher or decode loop (`ModelRuntime`;
each task's own, `VisionRuntime` and `TextRuntime`, is in its `service.engine.tasks` module), and every served
model's runtimes (`Runtimes`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from models import tasks
from models.output_function import probabilities
from service.base.config import Settings
from service.base.errors import ServiceError, shown
from service.base.metrics import UNKNOWN_MODEL, Metrics
from service.engine.background_export import BackgroundExports, publish_state
from service.engine.decoding import DecodePool
from service.engine.engine_errors import ShuttingDown
from service.engine.entry import Failed, Loaded, ModelEntry, ModelRuntime
from service.engine.tasks.text import TextRuntime
from service.engine.tasks.vision import VisionRuntime, image_pixel_limit

__all__ = ["ModelRuntime", "R", "Runtimes", "TextRuntime", "VisionRuntime", "image_pixel_limit",
           "output_probabilities", "softmax", "version_number"]

log = logging.getLogger(__name__)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def output_probabilities(output_function: str | None, logits: np.ndarray) -> np.ndarray:
    """The model's output distribution (models.output_function; softmax when None) of a batch of logits."""
    if output_function is None:
        return softmax(logits)
    return probabilities(output_function, torch.from_numpy(np.ascontiguousarray(logits))).numpy()


def version_number(text: str) -> int | None:
    """A version path parameter as a number, or None: ASCII digits only, and few enough that int() is cheap and
    never hits Python's digit limit (a version of 5,000 digits is simply not a version this server has)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


R = TypeVar("R", bound=ModelRuntime)


class Runtimes:
    """Every served model's runtimes, one per loaded version; started and stopped with the app (its lifespan).

    `models` maps each name to its latest loaded version: what plain routes and the OpenAI API serve.
    A request holds its runtime (`acquire`/`release`, through the endpoint's tracker) until it is answered or
    its stream ends, so a runtime replaced or unloaded by the repository API
    (service.protocols.control) is released only after its last request.
    """

    def __init__(self, entries: Loaded, settings: Settings, metrics: Metrics, skipped: Failed | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.versions: dict[str, dict[int, ModelRuntime]] = {}
        self.models: dict[str, ModelRuntime] = {}
        # name -> version -> why it is not served (failed to load, unloaded); kept until it loads again
        self.unavailable: dict[str, dict[int, str]] = {n: dict(v) for n, v in (skipped or {}).items()}
        self.loading: dict[str, set[int]] = {}  # versions a repository load is loading and warming up now
        self.draining: set[ModelRuntime] = set()  # replaced or unloaded, waiting for their last requests
        self.locks: dict[str, asyncio.Lock] = {}  # repository loads/unloads of one model run one at a time
        self._releases: set[asyncio.Task[None]] = set()
        self.ready = False
        self.decoder = DecodePool(settings.decode_threads)  # every vision model's images, fairly between requests
        self._version_series: set[tuple[str, str]] = set()  # (model, version) series of multimax_model_version_ready
        self.exports = BackgroundExports(self)  # Hugging Face folders exported while they serve on PyTorch
        for name, versions in entries.items():
            self.versions[name] = {v: self.runtime_of(e) for v, e in sorted(versions.items())}
            self.publish(name)
        for name in self.unavailable:
            if name not in self.models:
                metrics.model_ready.labels(name).set(0)

    def runtime_of(self, entry: ModelEntry) -> ModelRuntime:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{entry.name}-{entry.version}")
        return entry.model.runtime(executor, self.settings, self.metrics)

    def publish(self, name: str) -> None:
        """Route plain requests for `name` to its latest version (or nowhere), and point its metrics there."""
        versions = self.versions.get(name) or {}
        ready = self.metrics.model_ready.labels(name)
        if versions:
            rt = self.models[name] = versions[max(versions)]
            self.metrics.init_model(name, rt.entry.served.endpoints)
            ready.set_function(self._readiness(rt))
            if rt.entry.export is not None:
                publish_state(self.metrics, name, rt.entry.export)
        else:
            self.versions.pop(name, None)
            self.models.pop(name, None)
            ready.set_function(lambda: 0.0)
        for labels in [x for x in self._version_series if x[0] == name and int(x[1]) not in versions]:
            self.metrics.version_ready.remove(*labels)
            self._version_series.discard(labels)
        for v, rt in versions.items():
            self.metrics.version_ready.labels(name, str(v)).set_function(self._readiness(rt))
            self._version_series.add((name, str(v)))

    def _readiness(self, rt: ModelRuntime) -> Callable[[], float]:
        """multimax_model_ready of one model: 1 while the server serves and its worker is healthy."""
        return lambda: float(self.ready and rt.problem is None)

    def names(self) -> list[str]:
        """Every model the server knows: served, loading, failed or unloaded."""
        return sorted({*self.versions, *self.unavailable, *self.loading})

    def why_not(self, name: str) -> str:
        """Why `name` has no served version (for a 404 or a readiness answer)."""
        if name in self.loading:
            return "it is loading (warming up)"
        reasons = self.unavailable.get(name) or {}
        if reasons and set(reasons.values()) == {"unloaded"}:
            return "it was unloaded"
        return "it failed to load (" + "; ".join(f"version {v}: {why}" for v, why in sorted(reasons.items())) + ")"

    def problems(self) -> dict[str, str]:
        """Every model that is not ready, and why (skipped at startup, worker died, keeps failing)."""
        out = {name: self.why_not(name) for name in self.names() if name not in self.models}
        for name, rt in self.models.items():
            if rt.problem is not None:
                out[name] = rt.problem
        return out

    def start(self) -> None:
        """Start every model's worker, then (on the event loop) the exports of folders served on PyTorch meanwhile."""
        for versions in self.versions.values():
            for rt in versions.values():
                rt.worker.start()
        self.ready = True
        for versions in self.versions.values():
            for rt in versions.values():
                self.exports.start(rt)

    def start_runtime(self, rt: ModelRuntime) -> None:
        if not self.ready:
            raise ShuttingDown("server is not started or shutting down")
        rt.worker.start()
        self.exports.start(rt)

    async def release(self, rt: ModelRuntime, wait: bool = True) -> None:
        """Stop a runtime: its worker finishes what it accepted (after its last requests, `wait`), then it is freed."""
        self.draining.add(rt)
        self.exports.cancel(rt)
        try:
            if wait:
                await rt.drained()
            await rt.worker.close()
            await asyncio.get_running_loop().run_in_executor(None, rt.executor.shutdown, True)
            rt.entry.backend.close()
        finally:
            self.draining.discard(rt)
        log.info("released %s version %d", rt.name, rt.version)

    def release_later(self, rt: ModelRuntime) -> None:
        """Release `rt` once its last request has finished, without waiting here."""
        self.draining.add(rt)  # now: the repository index shows it UNLOADING at once
        task = asyncio.get_running_loop().create_task(self.release(rt), name=f"release-{rt.name}-{rt.version}")
        self._releases.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(self._releases.discard)

    async def stop(self) -> None:
        """Finish queued and running work (new work is refused meanwhile), then release the models."""
        self.ready = False
        await self.exports.stop()  # no export runs on, nothing is switched in
        for rt in self.draining:
            rt.stop_waiting()  # shutting down: uvicorn has already waited for the in-flight requests
        runtimes = [rt for versions in self.versions.values() for rt in versions.values()]
        await asyncio.gather(*(self.release(rt, wait=False) for rt in runtimes), *self._releases)
        self.decoder.close()

    def dead_loops(self) -> list[str]:
        """Models whose batcher or decode loop ended while the server is serving (a health check fails on
        these: the process cannot recover them, a supervisor should replace it)."""
        if not self.ready:
            return []  # not started yet, or stopping: the loops end on purpose
        return [rt.name for versions in self.versions.values() for rt in versions.values() if not rt.worker.alive]

    def get(self, name: str, version: str | int | None = None, *, list_served: bool = True) -> ModelRuntime:
        """The runtime of `name` (its latest version, or `version`); 404 with the reason otherwise (naming the
        served models when `list_served`: not on the open readiness route)."""
        if name not in self.models:
            if name in self.names():
                raise ServiceError(404, f"model {name!r} is not served: {self.why_not(name)}",
                                   code="model_not_found", param="model")
            served = f" (served: {', '.join(self.models)})" if list_served else ""
            raise ServiceError(404, f"model {shown(name)} not found{served}", code="model_not_found", param="model")
        if version is None or version == "":
            return self.models[name]
        versions = self.versions[name]
        number = version if isinstance(version, int) else version_number(version)
        if number not in versions:
            why = (self.unavailable.get(name) or {}).get(number or 0)
            raise ServiceError(404, f"model {name!r} has no version {shown(str(version))} "
                               f"{f'({why}) ' if why else ''}(served: {', '.join(map(str, versions))})",
                               code="model_not_found", param="version")
        return versions[number]

    def typed(self, name: str, kind: type[R], version: str | int | None = None) -> R:
        """The runtime of `name`, which must be of `kind` (a 400 naming both tasks otherwise)."""
        rt = self.get(name, version)
        if not isinstance(rt, kind):
            want = tasks.get(kind.TASK).name
            raise ServiceError(400, f"model {name!r} is a {rt.task} model, not {want}", code="wrong_task",
                               param="model")
        return rt

    def label(self, name: str) -> str:
        """The metrics label for a model name from a request (unknown names share one label)."""
        return name if name in self.models else UNKNOWN_MODEL
