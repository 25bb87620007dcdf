"""Continuous batching for one text model: one decode loop, sequences join and leave between steps.

Each step runs in the model's worker thread and is either
  * a prefill: the sequences admitted since the last step run their (left-padded) prompts in one call
    with an empty cache; their caches are merged into the running batch (`service.engine.text.kvcache.merge`). The
    choices of one prompt (n, best_of: a `group`) are admitted together and prefilled as one row, whose cache
    rows are copied to each; or
  * a decode: every running sequence feeds its last sampled token; one token per sequence; then, while a long
    prompt that arrived during decoding is queued (longer than prefill_chunk), the next chunk of it, so that its
    prefill holds each step up by one chunk's time instead of the running rows waiting for all of it.
Finished and cancelled sequences leave the batch at the start of the next step, and columns that are
padding for every row are trimmed, so one long generation never holds up the others and a closed
stream frees its slot at once. The event-loop side only moves results to the waiting endpoints.

Sampling is service.engine.text.sampler's (one batched call per step); refusals and failures are the engine's own errors
(service.engine.engine_errors), which the edge answers with HTTP statuses.
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
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from models.generate import NonFiniteLogits, stop_match
from models.tokenizer import TextTokenizer
from service.base.health import Health
from service.base.metrics import Metrics
import service.engine.text.kvcache as kvcache
from service.engine.backends.base import Past, TextModel
from service.engine.engine_errors import EngineError, ModelFailed, QueueFull, ShuttingDown
from service.engine.text.sampler import ProcessorFailed, SamplingParams, TokenLogprobs, new_generator, sample, token_logprobs

log = logging.getLogger(__name__)
T = TypeVar("T")
STEPS_SLICE_S = 0.25  # longest run of decode steps before the worker hands back to the event loop
# Shortest time between two wake-ups of the event loop by the worker (service.scheduler._hand_off): each wake-up
# is a thread switch that, on busy cores, costs the worker its CPU (measured below in docs/BENCHMARKS.md); a model
# slower than this (the paper-size LM: 4-8 ms a step) still wakes the loop every step
HANDOFF_INTERVAL_S = 0.001  # the default (--stream-interval-ms)
HANDOFF_MAX_STEPS = 8  # ... or this many steps are queued: well under what a stream coalesces (MAX_BACKLOG)
# An idle model's first prefill waits for the rest of a burst of arrivals (_gather_burst): while submissions keep
# coming less than BURST_GAP_S apart, for at most BURST_MAX_S in all
BURST_GAP_S = 0.002
BURST_MAX_S = 0.02
# A prompt longer than this that arrives while other sequences decode is prefilled this many tokens a step, each
# chunk after a decode step of the running rows (the default of --prefill-chunk-tokens; 0: whole prompts)
PREFILL_CHUNK_TOKENS = 512


@dataclass(eq=False)
class GenSequence:
    """One prompt's generation as the endpoint sees it; the scheduler fills it in between steps."""

    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)  # text tokens so far (eos and a matched stop removed)
    generated: int = 0  # tokens sampled, eos included (the usage count)
    finish_reason: str | None = None  # "stop" | "length"
    error: EngineError | None = None
    cancelled: bool = False
    started: float | None = None  # prefill began
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # shared by the sequences of one request
    # Choices of one prompt (n, best_of) share a group: admitted together, prefilled once, the cache copied.
    group: object | None = None
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)  # one entry per token in `tokens`
    cumulative_logprob: float = 0.0  # of every sampled token (eos included): best_of's ranking
    prompt_logprobs: TokenLogprobs | None = None  # echo + logprobs: the prompt's (first token None)
    # len(tokens) after each step that reached the loop: a stream sends one event per step even when several
    # steps' results arrive before it runs (service.protocols.openai_api)
    steps: list[int] = field(default_factory=list)
    # ended by a stop string: the text between the kept tokens and the stop (the start of the token holding the
    # stop's first byte), so the text ends exactly before the stop as in vLLM (service.engine.text.detokenizer.stop_tail)
    stop_tail: bytes = b""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class _Row:
    """Thread-side state of one sequence in the batch."""

    seq: GenSequence
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    finish_reason: str | None = None
    error: str | None = None  # this sequence failed (its batch-mates go on)
    last: int = 0  # the sampled token not yet fed to the model
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    cumulative_logprob: float = 0.0
    prompt_logprobs: TokenLogprobs | None = None  # sent with the first update only
    stop_tail: bytes = b""  # text before a matched stop string inside the token that was removed with it
    reported: int = 0  # len(tokens) as the last update left it: the next update sends what changed after it

    @property
    def live(self) -> bool:
        return self.finish_reason is None and self.error is None and not self.seq.cancelled

    # what service.engine.text.sampler reads of a row
    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt(self) -> list[int]:
        return self.seq.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens  # every sampled token while the row is live (eos and a stop end it)

    banned: tuple[int, ...] = ()  # set by the scheduler before each draw


@dataclass
class _Update:
    """What one step changed of a row: its tokens from `start` on are `tail` (a step appends; a stop string may
    also cut tokens the loop already has), and so are its logprobs (`logprobs`, when wanted). Sending the change,
    not a copy of every token so far, keeps a step's cost flat in the length of the text."""

    row: _Row
    start: int
    tail: list[int]
    generated: int
    finish_reason: str | None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: TokenLogprobs | None = None

    @classmethod
    def of(cls, row: _Row, finish_reason: str | None, error: str | None = None,
           prompt_logprobs: TokenLogprobs | None = None) -> _Update:
        """The row's change since its last update (worker side)."""
        start = min(row.reported, len(row.tokens))
        row.reported = len(row.tokens)
        lps = row.logprobs.since(start) if row.seq.params.wants_logprobs else None
        return cls(row, start, row.tokens[start:], row.generated, finish_reason, error, lps, row.cumulative_logprob,
                   prompt_logprobs)


@dataclass(eq=False)
class _Chunked:
    """A long prompt being prefilled a chunk a step (the sequences of its group, which join the batch together
    after its last chunk): its cache so far and how many of its tokens that holds."""

    seqs: list[GenSequence]
    past: Past
    done: int = 0

    @property
    def prompt(self) -> list[int]:
        return self.seqs[0].prompt


def _as_torch(logits: Any) -> torch.Tensor:
    if isinstance(logits, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(logits))
    return logits.float().cpu()


def _for_sampler(logits: Any) -> torch.Tensor | np.ndarray:
    """A step's last logits (B, V) as the sampler takes them: an onnxruntime step's array as it is (the sampler's
    common path is numpy: no tensor made and read back; it makes one where it needs it), a tensor on the CPU."""
    return logits if isinstance(logits, np.ndarray) else _as_torch(logits)


def _groups(seqs: list[GenSequence]) -> list[list[GenSequence]]:
    """The sequences in runs of one prompt each (the choices of a group are admitted next to each other)."""
    out: list[list[GenSequence]] = []
    for s in seqs:
        if out and s.group is not None and out[-1][0].group is s.group:
            out[-1].append(s)
        else:
            out.append([s])
    return out


class TextScheduler:
    def __init__(
        self,
        model: str,
        backend: TextModel,
        tokenizer: TextTokenizer,
        context_length: int,
        executor: Executor,
        metrics: Metrics,
        max_running: int,
        max_waiting: int,
        output_function: str | None = None,
        handoff_interval_s: float = HANDOFF_INTERVAL_S,
        prefill_chunk: int = PREFILL_CHUNK_TOKENS,
    ) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk  # tokens a step of a long prompt arriving while rows decode (0: off)
        self.handoff_interval_s = handoff_interval_s
        self.output_function = output_function  # models.output_function: what sampling and logprobs draw on
        self.backend = backend
        self.tokenizer = tokenizer
        # a Hugging Face tokenizer may name several end ids (generation_config.json); any of them ends a sequence
        self.eos_ids: tuple[int, ...] = tuple(i for i in tokenizer.eos_ids if i is not None and i >= 0)
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
        # thread-side batch state
        self._rows: list[_Row] = []
        self._past: Past = []
        self._mask = np.zeros((0, 0), np.int64)
        self._chunked: deque[_Chunked] = deque()  # long prompts being prefilled a chunk a step, first come first
        self._layout = backend.cache_layout  # how the backend's cache rows are padded
        # prefill_prompts: model rows prefilled; burst_waits: idle prefills that waited for more arrivals
        # prefill_chunks: calls that prefilled a chunk of a long prompt (each also counts as a prefill)
        self.steps = {"prefill": 0, "decode": 0, "prefill_prompts": 0, "burst_waits": 0, "prefill_chunks": 0}
        self._submits = 0  # submit() calls so far (arrivals, whatever their number of sequences)
        self.health = Health()
        self._interrupt = False  # set by the loop side: new sequences, a cancellation, closing
        self._exclusive = 0  # stateless forwards (KServe) queued or running on the worker thread
        self._seq_seconds: float | None = None  # moving average of a sequence's time in the batch (Retry-After)
        self._last_wait = 0.0  # what the sequences admitted last waited (Retry-After follows the queued work)
        # steps' results on their way to the loop (worker appends, loop drains); one wake-up of the loop carries
        # every step finished since its last drain (_hand_off)
        self._handoff: deque[list[_Update]] = deque()
        self._drain_queued = False
        self._last_wake = 0.0
        # the children every step and sequence update touches, looked up once (a labels() call costs microseconds,
        # and the loop applies one update per sequence and step)
        self._decode_time = metrics.compute_time.labels(model, "decode")
        self._decode_batch = metrics.batch_size.labels(model, "decode")
        self._running_gauge = metrics.running.labels(model)
        self._waiting_gauge = metrics.waiting.labels(model)
        self._generation_tokens = metrics.generation_tokens.labels(model)
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)

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
        self._running_gauge.set(len(self._active))
        self._waiting_gauge.set(len(self._waiting))

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
            if not self._active and not self._waiting and not self._rows:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._active and self._waiting:
                await self._gather_burst()
            self._interrupt = False  # before admitting: a sequence submitted from now on interrupts the worker
            admitted = self._admit()
            now = time.perf_counter()
            if admitted:
                self._last_wait = max(now - seq.arrival for seq in admitted)
            for seq in admitted:
                seq.started = now
                self._active.add(seq)
                self.metrics.queue_time.labels(self.model).observe(now - seq.arrival)
            self._gauges()
            try:
                updates = await loop.run_in_executor(self.executor, self._steps, admitted, loop)
            except Exception as exc:
                self._drain()  # the steps that succeeded before it, in order
                log.exception("%s: generation step failed", self.model)
                self._fail(admitted or list(self._active), exc)
                continue
            self._drain()  # earlier steps first (normally drained already: their callback ran before this one)
            self._apply(updates)

    async def _gather_burst(self) -> None:
        """Before an idle model's prefill: let requests already being handled submit theirs (two loop turns), and
        if that brought more, keep waiting while submissions arrive less than BURST_GAP_S apart (at most
        BURST_MAX_S, or until the batch is full). Clients that start together (a load test, a fan-out) are then
        prefilled in one batch instead of two or three (16 streams got two prefills of 8); a lone request, which
        nothing follows within those turns, starts at once."""
        start, submits = time.perf_counter(), self._submits
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

    def _admit(self) -> list[GenSequence]:
        """Waiting sequences for the free slots; the choices of one prompt (a group) come in together, so their
        prompt is prefilled once (a group larger than the whole batch still runs, alone)."""
        admitted: list[GenSequence] = []
        while self._waiting:
            head = self._waiting[0]
            size = 1
            if head.group is not None:
                while size < len(self._waiting) and self._waiting[size].group is head.group:
                    size += 1
            busy = len(self._active) + len(admitted)
            if busy + size > self.max_running and (busy or size == 1):
                break
            admitted.extend(self._waiting.popleft() for _ in range(size))
        return admitted

    def _fail(self, seqs: list[GenSequence], exc: Exception) -> None:
        """A failed prefill fails the sequences it admitted; a failed decode fails the batch it ran."""
        error = ModelFailed(f"model failed during generation: {type(exc).__name__}")
        self.health.failed(error.message)
        failed = set(seqs)
        for seq in seqs:
            seq.error = error
            self._active.discard(seq)
            seq.changed.set()
        # drop their rows and chunked prompts (thread idle here: the step that failed has returned)
        self._keep_rows([i for i, r in enumerate(self._rows) if r.seq not in failed])
        self._chunked = deque(c for c in self._chunked if not failed.intersection(c.seqs))
        self._gauges()

    def _apply(self, updates: list[_Update]) -> None:
        now = time.perf_counter()
        generated = 0  # tokens of this step, counted once
        for u in updates:
            seq = u.row.seq
            if u.error is not None:
                self.health.failed(u.error)
                seq.error = ModelFailed(u.error)
                self._active.discard(seq)
                seq.changed.set()
                continue
            new = u.generated - seq.generated
            if new <= 0 and u.finish_reason is None and u.prompt_logprobs is None:
                continue
            if u.prompt_logprobs is not None:
                seq.prompt_logprobs = u.prompt_logprobs
            if u.logprobs is not None:
                seq.logprobs.truncate(u.start)
                seq.logprobs.chosen += u.logprobs.chosen
                seq.logprobs.top += u.logprobs.top
                seq.cumulative_logprob = u.cumulative_logprob
            self.health.succeeded()
            if new > 0:
                generated += new
                if seq.first_token is None:
                    seq.first_token = now
                    self._ttft.observe(now - seq.arrival)
                else:
                    self._itl.observe(now - (seq.last_token or now))
                seq.last_token = now
            del seq.tokens[u.start:]
            seq.tokens += u.tail
            seq.generated = u.generated
            seq.steps.append(len(seq.tokens))
            seq.stop_tail = u.row.stop_tail
            if u.finish_reason is not None:
                seq.finished = now
                seq.finish_reason = u.finish_reason
                self._active.discard(seq)
                if seq.started is not None:
                    took = now - seq.started
                    self._seq_seconds = took if self._seq_seconds is None else 0.9 * self._seq_seconds + 0.1 * took
                self.metrics.e2e.labels(self.model).observe(now - seq.arrival)
            seq.changed.set()
        if generated:
            self._generation_tokens.inc(generated)
        self._gauges()

    # ---- worker thread ---------------------------------------------------------------------------------

    @torch.inference_mode()  # once for the whole run of steps: entering it costs microseconds a step
    def _steps(self, admitted: list[GenSequence], loop: asyncio.AbstractEventLoop) -> list[_Update]:
        """One step, then more decode steps in a row while nothing needs the loop side (no new sequence, no
        cancellation, at most STEPS_SLICE_S): each step's results go to the loop without waiting for it, so a
        busy event loop (a flood of requests, even refused ones) delays the delivery of tokens, not their
        computation. Returns the last step's results."""
        updates = self._step(admitted)
        until = time.perf_counter() + STEPS_SLICE_S
        while not self._interrupt and time.perf_counter() < until and (any(r.live for r in self._rows)
                                                                         or self._chunked):
            self._hand_off(updates, loop)
            updates = self._step([])
        return updates

    def _hand_off(self, updates: list[_Update], loop: asyncio.AbstractEventLoop) -> None:
        """Queue a step's results for the loop, waking it only when no drain is queued yet and handoff_interval_s
        have passed since the last wake-up (or HANDOFF_MAX_STEPS steps wait). A wake-up (a write to the loop's
        self-pipe) switches threads: the loop takes the GIL and, on loaded cores, the worker's CPU (profiled on
        the demo model: up to 0.8 ms a wake-up, more than a step). A fast model now hands over several steps per
        wake-up, each still applied as its own step (one stream event per step); what is queued when the worker
        returns is drained by _run. Deque appends/pops and the flag are GIL-atomic; the loop clears the flag
        before draining, so nothing is left behind."""
        self._handoff.append(updates)
        now = time.perf_counter()
        due = now - self._last_wake >= self.handoff_interval_s or len(self._handoff) >= HANDOFF_MAX_STEPS
        if not self._drain_queued and due:
            self._drain_queued, self._last_wake = True, now
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._drain_queued = False
        while self._handoff:
            self._apply(self._handoff.popleft())

    def _keep_rows(self, keep: list[int]) -> None:
        """Only these rows of the batch stay (their cache rows and mask with them, in the order kvcache.remove_rows
        leaves them; the columns that became padding for all of them trimmed)."""
        if len(keep) == len(self._rows):
            return
        if keep:
            self._past, self._mask, order = kvcache.remove_rows(self._past, self._mask, keep, self._layout)
            self._rows = [self._rows[i] for i in order]
        else:
            self._rows, self._past, self._mask = [], [], np.zeros((0, 0), np.int64)

    def _step(self, admitted: list[GenSequence]) -> list[_Update]:
        """A prefill of the sequences just admitted (a long prompt among them, while rows decode, is queued to be
        prefilled in chunks), or a decode step of the running rows followed by the next chunk of a long prompt."""
        self._keep_rows([i for i, r in enumerate(self._rows) if r.live])
        if self._chunked:  # a long prompt all of whose sequences were cancelled is not prefilled further
            self._chunked = deque(c for c in self._chunked if not all(s.cancelled for s in c.seqs))
        admitted = [s for s in admitted if not s.cancelled]
        if admitted:
            admitted = self._queue_long(admitted)
            if admitted:
                return self._prefill_isolated(admitted)
        updates: list[_Update] = []
        if self._rows:
            try:
                updates = self._decode()
            except Exception:
                log.exception("%s: decode step of %d sequences failed; stepping them one by one", self.model,
                              len(self._rows))
                updates = self._decode_one_by_one()
        if self._chunked:
            updates += self._prefill_chunk()
        return updates

    def _queue_long(self, admitted: list[GenSequence]) -> list[GenSequence]:
        """Queue the groups whose prompt is longer than prefill_chunk to be prefilled a chunk a step, when rows
        are decoding (whose every step a whole long prefill would hold up; an idle model prefills it in one call)
        and no prompt logprobs are asked (they need every position's logits); the others, to prefill now."""
        if not self.prefill_chunk or not any(r.live for r in self._rows):
            return admitted
        now: list[GenSequence] = []
        for group in _groups(admitted):
            if len(group[0].prompt) > self.prefill_chunk and not any(s.params.prompt_logprobs for s in group):
                self._chunked.append(_Chunked(group, self.backend.empty_past(1)))
            else:
                now.extend(group)
        return now

    @torch.inference_mode()
    def _prefill_chunk(self) -> list[_Update]:
        """The next chunk of the first long prompt (the rest of it where no row decodes any more); after its last,
        its sequences join the batch. A chunk that fails fails its prompt's sequences alone."""
        start = time.perf_counter()
        c = self._chunked[0]
        prompt = c.prompt
        end = min(c.done + self.prefill_chunk, len(prompt)) if any(r.live for r in self._rows) else len(prompt)
        ids = np.array([prompt[c.done:end]], np.int64)
        mask = np.ones((1, end), np.int64)
        positions = np.arange(c.done, end, dtype=np.int64)[None]
        try:
            logits, c.past = self._run_prompts(ids, mask, positions, c.past, last_only=True)
            c.done = end
            updates = self._join(c.seqs, [0] * len(c.seqs), logits[:, -1], c.past, mask, [None]) \
                if end == len(prompt) else []
        except Exception as exc:
            self._chunked.popleft()
            log.warning("%s: a chunk of a %d-token prompt failed", self.model, len(prompt))
            return [self._failed(_Row(s, new_generator(0)), exc) for s in c.seqs]
        if end == len(prompt):
            self._chunked.popleft()
        self._prefilled(start, int(end == len(prompt)), len(ids[0]))
        self.steps["prefill_chunks"] += 1
        return updates

    def _prefill_isolated(self, seqs: list[GenSequence]) -> list[_Update]:
        """A prefill that fails is redone one sequence at a time: only the sequence that breaks it fails."""
        try:
            return self._prefill(seqs)
        except Exception as exc:
            if len(seqs) == 1:
                return [self._failed(_Row(seqs[0], new_generator(0)), exc)]
            log.exception("%s: prefill of %d sequences failed; prefilling them one by one", self.model, len(seqs))
        return [u for s in seqs for u in self._prefill_isolated([s])]

    @torch.inference_mode()
    def _decode_one_by_one(self) -> list[_Update]:
        """Each row's decode step on its own cache; the rows that succeed form the batch again."""
        updates: list[_Update] = []
        kept: list[tuple[_Row, Past, np.ndarray]] = []
        for i, row in enumerate(self._rows):
            past, mask = kvcache.select(self._past, self._mask, [i], self._layout)
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            try:
                logits, presents = self.backend.run_text(np.array([[row.last]], np.int64), mask,
                                                         mask[:, :-1].sum(axis=1, keepdims=True), past)
            except Exception as exc:
                updates.append(self._failed(row, exc))
                continue
            updates.extend(self._sample([row], _as_torch(logits[:, -1])))
            kept.append((row, presents, mask))
        self._rows = [row for row, _, _ in kept]
        self._past, self._mask = [], np.zeros((0, 0), np.int64)
        for n, (_, presents, mask) in enumerate(kept):
            self._past, self._mask = (presents, mask) if n == 0 else kvcache.merge(
                self._past, self._mask, presents, mask, self._layout)
        self.steps["decode"] += 1
        return updates

    @torch.inference_mode()
    def _prefill(self, seqs: list[GenSequence]) -> list[_Update]:
        start = time.perf_counter()
        # One model row per distinct prompt: the choices of a group share it, their caches are copies of its.
        first: dict[int, int] = {}
        unique: list[GenSequence] = []
        index: list[int] = []
        for s in seqs:
            key = id(s.group) if s.group is not None else id(s)
            if key not in first:
                first[key] = len(unique)
                unique.append(s)
            index.append(first[key])
        longest = max(len(s.prompt) for s in unique)
        ids = np.zeros((len(unique), longest), np.int64)  # the pad id is masked out: any id would do
        mask = np.zeros((len(unique), longest), np.int64)
        for i, s in enumerate(unique):
            ids[i, longest - len(s.prompt):] = s.prompt
            mask[i, longest - len(s.prompt):] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        past = self.backend.empty_past(len(unique))
        logits, presents = self._run_prompts(ids, mask, positions, past,
                                             last_only=not any(s.params.prompt_logprobs for s in unique))
        prompt_lps = [self._prompt_logprobs(s, logits[i]) if s.params.prompt_logprobs else None
                      for i, s in enumerate(unique)]
        updates = self._join(seqs, index, logits[:, -1], presents, mask, prompt_lps)
        self._prefilled(start, len(unique), sum(len(s.prompt) for s in unique))
        return updates

    def _run_prompts(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Past,
                     last_only: bool) -> tuple[Any, Past]:
        """A prefill call (or a chunk of one); with last_only, one row of logits per prompt where the backend can
        (keeps_last_logits: the LM head and SegLU over a whole prompt are wasted work), else T rows."""
        if last_only and self.backend.keeps_last_logits:
            return self.backend.run_text(ids, mask, positions, past, last_only=True)
        return self.backend.run_text(ids, mask, positions, past)

    def _join(self, seqs: list[GenSequence], index: list[int], last_logits: Any, presents: Past, mask: np.ndarray,
              prompt_lps: list[TokenLogprobs | None]) -> list[_Update]:
        """Prefilled prompts join the batch: each sequence's first token drawn from its prompt's (row index[i]
        of) last logits, the caches merged into the batch's."""
        last = _as_torch(last_logits)
        if len(set(index)) < len(seqs):  # copy the prefilled cache (and last logits) for every choice
            presents = kvcache.map_past(presents, lambda t: kvcache.take_rows(t, index))
            mask, last = mask[index], last[index]
        rows = [_Row(s, new_generator(s.params.seed), prompt_logprobs=prompt_lps[j])
                for s, j in zip(seqs, index, strict=True)]
        updates = self._sample(rows, last)
        if self._rows:
            self._past, self._mask = kvcache.merge(self._past, self._mask, presents, mask, self._layout)
        else:
            self._past, self._mask = presents, mask
        self._rows.extend(rows)
        self._reserve()
        return updates

    def _prefilled(self, start: float, prompts: int, tokens: int) -> None:
        """A prefill call's counts and metrics (a chunk's: prompts 0 until its last)."""
        self.steps["prefill"] += 1
        self.steps["prefill_prompts"] += prompts
        self.metrics.compute_time.labels(self.model, "prefill").observe(time.perf_counter() - start)
        self.metrics.batch_size.labels(self.model, "prefill").observe(max(prompts, 1))
        self.metrics.prompt_tokens.labels(self.model).inc(tokens)

    def _reserve(self) -> None:
        """Tell the backend how far the batch's cache may grow: its width now plus the most tokens a row may
        still generate (its max_tokens, the context), so a buffer that grows is sized once for the batch."""
        ahead = max((min(r.params.max_tokens - r.generated, self.context_length - len(r.seq.prompt) - r.generated)
                     for r in self._rows if r.live), default=0)
        self.backend.reserve(min(self._mask.shape[1] + max(ahead, 0), self.context_length))

    def _prompt_logprobs(self, seq: GenSequence, logits: Any) -> TokenLogprobs:
        """Logprobs of the prompt's tokens from the prefill's logits (T, V) of its (left-padded) row: the first
        token has none (nothing predicts it), as OpenAI's echo shows."""
        rows = _as_torch(logits)
        offset = rows.shape[0] - len(seq.prompt)
        if not bool(torch.isfinite(rows[offset:]).all()):  # no NaN into the JSON; the prefill is retried alone
            raise NonFiniteLogits("the model produced non-finite logits for this prompt")
        out = TokenLogprobs([None], [None])
        for j in range(1, len(seq.prompt)):
            chosen, top = token_logprobs(rows[offset + j - 1], seq.prompt[j], seq.params.logprobs or 0,
                                         self.output_function)
            out.chosen.append(chosen)
            out.top.append(top)
        return out

    def _decode(self) -> list[_Update]:
        start = time.perf_counter()
        ids = np.array([[r.last] for r in self._rows], np.int64)
        positions = self._mask.sum(axis=1, keepdims=True)  # real tokens so far = the new token's position
        mask = np.concatenate([self._mask, np.ones((len(self._rows), 1), np.int64)], axis=1)
        logits, self._past = self.backend.run_text(ids, mask, positions, self._past)
        self._mask = mask
        updates = self._sample(self._rows, _for_sampler(logits[:, -1]))
        self.steps["decode"] += 1
        self._decode_time.observe(time.perf_counter() - start)
        self._decode_batch.observe(len(self._rows))
        return updates

    def _sample(self, rows: list[_Row], logits: torch.Tensor | np.ndarray) -> list[_Update]:
        tok = self.tokenizer
        live = [i for i, row in enumerate(rows) if row.live]
        updates = []
        drawing = []
        for i in live:
            row = rows[i]
            if row.params.max_tokens == 0:  # echo + logprobs of the prompt alone: the prefill was the work
                row.finish_reason = "length"
                updates.append(_Update.of(row, "length", prompt_logprobs=row.prompt_logprobs))
                row.prompt_logprobs = None
                continue
            p = row.params
            row.banned = self.eos_ids if p.ignore_eos or row.generated < p.min_tokens else ()
            drawing.append(i)
        if not drawing:
            return updates
        batch = [rows[i] for i in drawing]
        tokens, errors = sample(logits[drawing] if len(drawing) < len(logits) else logits, batch,
                                self.output_function)
        for i, row, token, error in zip(drawing, batch, tokens, errors, strict=True):
            prompt_lps, row.prompt_logprobs = row.prompt_logprobs, None
            if error is not None:  # this row's numbers (or its processor) went bad: it ends, its batch-mates go on
                updates.append(self._failed(row, error))
                continue
            p = row.params
            row.last = token
            row.generated += 1
            if p.wants_logprobs:
                chosen, top = token_logprobs(_as_torch(logits[i]), token, p.logprobs or 0, self.output_function)
                row.cumulative_logprob += chosen
            if token in self.eos_ids:
                row.finish_reason = "stop"
            else:
                row.tokens.append(token)
                if p.wants_logprobs:
                    row.logprobs.chosen.append(chosen)
                    row.logprobs.top.append(top)
                # Stop strings count from min_tokens on (vLLM: no stop check before min_tokens).
                hit = stop_match(row.tokens, p.stop, tok) if row.generated >= p.min_tokens else None
                if hit is not None:
                    row.stop_tail = hit.tail
                    del row.tokens[hit.keep:]
                    row.logprobs.truncate(hit.keep)
                    row.finish_reason = "stop"
            if row.finish_reason is None and (row.generated >= p.max_tokens
                                              or len(row.seq.prompt) + row.generated >= self.context_length):
                row.finish_reason = "length"
            updates.append(_Update.of(row, row.finish_reason, prompt_logprobs=prompt_lps))
        return updates

    def _failed(self, row: _Row, exc: Exception) -> _Update:
        log.warning("%s: one sequence failed and leaves the batch: %s: %s", self.model, type(exc).__name__, exc)
        row.error = str(exc) if isinstance(exc, NonFiniteLogits | ProcessorFailed) else \
            f"model failed on this sequence: {type(exc).__name__}"
        return _Update.of(row, None, row.error)
