"""The attention reweighting step of DeiT and GPT when it is one of models.reweighting's functions.

`AttentionFunction` holds the function's options (top-k's k, the length-scaled eps and m) and, for the
Gaussian and Laplacian, their learned per-head parameters: `offset` (phi, added to the row mean) and
`log_scale` (the scale is exp(log_scale) > 0, so training can never make it zero or negative). Under ONNX
export (inside models.multimax.onnx_export_params) each call is one `multimax::<Op>` node (with the mask)
or `<Op>NoMask` (without) carrying the contract's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from models import output_function
from models.multimax import ExportAttrs, _export_node
from models.onnx_contract import plugin_attrs
from models.reweighting import spec

# The configured functions that are NOT an AttentionFunction: the models' own MultiMax and plain softmax.
BUILTIN = ("multimax", "softmax")


class AttentionFunction(nn.Module):
    """scores (B, H, Tq, Tk) (+ additive mask) -> weights over the last axis, by the named function."""

    offset: Tensor
    log_scale: Tensor
    # A fused implementation, fn(name, scores, mask, **params) -> weights, that inference on CUDA calls instead
    # of the reference (set by plugins.torch_op.use_fused_kernels; None here: models never import plugins).
    fused: Callable[..., Tensor] | None = None

    def __init__(self, name: str, num_heads: int, options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.spec = spec(name)
        if self.spec.fn is None or name in BUILTIN:
            raise ValueError(f"{name} is not an AttentionFunction (the models implement it themselves)")
        self.name = name
        self.options = self.spec.check_options(options)
        if self.spec.params:
            # phi = 0 centres the window on the row mean; scale 1 = the scores' own unit
            self.offset = nn.Parameter(torch.zeros(num_heads))
            self.log_scale = nn.Parameter(torch.zeros(num_heads))

    def params(self) -> dict[str, Tensor]:
        """The function's keyword arguments: options, and offset/scale for the adaptive ones."""
        out: dict[str, Any] = dict(self.options)
        if self.spec.params:
            out["offset"], out["scale"] = self.offset, self.log_scale.exp()
        return out

    def onnx_attrs(self) -> ExportAttrs:
        """The node's attributes as Python values (read before tracing: the exporter traces with fake tensors)."""
        attrs: ExportAttrs = {}
        for key, value in self.params().items():
            attrs[key] = [float(v) for v in value.detach().reshape(-1).tolist()] if isinstance(value, Tensor) else value
        return attrs

    def forward(self, scores: Tensor, mask: Tensor | None = None) -> Tensor:
        frozen = vars(self).get("_onnx_attrs")
        if frozen is not None and torch.onnx.is_in_onnx_export():
            op = self.spec.op_types[0 if mask is not None else 1]
            return _export_node(op, scores, mask, {**frozen, **plugin_attrs(op)})
        if self.fused is not None and scores.is_cuda and not torch.is_grad_enabled():
            return self.fused(self.name, scores, mask, **self.params())
        half = scores.dtype in (torch.float16, torch.bfloat16)
        y = scores.float() if half else scores  # fp32 like the exported node
        fn = self.spec.fn
        assert fn is not None  # checked in __init__
        p = fn(y, None if mask is None else mask.to(y.dtype), -1, **self.params())
        return p.to(scores.dtype) if half else p

    def extra_repr(self) -> str:
        return ", ".join([self.name, *(f"{k}={v}" for k, v in self.options.items())])


def make_attention_function(
    name: str | None, num_heads: int, options: dict[str, Any] | None
) -> AttentionFunction | None:
    """The module for a config's `attention_function`, or None where the model's MultiMax/softmax path applies."""
    if name is None or name in BUILTIN:
        if options:
            raise ValueError(f"attention_options {sorted(options)} given but {name or 'multimax'} takes none")
        return None
    return AttentionFunction(name, num_heads, options)


# ---- config fields shared by DeiTConfig and GPTConfig ------------------------------------------------
# `attention_function` (None: MultiMax where `multimax_attention`, else softmax), `attention_options`
# (the function's hyperparameters, defaults filled in) and `output_function` (models.output_function). All are
# left out of `to_dict` when None, so
# configs (and the files exported from them) that predate them read and write exactly as before.
CONFIG_FIELDS = ("attention_function", "attention_options", "output_function")


def normalise_config(config: Any) -> None:
    """Validate and canonicalise a config's function fields in place (from its __post_init__).

    "multimax" and "softmax" become `multimax_attention` True/False with no `attention_function`, so the
    two spellings of one model give one config; the others switch `multimax_attention` off and get their
    options checked and completed.
    """
    output_function.normalise_config(config)
    name, options = config.attention_function, config.attention_options
    if name is None or name in BUILTIN:
        if options:
            raise ValueError(f"attention_options {sorted(options)} given but {name or 'multimax'} takes none")
        if name is not None:
            config.multimax_attention = name == "multimax"
        config.attention_function, config.attention_options = None, None
        return
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"attention_options must be an object, got {type(options).__name__}")
    config.attention_options = spec(name).check_options(options) or None  # ValueError for an unknown name
    config.multimax_attention = False


def config_dict(fields: dict[str, Any]) -> dict[str, Any]:
    """A config's to_dict: the function fields only where set."""
    return {k: v for k, v in fields.items() if k not in CONFIG_FIELDS or v is not None}


def function_name(config: Any) -> str:
    """The attention reweighting a model config uses: one of models.reweighting.FUNCTIONS."""
    return config.attention_function or ("multimax" if config.multimax_attention else "softmax")
