"""Where an exported ONNX file's weights lie, checked before anything reads them: the data file beside a graph past
2 GB (export.onnx_io writes it) must be inside the graph's folder, present and as long as the graph says. Here, below
export/ and service/, because both read exported files: the export's validation and the server's backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data


class ExternalDataError(ValueError):
    """An exported file whose weights are missing, truncated or outside its folder; one line for the user."""


def all_tensors(proto: onnx.ModelProto) -> Iterator[TensorProto]:
    yield from _get_all_tensors(proto)
    for fn in proto.functions:  # onnx's walk skips function bodies' Constant nodes
        for node in fn.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t


def check_external_data(path: Path, proto: onnx.ModelProto) -> None:
    """ExternalDataError unless every external tensor of `proto` (read from `path` without its weights) lies inside
    a data file in `path`'s folder: no absolute or `..` location, the file present, offset + length within it."""
    folder = path.resolve().parent
    sizes: dict[str, int] = {}
    for tensor in all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        where = (folder / info.location).resolve()
        if Path(info.location).is_absolute() or not where.is_relative_to(folder):
            raise ExternalDataError(f"{path.name}: tensor {tensor.name!r} names weights outside its folder "
                                    f"({info.location}); refused")
        if info.location not in sizes:
            if not where.is_file():
                raise ExternalDataError(f"{path.name}: its weights file {info.location} is missing (it must lie "
                                        f"beside {path.name})")
            sizes[info.location] = where.stat().st_size
        length = info.length if info.length is not None else _nbytes_of_dims(tensor)
        end = (info.offset or 0) + length
        if end > sizes[info.location]:
            raise ExternalDataError(f"{path.name}: its weights file {info.location} is truncated "
                                    f"({sizes[info.location]} bytes, tensor {tensor.name!r} ends at {end}); export "
                                    "it again")


def _nbytes_of_dims(tensor: TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
