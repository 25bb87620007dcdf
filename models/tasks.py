"""The task table: what a model of each task is, as far as the model package knows it.

One row per task ("vision": image classification, "text": causal language modelling). The row names the task as
clients see it, its description class (models.spec), the graph's inputs and outputs (models.onnx_contract), the
metadata a file must carry to be served and the metrics labels of the routes that serve it. The other layers keep
their own part of each task in their own table, keyed by the same task and importing their per-task modules
directly, so the layers keep importing downwards only:

- export: `export.tasks.EXPORT_TASKS` (how it is traced to ONNX, validated against PyTorch, summarised);
- serving: `service.engine.tasks.SERVED` (metadata validation, I/O checks, warm-up, runtime, KServe codec).

A new task: a spec class, a row here, an `ExportTask` in export.tasks and a `service/engine/tasks/<task>.py`
registered in service.engine.tasks (see docs/ARCHITECTURE.md); tests/project/test_architecture.py checks that the
three tables have the same tasks. Architectures name their task in their registration (models.registry); nothing
else branches on task names. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

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


TASKS: dict[Task, TaskInfo] = {
    VISION: TaskInfo(VISION, "image-classification", VisionSpec, (VISION_INPUT,), (LOGITS,), ("preprocess",),
                     ("classify", "infer")),
    TEXT: TaskInfo(TEXT, "text-generation", TextSpec, TEXT_INPUTS, (LOGITS,), ("tokenizer",),
                   ("completions", "chat", "infer")),
}


def get(task: Task) -> TaskInfo:
    try:
        return TASKS[task]
    except KeyError:
        raise KeyError(f"unknown task {task!r} (known: {', '.join(TASKS)})") from None


def of(spec: ModelSpec) -> TaskInfo:
    return get(spec.TASK)
