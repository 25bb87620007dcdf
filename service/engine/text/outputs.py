"""From a step's logits to each row's next token and what changed of it: the draw (service.engine.text.sampler),
end of sequence, stop strings, length, and the logprobs a request asked for."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from models.generate import NonFiniteLogits, stop_match
from models.tokenizer import TextTokenizer
from service.engine.text.sampler import ProcessorFailed, TokenLogprobs, sample, token_logprobs
from service.engine.text.sequence import GenSequence, Row, SequenceDelta

log = logging.getLogger(__name__)


def as_torch(logits: Any) -> torch.Tensor:
    """Host logits (`CachedDecoder.host_logits`: numpy or a CPU tensor) as a tensor, without a copy."""
    return torch.as_tensor(logits)


class OutputProcessor:
    def __init__(self, model: str, tokenizer: TextTokenizer, context_length: int,
                 output_function: str | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # a Hugging Face tokenizer may name several end ids (generation_config.json); any of them ends a sequence
        self.eos_ids: tuple[int, ...] = tuple(i for i in tokenizer.eos_ids if i is not None and i >= 0)
        self.context_length = context_length
        self.output_function = output_function  # models.output_function: what sampling and logprobs draw on

    def sample(self, rows: list[Row], logits: torch.Tensor | np.ndarray) -> list[SequenceDelta]:
        """Each live row's next token from its row of `logits` (B, V), and its delta."""
        deltas = []
        drawing = []
        for i, row in enumerate(rows):
            if not row.live:
                continue
            if row.params.max_tokens == 0:  # echo + logprobs of the prompt alone: the prefill was the work
                row.finish_reason = "length"
                deltas.append(SequenceDelta.of(row, "length", prompt_logprobs=row.prompt_logprobs))
                row.prompt_logprobs = None
                continue
            p = row.params
            row.banned = self.eos_ids if p.ignore_eos or row.generated < p.min_tokens else ()
            drawing.append(i)
        if not drawing:
            return deltas
        batch = [rows[i] for i in drawing]
        tokens, errors = sample(logits[drawing] if len(drawing) < len(logits) else logits, batch,
                                self.output_function)
        for i, row, token, error in zip(drawing, batch, tokens, errors, strict=True):
            prompt_lps, row.prompt_logprobs = row.prompt_logprobs, None
            if error is not None:  # this row's numbers (or its processor) went bad: it ends, its batch-mates go on
                deltas.append(self.failed(row, error))
                continue
            self._advance(row, token, logits[i])
            deltas.append(SequenceDelta.of(row, row.finish_reason, prompt_logprobs=prompt_lps))
        return deltas

    def _advance(self, row: Row, token: int, logits: Any) -> None:
        """The row takes its drawn token: eos, a stop string or the length may end it."""
        p = row.params
        row.last = token
        row.generated += 1
        if p.wants_logprobs:
            chosen, top = token_logprobs(as_torch(logits), token, p.logprobs or 0, self.output_function)
            row.cumulative_logprob += chosen
        if token in self.eos_ids:
            row.finish_reason = "stop"
        else:
            row.tokens.append(token)
            if p.wants_logprobs:
                row.logprobs.chosen.append(chosen)
                row.logprobs.top.append(top)
            # Stop strings count from min_tokens on (vLLM: no stop check before min_tokens).
            hit = stop_match(row.tokens, p.stop, self.tokenizer) if row.generated >= p.min_tokens else None
            if hit is not None:
                row.stop_tail = hit.tail
                del row.tokens[hit.keep:]
                row.logprobs.truncate(hit.keep)
                row.finish_reason = "stop"
        if row.finish_reason is None and (row.generated >= p.max_tokens
                                          or len(row.seq.prompt) + row.generated >= self.context_length):
            row.finish_reason = "length"

    def prompt_logprobs(self, seq: GenSequence, logits: Any) -> TokenLogprobs:
        """Logprobs of the prompt's tokens from the prefill's logits (T, V) of its (left-padded) row: the first
        token has none (nothing predicts it), as OpenAI's echo shows."""
        rows = as_torch(logits)
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

    def failed(self, row: Row, exc: Exception) -> SequenceDelta:
        """The row fails alone: its delta carries the error the client is shown."""
        log.warning("%s: one sequence failed and leaves the batch: %s: %s", self.model, type(exc).__name__, exc)
        row.error = str(exc) if isinstance(exc, NonFiniteLogits | ProcessorFailed) else \
            f"model failed on this sequence: {type(exc).__name__}"
        return SequenceDelta.of(row, None, row.error)
