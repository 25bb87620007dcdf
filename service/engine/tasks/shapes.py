"""Startup checks that a model's description matches what its backend really computes: the shared comparison.

A label list one entry short, an image size the graph does not take, a vocabulary that is not the logits'
width: each would fail (or silently mislabel) every request, so the model is refused at startup instead, with
the mismatch named. Dimensions the backend leaves dynamic are not compared.
"""

from __future__ import annotations

from typing import Any

from service.engine.backends.base import Backend


def session_shapes(backend: Backend) -> tuple[dict[str, list[int | None]], dict[str, list[int | None]]] | None:
    """(inputs, outputs) name -> static dims of an onnxruntime session's graph; None for a backend without one
    (PyTorch: its config was checked against the weights; TensorRT: its engine decides)."""
    session = backend.session
    if session is None:
        return None
    return ({i.name: static(i.shape) for i in session.get_inputs()},
            {o.name: static(o.shape) for o in session.get_outputs()})


def static(dims: Any) -> list[int | None]:
    return [d if isinstance(d, int) and d > 0 else None for d in (dims or [])]


def _shown(dims: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def compare(source: str, what: str, got: list[int | None], want: list[int | None]) -> None:
    if len(got) != len(want) or any(g is not None and w is not None and g != w
                                    for g, w in zip(got, want, strict=True)):
        raise ValueError(f"{source}: {what} has shape {_shown(got)}, the metadata says {_shown(want)}")
