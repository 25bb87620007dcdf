"""Text generation as the server serves it: metadata validation, I/O and context checks, warm-up, runtime and
KServe codec, in one place (the `serve` part of models.tasks' text row)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from models import tasks
from models.onnx_contract import ATTENTION_MASK, INPUT_IDS, LOGITS, past_names
from models.spec import TEXT, TextSpec
from models.tokenizer import TextTokenizer, tokenizer_from_dict
from service.base.config import Settings
from service.base.kserve_codec import bad, exact_input, json_output_bytes, requested_outputs
from service.base.metrics import Metrics
from service.engine.backends.base import TextBackend
from service.engine.entry import InferCall, InferResult, ModelEntry, ModelRuntime, ServedTask, TaskModel
from service.engine.tasks.shapes import compare, session_shapes
from service.engine.text import TextScheduler
from service.engine.text.delivery import stream_interval_s
from service.engine.warmup import DECODE_STEPS, Budget, prompt_lengths, warm_batches

log = logging.getLogger(__name__)


def load(entry: ModelEntry, source: str) -> TextModel:
    """The entry as a text model: its tokenizer built from its metadata (a model folder comes with its own), and
    checked against the vocabulary."""
    spec, backend = entry.spec, entry.backend
    if not isinstance(spec, TextSpec) or not isinstance(backend, TextBackend):  # the registry chose it by both
        raise ValueError(f"{source}: a {spec.TASK} model on the {backend.kind} backend is no text generator")
    tokenizer = entry.tokenizer  # a model folder's, read from its tokenizer.json (service.engine.model_folders)
    if tokenizer is None:
        try:
            tokenizer = entry.tokenizer = tokenizer_from_dict(entry.tokenizer_entry or {})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: unusable tokenizer metadata: {exc}") from None
    # fewer tokens than the vocabulary is fine: an embedding padded past the tokenizer (Qwen2)
    if tokenizer.vocab_size > spec.vocab_size:
        what = "vocabulary" if entry.details else "vocabulary (config vocab_size)"
        raise ValueError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens, the model's {what} "
                         f"{spec.vocab_size}")
    return TextModel(entry, spec, backend, tokenizer)


class TextModel(TaskModel):
    """A text generator, loaded: its description, backend and tokenizer."""

    def __init__(self, entry: ModelEntry, spec: TextSpec, backend: TextBackend, tokenizer: TextTokenizer) -> None:
        super().__init__(entry)
        self.spec, self.backend, self.tokenizer = spec, backend, tokenizer

    def check_io(self, source: str) -> None:
        spec = self.spec
        shapes = session_shapes(self.backend)
        if shapes is not None:
            inputs, outputs = shapes
            compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, None, spec.vocab_size])
            for layer, pair in enumerate(past_names(spec.layers)):
                for name in (n for n in pair if n in inputs):
                    compare(source, f"input {name}", inputs[name], [None, spec.kv_heads[layer], None,
                                                                    spec.head_size])
        self.check_context(source)

    def check_context(self, source: str) -> None:
        """A text model's claimed context against its graph: a decode step at the context's last position (a zero
        cache of the positions before it) must compute and give finite logits. A file whose metadata claims more
        positions than its position table holds would otherwise load, then fail every long prompt with a 500 (and
        take the model's readiness with it). One step, not a whole-context prompt: that prefill of SmolLM2's export
        (8,192 tokens, 30 layers) took 156 s on a busy 2-core CPU, the step reads the same table row."""
        if self.entry.details.get("format") == "huggingface-folder":
            return  # a Hugging Face folder's RoPE has no position table to run out of
        context, vocab = self.spec.context_length, self.spec.vocab_size
        ids = np.array([[(context - 1) % vocab]], dtype=np.int64)
        mask = np.ones((1, context), dtype=np.int64)
        try:
            with torch.inference_mode():
                past = [(_zeros_like(k, context - 1), _zeros_like(v, context - 1))
                        for k, v in self.backend.empty_past(1)]
                logits, _ = self.backend.run_text(ids, mask, np.array([[context - 1]], dtype=np.int64), past)
                logits = np.asarray(logits.float().cpu() if isinstance(logits, torch.Tensor) else logits)
        except Exception as exc:  # whatever the runtime raises for an index out of its table
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ValueError(f"{source}: the metadata's context of {context} tokens does not fit the graph: a "
                             f"decode step at position {context - 1} fails ({first})") from None
        if logits.shape[:2] != (1, 1) or not np.isfinite(logits[0, -1]).all():
            raise ValueError(f"{source}: the metadata's context of {context} tokens does not fit the graph: a "
                             f"decode step at position {context - 1} gives logits of shape {list(logits.shape)}, or "
                             "not finite ones")

    @torch.inference_mode()
    def warm_up(self, settings: Settings) -> int:
        """A prefill at a short and at a longer prompt length, each followed by decode steps on its KV cache, for
        one sequence and for a small batch, cheapest first, until --warmup-budget-s is spent
        (service.engine.warmup)."""
        backend = self.backend
        context, vocab = self.spec.context_length, self.spec.vocab_size
        rng = np.random.default_rng(0)
        budget = Budget(settings.warmup_budget_s)
        calls = 0
        shapes = [(batch, length) for batch in warm_batches(str(backend.provider), settings.max_running_sequences)
                  for length in prompt_lengths(context) for _ in range(settings.warmup_calls)]
        for done, (batch, length) in enumerate(shapes):
            if done and not budget.allows(batch * length):  # the cheapest call always runs
                log.info("%s: warm-up stopped after %d of %d prefills: --warmup-budget-s %g", self.entry.name,
                         done, len(shapes), settings.warmup_budget_s)
                break
            ids = rng.integers(0, vocab, (batch, length), dtype=np.int64)
            mask = np.ones_like(ids)
            positions = np.cumsum(mask, axis=1) - 1
            started = time.perf_counter()
            _, past = backend.run_text(ids, mask, positions, backend.empty_past(batch))
            budget.ran(time.perf_counter() - started, batch * length)  # prefills only: a step's time is no rate
            calls += 1
            for _ in range(min(DECODE_STEPS, context - length)):
                if not budget.allows(batch):
                    break
                positions = mask.sum(axis=1, keepdims=True)
                mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
                _, past = backend.run_text(rng.integers(0, vocab, (batch, 1), dtype=np.int64), mask, positions, past)
                calls += 1
        return calls

    def runtime(self, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> TextRuntime:
        return TextRuntime(self, executor, settings, metrics)


class TextRuntime(ModelRuntime):
    """A text generator: requests' sequences join its continuous-batching decode loop."""

    TASK = TEXT

    def __init__(self, model: TextModel, executor: ThreadPoolExecutor, settings: Settings, metrics: Metrics) -> None:
        entry = model.entry
        super().__init__(entry, executor)
        self.backend = model.backend
        self.tokenizer = model.tokenizer
        self.context_length = model.spec.context_length
        self.vocab_size = self.tokenizer.vocab_size  # validated against the spec's at load
        self.scheduler = self.worker = TextScheduler(entry.name, self.backend, self.tokenizer, self.context_length,
                                                     executor, metrics, settings.max_running_sequences,
                                                     settings.max_waiting_sequences,
                                                     output_function=entry.config.get("output_function"),
                                                     handoff_interval_s=stream_interval_s(settings),
                                                     prefill_chunk=settings.prefill_chunk_tokens,
                                                     prefix_cache_bytes=int(settings.prefix_cache_mb * (1 << 20)))

    # ---- KServe V2: input_ids INT64 [n, T] (and attention_mask) -> logits FP32 [n, T, vocab] ----

    def kserve_io(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return ([{"name": INPUT_IDS, "datatype": "INT64", "shape": [-1, -1]},
                 {"name": ATTENTION_MASK, "datatype": "INT64", "shape": [-1, -1], "optional": True}],
                [{"name": LOGITS, "datatype": "FP32", "shape": [-1, -1, self.vocab_size]}])

    def check_infer_room(self) -> None:
        self.scheduler.check_exclusive_room()

    def kserve_call(self, header: dict[str, Any], tensors: dict[str, np.ndarray], settings: Settings) -> InferCall:
        """One stateless forward with an empty past, run on the model's thread between decode steps (it has no
        deadline of its own: the forwards' queue is bounded)."""
        ids, mask = self.kserve_decode(tensors, settings.max_batch_size)
        kserve_check_outputs(header, ids.shape[0], ids.shape[1], self.vocab_size,
                             settings.max_kserve_json_output_bytes)

        async def run(deadline: float) -> InferResult:
            arrived = time.perf_counter()
            started: list[float] = []

            def forward() -> np.ndarray:
                started.append(time.perf_counter())
                return self.backend.forward_stateless(ids, mask)

            logits = await self.scheduler.run_exclusive(forward)
            done = time.perf_counter()
            return InferResult(logits.astype(np.float32, copy=False), started[0] - arrived, done - started[0])

        return run

    def kserve_decode(self, tensors: dict[str, np.ndarray], max_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The request's input_ids and attention_mask, checked (one stateless forward takes them)."""
        extra = sorted(set(tensors) - {INPUT_IDS, ATTENTION_MASK})
        if extra:
            raise bad(f"unknown input(s) {', '.join(extra)} (model takes {INPUT_IDS}, {ATTENTION_MASK})")
        ids = exact_input(tensors, INPUT_IDS, "INT64")
        context, vocab = self.context_length, self.vocab_size
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise bad(f"input input_ids: shape {list(ids.shape)}, expected [n, T] with n, T >= 1")
        if ids.shape[0] > max_batch:
            raise bad(f"input input_ids: batch {ids.shape[0]} exceeds max_batch_size {max_batch}")
        if ids.shape[1] > context:
            raise bad(f"input input_ids: {ids.shape[1]} tokens exceed the context of {context}")
        if ids.min() < 0 or ids.max() >= vocab:
            raise bad(f"input input_ids: token ids must be in 0..{vocab - 1}")
        if ATTENTION_MASK in tensors:
            mask = exact_input(tensors, ATTENTION_MASK, "INT64")
            if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
                raise bad("input attention_mask: must be 0/1 with the shape of input_ids")
            if not mask[:, -1].all():
                raise bad("input attention_mask: padding goes on the left (the last position must be real)")
        else:
            mask = np.ones_like(ids)
        return np.ascontiguousarray(ids), np.ascontiguousarray(mask)


def _zeros_like(past: Any, length: int) -> Any:
    """A cache tensor of `past`'s type, dtype and shape with `length` positions (axis 2) of zeros."""
    shape = (*past.shape[:2], length, *past.shape[3:])
    if isinstance(past, torch.Tensor):
        return torch.zeros(shape, dtype=past.dtype, device=past.device)
    return np.zeros(shape, dtype=past.dtype)


def kserve_check_outputs(header: dict[str, Any], rows: int, tokens: int, vocab: int, max_json_bytes: int) -> None:
    """The outputs a text infer asks for, refused before the model runs: the classification extension (it ranks
    the classes of [n, classes] scores; a text model's logits are [n, T, vocab]), and logits as JSON of more than
    `max_json_bytes` (--max-kserve-json-output-bytes; [16, 256] ids of a 4,096-token vocabulary were 343 MB of
    JSON that took the event loop 8 s to write). Binary output (the binary-data extension) carries any size."""
    for name, params, binary in requested_outputs(header, [LOGITS]):
        if params.get("classification") is not None:
            raise bad(f"output {name}: the classification extension applies to image classification models; a "
                      f"text model's logits are [n, T, vocab] (ask for them without it)")
        size = json_output_bytes(rows * tokens * vocab)
        if not binary and size > max_json_bytes:
            raise bad(f"output {name}: [{rows}, {tokens}, {vocab}] logits as JSON may take {size} bytes, over the "
                      f"limit of {max_json_bytes} (max_kserve_json_output_bytes); ask for binary output "
                      '(parameters.binary_data: true on the output, or "binary_data_output": true on the request), '
                      "or send fewer tokens")


TASK = ServedTask(tasks.get(TEXT), TextBackend, load)
