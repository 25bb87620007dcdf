"""One streamed event per decode step: what a sequence's new text is, step by step, for an SSE stream.

Why streams used to arrive bunched: the decode loop runs several steps in a row on the model's thread and hands
each step's result to the event loop (`call_soon_threadsafe`); when the model is faster than the loop gets the
GIL, several results are applied before the stream's task runs, and the stream sent everything new as one event
(2 to 31 events for 40 tokens on the demo model). Now each applied step is recorded (`GenSequence.steps`) and the
stream sends one event per step. Only a client slower than the model (a backlog of more than MAX_BACKLOG steps
while the stream was blocked writing) gets the backlog coalesced into one event.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.tokenizer import TextTokenizer
from service.engine.text import GenSequence, IncrementalDetokenizer

MAX_BACKLOG = 16  # more steps than this waiting: the client reads slower than the model writes


class StepReader:
    """The text events of one sequence since the last call (`pieces`), each a step's complete new text."""

    def __init__(self, seq: GenSequence, decode: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.detokenizer = decode
        self.consumed = 0  # of seq.steps

    def pieces(self) -> tuple[list[tuple[str, int]], bool]:
        """(events to send now: (text, generated tokens its text completes), whether the sequence has finished:
        the last event ends it).
        Empty texts of intermediate steps (a character not yet complete, text held back for a stop string) are
        dropped; the last one is kept when it is the finish."""
        seq = self.seq
        marks: Sequence[int] = seq.steps[self.consumed:]
        self.consumed = len(seq.steps)
        finished = seq.finish_reason is not None
        if len(marks) > MAX_BACKLOG:
            marks = marks[-1:]
        if not marks and finished:
            marks = [len(seq.tokens)]
        texts: list[tuple[str, int]] = []
        for k, mark in enumerate(marks):
            last = k == len(marks) - 1
            tokens = seq.tokens if last else seq.tokens[:mark]
            ends = finished and last
            text = self.detokenizer.step(tokens, final=ends, tail=seq.stop_tail.decode("utf-8", "replace") if ends
                                         else "")
            if text or (last and finished):
                texts.append((text, self.detokenizer.covered))
        return texts, finished

    @property
    def covered(self) -> int:
        """Generated tokens whose text has been sent."""
        return self.detokenizer.covered


def step_reader(tokenizer: TextTokenizer, seq: GenSequence) -> StepReader:
    """A sequence's stream of step texts, detokenized incrementally, stop strings held back."""
    stops = [b.decode("utf-8", errors="replace") for b in seq.params.stop]
    return StepReader(seq, IncrementalDetokenizer(tokenizer.decode, seq.prompt, stops, tokenizer.joins_next))
