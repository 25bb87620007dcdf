"""ONNX Runtime backend: the exported .onnx files, with the providers this machine really has."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from models import registry as architectures
from models.onnx_contract import (
    LOGITS,
    PIXEL_VALUES,
    OnnxMetadata,
    past_names,
    present_names,
    read_metadata,
    text_feeds,
)
from models.onnx_weights import ExternalDataError, check_external_data
from models.spec import TextSpec
from plugins import ort_ops
from plugins.onnx_functions import attribute_problems
from service.engine.backends.base import Backend, BackendUnavailable, Past, TextBackend, VisionBackend
from service.engine.backends.cache_numpy import NumpyCache
from service.engine.backends.probe import onnxruntime_providers

log = logging.getLogger(__name__)


def set_spinning(options: ort.SessionOptions, mode: str) -> None:
    """service.base.config's `ort_spinning` on a session: "run" lets the pool threads spin for work inside a call
    and stops them when it returns (`session.force_spinning_stop`), so a model call runs as fast as with spinning
    while the event loop, the sampler and the HTTP side get the CPU between calls."""
    spin = "0" if mode == "off" else "1"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    options.add_session_config_entry("session.force_spinning_stop", "1" if mode == "run" else "0")


def fused_ops_state(proto: onnx.ModelProto | None, options: ort.SessionOptions) -> dict[str, Any]:
    """Register the fused MultiMax ops (plugins.ort_ops) when the model has multimax nodes; say whether, and which
    library (`source`: the wheel's "prebuilt" one, "built on first use" from a checkout, or "unavailable")."""
    if proto is None or not any(node.domain == ort_ops.DOMAIN for node in proto.graph.node):
        return {"in_use": False, "reason": "the model has no multimax nodes"}
    if ort_ops.register(options):
        return {"in_use": True, "source": ort_ops.library().source, "kernel_path": ort_ops.kernel_path()}
    return {"in_use": False, "source": ort_ops.UNAVAILABLE, "reason": ort_ops.library().reason}


def _read_graph(path: Path) -> onnx.ModelProto | None:
    """The file's graph without its external weights, or None where onnx cannot read it (the session's own
    load then says why)."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:
        return None


def _refuse_bad_weights(proto: onnx.ModelProto | None, path: Path) -> None:
    """A graph whose external weights (`model.onnx.data`) are missing, truncated or outside its folder: refused
    with the reason, before onnxruntime reads any of them."""
    try:
        if proto is not None:
            check_external_data(path, proto)
    except ExternalDataError as exc:
        raise BackendUnavailable(str(exc)) from None


def _refuse_bad_attributes(proto: onnx.ModelProto | None, path: Path) -> None:
    """A reweighting node the fused op would refuse at session creation fails in its function body only when
    run (on a GPU, or without the library): refuse the file at load instead, for every provider."""
    problems = [] if proto is None else attribute_problems(proto)
    if problems:
        raise BackendUnavailable(f"{path.name}: {'; '.join(problems[:3])}" + (" ..." if len(problems) > 3 else ""))


class _OrtBackend(Backend):
    """One onnxruntime session of an exported file; the subclasses run it for their task."""

    kind = "onnxruntime"
    platform = "onnxruntime_onnx"

    def __init__(self, path: Path, session: ort.InferenceSession, metadata: OnnxMetadata,
                 fused_multimax: dict[str, Any] | None) -> None:
        self.path, self.session, self.metadata = path, session, metadata
        self.fused_multimax = fused_multimax
        self.provider = session.get_providers()[0]
        self.gpu = self.provider != "CPUExecutionProvider"
        self.arch = metadata.arch or ""
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]

    def _run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        if not self.gpu:
            return self.session.run(outputs, feeds)
        # On a GPU, IO binding lets ORT place outputs on the device and copy each once, in one sync.
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in outputs:
            binding.bind_output(name, "cuda")
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    def describe(self) -> dict[str, Any]:
        out = {"backend": self.kind, "provider": self.provider, "file": self.path.name}
        return out | {"fused_multimax": self.fused_multimax or {"in_use": False, "reason": "not a CPU-only session"}}


class OrtVisionBackend(_OrtBackend, VisionBackend):
    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        return self._run({PIXEL_VALUES: pixel_values}, [LOGITS])[0]


class OrtTextBackend(_OrtBackend, TextBackend):
    cache = NumpyCache()  # the exported graph reads a left-padded cache from numpy buffers

    def __init__(self, path: Path, session: ort.InferenceSession, metadata: OnnxMetadata,
                 fused_multimax: dict[str, Any] | None) -> None:
        super().__init__(path, session, metadata, fused_multimax)
        spec = architectures.read_spec(metadata)
        if not isinstance(spec, TextSpec):  # the loader picks this class for text descriptions only
            raise BackendUnavailable(f"{path.name}: its description is not a text model's")
        self.spec = spec
        self.n_layer = spec.layers
        self.past_names = past_names(self.n_layer)
        self.present_names = present_names(self.n_layer)
        missing = [n for pair in self.past_names for n in pair if n not in self.input_names]
        if missing:
            raise BackendUnavailable(f"{path.name}: text model without KV-cache inputs ({missing[0]} missing)")
        past_type = next(i.type for i in session.get_inputs() if i.name == self.past_names[0][0])
        self.past_dtype = np.float16 if past_type == "tensor(float16)" else np.float32

    def run_text(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past,
        last_only: bool = False,
    ) -> tuple[np.ndarray, Past]:
        if len(past) != self.n_layer:
            raise ValueError(f"past of {len(past)} layers for a model of {self.n_layer}")
        out = self._run(text_feeds(input_ids, attention_mask, position_ids, past), [LOGITS, *self.present_names])
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(self.n_layer)]

    def empty_past(self, batch: int) -> Past:
        shapes = [self.spec.cache_shape(i, batch) for i in range(self.n_layer)]
        return [(np.zeros(shape, self.past_dtype), np.zeros(shape, self.past_dtype)) for shape in shapes]


def OnnxRuntimeBackend(
    path: Path,
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
    providers: tuple[str, ...] = (),
    spinning: str = "run",
) -> OrtVisionBackend | OrtTextBackend:
    """The exported file in an onnxruntime session with the providers this machine really has, as the backend
    of its task (from the file's metadata)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    set_spinning(options, spinning)
    options.log_severity_level = 3  # errors only: providers are chosen so that there are none to warn about
    if providers:
        unknown = [p for p in providers if p not in ort.get_available_providers()]
        if unknown:
            raise BackendUnavailable(f"onnxruntime has no provider(s) {', '.join(unknown)}")
        requested, why = providers, ""
    else:
        requested, why = onnxruntime_providers()
    proto = _read_graph(path)
    _refuse_bad_weights(proto, path)
    _refuse_bad_attributes(proto, path)
    # The fused ops are CPU kernels: registered only for CPU-only sessions (on a GPU the bodies stay on the GPU).
    fused = fused_ops_state(proto, options) if list(requested) == ["CPUExecutionProvider"] else None
    del proto  # the session holds its own copy
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=list(requested))
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph/... types
        raise BackendUnavailable(f"{path.name}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from None
    if why and not providers:
        log.info("%s: %s (%s)", path.name, session.get_providers()[0], why)
    metadata = read_metadata(session.get_modelmeta().custom_metadata_map)
    try:
        text = isinstance(architectures.read_spec(metadata), TextSpec)
    except ValueError:  # no usable description: served as neither, the registry refuses it with the reason
        text = False
    cls = OrtTextBackend if text else OrtVisionBackend
    return cls(path, session, metadata, fused)
