"""A loaded model as the server knows it (`ModelEntry`), and what each architecture task is served as."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models import registry as architectures
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
    architectures.TEXT: ServedTask("text-generation", ("completions", "chat", "infer"), ("tokenizer",)),
}


@dataclass
class ModelEntry:
    name: str
    arch: str
    backend: Backend
    config: dict[str, Any]
    labels: list[str] | None = None
    preprocess: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    preprocessor: Preprocess | None = None  # built from `preprocess` when the model is loaded (validates it)
    byte_tokenizer: TextTokenizer | None = None  # likewise from `tokenizer`
    version: int = 1  # Triton's layout: name/<version>/model.onnx; a plain file is version 1
    source: Path | None = None  # the file it was loaded from
    fingerprint: tuple[tuple[str, int, int], ...] = ()  # its files' (path, mtime, size) when it was loaded
    # a model folder's description (service.model_folders): architecture, MultiMax placement, tokenizer
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> architectures.Task:
        """The architecture's task: "vision" or "text"."""
        return architectures.task_of(self.arch)

    @property
    def served(self) -> ServedTask:
        return SERVED_TASKS[self.kind]

    @property
    def task(self) -> str:
        return self.served.name

    @property
    def context_length(self) -> int | None:
        return int(self.config["block_size"]) if self.kind == architectures.TEXT else None

    def model_info(self) -> dict[str, Any]:
        """What /v1/models and KServe metadata say about the model: architecture, where SegLU / MultiMax sits and
        its parameters, the tokenizer, the context length (never a path)."""
        if self.details:
            return {**self.details, "context_length": self.context_length}
        config = self.config
        multimax = {"output": bool(config.get("multimax_output")), "attention": bool(config.get("multimax_attention")),
                    "variant": config.get("variant")} if self.kind == architectures.TEXT else None
        tokenizer = None
        if self.tokenizer is not None:
            tokenizer = {k: v for k, v in self.tokenizer.items() if k in ("type", "vocab_size")}
        return {"architecture": self.arch, "format": self.source.suffix.lstrip(".") if self.source else None,
                "multimax": multimax, "tokenizer": tokenizer, "context_length": self.context_length}

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, **self.backend.describe()}
