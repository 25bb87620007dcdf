"""The contract of an exported MultiMax ONNX file: graph names, dynamic axes, custom domain, metadata.

The exporter writes it, validation checks it, every backend, the KServe endpoint, the model registry
and the TensorRT engine builder read it: they all spell it from here. No torch (and no onnx) import,
so the service and the engine builder can read a file's contract without loading PyTorch.

Vision graph:  pixel_values (batch, C, H, W) float32  ->  logits (batch, classes) float32
Text graph:    input_ids (batch, sequence), attention_mask (batch, total_sequence),
               position_ids (batch, sequence), past_key_values.{i}.key|value (batch, heads, past_sequence, head_dim)
               ->  logits (batch, sequence, vocab), present.{i}.key|value (batch, heads, total_sequence, head_dim)
Names as Optimum and onnxruntime-genai spell them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# ---- graph names ---------------------------------------------------------------------------------------
PIXEL_VALUES = "pixel_values"
LOGITS = "logits"
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
VISION_INPUT = PIXEL_VALUES
VISION_OUTPUT = LOGITS
TEXT_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
TEXT_OUTPUT = LOGITS
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."
KV = ("key", "value")

# ---- dynamic axes --------------------------------------------------------------------------------------
BATCH = "batch"
SEQUENCE = "sequence"
PAST_SEQUENCE = "past_sequence"
TOTAL_SEQUENCE = "total_sequence"

# ---- the MultiMax custom-op domain (one node per use; TensorRT plugins and onnxruntime ops by that name) --
ONNX_DOMAIN = "multimax"
# TensorRT's ONNX parser finds a plugin by the node's op type; `plugin_name` repeats it for tools that
# read the attribute, and `plugin_namespace` names the plugin's namespace for parsers that look it up.
PLUGIN_VERSION = "1"
PLUGIN_ATTRIBUTES = ("plugin_name", "plugin_version", "plugin_namespace")  # on every node, after its own


def plugin_attrs(op: str) -> dict[str, str]:
    """The TensorRT plugin attributes every custom-domain node carries (op: its op type)."""
    return dict(zip(PLUGIN_ATTRIBUTES, (op, PLUGIN_VERSION, ONNX_DOMAIN), strict=True))


# The other reweighting functions (issue 15, models.reweighting; contract: docs/REWEIGHTING.md): config name ->
# masked op type; each also has `<op>NoMask` with input (x) only. Every op reduces over the last axis in fp32.
REWEIGHTING_OPS: dict[str, str] = {
    "sparsemax": "SparseMax",
    "entmax15": "EntMax15",
    "evsoftmax": "EvSoftMax",
    "topk_softmax": "TopKSoftMax",
    "gaussian": "GaussianAttention",
    "laplacian": "LaplacianAttention",
    "length_scaled": "LengthScaledSoftMax",
}
# Node attributes per op (besides plugin_name/_version/_namespace): k int; offset, scale floats (length 1 or H);
# eps, m float (m = 0: m = sqrt(l)).
REWEIGHTING_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "SparseMax": (),
    "EntMax15": (),
    "EvSoftMax": (),
    "TopKSoftMax": ("k",),
    "GaussianAttention": ("offset", "scale"),
    "LaplacianAttention": ("offset", "scale"),
    "LengthScaledSoftMax": ("eps", "m"),
}
# An entry is masked iff its additive mask is <= this (any such bias already gives softmax weight 0 in fp32).
MASKED_BELOW = -1e4
# Which reweighting function a model uses: stored in its config (`attention_function`; absent: MultiMax where
# `multimax_attention`, else softmax).
ATTENTION_FUNCTION = "attention_function"


# MultiMax's ops (models.multimax): the attention step `MultiMax(x, mask)` / `MultiMaxNoMask(x)` like every function,
# and `MultiMaxSigma(x)`, the modulation alone (output layers). Its attributes: the 8 learned parameters, the order.
MULTIMAX_OP = "MultiMax"
MULTIMAX_SIGMA_OP = "MultiMaxSigma"
MULTIMAX_ATTRIBUTES = ("ranges", "ts", "order")
NO_MASK = "NoMask"  # the op type without the mask input is the masked one's plus this
# The whole family of reweighting functions with custom ops, MultiMax first (plugins.family describes each member):
# config name -> masked op type, and op type -> node attributes.
FAMILY_OPS: dict[str, str] = {"multimax": MULTIMAX_OP, **REWEIGHTING_OPS}
FAMILY_ATTRIBUTES: dict[str, tuple[str, ...]] = {MULTIMAX_OP: MULTIMAX_ATTRIBUTES, **REWEIGHTING_ATTRIBUTES}


def multimax_op_types() -> tuple[str, ...]:
    """MultiMax's three op types: masked, NoMask and the modulation alone."""
    return MULTIMAX_OP, MULTIMAX_OP + NO_MASK, MULTIMAX_SIGMA_OP


def reweighting_op_types() -> tuple[str, ...]:
    """Every op type of the other reweighting functions, masked and NoMask."""
    return tuple(t for op in REWEIGHTING_OPS.values() for t in (op, op + "NoMask"))


def attention_function(config: Mapping[str, Any]) -> str:
    """The attention reweighting a config dict (a checkpoint's or a file's metadata) uses."""
    name = config.get(ATTENTION_FUNCTION)
    if name:
        return str(name)
    return "multimax" if config.get("multimax_attention", True) else "softmax"


def output_function(config: Mapping[str, Any]) -> str:
    """The output distribution a config dict uses: its `output_function`, else MultiMax or softmax."""
    name = config.get("output_function")
    if name:
        return str(name)
    return "multimax" if config.get("multimax_output", True) else "softmax"


def past_names(n_layer: int) -> list[tuple[str, str]]:
    """(key, value) input names per layer."""
    return [(f"{PAST_PREFIX}{i}.key", f"{PAST_PREFIX}{i}.value") for i in range(n_layer)]


def present_names(n_layer: int) -> list[str]:
    """Output names of the new cache, flat: present.0.key, present.0.value, present.1.key, ..."""
    return [f"{PRESENT_PREFIX}{i}.{kv}" for i in range(n_layer) for kv in KV]


def text_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    """Input and output names of the decoder graph, in graph order."""
    return [*TEXT_INPUTS, *(n for pair in past_names(n_layer) for n in pair)], [TEXT_OUTPUT, *present_names(n_layer)]


def text_feeds(
    input_ids: Any, attention_mask: Any, position_ids: Any, past: Iterable[tuple[Any, Any]]
) -> dict[str, Any]:
    """The decoder graph's inputs by name, for arrays of any type (numpy for onnxruntime)."""
    feeds = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, POSITION_IDS: position_ids}
    for i, (k, v) in enumerate(past):
        feeds[f"{PAST_PREFIX}{i}.key"], feeds[f"{PAST_PREFIX}{i}.value"] = k, v
    return feeds


# ---- metadata_props ------------------------------------------------------------------------------------
META_PREFIX = "multimax."
FORMAT = "multimax-onnx/1"
# field -> what it holds (each stored as JSON under "multimax.<field>")
META_FIELDS = ("format", "arch", "config", "placement", "precision", "labels", "preprocess", "tokenizer", "exporter")


def meta_key(name: str) -> str:
    """The metadata_props key of a field: "config" -> "multimax.config"."""
    if name not in META_FIELDS:
        raise KeyError(f"unknown multimax metadata field {name!r} (known: {', '.join(META_FIELDS)})")
    return META_PREFIX + name


@dataclass(frozen=True)
class OnnxMetadata:
    """What the exporter stores in a file's `multimax.*` metadata_props, decoded."""

    arch: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    labels: list[str] | None = None
    preprocess: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    placement: dict[str, Any] | None = None
    precision: str | None = None
    exporter: dict[str, Any] | None = None
    format: str | None = None

    def encode(self) -> dict[str, str]:
        """metadata_props key -> JSON value, the fields that are set."""
        values = {name: getattr(self, name) for name in META_FIELDS}
        values["config"] = self.config or None
        return {meta_key(k): json.dumps(v) for k, v in values.items() if v is not None}

    def as_dict(self) -> dict[str, Any]:
        """Field -> value without the prefix (what the server's registry and /v1/models work with)."""
        return {name: getattr(self, name) for name in META_FIELDS if getattr(self, name) not in (None, {})}

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> OnnxMetadata:
        """From field -> value (a sidecar JSON, a checkpoint's fields); unknown fields are ignored."""
        known = {k: v for k, v in fields.items() if k in META_FIELDS}
        if not isinstance(known.get("config") or {}, dict):
            raise ValueError(f"metadata config is a {type(known['config']).__name__}, not an object")
        known["config"] = dict(known.get("config") or {})
        if known.get("arch") is not None:
            known["arch"] = str(known["arch"])
        return cls(**known)


def decode_props(props: Iterable[tuple[str, str]] | Mapping[str, str]) -> dict[str, Any]:
    """Every `multimax.*` entry of metadata_props, JSON-decoded (a value that is not JSON stays a string)."""
    items = props.items() if isinstance(props, Mapping) else props
    out: dict[str, Any] = {}
    for key, value in items:
        if key.startswith(META_PREFIX):
            try:
                out[key.removeprefix(META_PREFIX)] = json.loads(value)
            except json.JSONDecodeError:
                out[key.removeprefix(META_PREFIX)] = value
    return out


def read_metadata(props: Iterable[tuple[str, str]] | Mapping[str, str]) -> OnnxMetadata:
    """The typed metadata of a file from its metadata_props (an onnx ModelProto's as (key, value) pairs, or
    onnxruntime's `custom_metadata_map`)."""
    return OnnxMetadata.from_dict(decode_props(props))


def proto_props(proto: Any) -> list[tuple[str, str]]:
    """(key, value) pairs of an onnx ModelProto's metadata_props (duck-typed: onnx is not imported here)."""
    return [(p.key, p.value) for p in proto.metadata_props]
