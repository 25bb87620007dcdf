"""A sequence as the endpoint sees it (`GenSequence`), its state in the running batch (`Row`), and what one step
changed of it (`SequenceDelta`): the engine fills the first from the last, between steps."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from service.engine.engine_errors import EngineError
from service.engine.text.sampler import SamplingParams, TokenLogprobs


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
    # stop's first byte), so the text ends exactly before the stop as in vLLM (service.engine.text.detokenizer)
    stop_tail: bytes = b""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def groups(seqs: list[GenSequence]) -> list[list[GenSequence]]:
    """The sequences in runs of one prompt each (the choices of a group are admitted next to each other)."""
    out: list[list[GenSequence]] = []
    for s in seqs:
        if out and s.group is not None and out[-1][0].group is s.group:
            out[-1].append(s)
        else:
            out.append([s])
    return out


@dataclass(eq=False)
class Row:
    """Worker-side state of one sequence in the batch (what service.engine.text.sampler reads of a row, too)."""

    seq: GenSequence
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    finish_reason: str | None = None
    error: str | None = None  # this sequence failed (its batch-mates go on)
    last: int = 0  # the sampled token not yet fed to the model
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    cumulative_logprob: float = 0.0
    prompt_logprobs: TokenLogprobs | None = None  # sent with the first delta only
    stop_tail: bytes = b""  # text before a matched stop string inside the token that was removed with it
    reported: int = 0  # len(tokens) as the last delta left it: the next delta sends what changed after it
    banned: tuple[int, ...] = ()  # ids never drawn at the next draw (eos before min_tokens, ignore_eos)

    @property
    def live(self) -> bool:
        return self.finish_reason is None and self.error is None and not self.seq.cancelled

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt(self) -> list[int]:
        return self.seq.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens  # every sampled token while the row is live (eos and a stop end it)


@dataclass
class SequenceDelta:
    """What one step changed of a row: its tokens from `start` on are `tail` (a step appends; a stop string may
    also cut tokens the loop already has), and so are its logprobs (`logprobs`, when wanted). Sending the change,
    not a copy of every token so far, keeps a step's cost flat in the length of the text."""

    row: Row
    start: int
    tail: list[int]
    generated: int
    finish_reason: str | None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: TokenLogprobs | None = None

    @classmethod
    def of(cls, row: Row, finish_reason: str | None, error: str | None = None,
           prompt_logprobs: TokenLogprobs | None = None) -> SequenceDelta:
        """The row's change since its last delta (worker side)."""
        start = min(row.reported, len(row.tokens))
        row.reported = len(row.tokens)
        lps = row.logprobs.since(start) if row.seq.params.wants_logprobs else None
        return cls(row, start, row.tokens[start:], row.generated, finish_reason, error, lps, row.cumulative_logprob,
                   prompt_logprobs)
