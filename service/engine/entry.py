"""A loaded model as the server knows it (`ModelEntry`), the shape of a task's serving side (`ServedTask`), and the
two objects each task builds from an entry: the model in its task's own types (`TaskModel`, built once at load)
and what runs it while it is served (`ModelRuntime`). The tasks' own classes are in `service.engine.tasks`, one
module per task; `service.engine.runtime` holds every served model's runtimes."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from models import tasks
from models.spec import ModelSpec, Task, TextSpec
from models.tokenizer import TextTokenizer
from service.base.config import Settings
from service.base.metrics import Metrics
from service.engine.backends.base import Backend
from service.engine.export_status import ExportStatus


@dataclass(frozen=True)
class ServedTask:
    """Everything the server does differently per task, in one place (a `service.engine.tasks` module's `TASK`):
    its backend interface, and `load`, which turns an entry of the task into its `TaskModel`."""

    info: tasks.TaskInfo  # its row of models.tasks: name, endpoints, required metadata
    backend: type  # the backend interface (a Backend subclass) a model of this task runs on
    # (entry, source) -> the model in the task's types, its metadata checked (ValueError naming the problem)
    load: Callable[[ModelEntry, str], TaskModel]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.info.endpoints

    @property
    def metadata(self) -> tuple[str, ...]:
        return self.info.metadata

    def warm_up(self, entry: ModelEntry, settings: Settings) -> int:
        """The loaded model's representative calls (service.engine.warmup); returns how many ran."""
        return entry.model.warm_up(settings)


@dataclass
class ModelEntry:
    name: str
    arch: str
    backend: Backend
    config: dict[str, Any]  # the architecture's own fields, shown as they are (read only through `spec`)
    spec: ModelSpec  # what the model takes and gives (models.spec): the server reads sizes only here
    served: ServedTask  # its task's serving side (service.engine.tasks)
    labels: list[str] | None = None
    preprocess: dict[str, Any] | None = None
    tokenizer_entry: dict[str, Any] | None = None  # the file's tokenizer metadata (models.tokenizer's dict)
    created: int = field(default_factory=lambda: int(time.time()))
    # A text model's tokenizer (byte, fairseq or Hugging Face: models.tokenizer.TextTokenizer): a model folder's
    # comes with it (service.engine.model_folders), a file's is built from `tokenizer_entry` when it is loaded.
    tokenizer: TextTokenizer | None = None
    version: int = 1  # Triton's layout: name/<version>/model.onnx; a plain file is version 1
    source: Path | None = None  # the file it was loaded from
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # its files' (path, mtime, size) when it was loaded
    # a model folder's description (service.engine.model_folders): architecture, MultiMax placement, tokenizer
    details: dict[str, Any] = field(default_factory=dict)
    # a Hugging Face folder's export (service.engine.export_status): which backend serves it now, and why
    export: ExportStatus | None = None
    # The model in its task's types, set once when it is loaded (service.engine.registry.validate: `served.load`).
    model: TaskModel = field(init=False, repr=False, compare=False)

    @property
    def kind(self) -> Task:
        """The model's task: "vision" or "text"."""
        return self.spec.TASK

    @property
    def task(self) -> str:
        return self.served.name

    @property
    def context_length(self) -> int | None:
        return self.spec.context_length if isinstance(self.spec, TextSpec) else None

    def model_info(self) -> dict[str, Any]:
        """What /v1/models and KServe metadata say about the model: architecture, where SegLU / MultiMax sits and
        its parameters, the tokenizer, the context length (never a path)."""
        if self.details:
            serving = {} if self.export is None else {"serving": self.export.card()}
            return {**self.details, **serving, "context_length": self.context_length}
        multimax = None
        if isinstance(self.spec, TextSpec):
            rw = self.spec.reweighting
            multimax = {"output": rw.output == "multimax", "attention": rw.attention == "multimax",
                        "variant": rw.variant}
        tokenizer = None
        if self.tokenizer_entry is not None:
            tokenizer = {k: v for k, v in self.tokenizer_entry.items() if k in ("type", "vocab_size")}
        return {"architecture": self.arch, "format": self.source.suffix.lstrip(".") if self.source else None,
                "multimax": multimax, "tokenizer": tokenizer, "context_length": self.context_length}

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, **self.backend.describe()}


class TaskModel(ABC):
    """A loaded model in its task's own types: its description, its backend and what its metadata became
    (preprocessing and labels, a tokenizer), built once at load (`ServedTask.load`), so nothing after needs to
    ask which task's objects an entry holds."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry

    @abstractmethod
    def check_io(self, source: str) -> None:
        """The description against what the backend really computes (ValueError naming the mismatch)."""

    @abstractmethod
    def warm_up(self, settings: Settings) -> int:
        """Representative calls before the model is ready; returns how many ran."""

    @abstractmethod
    def runtime(self, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> ModelRuntime:
        """What serves it: its runtime, computing on `executor` (one thread)."""


class Worker(Protocol):
    """A runtime's worker: its dynamic batcher or its decode loop."""

    def start(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def problem(self) -> str | None: ...


class InferResult(NamedTuple):
    """A KServe infer's output and where its time went."""

    output: np.ndarray
    queue_s: float
    compute_s: float


# A KServe request's inputs, decoded and checked: run it by its deadline (perf_counter time).
InferCall = Callable[[float], Awaitable[InferResult]]


class ModelRuntime(ABC):
    """One served model: its entry, the one thread it computes on, and its worker (batcher or decode loop); each
    task's runtime adds what its endpoints use, and answers the KServe V2 protocol its own way (the `kserve_*`
    hooks: service.protocols.kserve asks them and never which task a model serves)."""

    TASK: ClassVar[Task]  # the task whose models it runs
    worker: Worker
    # Class names of the output, for KServe's classification extension; empty where the output has no classes.
    labels: list[str]

    def __init__(self, entry: ModelEntry, executor: ThreadPoolExecutor) -> None:
        self.entry = entry
        self.executor = executor  # one thread: the model computes one call at a time, off the event loop
        self.leases = 0  # requests (streams included) that hold this runtime: it is released once they finish
        self._idle = asyncio.Event()
        self._idle.set()
        self.labels = []

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def version(self) -> int:
        return self.entry.version

    def acquire(self) -> None:
        self.leases += 1
        self._idle.clear()

    def release(self) -> None:
        self.leases -= 1
        if self.leases == 0:
            self._idle.set()

    async def drained(self) -> None:
        """Returns once no request holds this runtime (or `stop_waiting` was called)."""
        await self._idle.wait()

    def stop_waiting(self) -> None:
        self._idle.set()

    @property
    def task(self) -> str:
        return self.entry.task

    @property
    def problem(self) -> str | None:
        """Why this model is not ready (its worker died or keeps failing), or None."""
        return self.worker.problem

    # ---- KServe V2 (service.protocols.kserve) ----

    @abstractmethod
    def kserve_io(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The model metadata's inputs and outputs (name, datatype, shape; an input may be "optional")."""

    def kserve_config(self, settings: Settings) -> dict[str, Any]:
        """What the model configuration adds to the fields every model has (Triton's names)."""
        return {}

    @abstractmethod
    def check_infer_room(self) -> None:
        """The engine's QueueFull or ShuttingDown when an infer could not be taken now (before its body is read)."""

    @abstractmethod
    def kserve_call(self, header: dict[str, Any], tensors: dict[str, np.ndarray], settings: Settings) -> InferCall:
        """A request's tensors decoded and checked (a 400 naming the problem), ready to run."""


Loaded = dict[str, dict[int, ModelEntry]]  # name -> version -> entry
Failed = dict[str, dict[int, str]]  # name -> version -> why it is not served
