"""Image decoding on a bounded pool, shared fairly between requests.

Decoding is the one CPU-heavy step a client controls: six 40-megapixel PNGs cost seconds however small the
model. Every image of a request is one job of `DecodePool`; a fixed number of threads run them (Pillow and zlib
release the GIL while they work). When a thread frees up it takes the waiting job of the request that has had
the fewest pixels started so far (oldest first among equals), so a request that just arrived goes next: its wait
is what the images already decoding still need, at most one image per thread, and an image is bounded by the
pixel limit. Jobs whose request's deadline has passed, or whose request has failed or gone, are dropped unstarted.

One more thread is an express lane for small images (at most `SMALL_PIXELS`, a few milliseconds each): an ordinary
request never waits behind a 40-megapixel decode at all, even when every general thread is busy with one.

Admission (`check_room`): a request whose large images could not start before its deadline, at the decoding
rate measured so far, is refused at once with 429 and a Retry-After of the queued work's time, instead of
waiting to be dropped with a 504.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from service.base.errors import ServiceError

T = TypeVar("T")
SMALL_PIXELS = 1_000_000  # a 1000x1000 image: what the express thread takes


@dataclass
class _Request:
    started_pixels: int = 0  # of its images handed to a thread so far: the fairness key
    done: bool = False  # failed, answered or gone: its waiting jobs are dropped


@dataclass
class _Job(Generic[T]):
    request: _Request
    pixels: int
    work: Callable[[], T]
    future: asyncio.Future[T]
    due: float  # time.perf_counter() deadline (service.protocols.lifecycle.deadline)
    order: int = field(default=0)
    started: float = 0.0


class DecodePool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads + 1, thread_name_prefix="decode")  # + the express thread
        self._waiting: list[_Job[Any]] = []
        self._running = 0  # on the general threads
        self._express_busy = False
        self._order = itertools.count()
        self._thread_rate: float | None = None  # pixels per second of one general thread (moving average)

    def waiting_pixels(self) -> int:
        return sum(j.pixels for j in self._waiting if not j.request.done)

    def queued_seconds(self) -> float:
        """How long the waiting work will take the general threads, at the measured rate (0 before any)."""
        if not self._thread_rate:
            return 0.0
        return self.waiting_pixels() / (self._thread_rate * self.threads)

    def check_room(self, pixels: list[int], due: float) -> None:
        """429 (with Retry-After) when a request's large images could not start before `due`: the work queued
        ahead of them takes longer than the time left. Small images ride the express thread: never refused."""
        if all(p <= SMALL_PIXELS for p in pixels) or self._running < self.threads:
            return
        ahead = self.queued_seconds()
        if ahead > due - time.perf_counter():
            raise ServiceError(429, f"{self.waiting_pixels()} pixels of images are waiting to be decoded (about "
                               f"{ahead:.1f} s of work), more than this request's deadline allows; retry later",
                               code="queue_full", headers={"Retry-After": str(max(1, math.ceil(ahead)))})

    async def run(self, jobs: list[tuple[int, Callable[[], T]]], due: float) -> list[T]:
        """Each job's result, in order: `(pixels, work)` pairs of one request, all done by `due`
        (time.perf_counter()), else 504. The first job to raise ends the request (its other jobs are dropped)."""
        loop = asyncio.get_running_loop()
        request = _Request()
        futures: list[asyncio.Future[T]] = []
        for pixels, work in jobs:
            future: asyncio.Future[T] = loop.create_future()
            self._waiting.append(_Job(request, pixels, work, future, due, next(self._order)))
            futures.append(future)
        self._dispatch()
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), max(0.0, due - time.perf_counter())))
        except asyncio.TimeoutError:
            raise ServiceError(504, "deadline passed while the request's images were being decoded",
                               code="timeout") from None
        finally:
            request.done = True
            for f in futures:
                f.cancel()  # no-op for the done ones; a running job's result is dropped
            self._waiting = [j for j in self._waiting if not j.request.done]

    def _next(self) -> tuple[_Job[Any], bool] | None:
        """The job to start now and whether it takes the express thread, or None."""
        def fairest(jobs: list[_Job[Any]]) -> _Job[Any] | None:
            return min(jobs, key=lambda j: (j.request.started_pixels, j.order), default=None)

        if self._running < self.threads:
            job = fairest(self._waiting)
            return None if job is None else (job, False)
        if not self._express_busy:
            job = fairest([j for j in self._waiting if j.pixels <= SMALL_PIXELS])
            return None if job is None else (job, True)
        return None

    def _dispatch(self) -> None:
        now = time.perf_counter()
        while (chosen := self._next()) is not None:
            job, express = chosen
            self._waiting.remove(job)
            if job.request.done or job.future.done():
                continue
            if now >= job.due:
                job.future.set_exception(ServiceError(504, "deadline passed before the request's images were "
                                                           "decoded", code="timeout"))
                continue
            job.request.started_pixels += job.pixels
            job.started = now
            if express:
                self._express_busy = True
            else:
                self._running += 1
            running = asyncio.get_running_loop().run_in_executor(self._executor, job.work)
            running.add_done_callback(partial(self._finished, job, express))

    def _finished(self, job: _Job[Any], express: bool, running: asyncio.Future[Any]) -> None:
        if express:
            self._express_busy = False
        else:
            self._running -= 1
            took = time.perf_counter() - job.started
            if not running.cancelled() and running.exception() is None and took > 0 and job.pixels > SMALL_PIXELS:
                rate = job.pixels / took
                self._thread_rate = rate if self._thread_rate is None else 0.8 * self._thread_rate + 0.2 * rate
        if running.cancelled():  # the pool is closing
            job.future.cancel()
        elif not job.future.done():
            exc = running.exception()
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(running.result())
        self._dispatch()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
