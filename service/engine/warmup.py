"""Warm-up: a model's first calls pay for lazy work (ONNX Runtime's allocation plans per input shape, PyTorch's
kernel selection and caching allocator, torch.compile's tracing), so a freshly loaded model runs representative
calls before it is marked ready and takes its first request.

Classification: one batch of every size bucket the batcher forms (powers of two up to --max-batch-size, and that
size). Generation: a prefill at a short and at a longer prompt length (half the context, at most LONG_PROMPT
tokens), each followed by decode steps on its KV cache, for one sequence and for a small batch (at most 2 rows on a
CPU, 4 elsewhere), the cheapest calls first. `--warmup-calls N` repeats each call N times; 0 turns it off.
`--warmup-budget-s` bounds it: once a model's warm-up has run that long, it starts no more calls (issue 50: 1,024-token
prompts at batch 4 through SmolLM2's 30 layers took minutes on 2 cores; the first requests then pay what was cut).
"""

from __future__ import annotations

import logging
import time

from service.base.config import Settings
from service.engine.entry import ModelEntry

log = logging.getLogger(__name__)

DECODE_STEPS = 4
SHORT_PROMPT = 16
# The longer prompt: a length past the prefill's small-shape paths, not the context's worst case (a Hugging Face
# model's context can be 32k+; half of it, batched, takes minutes on a CPU and tells the runtime nothing new).
LONG_PROMPT = 256
CPU_BATCH, BATCH = 2, 4


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def prompt_lengths(context: int) -> list[int]:
    room = max(1, context - DECODE_STEPS)
    return sorted({min(SHORT_PROMPT, room), max(1, min(context // 2, room, LONG_PROMPT))})


def warm_batches(provider: str, max_running: int) -> list[int]:
    """The batch sizes a text model warms up with: 1 and a small batch (smaller on a CPU, where rows cost time)."""
    on_cpu = "cuda" not in provider.lower() and "tensorrt" not in provider.lower()
    return sorted({1, min(CPU_BATCH if on_cpu else BATCH, max_running)})


class Budget:
    """How long a model's warm-up may go on starting calls (`--warmup-budget-s`; 0: no limit). A call is not
    started when the last one, scaled by its size (rows x tokens), would end past the budget: on a busy CPU one
    256-token prefill of SmolLM2 took 10 s, and starting it at second 9 doubled the warm-up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()
        self.last: tuple[float, int] | None = None  # (seconds, size) of the last call

    def ran(self, seconds: float, size: int) -> None:
        self.last = (seconds, max(1, size))

    def allows(self, size: int) -> bool:
        """Whether a call of `size` (rows x tokens) may start."""
        if self.seconds <= 0:
            return True
        expected = 0.0 if self.last is None else self.last[0] * size / self.last[1]
        return time.perf_counter() - self.start + expected < self.seconds


def warm_up(entry: ModelEntry, settings: Settings) -> int:
    """Run the model's representative calls (on the calling thread; its task's, service.engine.tasks); returns how many
    ran."""
    if settings.warmup_calls == 0:
        return 0
    return entry.served.warm_up(entry, settings)
