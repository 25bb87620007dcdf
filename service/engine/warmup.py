"""Warm-up: a model's first calls pay for lazy work (ONNX Runtime's allocation plans per input shape, PyTorch's
kernel selection and caching allocator, torch.compile's tracing), so a freshly loaded model runs representative
calls before it is marked ready and takes its first request.

Classification: one batch of every size bucket the batcher forms (powers of two up to --max-batch-size, and that
size). Generation: a prefill at a short and at a half-context prompt length, each followed by decode steps on its
KV cache, for one sequence and for a small batch. `--warmup-calls N` repeats each call N times; 0 turns it off.
"""

from __future__ import annotations

from service.base.config import Settings
from service.engine.entry import ModelEntry

DECODE_STEPS = 4
SHORT_PROMPT = 16
LONG_PROMPT = 1024  # a Hugging Face model's context can be 32k+: half of it, batched, would take minutes on a CPU


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def prompt_lengths(context: int) -> list[int]:
    room = max(1, context - DECODE_STEPS)
    return sorted({min(SHORT_PROMPT, room), max(1, min(context // 2, room, LONG_PROMPT))})


def warm_up(entry: ModelEntry, settings: Settings) -> int:
    """Run the model's representative calls (on the calling thread; its task's, service.engine.tasks); returns how many
    ran."""
    if settings.warmup_calls == 0:
        return 0
    return entry.served.warm_up(entry, settings)
