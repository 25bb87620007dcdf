"""Writing and reading exported .onnx files of any size: one self-contained file, or above a threshold the graph
(`model.onnx`) with its weights in `model.onnx.data` beside it.

protobuf refuses to serialize a message of 2 GiB or more, so a large model is never serialized whole: each
weight's bytes are written to the data file as the tensors are walked, each tensor then names its place there
(onnx's external-data fields), and only the weightless graph is serialized. The size that decides is the sum of
the tensors' bytes, counted without `ByteSize()` (which itself serializes). `MULTIMAX_EXTERNAL_DATA_THRESHOLD`
(bytes) lowers the threshold, so tests exercise the large-model path on a tiny model.

Readers take the graph without its weights (`load_graph`) after `check_external_data` has checked that every
weight's place is inside the file's folder and inside its data file, so a moved, missing or truncated data
file is one clear error (`ExternalDataError`), never onnxruntime's or numpy's exception half-way through.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, set_external_data, uses_external_data

from models.atomic import publish, staging_dir
from models.onnx_weights import all_tensors, check_external_data

THRESHOLD_ENV = "MULTIMAX_EXTERNAL_DATA_THRESHOLD"
# protobuf refuses messages of 2 GiB; weights move to `<name>.data` a little before that (the graph, names and
# attributes, stays well below the margin).
DEFAULT_THRESHOLD = 2_000_000_000 - 10_000_000
SMALL_TENSOR = 1024  # tensors below this many bytes (shapes, scalars) stay in the graph, as onnx's own default
ALIGNMENT = 4096  # each weight starts on a page, so onnxruntime can map the file instead of copying it


def data_name(path: Path) -> str:
    """The data file's name beside `path` (`model.onnx` -> `model.onnx.data`)."""
    return path.name + ".data"


def external_threshold() -> int:
    """Bytes of tensor data above which weights go to the data file (`MULTIMAX_EXTERNAL_DATA_THRESHOLD`, else
    just under protobuf's 2 GiB)."""
    text = os.environ.get(THRESHOLD_ENV, "").strip()
    if not text:
        return DEFAULT_THRESHOLD
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{THRESHOLD_ENV}={text!r}: expected a number of bytes") from None
    return min(max(value, 0), DEFAULT_THRESHOLD)


def _nbytes(tensor: TensorProto) -> int:
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    if uses_external_data(tensor):
        return 0
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize if tensor.data_type else 0


def tensor_bytes(proto: onnx.ModelProto) -> int:
    """The bytes of every tensor the model holds in itself (initializers, constants, function bodies)."""
    return sum(_nbytes(t) for t in all_tensors(proto))


def _move_to_file(proto: onnx.ModelProto, data: Path, location: str) -> None:
    """Write each tensor of SMALL_TENSOR bytes or more to `data` and make it name its place there; the proto's
    weights are gone afterwards (it is the caller's to discard). fsync'ed."""
    with open(data, "wb") as fh:
        for tensor in all_tensors(proto):
            if _nbytes(tensor) < SMALL_TENSOR or tensor.data_type == TensorProto.STRING:
                continue
            raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
            offset = fh.tell()
            if offset % ALIGNMENT:
                fh.write(b"\0" * (ALIGNMENT - offset % ALIGNMENT))
                offset = fh.tell()
            fh.write(raw)
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)
            if not tensor.HasField("raw_data"):
                tensor.raw_data = b"\0"  # onnx's set_external_data wants the field present
            set_external_data(tensor, location, offset, len(raw))
            tensor.data_location = TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
            del raw
        fh.flush()
        os.fsync(fh.fileno())


def save_model(proto: onnx.ModelProto, out: Path, threshold: int | None = None) -> Path:
    """Write `proto` to `out` atomically: one file up to `threshold` bytes of tensors (None: `external_threshold()`),
    else the graph with its weights in `<name>.data` beside it. The proto is consumed (its weights may be moved
    out of it).

    Both are written in a staging directory next to `out` and renamed into place at the end, the data first, then
    the graph that names it, so a failed export leaves no partial files; a small export removes an earlier large
    one's data file.
    """
    large = tensor_bytes(proto) > (external_threshold() if threshold is None else threshold)
    name = data_name(out)
    with staging_dir(out) as staging:
        if large:
            _move_to_file(proto, staging / name, name)
        graph = proto.SerializeToString()  # the weightless graph when large: far below protobuf's limit
        del proto
        with open(staging / out.name, "wb") as fh:
            fh.write(graph)
        del graph
        if large:
            publish(staging / name, out.parent / name)
        publish(staging / out.name, out)
    if not large:
        (out.parent / name).unlink(missing_ok=True)  # an earlier, larger export's weights
    return out


def external_files(proto: onnx.ModelProto) -> list[str]:
    """The data files the graph's tensors name (relative to its folder), in first-use order."""
    return list(dict.fromkeys(ExternalDataInfo(t).location for t in all_tensors(proto) if uses_external_data(t)))


def load_graph(path: Path) -> onnx.ModelProto:
    """The model at `path` without its external weights (those checked by `check_external_data`): what the
    checks that read names, shapes, attributes and metadata need, at the graph's size whatever the weights'."""
    proto = onnx.load(str(path), load_external_data=False)
    check_external_data(path, proto)
    return proto


def check_model_file(path: Path) -> None:
    """onnx's full checker on the file itself: it reads the graph without the weights (and checks the data file's
    location), so a model of any size is checked in the graph's memory."""
    onnx.checker.check_model(str(path), full_check=True)


def initializer_arrays(path: Path, proto: onnx.ModelProto, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The values of the initializers named `names` (those that exist), read from `path`'s folder where external;
    only these are loaded."""
    wanted = set(names)
    out = {}
    for tensor in proto.graph.initializer:
        if tensor.name in wanted:
            out[tensor.name] = numpy_helper.to_array(tensor, base_dir=str(path.parent))
    return out


def graph_session(path: Path, graph: bytes) -> ort.InferenceSession:
    """A CPU session (ORT_ENABLE_ALL, the function bodies: no fused ops registered) of `graph`, a variant of
    `path`'s graph serialized with its external weights named, not loaded: onnxruntime reads them from `path`'s
    folder."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def proto_of(model: ir.Model, near: Path) -> onnx.ModelProto:
    """`model` (the exporter's IR, whose folded constants are copies of the weights beside PyTorch's) as a proto.
    A large one is written to a temporary file beside `near` tensor by tensor (onnx_ir streams them), its IR
    tensors dropped, and read back: one copy of the weights held at any time besides PyTorch's, instead of the
    IR's and the proto's together. Small models are serialized in memory, as always. The IR model is consumed."""
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if size <= external_threshold():
        return ir.serde.serialize_model(model)
    with staging_dir(near) as tmp:
        ir.save(model, tmp / "traced.onnx", external_data="traced.onnx.data")
        for value in model.graph.initializers.values():
            value.const_value = None  # the IR's copies freed before the proto's are read
        return onnx.load(str(tmp / "traced.onnx"))
