"""Model folders in the model directory: a Hugging Face `ForCausalLM` folder (config.json, weights, tokenizer.json;
PyTorch backend, models.hf_folder) and an onnxruntime-genai folder (genai_config.json, model.onnx, tokenizer.json;
ONNX Runtime backend, export.genai_folder). Either is served under the folder's name, as version 1, or as a
numbered version directory inside `name/` (Triton's layout), beside the model files.

Both carry a real tokenizer (models.hf_text) and, where tokenizer_config.json has one, a chat template.
A Hugging Face folder under `--folder-export auto` (and `--backend auto` or `onnxruntime`) is served from its
onnxruntime-genai export (made and validated once, cached: service.engine.folder_export) where the cache holds one;
otherwise on PyTorch at once, its export made in the background (service.engine.background_export) and served
once it passed. Under `--folder-export wait` the export is made before the model answers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnxruntime as ort
import torch

from models import registry as architectures
from models.checkpoint import Checkpoint
from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from models.loading import CheckpointError
from models.onnx_contract import LOGITS, ONNX_DOMAIN, OnnxMetadata, read_metadata
from models.spec import Reweighting, TextSpec
from service.base.config import Settings
from service.engine.backends.base import BackendUnavailable, Past, TextBackend, grown_length
from service.engine.backends.cache_numpy import NumpyCache
from service.engine.backends.cache_ops import LEFT, RIGHT, map_past
from service.engine.backends.onnxruntime import _read_graph, fused_ops_state, set_spinning
from service.engine.backends.probe import onnxruntime_providers, torch_cuda_available
from service.engine.backends.torch import TorchTextBackend
from service.engine.entry import ModelEntry
from service.engine.export_status import OFF, PENDING, ExportStatus
from service.engine.folder_export import CachedExport, discard, export_outcome, exports_folders, lookup
from service.engine.tasks import served

log = logging.getLogger(__name__)

HF_FOLDER, GENAI_FOLDER = "hf-folder", "genai-folder"
GENAI_CONFIG = "genai_config.json"


def folder_kind(path: Path) -> str | None:
    """HF_FOLDER, GENAI_FOLDER or None (not a model folder)."""
    if not path.is_dir():
        return None
    if (path / GENAI_CONFIG).is_file():
        return GENAI_FOLDER
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return HF_FOLDER
    return None


def folder_files(path: Path) -> list[Path]:
    """The regular files of a folder (its size and fingerprint are theirs)."""
    return sorted(p for p in path.iterdir() if p.is_file())


def _multimax_summary(rw: Reweighting, values: dict[str, Any] | None) -> dict[str, Any]:
    """Where SegLU / MultiMax sits (the logits, which attention layers) and its parameters (ranges, ts)."""
    attention = rw.attention == "multimax"
    out: dict[str, Any] = {"output": rw.output == "multimax",
                           "attention_layers": list(rw.attention_layers) if attention else [],
                           "variant": rw.variant}
    if values is not None:
        out["parameters"] = {"lm_head": values.get("lm_head"),
                             "attention": {str(k): v for k, v in (values.get("attention") or {}).items()}}
    return out


def graph_multimax_nodes(proto: Any) -> list[dict[str, list[float]]]:
    """The `ranges` / `ts` attributes of a graph's MultiMax nodes, in graph order (rounded as models.hf_folder
    shows them)."""
    nodes = []
    for node in proto.graph.node if proto is not None else ():
        attrs = {a.name: list(a.floats) for a in node.attribute if a.name in ("ranges", "ts")}
        if node.domain == ONNX_DOMAIN and len(attrs) == 2:
            nodes.append({k: [round(float(v), 6) for v in attrs[k]] for k in ("ranges", "ts")})
    return nodes


def placed_multimax_values(graph_nodes: list[dict[str, list[float]]], rw: Reweighting) -> dict[str, Any] | None:
    """An export's MultiMax parameters (graph_multimax_nodes) in the shape the PyTorch-served card gives: the
    head's node is the last (it reads the logits, which every layer feeds), the attention nodes come in layer
    order. None where they do not match the placement the metadata states (nothing is claimed)."""
    nodes = list(graph_nodes)
    head = nodes.pop() if rw.output == "multimax" and nodes else None
    layers = list(rw.attention_layers) if rw.attention == "multimax" else []
    if (rw.output == "multimax") != (head is not None) or len(nodes) != len(layers):
        return None
    return {"lm_head": head, "attention": dict(zip(layers, nodes, strict=True))}


# ---- Hugging Face folder on PyTorch --------------------------------------------------------------------------


def load_hf_folder(name: str, path: Path, settings: Settings) -> ModelEntry:
    from models.hf_folder import load_folder

    try:
        model, info = load_folder(path)
    except CheckpointError as exc:
        raise BackendUnavailable(str(exc)) from None
    if settings.device == "cuda" and not torch_cuda_available():
        raise BackendUnavailable("device cuda asked for, but PyTorch sees no CUDA device")
    where = torch.device("cuda" if settings.device in ("auto", "cuda") and torch_cuda_available() else "cpu")
    if settings.intra_op_threads:
        torch.set_num_threads(settings.intra_op_threads)
    config = info.config.to_dict()
    ckpt = Checkpoint("llama", config, {})  # the weights live in the model; the checkpoint names arch and config
    backend = HFTorchBackend(path, ckpt, model, where, settings.torch_compile)
    tokenizer = HFTextTokenizer(info.tokenizer)
    spec = _with_tokenizer(architectures.spec_of("llama", config), tokenizer)
    entry = ModelEntry(name, "llama", backend, config, spec, served(spec.TASK),
                       tokenizer_entry=tokenizer.to_dict())
    entry.tokenizer = tokenizer
    entry.details = {"architecture": info.architecture, "format": "huggingface-folder",
                     "dtype": str(info.dtype).removeprefix("torch."),
                     "multimax": _multimax_summary(spec.reweighting, info.multimax), "tokenizer": tokenizer.describe()}
    return entry


class HFTorchBackend(TorchTextBackend):
    """A folder's Llama/Qwen model: the GPT-shaped forward, its own (grouped-query) cache."""

    def empty_past(self, batch: int) -> Past:
        return list(cast(Any, self.model).empty_past(batch, device=self.device))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "file": self.path.name + "/"}


# ---- onnxruntime-genai folder on ONNX Runtime -------------------------------------------------------------------


class GenaiTextBackend(TextBackend):
    """An onnxruntime-genai folder's model.onnx, run as the server's decoder. Names and shapes come from
    genai_config.json, whatever the architecture. The cache lives in buffers with room at their end, and decode
    steps write into them in place (IOBinding, past and present one buffer, as onnxruntime-genai runs the
    folder); a GroupQueryAttention graph keeps its rows right-padded, a MultiMaxAttention graph left-padded
    (service.engine.backends.cache_ops' layouts). A prefill is a plain call (present = its new keys)."""

    kind = "onnxruntime"
    platform = "onnxruntime_onnx"

    def __init__(self, path: Path, decoder: dict[str, Any], settings: Settings, context: int = 0) -> None:
        self.path = path
        self.context = context  # the most positions a cache buffer needs (0: unknown)
        self._binding: Any = None  # the decode step's IOBinding, reused while the cache buffers are the same
        self._bound: tuple[Any, ...] = ()
        self._returned: Past | None = None  # the past the last decode step returned (its buffers are bound)
        self._logits: np.ndarray | None = None  # the decode step's logits buffer, bound with the cache buffers
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.intra_op_threads
        options.inter_op_num_threads = settings.inter_op_threads
        set_spinning(options, settings.ort_spinning)
        options.log_severity_level = 3
        providers = list(settings.ort_providers) or list(onnxruntime_providers()[0])
        model_file = path / str(decoder.get("filename", "model.onnx"))
        proto = _read_graph(model_file)
        self.fused_multimax = fused_ops_state(proto, options) if providers == ["CPUExecutionProvider"] else None
        # onnxruntime's GroupQueryAttention reads each row's cache from the start of its buffer (right padding):
        # such graphs keep a right-padded cache (its layout), only a prefill's new tokens are realigned
        self.right_padded = proto is not None and any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)
        self.cache = NumpyCache(RIGHT if self.right_padded else LEFT)
        self.multimax_nodes = graph_multimax_nodes(proto)
        del proto
        try:
            self.session = ort.InferenceSession(str(model_file), sess_options=options, providers=providers)
        except Exception as exc:
            raise BackendUnavailable(f"{path.name}/{model_file.name}: onnxruntime cannot load it: "
                                     f"{str(exc).splitlines()[0]}") from None
        self.provider = self.session.get_providers()[0]
        self.metadata: OnnxMetadata = read_metadata(self.session.get_modelmeta().custom_metadata_map)
        self.arch = self.metadata.arch or ""
        try:
            self.n_layer = int(decoder["num_hidden_layers"])
            self.kv_heads = int(decoder.get("num_key_value_heads") or decoder["num_attention_heads"])
            self.head_dim = int(decoder["head_size"])
            names_in, names_out = decoder["inputs"], decoder["outputs"]
            self.feeds = {k: str(names_in[k]) for k in ("input_ids", "attention_mask")}
            self.position_name = names_in.get("position_ids")
            self.past_names = [(names_in["past_key_names"] % i, names_in["past_value_names"] % i)
                               for i in range(self.n_layer)]
            self.present_names = [n for i in range(self.n_layer) for n in (names_out["present_key_names"] % i,
                                                                          names_out["present_value_names"] % i)]
            self.logits_name = str(names_out.get("logits", LOGITS))
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"{path.name}/{GENAI_CONFIG}: decoder section unusable ({exc!r})") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for pair in self.past_names for n in pair if n not in inputs]
        if missing:
            raise BackendUnavailable(f"{path.name}: model.onnx has no input {missing[0]} that {GENAI_CONFIG} names")
        self.past_dtype = _NUMPY_TYPES.get(inputs[self.past_names[0][0]].type, np.float32)
        logits_out = next((o for o in self.session.get_outputs() if o.name == self.logits_name), None)
        width = logits_out.shape[-1] if logits_out is not None and logits_out.shape else None
        # a static vocabulary width lets decode steps write their logits into a buffer of ours (none: onnxruntime
        # allocates them each step, and reading them back wraps every bound output, about 9 us a step)
        self._logits_row: tuple[int, Any] | None = None
        if isinstance(width, int) and logits_out is not None and logits_out.type in _NUMPY_TYPES:
            self._logits_row = (width, _NUMPY_TYPES[logits_out.type])

    def run_text(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                 past: Past, last_only: bool = False) -> tuple[np.ndarray, Past]:
        if input_ids.shape[1] == 1 and past and past[0][0].shape[2] > 0:
            return self._step_in_place(input_ids, attention_mask, position_ids, past)
        if not self.right_padded:
            return self._run(input_ids, attention_mask, position_ids, past)
        # The cache stays right-padded between calls (its cache's layout: the batch pads it so); only the new tokens
        # of a prefill's shorter prompts (zeros, then the row's tokens) are moved to the row's start, and their
        # logits back. What the graph reads of the mask is each row's count of real tokens.
        pads = attention_mask.shape[1] - attention_mask.sum(axis=1)
        new_pads = np.maximum(pads - (past[0][0].shape[2] if past else 0), 0)
        ids, positions = _roll_rows(input_ids, -new_pads, 1), _roll_rows(position_ids, -new_pads, 1)
        logits, presents = self._run(ids, attention_mask, positions, past)
        return _roll_rows(logits, new_pads, 1), presents

    def _step_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                       past: Past) -> tuple[np.ndarray, Past]:
        """A decode step with each layer's past and present bound to one buffer (IOBinding), as
        onnxruntime-genai's past_present_share_buffer: GroupQueryAttention writes the new keys at each row's own
        position (right-padded rows), MultiMaxAttention at the common one (left-padded rows; its fused kernel in
        place, its function body by copies), and nothing else is copied. A buffer without room for this step
        grows to what the running rows may reach (`reserve`; grown_length): one copy for a batch's
        whole generation, where doubling to twice what it must hold copied at 64, 128, ... positions (two
        whole-cache copies of 16 ms each for 64 tokens on the paper-size LM at 16 rows)."""
        total = attention_mask.shape[1]
        if past[0][0].shape[2] < total:
            size = grown_length(total, self.reserved, self.context)
            past = map_past(past, lambda t: self.cache.pad(t, size - t.shape[2], 2, at_end=True))
        # The buffers stay bound from step to step (rebinding every layer's past and present cost about 5 us a
        # name, a tenth of a small model's step); only a new buffer (a join, a leave, growth) binds anew. The
        # past this call returned last time is those buffers as they are (the scheduler's cache functions make
        # a new list for any change): not even their addresses need reading.
        binding = self._binding if past is self._returned else None
        if binding is None:
            past = map_past(past, np.ascontiguousarray)  # the buffers' memory is bound as it is
            where = tuple((k.ctypes.data, v.ctypes.data, k.shape, k.dtype.str) for k, v in past)
            binding = self._binding if where == self._bound else None
        if binding is None:
            binding = self.session.io_binding()
            if self._logits_row is not None:
                width, dtype = self._logits_row
                self._logits = np.empty((len(input_ids), 1, width), dtype)
                binding.bind_output(self.logits_name, "cpu", 0, dtype, list(self._logits.shape),
                                    self._logits.ctypes.data)
            else:
                self._logits = None
                binding.bind_output(self.logits_name, "cpu")  # first: get_outputs() lists outputs in binding order
            for i, ((key_name, value_name), (key, value)) in enumerate(zip(self.past_names, past, strict=True)):
                for name, out_name, buffer in ((key_name, self.present_names[2 * i], key),
                                               (value_name, self.present_names[2 * i + 1], value)):
                    binding.bind_cpu_input(name, buffer)
                    binding.bind_output(out_name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
            self._binding, self._bound = binding, where
        binding.bind_cpu_input(self.feeds["input_ids"], np.ascontiguousarray(input_ids))
        binding.bind_cpu_input(self.feeds["attention_mask"], np.ascontiguousarray(attention_mask))
        if self.position_name:
            binding.bind_cpu_input(self.position_name, np.ascontiguousarray(position_ids))
        self.session.run_with_iobinding(binding)
        self._returned = past
        if self._logits is not None:  # valid until the next decode step writes into the same buffer
            return self._logits, past
        return binding.get_outputs()[0].numpy(), past

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: Past) -> tuple[np.ndarray, Past]:
        feeds: dict[str, np.ndarray] = {self.feeds["input_ids"]: input_ids,
                                        self.feeds["attention_mask"]: attention_mask}
        if self.position_name:
            feeds[self.position_name] = position_ids
        for (k, v), (pk, pv) in zip(self.past_names, past, strict=True):
            feeds[k], feeds[v] = pk, pv
        out = self.session.run([self.logits_name, *self.present_names], feeds)
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(self.n_layer)]

    def empty_past(self, batch: int) -> Past:
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return [(np.zeros(shape, self.past_dtype), np.zeros(shape, self.past_dtype)) for _ in range(self.n_layer)]

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "provider": self.provider, "file": self.path.name + "/",
                "fused_multimax": self.fused_multimax or {"in_use": False, "reason": "not a CPU-only session"}}

    def close(self) -> None:
        del self.session


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _roll_rows(a: np.ndarray, shift: np.ndarray, axis: int) -> np.ndarray:
    """Each row (axis 0) of `a` rolled by its own `shift` along `axis` (positive: towards the end)."""
    if not shift.any():
        return a
    length = a.shape[axis]
    index = (np.arange(length)[None, :] - shift[:, None]) % length  # (B, L)
    shape = [1] * a.ndim
    shape[0], shape[axis] = a.shape[0], length
    index = index.reshape(shape)
    return np.take_along_axis(a, np.broadcast_to(index, a.shape), axis=axis)


def _genai_eos(model: dict[str, Any]) -> list[int]:
    eos = model.get("eos_token_id")
    return [eos] if isinstance(eos, int) else [int(e) for e in eos or [] if isinstance(e, int)]


def load_genai_folder(name: str, path: Path, settings: Settings) -> ModelEntry:
    try:
        genai = json.loads((path / GENAI_CONFIG).read_text(encoding="utf-8"))
        model = genai["model"]
        decoder = model["decoder"]
        context, vocab = int(model["context_length"]), int(model["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendUnavailable(f"{path.name}/{GENAI_CONFIG}: unusable ({type(exc).__name__}: {exc})") from None
    if not (path / "tokenizer.json").is_file():
        raise BackendUnavailable(f"{path.name}: no tokenizer.json (an onnxruntime-genai folder carries its tokenizer)")
    try:
        hf_tok = HFTokenizer.from_folder(path, _genai_eos(model))
    except CheckpointError as exc:
        raise BackendUnavailable(f"{path.name}: {exc}") from None
    backend = GenaiTextBackend(path, decoder, settings, context)
    meta_config = dict(backend.metadata.config or {})
    config = {**meta_config, "block_size": context, "vocab_size": vocab}
    outputs = {o.name: o.shape for o in backend.session.get_outputs()}
    width = (outputs.get(backend.logits_name) or [None])[-1]
    if isinstance(width, int) and width != vocab:
        raise BackendUnavailable(f"{path.name}: {GENAI_CONFIG} says vocab_size {vocab}, model.onnx's logits are "
                                 f"{width} wide")
    tokenizer = HFTextTokenizer(hf_tok)
    arch = backend.arch if backend.arch else "gpt"
    try:  # the project's own exports describe themselves; a foreign folder's placement is unknown: softmax
        reweighting = architectures.read_spec(backend.metadata).reweighting
    except ValueError:
        reweighting = Reweighting()
    values = placed_multimax_values(backend.multimax_nodes, reweighting)
    spec = _with_tokenizer(TextSpec((backend.kv_heads,) * backend.n_layer, backend.head_dim, vocab, context,
                                    reweighting), tokenizer)
    entry = ModelEntry(name, arch, backend, config, spec, served(spec.TASK),
                       tokenizer_entry=tokenizer.to_dict())
    entry.tokenizer = tokenizer
    entry.details = {"architecture": backend.arch or "unknown", "format": "onnxruntime-genai-folder",
                     "multimax": _multimax_summary(reweighting, values) if meta_config else None,
                     "tokenizer": tokenizer.describe()}
    return entry


def _with_tokenizer(spec: Any, tokenizer: HFTextTokenizer) -> TextSpec:
    """A folder's description with its tokenizer's entry and special ids (-1: the tokenizer has none)."""
    def known(i: int) -> int | None:
        return None if i < 0 else i
    return dataclasses.replace(spec, tokenizer=tokenizer.to_dict(), bos_id=known(tokenizer.bos_id),
                               eos_id=known(tokenizer.eos_id), pad_id=known(tokenizer.pad_id))


def load_folder_entry(name: str, kind: str, path: Path, settings: Settings) -> ModelEntry:
    """The model of a folder: kind is HF_FOLDER or GENAI_FOLDER (folder_kind). A Hugging Face folder's entry says
    which backend serves it and why (`export`); one left PENDING is exported in the background (its `make` is set
    by service.engine.registry)."""
    if kind != HF_FOLDER:
        return load_genai_folder(name, path, settings)
    label = _label(name, path)
    made: ModelEntry | str | None
    if not exports_folders(settings):
        made = f"--{'backend torch' if settings.backend == 'torch' else 'folder-export off'} serves the folder itself"
    elif settings.folder_export == "wait":  # issue 40: the export, made now, before the model answers
        made = load_exported(name, path, settings)
    else:  # issue 50: the cache's export, if it holds one; else PyTorch now and the export in the background
        found = lookup(label, path, settings)
        made = _exported_entry(name, label, found, settings) if isinstance(found, CachedExport) else found
    if isinstance(made, ModelEntry):
        return made
    entry = load_hf_folder(name, path, settings)
    if made is None:
        entry.export = ExportStatus(PENDING)
    else:
        entry.export = ExportStatus(OFF, reason=made) if not exports_folders(settings) else ExportStatus.failed(made)
    return entry


# ---- a Hugging Face folder served from its cached export (service.engine.folder_export) --------------------------


def _label(name: str, path: Path) -> str:
    return name if path.name == name else f"{name}/{path.name}"  # a version directory: "name/2"


def load_exported(name: str, path: Path, settings: Settings, stop: threading.Event | None = None) -> ModelEntry | str:
    """The folder's validated onnxruntime-genai export, made now if the cache has none, loaded under the folder's
    name (its tokenizer, chat template and SegLU are the export's copies); or why not (serve the folder itself). A
    cached entry that onnxruntime cannot load is damaged: it is made again, once. `stop`: the server stops."""
    label = _label(name, path)
    why = "its export does not load"
    for _ in range(2):
        export = export_outcome(label, path, settings, stop)
        if isinstance(export, str):
            return export
        entry = _exported_entry(name, label, export, settings)
        if entry is not None:
            return entry
        if export.made:
            return why
    return why


def _exported_entry(name: str, label: str, export: CachedExport, settings: Settings) -> ModelEntry | None:
    """The export loaded, or None when onnxruntime cannot load it (a cached one is then discarded: made again)."""
    try:
        entry = load_genai_folder(name, export.folder, settings)
    except BackendUnavailable as exc:
        if export.made:
            log.warning("%s: its new export does not load (%s); serving the folder on PyTorch", label, exc)
        else:
            log.warning("%s: its cached export %s does not load (%s): exporting it again", label, export.folder, exc)
            discard(export)
        return None
    architecture = export.manifest.get("architecture") or entry.details["architecture"]
    entry.details = {**entry.details, "architecture": architecture, "served_from": export.describe(label)}
    entry.export = ExportStatus.passed(reused=not export.made)
    return entry
