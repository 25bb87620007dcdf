"""Startup checks that a model's metadata describes what its backend really computes.

A label list one entry short, an image size the graph does not take, a vocabulary that is not the
logits' width: each would fail (or silently mislabel) every request, so the model is refused at
startup instead, with the mismatch named. Dimensions the backend leaves dynamic are not compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models import registry as architectures
from models.onnx_contract import LOGITS, PAST_PREFIX, PIXEL_VALUES
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
    cfg = entry.config
    vision = entry.kind == architectures.VISION
    if vision:
        assert entry.preprocessor is not None
        classes = len(entry.labels or [])
        if isinstance(cfg.get("num_classes"), int) and cfg["num_classes"] != classes:
            raise ValueError(f"{source}: {classes} labels for a model of {cfg['num_classes']} classes")
        if isinstance(cfg.get("in_chans"), int) and cfg["in_chans"] != entry.preprocessor.shape[0]:
            raise ValueError(f"{source}: preprocess gives {entry.preprocessor.shape[0]} channels, the model takes "
                             f"{cfg['in_chans']}")
    session = getattr(entry.backend, "session", None)
    if session is None:  # PyTorch: the config was checked against the weights; TensorRT: its engine decides
        return
    inputs = {i.name: _static(i.shape) for i in session.get_inputs()}
    outputs = {o.name: _static(o.shape) for o in session.get_outputs()}
    if vision:
        assert entry.preprocessor is not None
        _compare(source, f"input {PIXEL_VALUES}", inputs.get(PIXEL_VALUES, []), [None, *entry.preprocessor.shape])
        _compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, len(entry.labels or [])])
    else:
        _compare(source, f"output {LOGITS}", outputs.get(LOGITS, []), [None, None, int(cfg["vocab_size"])])
        n_head, n_embd = cfg.get("n_head"), cfg.get("n_embd")
        if isinstance(n_head, int) and isinstance(n_embd, int) and n_head > 0:
            for name, dims in inputs.items():
                if name.startswith(PAST_PREFIX):
                    _compare(source, f"input {name}", dims, [None, n_head, None, n_embd // n_head])


def check_context(entry: ModelEntry, source: str) -> None:
    """A text model's claimed context against its graph: one prompt of the full context must compute (and give
    finite logits). A file whose metadata claims more positions than its position table holds would otherwise
    load, then fail every long prompt with a 500 (and take the model's readiness with it)."""
    if entry.kind != architectures.TEXT or entry.details.get("format") == "huggingface-folder":
        return  # a Hugging Face folder's RoPE has no position table to run out of

    backend = entry.backend
    assert isinstance(backend, TextBackend)
    context, vocab = int(entry.config["block_size"]), int(entry.config["vocab_size"])
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
