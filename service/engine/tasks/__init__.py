"""The serving side of each task (models.tasks' `serve` column): task -> `ServedTask`, one module per task."""

from __future__ import annotations

from models.spec import TEXT, VISION, Task
from models.tasks import TASKS
from service.engine.entry import ServedTask
from service.engine.tasks import text, vision

SERVED: dict[Task, ServedTask] = {VISION: vision.TASK, TEXT: text.TASK}
assert all(SERVED[t] is TASKS[t].part("serve") for t in TASKS), "models.tasks names each row's serving side"


def served(task: Task) -> ServedTask:
    """The serving side of `task` (its row of models.tasks)."""
    return SERVED[task]
