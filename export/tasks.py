"""What export does per task (export's part of each task; models.tasks holds what the model package knows of it):
how a model of that task is traced to ONNX, validated against PyTorch, and described in the summary. Keyed by
task, so a new architecture of an existing task needs nothing here; a new task adds one entry to `EXPORT_TASKS`
(tests/project/test_architecture.py checks that it has the tasks of models.tasks)."""

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
from models.registry import TextModel
from models.spec import TEXT, VISION, ModelSpec, Task, TextSpec, VisionSpec

# (model, checkpoint, out, opset=, inline=, precision=, verbose=, spec=) -> the written path
Exporter = Callable[..., Path]


def _validate_vision(model: nn.Module, out: Path, spec: ModelSpec, samples: int | None,
                     batch_sizes: tuple[int, ...], tolerance: Tolerance, phases: Phases) -> dict[str, Any]:
    assert isinstance(spec, VisionSpec), "a vision export needs an image classifier"
    samples = samples or default_samples(model, spec, batch_sizes)
    return validate_vision(model, out, spec, samples=samples, batch_sizes=batch_sizes, tolerance=tolerance,
                           phases=phases)


def _validate_text(model: nn.Module, out: Path, spec: ModelSpec, samples: int | None,
                   batch_sizes: tuple[int, ...], tolerance: Tolerance, phases: Phases) -> dict[str, Any]:
    assert isinstance(spec, TextSpec), "a text export needs a text model"
    return validate_text(cast(TextModel, model), out, samples=samples or 100, tolerance=tolerance, phases=phases,
                         spec=spec)


@dataclass(frozen=True)
class ExportTask:
    export: Exporter
    # (model, out, the model's description, samples or None, batch sizes, tolerance, phases) -> validation report
    validate: Callable[[nn.Module, Path, ModelSpec, int | None, tuple[int, ...], Tolerance, Phases], dict[str, Any]]
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
# export's side of each task of models.tasks
EXPORT_TASKS: dict[Task, ExportTask] = {VISION: VISION_EXPORT, TEXT: TEXT_EXPORT}


def export_task(arch: str) -> ExportTask:
    """The export side of an architecture's task (a report names its `arch`)."""
    return EXPORT_TASKS[registry.task_of(arch)]
