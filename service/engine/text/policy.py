"""What the next step does: which waiting sequences join, when an idle model waits for more arrivals, and which
prompts are prefilled whole or a chunk a step. Decisions only, in plain objects (no arrays, no torch): the runner
(service.engine.text.runner) carries them out.

A step is either
  * a prefill of the prompts admitted since the last step, in one call with an empty cache (the choices of one
    prompt, n or best_of, are one group: one row, whose cache the runner copies to each), or
  * a decode step of every running row, followed (a second plan) by the next chunk of a long prompt that
    arrived while rows were decoding (longer than `chunk_tokens`): its prefill then holds each step up by one
    chunk's time, instead of the running rows waiting for all of it. A chunk is a prefill of part of a prompt
    over the cache of its earlier chunks: the runner has one prefill path for both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service.engine.backends.base import Past
from service.engine.text.prefix_cache import PrefixCache
from service.engine.text.sequence import GenSequence, groups

# An idle model's first prefill waits for the rest of a burst of arrivals (TextScheduler._gather_burst): while
# submissions keep coming less than BURST_GAP_S apart, for at most BURST_MAX_S in all
BURST_GAP_S = 0.002
BURST_MAX_S = 0.02
# ... and where idle starts have lately had such company, the first wait (one client's 16 requests reach the
# server up to a few milliseconds apart)
BURST_FIRST_S = 0.005
# A prompt longer than this that arrives while other sequences decode is prefilled this many tokens a step, each
# chunk after a decode step of the running rows (the default of --prefill-chunk-tokens; 0: whole prompts)
PREFILL_CHUNK_TOKENS = 512


@dataclass(eq=False)
class PromptWork:
    """A prompt being prefilled (the sequences of its group): how many of its tokens its cache holds (`done`) and,
    between the chunks of a long prompt, that cache."""

    seqs: list[GenSequence]
    done: int = 0
    past: Past | None = None
    chunked: bool = False  # prefilled a chunk a step (queued while rows decode)
    cached: int = 0  # of its tokens, how many the prefix cache held (`past` is a copy of their cache)

    @property
    def prompt(self) -> list[int]:
        return self.seqs[0].prompt

    @property
    def cancelled(self) -> bool:
        return all(s.cancelled for s in self.seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return any(s.params.prompt_logprobs for s in self.seqs)


@dataclass
class PrefillPart:
    """Tokens [work.done, end) of a prompt, in one prefill call."""

    work: PromptWork
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.work.prompt)


@dataclass
class StepPlan:
    """One model call: a prefill of `prefill` (all from an empty cache, or one chunk over its prompt's cache), or a
    decode step of the running rows."""

    prefill: list[PrefillPart] = field(default_factory=list)
    decode: bool = False


class StepPolicy:
    def __init__(self, max_running: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens  # tokens a step of a long prompt arriving while rows decode (0: off)
        # prompts prefilled over a cache of their own, a chunk a step, first come first: long prompts arriving
        # while rows decode, and prompts whose start the prefix cache holds
        self.chunked: deque[PromptWork] = deque()
        self.prefix_cache = prefix_cache

    def admit(self, waiting: deque[GenSequence], active: int) -> list[GenSequence]:
        """Waiting sequences for the free slots (taken from `waiting`); the choices of one prompt (a group) come in
        together, so their prompt is prefilled once (a group larger than the whole batch still runs, alone)."""
        admitted: list[GenSequence] = []
        while waiting:
            head = waiting[0]
            size = 1
            if head.group is not None:
                while size < len(waiting) and waiting[size].group is head.group:
                    size += 1
            busy = active + len(admitted)
            if busy + size > self.max_running and (busy or size == 1):
                break
            admitted.extend(waiting.popleft() for _ in range(size))
        return admitted

    def plan(self, admitted: list[GenSequence], decoding: bool) -> StepPlan:
        """The step for the sequences just admitted and the rows running (`decoding`: some are live): a prefill
        of the admitted (the long ones among them, while rows decode, queued to be prefilled in chunks), else a
        decode step."""
        self.chunked = deque(w for w in self.chunked if not w.cancelled)
        live = [s for s in admitted if not s.cancelled]
        parts = [PrefillPart(w, len(w.prompt)) for w in self._queue_long(groups(live), decoding)]
        if parts:
            return StepPlan(prefill=parts)
        return StepPlan(decode=decoding)

    def plan_chunk(self, decoding: bool) -> StepPlan:
        """After a decode step: the next chunk of the first long prompt (the rest of it where no row decodes any
        more), if one is queued."""
        if not self.chunked:
            return StepPlan()
        work = self.chunked[0]
        whole = not (decoding and self.chunk_tokens)
        end = len(work.prompt) if whole else min(work.done + self.chunk_tokens, len(work.prompt))
        return StepPlan(prefill=[PrefillPart(work, end)])

    def prefilled(self, part: PrefillPart) -> None:
        """A chunk ran: its prompt holds `end` tokens now; a prompt's last chunk (or a failed one) leaves the
        queue."""
        part.work.done = part.end
        if self.chunked and self.chunked[0] is part.work and part.completes:
            self.chunked.popleft()

    def drop(self, work: PromptWork) -> None:
        if work in self.chunked:
            self.chunked.remove(work)

    def forget(self, seqs: set[GenSequence]) -> None:
        """Failed sequences: their queued chunks are not prefilled."""
        self.chunked = deque(w for w in self.chunked if not seqs.intersection(w.seqs))

    def _queue_long(self, admitted: list[list[GenSequence]], decoding: bool) -> list[PromptWork]:
        """Queue to be prefilled over a cache of their own, one a step: the groups whose prompt starts with what
        the prefix cache holds (from there), and those whose prompt is longer than chunk_tokens when rows are
        decoding (whose every step a whole long prefill would hold up; an idle model prefills it in one call), a
        chunk a step; not those that ask for prompt logprobs (they need every position's logits). Returns the
        others, to prefill now in one call."""
        now = []
        for work in (PromptWork(group) for group in admitted):
            if work.wants_prompt_logprobs:
                now.append(work)
                continue
            if self.prefix_cache is not None:
                work.cached, work.past = self.prefix_cache.lookup(work.prompt)
                work.done = work.cached
            long = decoding and self.chunk_tokens and len(work.prompt) - work.done > self.chunk_tokens
            if long or work.cached:
                work.chunked = bool(long)
                self.chunked.append(work)
            else:
                now.append(work)
        return now
