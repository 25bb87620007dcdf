"""The engine's own errors: what the batcher and the text scheduler raise when they cannot take or finish work.

They say what happened in the engine's terms, never how a protocol answers it: `service.protocols.engine_status` maps
each to its HTTP status, body code and headers at the edge (429 + Retry-After, 503, 504, 499, 400, 500).
"""

from __future__ import annotations


class EngineError(Exception):
    """Work the engine refused or could not finish; `message` is fit to show the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(EngineError):
    """The waiting room is full; `retry_after` whole seconds until it likely has room."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(EngineError):
    """The engine is closing: it finishes accepted work and takes no more."""

    def __init__(self, message: str = "server is shutting down") -> None:
        super().__init__(message)


class DeadlineExceeded(EngineError):
    """The work's deadline passed before it started."""


class Cancelled(EngineError):
    """The work was cancelled (its client went away) before it finished."""


class TooLarge(EngineError):
    """One submission holds more rows than a batch may: it could never be served."""


class ModelFailed(EngineError):
    """The model failed on this work (its batch-mates are unaffected)."""
