"""A loaded model as the server knows it (`ModelEntry`), and the shape of a task's serving side (`ServedTask`;
the rows themselves are in `service.engine.tasks`, one module per task)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models import tasks
from models.spec import ModelSpec, Task, TextSpec
from models.tokenizer import TextTokenizer
from service.base.config import Settings
from service.engine.backends.base import Backend
from service.engine.vision import Preprocess


@dataclass(frozen=True)
class ServedTask:
    """Everything the server does differently per task, in one place (a `service.engine.tasks` module's `TASK`)."""

    info: tasks.TaskInfo  # its row of models.tasks: name, endpoints, required metadata
    backend: type  # the backend interface (a Backend subclass) a model of this task runs on
    validate: Callable[[ModelEntry, str], None]  # metadata a request relies on (ValueError naming the problem)
    check_io: Callable[[ModelEntry, str], None]  # the description against what the backend really computes
    warm_up: Callable[[ModelEntry, Settings], int]  # representative calls before it is ready; returns how many
    runtime: Callable[..., Any]  # (entry, executor, settings, metrics) -> its runtime (service.engine.runtime)
    kserve_io: Callable[[Any], tuple[list[dict[str, Any]], list[dict[str, Any]]]]  # runtime -> metadata in/out
    kserve_decode: Callable[[Any, dict[str, Any], int], Any]  # (runtime, tensors, max batch) -> its inputs

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.info.endpoints

    @property
    def metadata(self) -> tuple[str, ...]:
        return self.info.metadata


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
    tokenizer: dict[str, Any] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    preprocessor: Preprocess | None = None  # built from `preprocess` when the model is loaded (validates it)
    byte_tokenizer: TextTokenizer | None = None  # likewise from `tokenizer`
    version: int = 1  # Triton's layout: name/<version>/model.onnx; a plain file is version 1
    source: Path | None = None  # the file it was loaded from
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # its files' (path, mtime, size) when it was loaded
    # a model folder's description (service.engine.model_folders): architecture, MultiMax placement, tokenizer
    details: dict[str, Any] = field(default_factory=dict)

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
            return {**self.details, "context_length": self.context_length}
        multimax = None
        if isinstance(self.spec, TextSpec):
            rw = self.spec.reweighting
            multimax = {"output": rw.output == "multimax", "attention": rw.attention == "multimax",
                        "variant": rw.variant}
        tokenizer = None
        if self.tokenizer is not None:
            tokenizer = {k: v for k, v in self.tokenizer.items() if k in ("type", "vocab_size")}
        return {"architecture": self.arch, "format": self.source.suffix.lstrip(".") if self.source else None,
                "multimax": multimax, "tokenizer": tokenizer, "context_length": self.context_length}

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, **self.backend.describe()}


Loaded = dict[str, dict[int, ModelEntry]]  # name -> version -> entry
Failed = dict[str, dict[int, str]]  # name -> version -> why it is not served
