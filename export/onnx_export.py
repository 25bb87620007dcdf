"""Checkpoint -> ONNX with the current (dynamo) exporter, MultiMax as one custom node per use.

The file carries everything a server needs in `metadata_props` (architecture, config, labels,
preprocessing, MultiMax placement, exporter versions) and is written atomically.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import onnx
import onnx.inliner
import onnx_ir as ir
import onnxscript
import torch
from torch import nn

from export.onnx_functions import function_protos
from models.checkpoint import Checkpoint
from models.multimax import ONNX_DOMAIN, onnx_export_params

DEFAULT_OPSET = 18
VISION_INPUT = "pixel_values"
VISION_OUTPUT = "logits"


class ExportError(ValueError):
    """An export that cannot be done as asked; one line for the user (exit code 2)."""


def metadata(ckpt: Checkpoint, opset: int, inline: bool) -> dict[str, str]:
    cfg = ckpt.config
    places = [p for p in ("attention", "output") if cfg.get(f"multimax_{p}")]
    meta: dict[str, Any] = {
        "multimax.format": "multimax-onnx/1",
        "multimax.arch": ckpt.arch,
        "multimax.config": cfg,
        "multimax.placement": {"places": places, "variant": cfg.get("variant"), "inlined": inline},
        "multimax.labels": ckpt.labels,
        "multimax.preprocess": ckpt.preprocess,
        "multimax.tokenizer": ckpt.tokenizer,
        "multimax.exporter": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__,
            "opset": opset,
        },
    }
    return {k: json.dumps(v) for k, v in meta.items() if v is not None}


def export_vision(
    model: nn.Module, ckpt: Checkpoint, out: Path, opset: int = DEFAULT_OPSET, inline: bool = False
) -> Path:
    """Export a DeiT to `out` (atomically); batch is the one dynamic axis, named "batch"."""
    cfg = ckpt.config
    example = torch.randn(2, cfg["in_chans"], cfg["img_size"], cfg["img_size"])
    model = model.eval()
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # "torchvision is not installed" chatter: not the user's concern
    with warnings.catch_warnings(), onnx_export_params(model), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            opset_version=opset,
            input_names=[VISION_INPUT],
            output_names=[VISION_OUTPUT],
            dynamic_shapes={"images": {0: "batch"}},
            verbose=False,
        )
    exporter_log.setLevel(level)
    for proto in function_protos(opset):
        fn = ir.serde.deserialize_function(proto)
        program.model.functions[fn.identifier()] = fn
    program.model.opset_imports[ONNX_DOMAIN] = 1
    proto = program.model_proto
    if inline:
        proto = onnx.inliner.inline_local_functions(proto)
        del proto.functions[:]
        kept = [o for o in proto.opset_import if o.domain != ONNX_DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)
    for key, value in metadata(ckpt, opset, inline).items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    return save_atomic(proto, out)


def save_atomic(proto: onnx.ModelProto, out: Path) -> Path:
    """One file below 2 GB, external data beside it above; temp files renamed into place at the end."""
    directory = out.parent
    large = proto.ByteSize() > 2_000_000_000 - 10_000_000
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    data_name = out.name + ".data"
    try:
        if large:
            onnx.save_model(proto, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
        else:
            onnx.save_model(proto, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
