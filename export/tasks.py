"""What export does per task (the export side of `models.tasks`' rows): how a model of that task is traced to
ONNX, validated against PyTorch, and described in the summary. Keyed by task, so a new architecture of an
existing task needs nothing here; a new task adds one entry, named by its row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch import nn

from export.onnx_export import export_text, export_vision
from export.progress import Phases
from export.samples import default_samples
from export.validate import (
    GraphProblems,
    Tolerance,
    text_graph_problems,
    validate_text,
    validate_vision,
    vision_graph_problems,
)
from models import registry
from models.checkpoint import Checkpoint
from models.registry import TextModel
from models.spec import Task, VisionSpec
from models.tasks import TASKS

# (model, checkpoint, out, opset=, inline=, precision=, verbose=) -> the written path
Exporter = Callable[..., Path]


def _validate_vision(model: nn.Module, out: Path, ckpt: Checkpoint, samples: int | None,
                     batch_sizes: tuple[int, ...], tolerance: Tolerance, phases: Phases) -> dict[str, Any]:
    spec = ckpt.spec()
    assert isinstance(spec, VisionSpec), f"a vision export needs an image classifier, got {ckpt.arch}"
    samples = samples or default_samples(model, spec, batch_sizes)
    return validate_vision(model, out, spec, samples=samples, batch_sizes=batch_sizes, tolerance=tolerance,
                           phases=phases)


def _validate_text(model: nn.Module, out: Path, ckpt: Checkpoint, samples: int | None,
                   batch_sizes: tuple[int, ...], tolerance: Tolerance, phases: Phases) -> dict[str, Any]:
    return validate_text(cast(TextModel, model), out, samples=samples or 100, tolerance=tolerance, phases=phases)


@dataclass(frozen=True)
class ExportTask:
    export: Exporter
    # (model, out, checkpoint, samples or None, batch sizes, tolerance, phases) -> validation report
    validate: Callable[[nn.Module, Path, Checkpoint, int | None, tuple[int, ...], Tolerance, Phases], dict[str, Any]]
    agreement_key: str  # the validation report's top-1 agreement field
    shapes: Callable[[dict[str, Any]], str]  # the summary's description of the validated input shapes
    greedy_checked: bool  # whether validation compares greedy generations
    graph_problems: GraphProblems  # the graph's names and dynamic axes against the task's contract


VISION_EXPORT = ExportTask(export_vision, _validate_vision, "top1_agreement",
                           lambda v: f"batch sizes {v['batch_sizes']}", greedy_checked=False,
                           graph_problems=vision_graph_problems)
TEXT_EXPORT = ExportTask(export_text, _validate_text, "next_token_agreement",
                         lambda v: f"batch 1-8, past 0-{v['past_lengths'][1]}, new tokens 1-8", greedy_checked=True,
                         graph_problems=text_graph_problems)
# the export side of models.tasks' rows (each row names its entry here)
EXPORT_TASKS: dict[Task, ExportTask] = {task: info.part("export") for task, info in TASKS.items()}


def export_task(arch: str) -> ExportTask:
    return EXPORT_TASKS[registry.task_of(arch)]
