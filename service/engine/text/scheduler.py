"""Continuous batching for one text model: the loop that admits sequences, has the worker thread run steps, and
commits their results to the waiting endpoints.

A step (worker thread) is planned (service.engine.text.policy: admission, burst gathering, chunking), run
(service.engine.text.runner: the model call over the batch, the draw, stops, logprobs) and handed to the event
loop, which applies each sequence's delta (`_commit`): the endpoints only read their `GenSequence`. Finished and
cancelled sequences leave the batch at the start of the next step, and columns that are padding for every row are
trimmed, so one long generation never holds up the others and a closed stream frees its slot at once.

Refusals and failures are the engine's own errors (service.engine.engine_errors), which the edge answers with
HTTP statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import torch

from models.tokenizer import TextTokenizer
from service.base.health import Health
from service.base.metrics import Metrics
from service.engine.backends.base import CachedDecoder
from service.engine.engine_errors import ModelFailed, QueueFull, ShuttingDown
from service.engine.text.batch import Batch
from service.engine.text.outputs import OutputProcessor
from service.engine.text.policy import BURST_FIRST_S, BURST_GAP_S, BURST_MAX_S, PREFILL_CHUNK_TOKENS, StepPolicy
from service.engine.text.prefix_cache import PrefixCache
from service.engine.text.runner import StepRunner
from service.engine.text.sequence import GenSequence, SequenceDelta

__all__ = ["HANDOFF_INTERVAL_S", "HANDOFF_MAX_STEPS", "PREFILL_CHUNK_TOKENS", "PREFIX_CACHE_BYTES", "STEPS_SLICE_S",
           "GenSequence", "TextScheduler"]

log = logging.getLogger(__name__)
T = TypeVar("T")
STEPS_SLICE_S = 0.25  # longest run of decode steps before the worker hands back to the event loop
# Shortest time between two wake-ups of the event loop by the worker (_hand_off): each wake-up is a thread switch
# that, on busy cores, costs the worker its CPU (measured in docs/BENCHMARKS.md); a model slower than this (the
# paper-size LM: 4-8 ms a step) still wakes the loop every step
HANDOFF_INTERVAL_S = 0.001  # the default (--stream-interval-ms)
HANDOFF_MAX_STEPS = 8  # ... or this many steps are queued: well under what a stream coalesces (MAX_BACKLOG)
BURSTY_SHARE = 0.5  # idle starts with company (moving average) from which an idle model waits for a burst
BURSTY_WEIGHT = 0.5  # the last idle start's weight in that average
PREFIX_CACHE_BYTES = 256 << 20  # KV cache kept for prompts' shared starts (the default of --prefix-cache-mb)


class TextScheduler:
    def __init__(
        self,
        model: str,
        backend: CachedDecoder,
        tokenizer: TextTokenizer,
        context_length: int,
        executor: Executor,
        metrics: Metrics,
        max_running: int,
        max_waiting: int,
        output_function: str | None = None,
        handoff_interval_s: float = HANDOFF_INTERVAL_S,
        prefill_chunk: int = PREFILL_CHUNK_TOKENS,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
    ) -> None:
        self.model = model
        self.handoff_interval_s = handoff_interval_s
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.executor = executor
        self.metrics = metrics
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._waiting: deque[GenSequence] = deque()
        self._active: set[GenSequence] = set()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # the worker's side: what a step decides, the rows it runs on, and what runs it
        self.prefix_cache = PrefixCache(backend.cache, prefix_cache_bytes, metrics, model)
        self.policy = StepPolicy(max_running, prefill_chunk, self.prefix_cache)
        self.batch = Batch(backend, context_length)
        self.steps = {"prefill": 0, "decode": 0, "prefill_prompts": 0, "burst_waits": 0, "prefill_chunks": 0}
        self.runner = StepRunner(model, backend, self.batch,
                                 OutputProcessor(model, tokenizer, context_length, output_function),
                                 self.policy, metrics, self.steps)
        self._submits = 0  # submit() calls so far (arrivals, whatever their number of sequences)
        # How often an idle model's first arrival has had company (another arrival within BURST_MAX_S): a moving
        # average over idle starts; the time of the last idle start, and whether company came after it
        self._bursty = 0.0
        self._idle_start: float | None = None
        self._company = False
        self.health = Health()
        self._interrupt = False  # set by the loop side: new sequences, a cancellation, closing
        self._exclusive = 0  # stateless forwards (KServe) queued or running on the worker thread
        self._seq_seconds: float | None = None  # moving average of a sequence's time in the batch (Retry-After)
        self._last_wait = 0.0  # what the sequences admitted last waited (Retry-After follows the queued work)
        # steps' results on their way to the loop (worker appends, loop drains); one wake-up of the loop carries
        # every step finished since its last drain (_hand_off)
        self._handoff: deque[list[SequenceDelta]] = deque()
        self._drain_queued = False
        self._last_wake = 0.0
        # the children every sequence update touches, looked up once (a labels() call costs microseconds)
        self._running_gauge = metrics.running.labels(model)
        self._waiting_gauge = metrics.waiting.labels(model)
        self._counts = (-1, -1)  # (running, waiting) as the gauges were last set
        self._generation_tokens = metrics.generation_tokens.labels(model)
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)

    @property
    def backend(self) -> CachedDecoder:
        return self.batch.backend

    @backend.setter
    def backend(self, backend: CachedDecoder) -> None:  # between steps only (a test's wrapper)
        self.batch.backend = self.runner.backend = backend

    @property
    def prefill_chunk(self) -> int:
        return self.policy.chunk_tokens

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self.policy.chunk_tokens = tokens

    # ---- endpoint side ----------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def problem(self) -> str | None:
        return self.health.problem(self._task, self._closing)

    def check_room(self, n: int = 1) -> None:
        """ShuttingDown while closing, QueueFull (with its retry-after) when `n` more sequences would not fit the
        waiting room; cheap, so the endpoint calls it before reading a request's body."""
        if self._closing:
            raise ShuttingDown()
        if len(self._waiting) + n > self.max_waiting:
            raise QueueFull(f"model {self.model} has {len(self._waiting)} sequences waiting; retry later",
                            self.retry_after())

    def retry_after(self) -> int:
        """Whole seconds until a slot frees up for the queue's tail: the rounds of the running batch ahead of it
        times the measured time a sequence spends in the batch."""
        rounds = (len(self._waiting) / self.max_running + 1) * (self._seq_seconds or 0.0)
        return max(1, math.ceil(max(rounds, self._last_wait if self._waiting else 0.0)))

    def submit(self, seqs: Sequence[GenSequence]) -> None:
        """Queue sequences (all or none); QueueFull when the waiting room is full."""
        self.check_room(len(seqs))
        for seq in seqs:
            if seq.params.max_tokens == 0 and not seq.params.prompt_logprobs:  # answer without the model
                seq.finish_reason, seq.finished = "length", time.perf_counter()
                seq.changed.set()
                continue
            self._waiting.append(seq)
        self._submits += 1
        if self._idle_start is not None and time.perf_counter() - self._idle_start <= BURST_MAX_S:
            self._company = True
        self._gauges()
        self._wake.set()
        self._interrupt = True  # the worker returns to the loop after its current step

    def cancel(self, seq: GenSequence) -> None:
        """The client is gone: a waiting sequence leaves the queue, a running one leaves at the next step."""
        if seq.done or seq.cancelled:
            return
        seq.cancelled = True
        with contextlib.suppress(ValueError):
            self._waiting.remove(seq)
        self._active.discard(seq)
        self._gauges()
        self._wake.set()
        self._interrupt = True  # the worker returns to the loop after its current step

    def check_exclusive_room(self) -> None:
        """ShuttingDown while closing, QueueFull when as many stateless forwards wait as sequences may
        (max_waiting)."""
        if self._closing:
            raise ShuttingDown()
        if self._exclusive >= self.max_waiting:
            raise QueueFull(f"model {self.model} has {self._exclusive} forwards queued; retry later",
                            self.retry_after())

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the model's worker thread, between decode steps (KServe's stateless forward); the queue
        of such calls is bounded like the waiting room."""
        self.check_exclusive_room()
        self._exclusive += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            self._exclusive -= 1

    def _gauges(self) -> None:
        counts = (len(self._active), len(self._waiting))
        if counts != self._counts:  # every step's commit calls this: set (a lock each) only what changed
            self._counts = counts
            self._running_gauge.set(counts[0])
            self._waiting_gauge.set(counts[1])

    # ---- loop --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"scheduler-{self.model}")

    @property
    def alive(self) -> bool:
        """False once the decode loop has ended (closed, or died of a bug): no sequence will advance."""
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        """Refuse new sequences, finish the accepted ones, stop."""
        self._closing = True
        self._wake.set()
        self._interrupt = True  # the worker returns to the loop after its current step
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._active and not self._waiting and not self.batch.rows:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._active and self._waiting:
                await self._gather_burst()
            self._interrupt = False  # before admitting: a sequence submitted from now on interrupts the worker
            admitted = self.policy.admit(self._waiting, len(self._active))
            now = time.perf_counter()
            if admitted:
                self._last_wait = max(now - seq.arrival for seq in admitted)
            for seq in admitted:
                seq.started = now
                self._active.add(seq)
                self.metrics.queue_time.labels(self.model).observe(now - seq.arrival)
            self._gauges()
            try:
                deltas = await loop.run_in_executor(self.executor, self._steps, admitted, loop)
            except Exception as exc:
                self._drain()  # the steps that succeeded before it, in order
                log.exception("%s: generation step failed", self.model)
                self._fail(admitted or list(self._active), exc)
                continue
            self._drain()  # earlier steps first (normally drained already: their callback ran before this one)
            self._commit(deltas)

    async def _gather_burst(self) -> None:
        """Before an idle model's prefill: let requests already being handled submit theirs (two loop turns), and
        if that brought more, keep waiting while submissions arrive less than BURST_GAP_S apart (at most
        BURST_MAX_S, or until the batch is full). Clients that start together (a load test, a fan-out) are then
        prefilled in one batch instead of two or three (16 streams got two prefills of 8); a lone request, which
        nothing follows within those turns, starts at once.
        Requests of one burst sent by one client process reach the loop up to a few milliseconds apart (measured:
        4 streams 0.5-3 ms), later than two loop turns: the first was then prefilled alone and the others waited
        for it (45 ms at 4 streams). So where idle starts have mostly had company within BURST_MAX_S lately
        (BURSTY_SHARE of them, a moving average), the first wait is BURST_FIRST_S; traffic of lone requests never
        pays it."""
        start, submits = time.perf_counter(), self._submits
        if self._idle_start is None or start - self._idle_start > BURST_MAX_S:  # not a straggler of the last burst
            if self._idle_start is not None:  # the last idle start's outcome is known now
                self._bursty += BURSTY_WEIGHT * (float(self._company) - self._bursty)
            self._idle_start, self._company = start, False
        if self._bursty >= BURSTY_SHARE:
            await asyncio.sleep(BURST_FIRST_S)
        else:
            for _ in range(2):
                await asyncio.sleep(0)
        if self._submits == submits:
            return
        self.steps["burst_waits"] += 1
        while len(self._waiting) < self.max_running and time.perf_counter() - start < BURST_MAX_S:
            submits = self._submits
            await asyncio.sleep(BURST_GAP_S)
            if self._submits == submits:
                return

    def _fail(self, seqs: list[GenSequence], exc: Exception) -> None:
        """A failed prefill fails the sequences it admitted; a failed decode fails the batch it ran."""
        error = ModelFailed(f"model failed during generation: {type(exc).__name__}")
        self.health.failed(error.message)
        failed = set(seqs)
        for seq in seqs:
            seq.error = error
            self._active.discard(seq)
            seq.changed.set()
        # drop their rows and queued chunks (the worker is idle here: the step that failed has returned)
        self.batch.keep([i for i, r in enumerate(self.batch.rows) if r.seq not in failed])
        self.policy.forget(failed)
        self._gauges()

    def _commit(self, deltas: list[SequenceDelta]) -> None:
        """A step's deltas reach their sequences (and the metrics); the endpoints waiting on them wake."""
        now = time.perf_counter()
        generated = 0  # tokens of this step, counted once
        for d in deltas:
            seq = d.row.seq
            if d.error is not None:
                self.health.failed(d.error)
                seq.error = ModelFailed(d.error)
                self._active.discard(seq)
                seq.changed.set()
                continue
            new = d.generated - seq.generated
            if new <= 0 and d.finish_reason is None and d.prompt_logprobs is None:
                continue
            if d.prompt_logprobs is not None:
                seq.prompt_logprobs = d.prompt_logprobs
            if d.logprobs is not None:
                seq.logprobs.truncate(d.start)
                seq.logprobs.chosen += d.logprobs.chosen
                seq.logprobs.top += d.logprobs.top
                seq.cumulative_logprob = d.cumulative_logprob
            self.health.succeeded()
            if new > 0:
                generated += new
                if seq.first_token is None:
                    seq.first_token = now
                    self._ttft.observe(now - seq.arrival)
                else:
                    self._itl.observe(now - (seq.last_token or now))
                seq.last_token = now
            del seq.tokens[d.start:]
            seq.tokens += d.tail
            seq.generated = d.generated
            seq.steps.append(len(seq.tokens))
            seq.stop_tail = d.row.stop_tail
            if d.finish_reason is not None:
                self._finished(seq, d.finish_reason, now)
            seq.changed.set()
        if generated:
            self._generation_tokens.inc(generated)
        self._gauges()

    def _finished(self, seq: GenSequence, reason: str, now: float) -> None:
        seq.finished = now
        seq.finish_reason = reason
        self._active.discard(seq)
        if seq.started is not None:
            took = now - seq.started
            self._seq_seconds = took if self._seq_seconds is None else 0.9 * self._seq_seconds + 0.1 * took
        self.metrics.e2e.labels(self.model).observe(now - seq.arrival)

    # ---- worker thread ---------------------------------------------------------------------------------

    @torch.inference_mode()  # once for the whole run of steps: entering it costs microseconds a step
    def _steps(self, admitted: list[GenSequence], loop: asyncio.AbstractEventLoop) -> list[SequenceDelta]:
        """One step, then more decode steps in a row while nothing needs the loop side (no new sequence, no
        cancellation, at most STEPS_SLICE_S): each step's results go to the loop without waiting for it, so a
        busy event loop (a flood of requests, even refused ones) delays the delivery of tokens, not their
        computation. Returns the last step's results."""
        deltas = self._step(admitted)
        until = time.perf_counter() + STEPS_SLICE_S
        while not self._interrupt and time.perf_counter() < until and (self.batch.live or self.policy.chunked):
            self._hand_off(deltas, loop)
            deltas = self._step([])
        return deltas

    def _step(self, admitted: list[GenSequence]) -> list[SequenceDelta]:
        """Plan, run: a prefill of the sequences just admitted, or a decode step of the running rows followed by
        the next chunk of a long prompt."""
        self.batch.keep_live()
        plan = self.policy.plan(admitted, decoding=self.batch.live)
        deltas = self.runner.run(plan)
        if plan.decode or not plan.prefill:
            deltas += self.runner.run(self.policy.plan_chunk(decoding=self.batch.live))
        return deltas

    def _hand_off(self, deltas: list[SequenceDelta], loop: asyncio.AbstractEventLoop) -> None:
        """Queue a step's results for the loop, waking it only when no drain is queued yet and handoff_interval_s
        have passed since the last wake-up (or HANDOFF_MAX_STEPS steps wait, or the step holds a sequence's first
        token, its end or its failure: the interval never delays a time to first token or a request's end). A
        wake-up (a write to the loop's self-pipe) switches threads: the loop takes the GIL and, on loaded cores,
        the worker's CPU (profiled on the demo model: up to 0.8 ms a wake-up, more than a step). A fast model now
        hands over several steps per wake-up, each still applied as its own step (one stream event per step); what
        is queued when the worker returns is drained by _run. Deque appends/pops and the flag are GIL-atomic; the
        loop clears the flag before draining, so nothing is left behind."""
        self._handoff.append(deltas)
        if self._drain_queued:  # the queued drain takes this step too: nothing to decide
            return
        now = time.perf_counter()
        if (now - self._last_wake >= self.handoff_interval_s or len(self._handoff) >= HANDOFF_MAX_STEPS
                or any(d.start == 0 or d.finish_reason is not None or d.error is not None for d in deltas)):
            self._drain_queued, self._last_wake = True, now
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._drain_queued = False
        while self._handoff:
            self._commit(self._handoff.popleft())
