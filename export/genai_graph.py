"""The project's GPT as a shared-buffer decoder graph: what onnxruntime-genai runs with
`past_present_share_buffer: true`.

Same names as the single-file export (models.onnx_contract), but each layer's attention is one node that
writes the new keys/values into the cache buffer and attends over its first `total_sequence` positions:
- softmax attention: `com.microsoft::GroupQueryAttention` (onnxruntime's kernel; seqlens_k and
  total_sequence_length come from the attention mask, as onnxruntime-genai's own model builder does);
- MultiMax attention: `multimax::MultiMaxAttention` (plugins/onnx_attention.py: a portable function body,
  fused and in place with plugins.ort_ops).
past_key_values.{i}.* is (batch, heads, max_sequence, head_dim) and present.{i}.* the same buffer, so a
decode step copies nothing whatever the context. Without a shared buffer (past = exactly the past) the graph
returns present = past ++ new, like the single-file export.
"""

from __future__ import annotations

import math
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

from export.onnx_export import DEFAULT_OPSET, ExportError, _finish, _trace
from models import onnx_contract as contract
from models.checkpoint import Checkpoint
from models.gpt import GPT
from models.multimax import ExportAttrs, Modulation
from models.onnx_contract import plugin_attrs, text_io_names
from plugins.onnx_attention import OP as ATTENTION_OP
from plugins.onnx_attention import attention_function_proto

GQA = "com.microsoft::GroupQueryAttention"
MULTIMAX_ATTENTION = f"{contract.ONNX_DOMAIN}::{ATTENTION_OP}"


def attention_kind(model: GPT) -> str:
    """"softmax" or "multimax": the attentions this export has a shared-buffer node for (else ExportError)."""
    cfg = model.config
    if cfg.output_function:  # onnxruntime-genai samples from softmax(logits): another distribution would be lost
        raise ExportError(f"the onnxruntime-genai folder export serves softmax (or MultiMax) outputs, not "
                          f"{cfg.output_function!r}; export it to a single .onnx file instead")
    if cfg.attention_function:
        raise ExportError(f"the onnxruntime-genai folder export supports softmax and MultiMax attention, not "
                          f"{cfg.attention_function!r}; export it to a single .onnx file instead")
    return "multimax" if cfg.multimax_attention else "softmax"


def _multimax_attrs(mod: Modulation, scale: float, n_head: int) -> ExportAttrs:
    ranges = [float(v) for v in mod.ranges.detach().tolist()]
    ts = [float(v) for v in mod.ts.detach().tolist()]
    if mod.order == 1:
        ts = [*ts[:2], 0.0, 0.0]
    if mod.affine:  # V2's t*x + b folded in: t into the scale, b into the thresholds (softmax drops the shift)
        t, b = float(mod.t.detach()), float(mod.b.detach())
        scale, ranges = scale * t, [r - b for r in ranges]
    return {"num_heads": n_head, "scale": scale, "ranges": ranges, "ts": ts, "order": mod.order,
            **plugin_attrs(ATTENTION_OP)}


class _SharedCacheDecoder(nn.Module):
    """The GPT's forward with one attention node per layer (traced only: the node has no PyTorch kernel)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model
        cfg = model.config
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.kind = attention_kind(model)
        # read before tracing: the exporter's parameters are fake tensors
        self.attrs = [_multimax_attrs(b.attn.multimax, self.scale, cfg.n_head) if b.attn.multimax is not None else {}
                      for b in model.block_list()]

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: tuple,
                mask: torch.Tensor, seqlens: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.model.config
        shapes = [q.shape, past[0].shape, past[1].shape]
        dtypes = [q.dtype] * 3
        if self.kind == "softmax":
            attrs: ExportAttrs = {"num_heads": cfg.n_head, "kv_num_heads": cfg.n_head, "scale": self.scale}
            inputs = [q, k, v, past[0], past[1], seqlens, total]
            return tuple(torch.onnx.ops.symbolic_multi_out(GQA, inputs, attrs, dtypes=dtypes, shapes=shapes, version=1))
        inputs = [q, k, v, past[0], past[1], mask]
        return tuple(torch.onnx.ops.symbolic_multi_out(MULTIMAX_ATTENTION, inputs, self.attrs[i], dtypes=dtypes,
                                                       shapes=shapes, version=1))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, past_key_values: list
    ) -> tuple[torch.Tensor, list]:
        model = self.model
        # GroupQueryAttention's lengths: real tokens per row - 1, and the total length (onnxruntime-genai's convention)
        seqlens = (attention_mask.sum(-1) - 1).to(torch.int32)
        total = torch.ones_like(attention_mask[0]).sum().to(torch.int32)
        x = model.wte(input_ids) + model.wpe(position_ids)
        presents = []
        for i, block in enumerate(model.block_list()):
            h = block.ln_1(x)
            q, k, v = block.attn.c_attn(h).split(model.config.n_embd, dim=2)
            a, pk, pv = self._attend(i, q, k, v, past_key_values[i], attention_mask, seqlens, total)
            x = x + block.attn.c_proj(a)
            x = x + block.mlp(block.ln_2(x))
            presents.append((pk, pv))
        logits = model.lm_head(model.ln_f(x))
        if model.multimax is not None:
            logits = model.multimax(logits)
        return logits, presents


def export_genai_text(model: GPT, ckpt: Checkpoint, out: Path, opset: int = DEFAULT_OPSET,
                      verbose: bool = False) -> Path:
    """Export the shared-buffer decoder graph (fp32) to `out`, atomically, with every function body attached."""
    cfg = model.config
    model = model.eval()
    batch, past_len, new, buffer = 2, 3, 4, 9  # buffer > past + new: the shape a shared buffer has
    ids = torch.randint(0, cfg.vocab_size, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    positions = torch.arange(past_len, past_len + new).expand(batch, new).contiguous()
    shape = (batch, cfg.n_head, buffer, cfg.head_dim)
    past = [(torch.randn(shape), torch.randn(shape)) for _ in range(cfg.n_layer)]
    b = torch.export.Dim(contract.BATCH, min=1, max=4096)
    t = torch.export.Dim(contract.SEQUENCE, min=1, max=cfg.block_size)
    m = torch.export.Dim(contract.PAST_SEQUENCE, min=0, max=2 * cfg.block_size)
    total = torch.export.Dim(contract.TOTAL_SEQUENCE, min=1, max=2 * cfg.block_size)
    dynamic = {
        contract.INPUT_IDS: {0: b, 1: t},
        contract.ATTENTION_MASK: {0: b, 1: total},
        contract.POSITION_IDS: {0: b, 1: t},
        "past_key_values": [({0: b, 2: m}, {0: b, 2: m}) for _ in range(cfg.n_layer)],
    }
    inputs, outputs = text_io_names(cfg.n_layer)
    program = _trace(_SharedCacheDecoder(model), (ids, mask, positions, past), inputs, outputs, dynamic, opset,
                     verbose)
    if attention_kind(model) == "multimax":
        fn = ir.serde.deserialize_function(attention_function_proto(opset))
        program.model.functions[fn.identifier()] = fn
    return _finish(program, ckpt, out, opset, inline=False, precision="fp32")
