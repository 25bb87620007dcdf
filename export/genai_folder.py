"""A text export as a folder that onnxruntime-genai loads as it is: `python -m export CKPT -o DIR`.

    DIR/model.onnx               the shared-buffer decoder graph (export.genai_graph), weights inside (or,
                                 above 2 GB of weights, in DIR/model.onnx.data beside it: export.onnx_io)
    DIR/genai_config.json        decoder names and shapes, `past_present_share_buffer: true`, greedy search
    DIR/tokenizer.json, tokenizer_config.json, ...  the model's tokenizer (export.hf_tokenizer: the byte
                                 tokenizer, a fairseq dictionary's, or a Hugging Face folder's files as they are:
                                 chat template and generation_config.json included)
    DIR/libmultimax_ort_ops.so   the fused MultiMax ops (plugins.ort_ops), named in genai_config.json's
                                 session_options.custom_ops_library (onnxruntime-genai only loads a library
                                 from inside the model folder); left out for a model without MultiMax, and
                                 when it cannot be built: the graph's function bodies then run
    DIR/validation.json          the export's report

Written in a staging folder beside DIR and renamed into place, so a failed export leaves DIR as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

from torch import nn

from export.genai_graph import attention_kind, export_genai_text
from export.hf_tokenizer import TokenizerFiles, tokenizer_files
from export.onnx_export import DEFAULT_OPSET, ExportError, text_spec_of
from export.precision import Precision
from models.atomic import staging_dir
from models.attention_hook import AttentionLayer
from models.checkpoint import Checkpoint
from models.multimax import multimax_owners
from models.onnx_contract import PAST_PREFIX, PRESENT_PREFIX
from models.registry import TextModel
from models.spec import TextSpec

MODEL_FILE = "model.onnx"
CONFIG_FILE = "genai_config.json"
LIBRARY_FILE = "libmultimax_ort_ops.so"
REPORT_FILE = "validation.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # the byte tokenizer's


def is_folder_output(output: Path | None) -> bool:
    """-o names a folder (anything but a .onnx file) -> the onnxruntime-genai folder export."""
    return output is not None and output.suffix != ".onnx"


def check_folder_target(out: Path) -> None:
    """ExportError unless `out` can become the folder: absent, empty, or an earlier folder export."""
    if not out.parent.is_dir():
        raise ExportError(f"cannot write {out}: directory {out.parent} does not exist")
    if out.exists() and not out.is_dir():
        raise ExportError(f"cannot write the export folder {out}: it exists and is not a directory "
                          "(name a .onnx file for a single-file export)")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise ExportError(f"cannot write the export folder {out}: it is not empty and holds no {CONFIG_FILE} "
                          "(not an earlier export; choose an empty or new folder)")


def genai_config(spec: TextSpec, layers: list[AttentionLayer], tok: TokenizerFiles,
                 library: str | None) -> dict[str, Any]:
    """genai_config.json of a model with this description and these attention layers (`attention_layers()`)."""
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    if library:
        session["custom_ops_library"] = library
    first = layers[0]
    return {
        "model": {
            "type": "decoder",  # onnxruntime-genai's generic decoder-only LLM
            "bos_token_id": tok.bos_id,
            "eos_token_id": tok.eos_ids[0] if len(tok.eos_ids) == 1 else tok.eos_ids,
            "pad_token_id": tok.pad_id,
            "vocab_size": spec.vocab_size,
            "context_length": spec.context_length,
            "decoder": {
                "session_options": session,
                "filename": MODEL_FILE,
                "head_size": first.head_dim,
                "hidden_size": first.num_heads * first.head_dim,  # the attention width (genai's decoder reads none)
                "num_attention_heads": first.num_heads,
                "num_key_value_heads": first.kv_heads,
                "num_hidden_layers": len(layers),
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": f"{PAST_PREFIX}%d.key",
                    "past_value_names": f"{PAST_PREFIX}%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": f"{PRESENT_PREFIX}%d.key",
                    "present_value_names": f"{PRESENT_PREFIX}%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,  # greedy unless the caller asks
            "num_beams": 1,
            "num_return_sequences": 1,
            "max_length": spec.context_length,
            "min_length": 0,
            "past_present_share_buffer": True,  # the graph writes new keys into the buffer in place
            "early_stopping": True,
            "length_penalty": 1.0,
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
            "temperature": 1.0,
            "top_k": spec.vocab_size,  # no top-k filter when sampling, as models.generate by default
            "top_p": 1.0,
        },
    }


def _library() -> Path | None:
    from plugins.ort_ops import library

    return library().path


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_folder(model: TextModel, ckpt: Checkpoint, out: Path, opset: int = DEFAULT_OPSET, verbose: bool = False,
                 with_library: bool = True, tokenizer_source: Path | None = None,
                 precision: Precision = "fp32", spec: TextSpec | None = None,
                 layers: list[AttentionLayer] | None = None, fuse: bool = True) -> Path:
    """Export `model` into the folder `out` (see the module docstring); returns `out`.

    `tokenizer_source`: the Hugging Face folder whose tokenizer files are copied (else they are made from
    `ckpt.tokenizer`). precision "int4": the fp32 graph with its weight MatMuls as MatMulNBits. `spec` (the
    checkpoint's description) and `layers` (the model's `attention_layers()`): what export.pipeline computed once
    for this export, else computed here; the check, the graph and genai_config.json all take them. `fuse`: the
    graph's small nodes fused (export.genai_fusions; `--no-fuse` keeps the traced graph as it is).
    """
    check_folder_target(out)
    spec = spec or text_spec_of(ckpt)
    layers = layers if layers is not None else model.attention_layers()
    tok = tokenizer_files(ckpt.tokenizer, tokenizer_source, spec.context_length, spec.vocab_size)
    attention_kind(spec, layers)  # refuses what has no shared-buffer node, before anything is written
    library = _library() if with_library and multimax_owners(cast(nn.Module, model)) else None
    with staging_dir(out) as staging:
        folder = staging / out.name
        folder.mkdir()
        traced: Precision = "fp16" if precision == "fp16" else "fp32"
        export_genai_text(model, ckpt, folder / MODEL_FILE, opset=opset, verbose=verbose, precision=traced, spec=spec,
                          layers=layers, fuse=fuse, int4=precision == "int4")
        if library is not None:
            shutil.copy2(library, folder / LIBRARY_FILE)
        _write_json(folder / CONFIG_FILE, genai_config(spec, layers, tok, LIBRARY_FILE if library else None))
        for name, data in tok.files.items():
            (folder / name).write_bytes(data)
        os.chmod(folder, 0o777 & ~_umask())  # mkdtemp's parent is private; the folder gets the usual mode
        if out.exists():  # an earlier export: moved aside (removed with the staging folder), then replaced
            out.rename(staging / (out.name + ".old"))
        folder.rename(out)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
