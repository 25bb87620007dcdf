"""Startup checks that a model's metadata describes what its backend really computes.

A label list one entry short, an image size the graph does not take, a vocabulary that is not the
logits' width: each would fail (or silently mislabel) every request, so the model is refused at
startup instead, with the mismatch named. Dimensions the backend leaves dynamic are not compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.onnx_contract import LOGITS, PIXEL_VALUES, past_names
from models.spec import TextSpec, VisionSpec
from service.backends.base import TextBackend
from service.entry import ModelEntry


def _static(dims: Any) -> list[int | None]:
    return [d if isinstance(d, int) and d > 0 else None for d in (dims or [])]


def _shown(dims: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _compare(source: str, what: str, got: list[int | None], want: list[int | None]) -> None:
    if len(got) != len(want) or any(g is not None and w is not None and g != w
                                    for g, w in zip(got, want, strict=True)):
        raise ValueError(f"{source}: {what} has shape {_shown(got)}, the metadata says {_shown(want)}")


def check_io(entry: ModelEntry, source: str) -> None:
    spec = entry.spec
    if isinstance(spec, VisionSpec):
        assert entry.preprocessor is not None
        classes = len(entry.labels or [])
        if spec.classes != classes:
            raise ValueError(f"{source}: {classes} labels for a model of {spec.classes} classes")
        if spec.channels != entry.preprocessor.shape[0]:
            raise ValueError(f"{source}: preprocess gives {entry.preprocessor.shape[0]} channels, the model takes "
                             f"{spec.channels}")
    session = getattr(entry.backend, "session", None)
    if session is None:  # PyTorch: the config was checked against the weights; TensorRT: its engine decides
        return
    inputs = {i.name: _static(i.shape) for i in session.get_inputs()}
    outputs = {o.name: _static(o.shape) for o in session.get_outputs()}
    if isinstance(spec, VisionSpec):
        assert entry.preprocessor is not None
        _compare(source, f"input {PIXEL_VALUES}", inputs.get(PIXEL_VALUES, []), [None, *entry.preprocessor.shape])
        _compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, len(entry.labels or [])])
    else:
        _compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, None, spec.vocab_size])
        for layer, (key, value) in enumerate(past_names(spec.layers)):
            for name in (key, value):
                if name in inputs:
                    _compare(source, f"input {name}", inputs[name], [None, spec.kv_heads[layer], None, spec.head_size])


def check_context(entry: ModelEntry, source: str) -> None:
    """A text model's claimed context against its graph: one prompt of the full context must compute (and give
    finite logits). A file whose metadata claims more positions than its position table holds would otherwise
    load, then fail every long prompt with a 500 (and take the model's readiness with it)."""
    if not isinstance(entry.spec, TextSpec):
        return

    backend = entry.backend
    assert isinstance(backend, TextBackend)
    context, vocab = entry.spec.context_length, entry.spec.vocab_size
    ids = (np.arange(context, dtype=np.int64) % vocab)[None]
    mask = np.ones_like(ids)
    try:
        with torch.inference_mode():
            logits = backend.forward_stateless(ids, mask)
    except Exception as exc:  # whatever the runtime raises for an index out of its table
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ValueError(f"{source}: the metadata's context of {context} tokens does not fit the graph: a prompt "
                         f"of {context} tokens fails ({first})") from None
    if logits.shape[:2] != (1, context) or not np.isfinite(logits[0, -1]).all():
        raise ValueError(f"{source}: the metadata's context of {context} tokens does not fit the graph: a prompt "
                         f"of {context} tokens gives logits of shape {list(logits.shape)}, or not finite ones")
