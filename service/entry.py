"""A loaded model as the server knows it (`ModelEntry`), and what each architecture task is served as."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models import registry as architectures
from models.spec import ModelSpec, TextSpec
from models.tokenizer import TextTokenizer
from service.backends.base import Backend
from service.vision import Preprocess


@dataclass(frozen=True)
class ServedTask:
    name: str  # the task name clients see (/v1/models, KServe parameters)
    endpoints: tuple[str, ...]  # metrics endpoint labels of the routes that serve it
    metadata: tuple[str, ...]  # metadata fields a file must carry to be served (a vision model's labels are optional)


SERVED_TASKS = {
    architectures.VISION: ServedTask("image-classification", ("classify", "infer"), ("preprocess",)),
    architectures.TEXT: ServedTask("text-generation", ("completions", "infer"), ("tokenizer",)),
}


@dataclass
class ModelEntry:
    name: str
    arch: str
    backend: Backend
    config: dict[str, Any]  # the architecture's own fields, shown as they are (read only through `spec`)
    spec: ModelSpec  # what the model takes and gives (models.spec): the server reads sizes only here
    labels: list[str] | None = None
    preprocess: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    preprocessor: Preprocess | None = None  # built from `preprocess` when the model is loaded (validates it)
    byte_tokenizer: TextTokenizer | None = None  # likewise from `tokenizer`
    version: int = 1  # Triton's layout: name/<version>/model.onnx; a plain file is version 1
    source: Path | None = None  # the file it was loaded from
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # its files' (path, mtime, size) when it was loaded

    @property
    def kind(self) -> architectures.Task:
        """The model's task: "vision" or "text"."""
        return self.spec.TASK

    @property
    def served(self) -> ServedTask:
        return SERVED_TASKS[self.kind]

    @property
    def task(self) -> str:
        return self.served.name

    @property
    def context_length(self) -> int | None:
        return self.spec.context_length if isinstance(self.spec, TextSpec) else None

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, **self.backend.describe()}
