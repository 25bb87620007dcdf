"""Warm-up: a model's first calls pay for lazy work (ONNX Runtime's allocation plans per input shape, PyTorch's
kernel selection and caching allocator, torch.compile's tracing), so a freshly loaded model runs representative
calls before it is marked ready and takes its first request.

Classification: one batch of every size bucket the batcher forms (powers of two up to --max-batch-size, and that
size). Generation: a prefill at a short and at a half-context prompt length, each followed by decode steps on its
KV cache, for one sequence and for a small batch. `--warmup-calls N` repeats each call N times; 0 turns it off.
"""

from __future__ import annotations

import numpy as np
import torch

from models.registry import VISION
from models.spec import TextSpec
from service.backends.base import TextBackend, VisionBackend
from service.config import Settings
from service.entry import ModelEntry

DECODE_STEPS = 4
SHORT_PROMPT = 16


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def prompt_lengths(context: int) -> list[int]:
    room = max(1, context - DECODE_STEPS)
    return sorted({min(SHORT_PROMPT, room), max(1, min(context // 2, room))})


def _vision(backend: VisionBackend, shape: tuple[int, ...], settings: Settings) -> int:
    rng = np.random.default_rng(0)
    calls = 0
    for size in batch_buckets(settings.max_batch_size):
        x = rng.standard_normal((size, *shape)).astype(np.float32)
        for _ in range(settings.warmup_calls):
            backend.run_vision(x)
            calls += 1
    return calls


@torch.inference_mode()
def _text(backend: TextBackend, context: int, vocab: int, settings: Settings) -> int:
    rng = np.random.default_rng(0)
    calls = 0
    for batch in sorted({1, min(4, settings.max_running_sequences)}):
        for length in prompt_lengths(context):
            for _ in range(settings.warmup_calls):
                ids = rng.integers(0, vocab, (batch, length), dtype=np.int64)
                mask = np.ones_like(ids)
                positions = np.cumsum(mask, axis=1) - 1
                _, past = backend.run_text(ids, mask, positions, backend.empty_past(batch))
                calls += 1
                for _ in range(min(DECODE_STEPS, context - length)):
                    positions = mask.sum(axis=1, keepdims=True)
                    mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
                    _, past = backend.run_text(rng.integers(0, vocab, (batch, 1), dtype=np.int64), mask, positions,
                                               past)
                    calls += 1
    return calls


def warm_up(entry: ModelEntry, settings: Settings) -> int:
    """Run the model's representative calls (on the calling thread); returns how many ran."""
    if settings.warmup_calls == 0:
        return 0
    if entry.kind == VISION:
        assert isinstance(entry.backend, VisionBackend) and entry.preprocessor is not None
        return _vision(entry.backend, entry.preprocessor.shape, settings)
    assert isinstance(entry.backend, TextBackend) and entry.context_length is not None
    assert isinstance(entry.spec, TextSpec)
    return _text(entry.backend, entry.context_length, entry.spec.vocab_size, settings)
