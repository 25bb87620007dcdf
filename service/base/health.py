"""Is a model's worker healthy? The model's own readiness (`/v2/models/{m}/ready`, `multimax_model_ready`) asks
this; the server's (`/v2/health/ready`) does not, so one model's failures never take the others out of service.

A model is not ready when its batcher or decode loop has died (the asyncio task ended with an error), or
when its last `FAILING_AFTER` model calls all failed with no success between them. One success makes it
ready again: a request that breaks the model on its own input cannot take the model offline while
other traffic succeeds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from service.base.errors import without_paths

FAILING_AFTER = 5


@dataclass
class Health:
    consecutive_failures: int = 0
    last_error: str | None = None

    def succeeded(self) -> None:
        self.consecutive_failures = 0

    def failed(self, why: str) -> None:
        self.consecutive_failures += 1
        self.last_error = without_paths(why)  # shown by the open readiness routes

    def problem(self, task: asyncio.Task[None] | None, closing: bool) -> str | None:
        """Why the model is not ready, or None."""
        if task is not None and task.done() and not closing:
            exc = None if task.cancelled() else task.exception()
            return f"its worker stopped: {type(exc).__name__ if exc else 'cancelled'}"
        if self.consecutive_failures >= FAILING_AFTER:
            return f"its last {self.consecutive_failures} model calls failed ({self.last_error})"
        return None
