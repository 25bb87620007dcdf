"""Per-request bookkeeping shared by the endpoints: outcome metrics, deadlines, vanished clients."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request

from service.base.errors import OUTCOME_BY_STATUS, ServiceError
from service.base.metrics import Metrics
from service.engine.engine_errors import EngineError
from service.protocols.engine_status import http_error

T = TypeVar("T")


class ClientGone(ServiceError):
    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_disconnected")


class CountedHTTPException(HTTPException):
    """An HTTPException raised while a model endpoint's request was tracked, so already counted in its metrics (the
    edge's error handler must not count it again)."""


class Tracker:
    """Counts one request: pending while it runs, then its duration and outcome."""

    def __init__(self, metrics: Metrics, model: str, endpoint: str) -> None:
        self.metrics, self.model, self.endpoint = metrics, model, endpoint
        self.start = time.perf_counter()
        self.outcome: str | None = None
        self.on_finish: list[Callable[[], None]] = []  # e.g. release the model runtime the request held

    def finish(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        for release in self.on_finish:
            release()
        self.metrics.requests.labels(self.model, self.endpoint, outcome).inc()
        self.metrics.request_duration.labels(self.model, self.endpoint).observe(time.perf_counter() - self.start)
        self.metrics.pending.labels(self.model).dec()


@contextlib.asynccontextmanager
async def tracked(metrics: Metrics, model: str, endpoint: str, *, finish: bool = True) -> AsyncIterator[Tracker]:
    """`finish=False`: a streaming endpoint finishes the tracker itself when its stream ends."""
    tracker = Tracker(metrics, model, endpoint)
    metrics.pending.labels(model).inc()
    try:
        yield tracker
    except ServiceError as exc:
        tracker.finish(exc.outcome)
        raise
    except EngineError as exc:  # the engine's own error: answered (and counted) as the edge maps it
        error = http_error(exc)
        tracker.finish(error.outcome)
        raise error from None
    except HTTPException as exc:  # e.g. a body over the limit while it streams in, or a malformed multipart
        tracker.finish(outcome_of(exc.status_code))
        if isinstance(exc, CountedHTTPException):
            raise
        raise CountedHTTPException(exc.status_code, exc.detail, exc.headers) from exc
    except asyncio.CancelledError:
        tracker.finish("cancelled")
        raise
    except BaseException:
        tracker.finish("error")
        raise
    if finish:
        tracker.finish("success")


def deadline(default_s: float, requested_s: float | None = None) -> float:
    """perf_counter time by which the request must be answered (a request may shorten, not extend it)."""
    seconds = default_s if requested_s is None else min(default_s, requested_s)
    return time.perf_counter() + seconds


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect (or the end of our response).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (so queued work is dropped before compute) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


def outcome_of(status: int) -> str:
    return OUTCOME_BY_STATUS.get(status, "invalid_input" if status < 500 else "error")
