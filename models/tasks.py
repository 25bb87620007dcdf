"""The task table: what a model of each task is, and where each layer keeps its part of that task.

One row per task ("vision": image classification, "text": causal language modelling). The row names the task as
clients see it, its description class (models.spec), the graph's inputs and outputs (models.onnx_contract), the
metadata a file must carry to be served and the metrics labels of the routes that serve it; and it points at the
one module per layer that holds the rest, so the layers keep importing downwards only:

- `export`: `export.tasks` (how it is traced to ONNX, validated against PyTorch, summarised);
- `serve`: `service.engine.tasks.<task>` (metadata validation, I/O checks, warm-up, runtime, KServe codec).

A new task: a spec class, a row here, an `ExportTask` and a `service/engine/tasks/<task>.py` (see docs/ARCHITECTURE.md).
Architectures name their task in their registration (models.registry); nothing else branches on task names.
No torch import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from models.onnx_contract import LOGITS, TEXT_INPUTS, VISION_INPUT
from models.spec import TEXT, VISION, ModelSpec, Task, TextSpec, VisionSpec


@dataclass(frozen=True)
class TaskInfo:
    task: Task  # the key: "vision" or "text"
    name: str  # the task name clients see (/v1/models, KServe parameters)
    spec: type[ModelSpec]  # its description (models.spec)
    inputs: tuple[str, ...]  # the graph's inputs (a decoder's past too: models.onnx_contract.past_names)
    outputs: tuple[str, ...]
    metadata: tuple[str, ...]  # metadata fields a file must carry to be served (a vision model's labels are optional)
    endpoints: tuple[str, ...]  # metrics endpoint labels of the routes that serve it
    export: str  # "module:attribute" of its export side (an export.tasks.ExportTask)
    serve: str  # "module:attribute" of its serving side (a service.engine.entry.ServedTask)

    def part(self, layer: str) -> Any:
        """The object a row points at for `layer` ("export" or "serve"), imported on demand."""
        module, _, attribute = getattr(self, layer).partition(":")
        return getattr(importlib.import_module(module), attribute)


TASKS: dict[Task, TaskInfo] = {
    VISION: TaskInfo(VISION, "image-classification", VisionSpec, (VISION_INPUT,), (LOGITS,), ("preprocess",),
                     ("classify", "infer"), "export.tasks:VISION_EXPORT", "service.engine.tasks.vision:TASK"),
    TEXT: TaskInfo(TEXT, "text-generation", TextSpec, TEXT_INPUTS, (LOGITS,), ("tokenizer",),
                   ("completions", "chat", "infer"), "export.tasks:TEXT_EXPORT", "service.engine.tasks.text:TASK"),
}


def get(task: Task) -> TaskInfo:
    try:
        return TASKS[task]
    except KeyError:
        raise KeyError(f"unknown task {task!r} (known: {', '.join(TASKS)})") from None


def of(spec: ModelSpec) -> TaskInfo:
    return get(spec.TASK)
