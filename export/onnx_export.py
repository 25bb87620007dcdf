"""Checkpoint -> ONNX with the current (dynamo) exporter, MultiMax as one custom node per use.

The file carries everything a server needs in `metadata_props` (architecture, config, labels,
preprocessing, MultiMax placement, exporter versions) and is written atomically.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx.inliner
import onnx_ir as ir
import onnxscript
import torch
from torch import nn

from export.fast_rewrites import op_type_filtered_rewrites
from export.onnx_io import DEFAULT_THRESHOLD, external_threshold, proto_of, save_model, tensor_bytes
from export.precision import DTYPES, Precision, quantize_int8
from models import onnx_contract as contract
from models.atomic import staging_dir
from models.checkpoint import Checkpoint
from models.multimax import onnx_export_params
from models.onnx_contract import (
    ONNX_DOMAIN,
    VISION_INPUT,
    VISION_OUTPUT,
    OnnxMetadata,
    multimax_op_types,
    text_io_names,
)
from models.spec import ModelSpec, TextSpec, VisionSpec
from plugins.onnx_functions import function_protos

DEFAULT_OPSET = 18
# protobuf refuses messages of 2 GiB; weights move to `<name>.data` a little before that (export.onnx_io).
EXTERNAL_DATA_THRESHOLD = DEFAULT_THRESHOLD


class ExportError(ValueError):
    """An export that cannot be done as asked; one line for the user (exit code 2)."""


def metadata(ckpt: Checkpoint, opset: int, inline: bool, precision: Precision = "fp32",
             spec: ModelSpec | None = None) -> dict[str, str]:
    """The file's `multimax.*` metadata; `spec`: the checkpoint's description where the caller has it (an export
    computes it once), else described here."""
    cfg = ckpt.config
    places = [p for p in ("attention", "output") if cfg.get(f"multimax_{p}")]
    return OnnxMetadata(
        format=contract.FORMAT,
        arch=ckpt.arch,
        config=cfg,
        placement={"places": places, "variant": cfg.get("variant"), "inlined": inline},
        precision=precision,
        labels=ckpt.labels,
        preprocess=ckpt.preprocess,
        tokenizer=ckpt.tokenizer,
        spec=(spec or ckpt.spec()).to_dict(),
        exporter={
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__,
            "opset": opset,
        },
    ).encode()


class _Vision(nn.Module):
    """The classifier in `dtype` behind float32 inputs and outputs, so every precision has one interface."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values.to(self.dtype)).float()


def export_vision(
    model: nn.Module,
    ckpt: Checkpoint,
    out: Path,
    opset: int = DEFAULT_OPSET,
    inline: bool = False,
    precision: Precision = "fp32",
    verbose: bool = False,
    spec: VisionSpec | None = None,
) -> Path:
    """Export an image classifier to `out` (atomically); batch is the one dynamic axis, named "batch".
    `spec`: the checkpoint's description (export.pipeline computes it once per export), else described here."""
    spec = spec or vision_spec_of(ckpt)
    example = torch.randn(2, spec.channels, spec.image_size, spec.image_size)
    module = _Vision(_in_dtype(model, precision), DTYPES[precision])
    dynamic = {VISION_INPUT: {0: contract.BATCH}}
    program = _trace(module, (example,), [VISION_INPUT], [VISION_OUTPUT], dynamic, opset, verbose)
    return _finish(program, ckpt, out, opset, inline, precision, spec)


class _Decoder(nn.Module):
    """The decoder with the argument order of the ONNX graph (ids, mask, positions, past), float32 at its edges."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, past_key_values: list
    ) -> tuple[torch.Tensor, list]:
        past = [(k.to(self.dtype), v.to(self.dtype)) for k, v in past_key_values]
        logits, presents = self.model(
            input_ids, position_ids=position_ids, attention_mask=attention_mask, past_key_values=past
        )
        return logits.float(), [(k.float(), v.float()) for k, v in presents]


def export_text(
    model: nn.Module,
    ckpt: Checkpoint,
    out: Path,
    opset: int = DEFAULT_OPSET,
    inline: bool = False,
    precision: Precision = "fp32",
    verbose: bool = False,
    spec: TextSpec | None = None,
) -> Path:
    """Export a decoder as one graph with KV cache (prefill when the past is empty, else decode).
    `spec`: the checkpoint's description (export.pipeline computes it once per export), else described here."""
    spec = spec or text_spec_of(ckpt)
    batch, past_len, new = 2, 3, 4  # trace above 1: sizes 0 and 1 would be specialised into the graph
    ids = torch.randint(0, spec.vocab_size, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    positions = torch.arange(past_len, past_len + new).expand(batch, new).contiguous()
    shapes = [spec.cache_shape(i, batch, past_len) for i in range(spec.layers)]
    past = [(torch.randn(shape), torch.randn(shape)) for shape in shapes]
    # Ranges, not just names: the past may be empty (prefill), and the graph itself has no context limit.
    b = torch.export.Dim(contract.BATCH, min=1, max=4096)
    t = torch.export.Dim(contract.SEQUENCE, min=1, max=spec.context_length)
    p = torch.export.Dim(contract.PAST_SEQUENCE, min=0, max=spec.context_length)
    total = torch.export.Dim(contract.TOTAL_SEQUENCE, min=1, max=2 * spec.context_length)
    dynamic = {  # keyed by _Decoder.forward's argument names
        contract.INPUT_IDS: {0: b, 1: t},
        contract.ATTENTION_MASK: {0: b, 1: total},
        contract.POSITION_IDS: {0: b, 1: t},
        "past_key_values": [({0: b, 2: p}, {0: b, 2: p}) for _ in range(spec.layers)],
    }
    inputs, outputs = text_io_names(spec.layers)
    module = _Decoder(_in_dtype(model, precision), DTYPES[precision])
    program = _trace(module, (ids, mask, positions, past), inputs, outputs, dynamic, opset, verbose)
    return _finish(program, ckpt, out, opset, inline, precision, spec)


def vision_spec_of(ckpt: Checkpoint) -> VisionSpec:
    """The description of an image classifier's checkpoint (for callers that have none computed)."""
    spec = ckpt.spec()
    assert isinstance(spec, VisionSpec), f"{ckpt.arch} is not an image classifier"
    return spec


def text_spec_of(ckpt: Checkpoint) -> TextSpec:
    """The description of a text checkpoint (for callers that have none computed)."""
    spec = ckpt.spec()
    assert isinstance(spec, TextSpec), f"{ckpt.arch} is not a text model"
    return spec


def _in_dtype(model: nn.Module, precision: Precision) -> nn.Module:
    """An eval-mode model in the precision's dtype; a copy when that differs, so the caller's stays fp32."""
    dtype = DTYPES[precision]
    if next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    return model.eval()


def _trace(
    module: nn.Module, args: tuple, inputs: list[str], outputs: list[str], dynamic: dict, opset: int,
    verbose: bool = False,
) -> torch.onnx.ONNXProgram:
    """The dynamo exporter; `verbose` lets its step lines ("Run decompositions...") through to stdout."""
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # "torchvision is not installed" chatter: not the user's concern
    try:
        with warnings.catch_warnings(), onnx_export_params(module), torch.no_grad(), op_type_filtered_rewrites():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=dynamic,
                verbose=verbose,
            )
            if program is None:  # only without dynamo=True
                raise ExportError("the exporter returned no program")
            return program
    finally:
        exporter_log.setLevel(level)


def _finish(
    program: torch.onnx.ONNXProgram, ckpt: Checkpoint, out: Path, opset: int, inline: bool, precision: Precision,
    spec: ModelSpec, rewrite: Callable[[onnx.ModelProto], dict[str, str]] | None = None,
    quantize: Callable[[onnx.ModelProto], object] | None = None,
) -> Path:
    """Attach the MultiMax function bodies (or inline them), rewrite (a pass that returns metadata entries),
    quantize if asked (int8 here; `quantize`: a pass that quantizes the proto in place, the folder's int4), add the
    metadata, write atomically."""
    # the other reweighting functions' bodies only where the graph uses them (MultiMax files stay as they were)
    used = {n.op_type for n in program.model.graph.all_nodes() if n.domain == ONNX_DOMAIN}
    for proto in function_protos(opset, used | set(multimax_op_types())):
        fn = ir.serde.deserialize_function(proto)
        program.model.functions[fn.identifier()] = fn
    program.model.opset_imports[ONNX_DOMAIN] = 1
    proto = proto_of(program.model, out)  # a large model: never the IR's and the proto's weights at once
    if inline:
        proto = onnx.inliner.inline_local_functions(proto)
        del proto.functions[:]
        kept = [o for o in proto.opset_import if o.domain != ONNX_DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)
    extra = rewrite(proto) if rewrite is not None else {}
    if quantize is not None:
        if rewrite is not None and tensor_bytes(proto) > external_threshold():
            # protobuf keeps the bytes of every tensor the rewrite replaced (packed projections) until the message
            # is freed: a large one is written out and read back first, so the quantizer starts from one copy
            with staging_dir(out) as tmp:
                save_model(proto, tmp / "rewritten.onnx", threshold=0)
                del proto
                proto = onnx.load(str(tmp / "rewritten.onnx"))
        quantize(proto)
    if precision == "int8":
        proto = quantize_int8(proto)
    for key, value in (metadata(ckpt, opset, inline, precision, spec) | extra).items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    return save_atomic(proto, out)


def save_atomic(proto: onnx.ModelProto, out: Path) -> Path:
    """One file below 2 GB (or `MULTIMAX_EXTERNAL_DATA_THRESHOLD`), external data beside it (`<name>.data`)
    above, written atomically without serializing the whole model (export.onnx_io.save_model; `proto` is
    consumed)."""
    return save_model(proto, out, min(EXTERNAL_DATA_THRESHOLD, external_threshold()))
