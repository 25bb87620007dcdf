"""How the edge answers the engine's errors (`service.engine.engine_errors`): status, error code and headers, exactly
as the batcher and scheduler answered before they raised their own errors (tests and clients depend on them)."""

from __future__ import annotations

from service.base.errors import ServiceError
from service.engine.engine_errors import (
    Cancelled,
    DeadlineExceeded,
    EngineError,
    ModelFailed,
    QueueFull,
    ShuttingDown,
    TooLarge,
)

_STATUS: tuple[tuple[type[EngineError], int, str], ...] = (
    (QueueFull, 429, "queue_full"),
    (ShuttingDown, 503, "shutting_down"),
    (DeadlineExceeded, 504, "deadline_exceeded"),
    (Cancelled, 499, "client_disconnected"),
    (TooLarge, 400, "batch_too_large"),
    (ModelFailed, 500, "model_error"),
)


def http_error(exc: EngineError) -> ServiceError:
    """The ServiceError (status, body code, headers) a client gets for `exc`; an unknown engine error is a 500."""
    for kind, status, code in _STATUS:
        if isinstance(exc, kind):
            headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, QueueFull) else None
            return ServiceError(status, exc.message, code=code, headers=headers)
    return ServiceError(500, exc.message, code="internal_error")
