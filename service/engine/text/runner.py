"""Carries out a step's plan (service.engine.text.policy.StepPlan) on the batch: the model call, then the draw,
stops and logprobs (service.engine.text.outputs); returns each touched sequence's delta.

One prefill path: a plan's prompts run from an empty cache, left-padded into one call (a group's prompt once, its
cache copied to each choice), or one chunk of a long prompt over the cache of its earlier chunks; a prompt whose
last tokens ran joins the batch with its first token drawn. Failures stay with the sequences that cause them: a
prefill that fails is redone a prompt at a time, and a decode step that fails is redone row by row, each on its
own cache (the rows that succeed form the batch again).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from service.base.metrics import Metrics
from service.engine.backends.base import CachedDecoder, Past
from service.engine.text.batch import Batch
from service.engine.text.outputs import OutputProcessor
from service.engine.text.policy import PrefillPart, StepPlan, StepPolicy
from service.engine.text.sampler import TokenLogprobs, new_generator
from service.engine.text.sequence import Row, SequenceDelta

log = logging.getLogger(__name__)


class StepRunner:
    def __init__(self, model: str, backend: CachedDecoder, batch: Batch, outputs: OutputProcessor,
                 policy: StepPolicy, metrics: Metrics, steps: dict[str, int]) -> None:
        self.model = model
        self.backend = backend
        self.batch = batch
        self.outputs = outputs
        self.policy = policy
        self.metrics = metrics
        # prefill / decode: model calls; prefill_prompts: model rows prefilled; prefill_chunks: calls that
        # prefilled a chunk of a long prompt (each also counts as a prefill); burst_waits: the scheduler's
        self.steps = steps
        # the children every step touches, looked up once (a labels() call costs microseconds)
        self._decode_time = metrics.compute_time.labels(model, "decode")
        self._decode_batch = metrics.batch_size.labels(model, "decode")

    def run(self, plan: StepPlan) -> list[SequenceDelta]:
        if plan.prefill:
            return self._prefill_isolated(plan.prefill)
        if not plan.decode or not self.batch.rows:
            return []
        try:
            return self._decode()
        except Exception:
            log.exception("%s: decode step of %d sequences failed; stepping them one by one", self.model,
                          len(self.batch))
            return self._decode_one_by_one()

    # ---- prefill -------------------------------------------------------------------------------------------

    def _prefill_isolated(self, parts: list[PrefillPart]) -> list[SequenceDelta]:
        """A prefill that fails is redone a prompt at a time: only the prompt that breaks it fails (a chunk that
        fails fails its prompt: it leaves the queue)."""
        try:
            return self._prefill(parts)
        except Exception as exc:
            if len(parts) == 1:
                self.policy.drop(parts[0].work)
                if parts[0].work.chunked:
                    log.warning("%s: a chunk of a %d-token prompt failed", self.model, len(parts[0].work.prompt))
                return [self.outputs.failed(Row(s, new_generator(0)), exc) for s in parts[0].work.seqs]
            log.exception("%s: prefill of %d prompts failed; prefilling them one by one", self.model, len(parts))
        return [d for part in parts for d in self._prefill_isolated([part])]

    @torch.inference_mode()
    def _prefill(self, parts: list[PrefillPart]) -> list[SequenceDelta]:
        start = time.perf_counter()
        tokens = sum(p.end - p.work.done for p in parts)
        ids, mask, positions, past = self._prefill_inputs(parts)
        if past is None:
            past = self.backend.empty_past(len(parts))
        logits_all = any(p.work.wants_prompt_logprobs for p in parts)
        if not logits_all and self.backend.keeps_last_logits:  # the LM head over a whole prompt is wasted work
            logits, presents = self.backend.run_text(ids, mask, positions, past, last_only=True)
        else:
            logits, presents = self.backend.run_text(ids, mask, positions, past)
        deltas: list[SequenceDelta] = []
        if all(p.completes for p in parts):
            self._remember(parts, presents, mask)
            logits = self.backend.host_logits(logits)
            prompt_lps = [self._prompt_logprobs(p, logits[i]) for i, p in enumerate(parts)]
            deltas = self._join(parts, logits[:, -1], presents, mask, prompt_lps)
        for part in parts:
            if not part.completes:
                part.work.past = presents
            self.policy.prefilled(part)
        self._count_prefill(start, sum(p.completes for p in parts), tokens, parts[0].work.chunked)
        return deltas

    def _remember(self, parts: list[PrefillPart], presents: Past, mask: np.ndarray) -> None:
        """Prefilled prompts' caches into the prefix cache (before the batch takes the buffers over)."""
        cache = self.policy.prefix_cache
        if cache is None or not cache.budget:
            return
        for i, part in enumerate(parts):
            cache.store(part.work.prompt, presents, mask, i)

    @staticmethod
    def _prefill_inputs(parts: list[PrefillPart]) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
        """ids, mask, positions and past of a prefill call: one chunk over its prompt's cache, or whole prompts
        left-padded from an empty cache (None: the caller's empty past)."""
        if len(parts) == 1 and parts[0].work.past is not None:
            work, end = parts[0].work, parts[0].end
            ids = np.array([work.prompt[work.done:end]], np.int64)
            mask = np.ones((1, end), np.int64)
            positions = np.arange(work.done, end, dtype=np.int64)[None]
            return ids, mask, positions, work.past
        longest = max(p.end for p in parts)
        ids = np.zeros((len(parts), longest), np.int64)  # the pad id is masked out: any id would do
        mask = np.zeros((len(parts), longest), np.int64)
        for i, p in enumerate(parts):
            ids[i, longest - p.end:] = p.work.prompt[:p.end]
            mask[i, longest - p.end:] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        return ids, mask, positions, None

    def _prompt_logprobs(self, part: PrefillPart, logits: Any) -> TokenLogprobs | None:
        seq = part.work.seqs[0]
        return self.outputs.prompt_logprobs(seq, logits) if seq.params.prompt_logprobs else None

    def _join(self, parts: list[PrefillPart], last_logits: Any, presents: Past, mask: np.ndarray,
              prompt_lps: list[TokenLogprobs | None]) -> list[SequenceDelta]:
        """Prefilled prompts join the batch: each sequence's first token drawn from its prompt's last logits, the
        caches merged into the batch's (a group's row copied for each of its choices)."""
        source = [i for i, p in enumerate(parts) for _ in p.work.seqs]
        rows = [Row(s, new_generator(s.params.seed), prompt_logprobs=prompt_lps[i])
                for i, p in enumerate(parts) for s in p.work.seqs]
        last = last_logits[source] if len(source) > len(parts) else last_logits
        deltas = self.outputs.sample(rows, last)
        self.batch.join(rows, presents, mask, source)
        return deltas

    def _count_prefill(self, start: float, prompts: int, tokens: int, chunk: bool) -> None:
        """A prefill call's counts and metrics (a chunk's: prompts 0 until its last)."""
        self.steps["prefill"] += 1
        self.steps["prefill_prompts"] += prompts
        self.steps["prefill_chunks"] += int(chunk)
        self.metrics.compute_time.labels(self.model, "prefill").observe(time.perf_counter() - start)
        self.metrics.batch_size.labels(self.model, "prefill").observe(max(prompts, 1))
        self.metrics.prompt_tokens.labels(self.model).inc(tokens)

    # ---- decode ---------------------------------------------------------------------------------------------

    def _decode(self) -> list[SequenceDelta]:
        start = time.perf_counter()
        ids, mask, positions = self.batch.decode_inputs()
        logits, past = self.backend.run_text(ids, mask, positions, self.batch.past)
        self.batch.advanced(past, mask)
        deltas = self.outputs.sample(self.batch.rows, self.backend.host_logits(logits[:, -1]))
        self.steps["decode"] += 1
        self._decode_time.observe(time.perf_counter() - start)
        self._decode_batch.observe(len(self.batch))
        return deltas

    @torch.inference_mode()
    def _decode_one_by_one(self) -> list[SequenceDelta]:
        """Each row's decode step on its own cache; the rows that succeed form the batch again."""
        deltas: list[SequenceDelta] = []
        kept: list[tuple[Row, Past, np.ndarray]] = []
        for i, row in enumerate(self.batch.rows):
            past, mask = self.batch.row_cache(i)
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            try:
                logits, presents = self.backend.run_text(np.array([[row.last]], np.int64), mask,
                                                         mask[:, :-1].sum(axis=1, keepdims=True), past)
            except Exception as exc:
                deltas.append(self.outputs.failed(row, exc))
                continue
            deltas.extend(self.outputs.sample([row], self.backend.host_logits(logits[:, -1])))
            kept.append((row, presents, mask))
        self.batch.rebuild(kept)
        self.steps["decode"] += 1
        return deltas
