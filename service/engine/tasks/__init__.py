"""The serving side of each task: task -> `ServedTask`, one module per task (each holds its row of models.tasks)."""

from __future__ import annotations

from models.spec import TEXT, VISION, Task
from service.engine.entry import ServedTask
from service.engine.tasks import text, vision

SERVED: dict[Task, ServedTask] = {VISION: vision.TASK, TEXT: text.TASK}


def served(task: Task) -> ServedTask:
    """The serving side of `task` (the task of its row of models.tasks)."""
    return SERVED[task]
