"""Dynamic batching for one model: requests queue, a worker groups them into one model call.

The steps are those of LitServe's API, each its own function: the endpoint decodes a request into
rows (its own failure stays its own), the batcher concatenates rows of many requests (`batch`),
calls the model once (`predict`, in a worker thread so the event loop keeps serving), and splits the
output back per request (`unbatch`); the endpoint encodes the response.

Policy: when the model is idle, the first waiting request starts a batch that takes whatever else is
queued and waits at most `max_delay` for more; while the model computes, arrivals pile up and form
the next batch. A request whose client has gone or whose deadline passed is dropped before compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.base.health import Health
from service.base.metrics import Metrics
from service.engine.engine_errors import DeadlineExceeded, ModelFailed, QueueFull, ShuttingDown, TooLarge

log = logging.getLogger(__name__)


@dataclass
class BatchResult:
    output: Any  # this request's rows of the model output
    queue_s: float  # arrival in the queue -> its batch started computing
    compute_s: float  # the model call of its batch
    batch_rows: int


@dataclass(eq=False)
class _Item:
    rows: np.ndarray
    future: asyncio.Future[BatchResult]
    deadline: float
    enqueued: float = field(default_factory=time.perf_counter)
    started: bool = False  # handed to the model: past this point it finishes even if its deadline passes
    timer: asyncio.TimerHandle | None = None


def concat_batch(rows: list[np.ndarray]) -> np.ndarray:
    return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)


def split_batch(output: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(output, np.cumsum(sizes)[:-1], axis=0)


class DynamicBatcher:
    def __init__(
        self,
        model: str,
        predict: Callable[[np.ndarray], np.ndarray],
        executor: Executor,
        metrics: Metrics,
        max_batch_size: int,
        max_delay_s: float,
        max_queue: int,
        batch: Callable[[list[np.ndarray]], np.ndarray] = concat_batch,
        unbatch: Callable[[np.ndarray, list[int]], list[np.ndarray]] = split_batch,
    ) -> None:
        self.model = model
        self.predict, self.batch, self.unbatch = predict, batch, unbatch
        self.executor = executor
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self._queue: deque[_Item] = deque()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._batch_seconds: float | None = None  # moving average of one model call (None: none measured yet)
        # Retry-After follows the work really queued: the time from one batch's start to the next while requests
        # wait (model call, delivery and the event loop's own delay under a flood), and what the requests of
        # the latest batch waited.
        self._cycle_seconds: float | None = None
        self._last_start: float | None = None
        self._last_wait = 0.0
        self.health = Health()

    # ---- producer side (endpoints) ---------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def problem(self) -> str | None:
        return self.health.problem(self._task, self._closing)

    def check_room(self) -> None:
        """ShuttingDown while closing, QueueFull (with its retry-after) when the queue is full; cheap, so endpoints
        call it before reading a request's body."""
        if self._closing:
            raise ShuttingDown()
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"model {self.model} has {len(self._queue)} requests queued; retry later",
                            self.retry_after())

    def retry_after(self) -> int:
        """Whole seconds until the queue has room: the batches ahead times the measured batch time."""
        return max(1, math.ceil(self._estimated_wait()))

    def enqueue(self, rows: np.ndarray, deadline: float) -> asyncio.Future[BatchResult]:
        """Queue `rows` (n, ...); the future gets their output. QueueFull when the queue is full, DeadlineExceeded
        (as the future's exception) if the deadline passes while still queued. Cancelling the future (client gone)
        drops the request before compute. No task per request: the deadline is a timer on the loop."""
        self.check_room()
        if len(rows) > self.max_batch_size:
            raise TooLarge(f"{len(rows)} inputs in one request exceed the model's max batch size "
                           f"{self.max_batch_size}")
        loop = asyncio.get_running_loop()
        item = _Item(rows, loop.create_future(), deadline)
        item.timer = loop.call_later(max(0.0, deadline - time.perf_counter()), self._expire, item)
        self._queue.append(item)
        self._arrived.set()
        return item.future

    async def submit(self, rows: np.ndarray, deadline: float) -> BatchResult:
        """`enqueue` and wait; cancelling the waiting task drops the request if it has not started."""
        future = self.enqueue(rows, deadline)
        try:
            return await future
        finally:
            future.cancel()  # no-op once it has a result

    def _expire(self, item: _Item) -> None:
        # Past its deadline: a queued request fails now; one already computing finishes (ms away).
        if not item.started and not item.future.done():
            item.future.set_exception(DeadlineExceeded("deadline exceeded while queued"))

    def _estimated_wait(self) -> float:
        """Seconds until the queued work is done (for Retry-After): the batches ahead times the measured time
        from one batch's start to the next (never less than a model call), and never less than what the latest
        batch's requests waited."""
        per_batch = max(self._cycle_seconds or 0.0, self._batch_seconds or 0.0)
        return max((len(self._queue) / self.max_batch_size + 1) * per_batch, self._last_wait if self._queue else 0.0)

    # ---- worker side -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher-{self.model}")

    @property
    def alive(self) -> bool:
        """False once the worker loop has ended (closed, or died of a bug): nothing queued will be served."""
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        """Refuse new work, finish what is queued, stop."""
        self._closing = True
        self._arrived.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _live(self, item: _Item, now: float) -> bool:
        if item.future.done():  # cancelled: its client went away (the endpoint counts the outcome)
            return False
        if now >= item.deadline:
            self._expire(item)
            return False
        return True

    async def _collect(self) -> list[_Item]:
        """Next batch: the first live request, then more until max_batch_size rows or max_delay passed."""
        batch: list[_Item] = []
        rows = 0
        wait_until: float | None = None
        while True:
            now = time.perf_counter()
            while self._queue and rows < self.max_batch_size:
                item = self._queue[0]
                if not self._live(item, now):
                    self._queue.popleft()
                    continue
                if rows + len(item.rows) > self.max_batch_size:
                    return batch  # it starts the next batch
                self._queue.popleft()
                batch.append(item)
                rows += len(item.rows)
            if rows >= self.max_batch_size or (batch and self._closing):
                return batch
            if not batch:
                if self._closing:
                    return batch
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if wait_until is None:
                wait_until = batch[0].enqueued + self.max_delay_s
            remaining = wait_until - time.perf_counter()
            if remaining <= 0:
                return batch
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                return  # closing and nothing left
            start = time.perf_counter()
            sizes = [len(item.rows) for item in batch]
            for item in batch:
                item.started = True
            self._measure_cycle(start, batch)
            try:
                outputs, compute_s = await loop.run_in_executor(self.executor, self._compute, [i.rows for i in batch])
            except Exception:
                log.exception("%s: batch of %d failed; retrying its requests one by one", self.model, len(batch))
                await self._one_by_one(batch, start)
                continue
            self._deliver(batch, outputs, start, compute_s, sum(sizes))

    def _measure_cycle(self, start: float, batch: list[_Item]) -> None:
        backlogged = self._last_start is not None and min(i.enqueued for i in batch) < self._last_start
        if backlogged and self._last_start is not None:  # the batch waited for the previous one: a full cycle
            took = start - self._last_start
            self._cycle_seconds = took if self._cycle_seconds is None else 0.8 * self._cycle_seconds + 0.2 * took
        self._last_start = start
        self._last_wait = max(start - i.enqueued for i in batch)

    def _compute(self, rows: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
        start = time.perf_counter()
        output = self.predict(self.batch(rows))
        compute_s = time.perf_counter() - start
        return self.unbatch(output, [len(r) for r in rows]), compute_s

    def _deliver(self, batch: list[_Item], outputs: list[np.ndarray], start: float, compute_s: float,
                 rows: int) -> None:
        self.health.succeeded()
        self.metrics.compute_time.labels(self.model, "classify").observe(compute_s)
        self._batch_seconds = compute_s if self._batch_seconds is None else 0.9 * self._batch_seconds + 0.1 * compute_s
        self.metrics.batch_size.labels(self.model, "classify").observe(rows)
        for item, out in zip(batch, outputs, strict=True):
            if item.timer is not None:
                item.timer.cancel()
            queue_s = start - item.enqueued
            self.metrics.queue_time.labels(self.model).observe(queue_s)
            if not item.future.done():
                item.future.set_result(BatchResult(out, queue_s, compute_s, rows))

    async def _one_by_one(self, batch: list[_Item], start: float) -> None:
        """A failed batch must fail only the request that broke it, never its batch-mates."""
        loop = asyncio.get_running_loop()
        for item in batch:
            if item.future.done():
                continue
            try:
                outputs, compute_s = await loop.run_in_executor(self.executor, self._compute, [item.rows])
            except Exception as exc:
                log.exception("%s: a request failed on its own", self.model)
                self.health.failed(f"{type(exc).__name__}: {exc}"[:200])
                if not item.future.done():
                    item.future.set_exception(ModelFailed(f"model failed on this input: {type(exc).__name__}"))
                continue
            self._deliver([item], outputs, start, compute_s, len(item.rows))
