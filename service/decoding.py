"""Image decoding on a bounded pool, shared fairly between requests.

Decoding is the one CPU-heavy step a client controls: six 40-megapixel PNGs cost seconds however small the
model. Every image of a request is one job of `DecodePool`; a fixed number of threads run them (Pillow and zlib
release the GIL while they work). When a thread frees up it takes the waiting job of the request that has had
the fewest pixels started so far (oldest first among equals), so a request that just arrived goes next: its wait
is what the images already decoding still need, at most one image per thread, and an image is bounded by the
pixel limit. Jobs whose request's deadline has passed, or whose request has failed or gone, are dropped unstarted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from service.errors import ServiceError

T = TypeVar("T")


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
    due: float  # time.perf_counter() deadline (service.lifecycle.deadline)
    order: int = field(default=0)


class DecodePool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="decode")
        self._waiting: list[_Job[Any]] = []
        self._running = 0
        self._order = itertools.count()

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

    def _dispatch(self) -> None:
        now = time.perf_counter()
        while self._running < self.threads and self._waiting:
            job = min(self._waiting, key=lambda j: (j.request.started_pixels, j.order))
            self._waiting.remove(job)
            if job.request.done or job.future.done():
                continue
            if now >= job.due:
                job.future.set_exception(ServiceError(504, "deadline passed before the request's images were "
                                                           "decoded", code="timeout"))
                continue
            job.request.started_pixels += job.pixels
            self._running += 1
            running = asyncio.get_running_loop().run_in_executor(self._executor, job.work)
            running.add_done_callback(partial(self._finished, job))

    def _finished(self, job: _Job[Any], running: asyncio.Future[Any]) -> None:
        self._running -= 1
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
