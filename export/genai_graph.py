"""A text model as a shared-buffer decoder graph: what onnxruntime-genai runs with `past_present_share_buffer: true`.

Same names as the single-file export (models.onnx_contract), but each layer's attention is one node that
writes the new keys/values into the cache buffer and attends over its first `total_sequence` positions. The
model's own forward is traced with its attention hook (models.attention_hook): the architecture does
everything up to the node (projections, RoPE, q/k norm) and after it; the node is
- softmax attention: `com.microsoft::GroupQueryAttention` (onnxruntime's kernel, with the model's key/value
  heads; seqlens_k and total_sequence_length come from the attention mask, as onnxruntime-genai's own model
  builder does; RoPE stays in the traced graph, exactly the model's, so the node's do_rotary is not used);
- MultiMax attention: `multimax::MultiMaxAttention` (plugins/onnx_attention.py: a portable function body,
  fused and in place with plugins.ort_ops; grouped key/value heads too).
past_key_values.{i}.* is (batch, kv_heads, max_sequence, head_dim) and present.{i}.* the same buffer, so a
decode step copies nothing whatever the context. Without a shared buffer (past = exactly the past) the graph
returns present = past ++ new, like the single-file export.

fp16: the model runs in fp16 with an fp16 cache; MultiMaxAttention is an fp32 kernel, and onnxruntime-genai
allocates every layer's cache in one dtype, so a model with MultiMax attention in any layer keeps an fp32 cache
and runs all its attention nodes in fp32 (inputs cast up, outputs down); the logits are float32 either way.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from torch import nn

from export.genai_fusions import fuse_decoder, fusion_metadata
from export.onnx_export import DEFAULT_OPSET, ExportError, _finish, _trace, text_spec_of
from export.precision import DTYPES, Precision
from models import onnx_contract as contract
from models.attention_hook import KV, AttentionLayer
from models.checkpoint import Checkpoint
from models.multimax import ExportAttrs
from models.onnx_contract import plugin_attrs, text_io_names
from models.registry import TextModel
from models.spec import TextSpec
from plugins.onnx_attention import OP as ATTENTION_OP
from plugins.onnx_attention import attention_function_proto

GQA = "com.microsoft::GroupQueryAttention"
MULTIMAX_ATTENTION = f"{contract.ONNX_DOMAIN}::{ATTENTION_OP}"


def attention_kind(spec: TextSpec, layers: list[AttentionLayer]) -> str:
    """"softmax" or "multimax": the attentions this export has a shared-buffer node for (else ExportError), from
    the model's description (models.spec: sizes are read there, never from its config) and its attention layers."""
    rw = spec.reweighting
    if rw.output not in ("softmax", "multimax"):  # onnxruntime-genai samples from softmax(logits)
        raise ExportError(f"the onnxruntime-genai folder export serves softmax (or MultiMax) outputs, not "
                          f"{rw.output!r}; export it to a single .onnx file instead")
    if rw.attention not in ("softmax", "multimax"):
        raise ExportError(f"the onnxruntime-genai folder export supports softmax and MultiMax attention, not "
                          f"{rw.attention!r}; export it to a single .onnx file instead")
    return "multimax" if any(a.multimax for a in layers) else "softmax"


def cache_dtype(layers: list[AttentionLayer], precision: Precision) -> torch.dtype:
    """Every layer's cache dtype: the model's, but fp32 where any layer is MultiMaxAttention (an fp32 kernel;
    onnxruntime-genai gives all layers one cache dtype)."""
    return torch.float32 if any(a.multimax is not None for a in layers) else DTYPES[precision]


def _multimax_attrs(layer: AttentionLayer) -> ExportAttrs:
    assert layer.multimax is not None
    mm = layer.multimax
    return {"num_heads": layer.num_heads, "kv_num_heads": layer.kv_heads, "scale": layer.scale,
            "ranges": list(mm.ranges), "ts": list(mm.ts), "order": mm.order, **plugin_attrs(ATTENTION_OP)}


class _SharedCacheDecoder(nn.Module):
    """The model's forward with one attention node per layer (traced only: the nodes have no PyTorch kernel)."""

    def __init__(self, model: TextModel, layers: list[AttentionLayer], precision: Precision) -> None:
        super().__init__()
        self.model = model
        self.precision = precision
        self.layers = layers  # read before tracing (the exporter's parameters are fake tensors); checked by the caller
        self.cache_dtype = cache_dtype(layers, precision)

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: KV | None,
                mask: torch.Tensor | None, seqlens: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, KV]:
        assert past is not None and mask is not None
        layer = self.layers[i]
        dtype = q.dtype
        q, k, v = q.to(self.cache_dtype), k.to(self.cache_dtype), v.to(self.cache_dtype)
        if layer.multimax is None:
            attrs: ExportAttrs = {"num_heads": layer.num_heads, "kv_num_heads": layer.kv_heads, "scale": layer.scale}
            inputs = [q, k, v, past[0], past[1], seqlens, total]
            shapes = [q.shape, past[0].shape, past[1].shape]
            out = torch.onnx.ops.symbolic_multi_out(GQA, inputs, attrs, dtypes=[self.cache_dtype] * 3, shapes=shapes,
                                                    version=1)
            return out[0].to(dtype), (out[1], out[2])
        inputs = [q, k, v, past[0], past[1], mask]
        shapes = [q.shape, past[0].shape, past[1].shape]
        out = torch.onnx.ops.symbolic_multi_out(MULTIMAX_ATTENTION, inputs, _multimax_attrs(layer),
                                                dtypes=[torch.float32] * 3, shapes=shapes, version=1)
        return out[0].to(dtype), (out[1], out[2])

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, past_key_values: list
    ) -> tuple[torch.Tensor, list]:
        # GroupQueryAttention's lengths: real tokens per row - 1, and the total length (onnxruntime-genai's convention)
        seqlens = (attention_mask.sum(-1) - 1).to(torch.int32)
        total = torch.ones_like(attention_mask[0]).sum().to(torch.int32)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: KV | None,
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
            return self._attend(i, q, k, v, past, mask, seqlens, total)

        logits, presents = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                      past_key_values=past_key_values, attend=attend)
        return logits.float(), presents


def export_genai_text(model: TextModel, ckpt: Checkpoint, out: Path, opset: int = DEFAULT_OPSET,
                      verbose: bool = False, precision: Precision = "fp32", spec: TextSpec | None = None,
                      layers: list[AttentionLayer] | None = None, fuse: bool = True, int4: bool = False) -> Path:
    """Export the shared-buffer decoder graph to `out`, atomically, with every function body attached
    (precision fp32 or fp16), its small nodes fused where `fuse` (export.genai_fusions); `int4`: the fp32 graph's
    weight MatMuls quantized (export.genai_quantize) before it is written.

    `spec` (the checkpoint's description) and `layers` (the model's `attention_layers()`): what the caller computed
    for this export (export.genai_folder), else computed here. fp16 traces a copy in fp16, whose layers are its own
    (its MultiMax parameters in fp16)."""
    spec = spec or text_spec_of(ckpt)
    model = model.eval()
    if DTYPES[precision] != torch.float32:
        model = copy.deepcopy(model).to(DTYPES[precision])
        layers = model.attention_layers()  # the traced copy's: its MultiMax parameters in its dtype
    elif layers is None:
        layers = model.attention_layers()
    attention_kind(spec, layers)  # refuses what has no node
    dtype = cache_dtype(layers, precision)
    batch, past_len, new, buffer = 2, 3, 4, 9  # buffer > past + new: the shape a shared buffer has
    ids = torch.randint(0, spec.vocab_size, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    positions = torch.arange(past_len, past_len + new).expand(batch, new).contiguous()
    past = [tuple(torch.randn(batch, a.kv_heads, buffer, a.head_dim, dtype=dtype) for _ in range(2)) for a in layers]
    b = torch.export.Dim(contract.BATCH, min=1, max=4096)
    t = torch.export.Dim(contract.SEQUENCE, min=1, max=spec.context_length)
    m = torch.export.Dim(contract.PAST_SEQUENCE, min=0, max=2 * spec.context_length)
    total = torch.export.Dim(contract.TOTAL_SEQUENCE, min=1, max=2 * spec.context_length)
    dynamic = {
        contract.INPUT_IDS: {0: b, 1: t},
        contract.ATTENTION_MASK: {0: b, 1: total},
        contract.POSITION_IDS: {0: b, 1: t},
        "past_key_values": [({0: b, 2: m}, {0: b, 2: m}) for _ in layers],
    }
    inputs, outputs = text_io_names(len(layers))
    program = _trace(_SharedCacheDecoder(model, layers, precision), (ids, mask, positions, past), inputs, outputs,
                     dynamic, opset, verbose)
    if any(a.multimax for a in layers):
        fn = ir.serde.deserialize_function(attention_function_proto(opset))
        program.model.functions[fn.identifier()] = fn
    context = spec.context_length

    def quantize(proto: onnx.ModelProto) -> int:
        from export.genai_quantize import quantize_int4_proto

        return quantize_int4_proto(proto)

    return _finish(program, ckpt, out, opset, inline=False, precision=precision, spec=spec,
                   rewrite=(lambda proto: fusion_metadata(fuse_decoder(proto, context))) if fuse else None,
                   quantize=quantize if int4 else None)
