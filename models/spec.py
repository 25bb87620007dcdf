"""What a model takes and gives, in words no architecture owns (in the spirit of timm's pretrained_cfg).

Each architecture's registration (`models.registry.Architecture.describe`) turns its own config into one of
these; export, validation, every backend, warm-up, the startup checks and the KServe endpoint read only this,
never a config field such as `n_head` or `img_size`. An ONNX file carries it under one metadata key
(`multimax.spec`, versioned, see `models.onnx_contract`); files written before it existed are described
from their legacy keys by `models.registry.read_spec`.

Labels, preprocessing and the tokenizer entry keep their own metadata keys (they are large, and older
servers read them there); the spec key holds the rest and the reader joins them. No torch import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

SPEC_VERSION = 1
Task = Literal["vision", "text"]
VISION: Task = "vision"
TEXT: Task = "text"
# the fields that live under their own metadata keys, not in the spec's JSON
SEPARATE_FIELDS = ("labels", "preprocess", "tokenizer")


class SpecError(ValueError):
    """A description that cannot be used (one line, naming the field)."""


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"spec {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Reweighting:
    """Where each reweighting function sits and its parameters.

    attention: the function over attention scores ("softmax", "multimax", "sparsemax", ...), used in
    `attention_layers` (the other layers use softmax); output: the output distribution over the logits.
    `variant` is MultiMax's (its learned parameters are weights of the graph); `options` the attention
    function's hyperparameters (top-k's k, length-scaled eps and m).
    """

    attention: str = "softmax"
    attention_layers: tuple[int, ...] = ()
    output: str = "softmax"
    variant: str | None = None
    options: Mapping[str, float] = field(default_factory=dict)

    @property
    def output_distribution(self) -> str | None:
        """The function a server applies to the logits instead of softmax (None: softmax; MultiMax's output is
        part of the graph, so its logits take softmax too)."""
        return None if self.output in ("softmax", "multimax") else self.output

    def to_dict(self) -> dict[str, Any]:
        return {"attention": self.attention, "attention_layers": list(self.attention_layers), "output": self.output,
                "variant": self.variant, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Reweighting:
        layers = d.get("attention_layers") or []
        if not isinstance(layers, list) or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise SpecError(f"spec reweighting attention_layers must be a list of layer indices, got {layers!r}")
        return cls(str(d.get("attention") or "softmax"), tuple(layers), str(d.get("output") or "softmax"),
                   d.get("variant"), dict(d.get("options") or {}))


@dataclass(frozen=True)
class VisionSpec:
    """An image classifier: pixel_values (batch, channels, image_size, image_size) -> logits (batch, classes)."""

    TASK: ClassVar[Task] = VISION
    channels: int
    image_size: int
    classes: int
    reweighting: Reweighting = field(default_factory=Reweighting)
    labels: tuple[str, ...] | None = None
    preprocess: Mapping[str, Any] | None = None  # mean, std, interpolation, crop (service.engine.vision.Preprocess)
    tokens: int | None = None  # tokens per image where the model has them (a budget for validation)

    def __post_init__(self) -> None:
        for name in ("channels", "image_size", "classes"):
            _positive(name, getattr(self, name))

    @property
    def task(self) -> Task:
        return self.TASK

    def to_dict(self) -> dict[str, Any]:
        """The spec's JSON (without the separately stored fields)."""
        return {"version": SPEC_VERSION, "task": VISION, "channels": self.channels, "image_size": self.image_size,
                "classes": self.classes, "tokens": self.tokens, "reweighting": self.reweighting.to_dict()}


@dataclass(frozen=True)
class TextSpec:
    """A causal decoder: input_ids, attention_mask, position_ids, per layer a past (batch, kv_heads[i], past,
    head_size) -> logits (batch, sequence, vocab_size) and the presents."""

    TASK: ClassVar[Task] = TEXT
    kv_heads: tuple[int, ...]  # key/value heads of each layer's cache (its length: the number of layers)
    head_size: int
    vocab_size: int
    context_length: int
    reweighting: Reweighting = field(default_factory=Reweighting)
    tokenizer: Mapping[str, Any] | None = None  # the tokenizer entry (models.tokenizer.tokenizer_from_dict)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if not self.kv_heads:
            raise SpecError("spec kv_heads must name the key/value heads of at least one layer")
        for heads in self.kv_heads:
            _positive("kv_heads", heads)
        for name in ("head_size", "vocab_size", "context_length"):
            _positive(name, getattr(self, name))

    @property
    def task(self) -> Task:
        return self.TASK

    @property
    def layers(self) -> int:
        return len(self.kv_heads)

    @property
    def tokenizer_kind(self) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.get("type"))

    def cache_shape(self, layer: int, batch: int, length: int = 0) -> tuple[int, int, int, int]:
        """One layer's key (or value) shape."""
        return batch, self.kv_heads[layer], length, self.head_size

    def to_dict(self) -> dict[str, Any]:
        return {"version": SPEC_VERSION, "task": TEXT, "kv_heads": list(self.kv_heads), "head_size": self.head_size,
                "vocab_size": self.vocab_size, "context_length": self.context_length,
                "tokenizer_kind": self.tokenizer_kind, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "pad_id": self.pad_id, "reweighting": self.reweighting.to_dict()}


ModelSpec = VisionSpec | TextSpec


def encode(spec: ModelSpec) -> str:
    return json.dumps(spec.to_dict())


def from_dict(d: Mapping[str, Any], labels: list[str] | None = None, preprocess: Mapping[str, Any] | None = None,
              tokenizer: Mapping[str, Any] | None = None) -> ModelSpec:
    """A spec from its JSON (and the separately stored fields); SpecError naming what is wrong."""
    if not isinstance(d, Mapping):
        raise SpecError(f"spec is a {type(d).__name__}, not an object")
    version = d.get("version")
    if version != SPEC_VERSION:
        raise SpecError(f"spec version {version!r} is not supported (this version reads {SPEC_VERSION})")
    reweighting = Reweighting.from_dict(d.get("reweighting") or {})
    try:
        if d.get("task") == VISION:
            return VisionSpec(d["channels"], d["image_size"], d["classes"], reweighting,
                              tuple(labels) if labels is not None else None, preprocess, d.get("tokens"))
        if d.get("task") == TEXT:
            kv = d["kv_heads"]
            if not isinstance(kv, list):
                raise SpecError(f"spec kv_heads must be a list, got {kv!r}")
            return TextSpec(tuple(kv), d["head_size"], d["vocab_size"], d["context_length"], reweighting,
                            tokenizer, d.get("bos_id"), d.get("eos_id"), d.get("pad_id"))
    except KeyError as exc:
        raise SpecError(f"spec has no {exc.args[0]}") from None
    raise SpecError(f"spec task {d.get('task')!r} is not one of {VISION!r}, {TEXT!r}")
