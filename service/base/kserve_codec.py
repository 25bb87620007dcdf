"""The KServe V2 tensor codec: request bodies (JSON `data` or the binary-data extension, gzip/deflate) to numpy
arrays, and numpy outputs to response bodies. Pure: no HTTP, no models, only numpy in and out; every malformed
input is a `ServiceError` 400 (413/415 for size and encoding) naming the tensor.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import numpy as np

from service.base.bodies import inflate
from service.base.errors import ServiceError
from service.base.jsonio import NonFiniteOutput, check_size, dumps, loads, non_finite_error

HEADER_LENGTH = "inference-header-content-length"
MAX_DIMS = 8
# The most a float takes in a JSON response: "-1.2345678901234567e-05, " (a float32 written as Python's double).
JSON_BYTES_PER_VALUE = 25
# A float output larger than this is written as JSON in pieces of this many values: each piece is one C call that
# holds the GIL, so a thread writing a large response lets the event loop in between (one call per piece).
JSON_CHUNK = 8192

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}


def bad(message: str) -> ServiceError:
    return ServiceError(400, message, code="invalid_tensor")


def _bytes_elements(raw: bytes, count: int, name: str) -> np.ndarray:
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(raw):
            raise bad(f"input {name}: BYTES data ends inside an element's length prefix")
        size = int.from_bytes(raw[pos:pos + 4], "little")
        pos += 4
        if pos + size > len(raw):
            raise bad(f"input {name}: BYTES element of {size} bytes runs past the data")
        out.append(raw[pos:pos + size])
        pos += size
    if pos != len(raw):
        raise bad(f"input {name}: {len(raw) - pos} bytes left after {count} BYTES elements")
    return np.array(out, dtype=object)


def _from_json_data(data: Any, datatype: str, dtype: np.dtype[Any], name: str) -> np.ndarray:
    if datatype == "BYTES":
        try:
            flat = np.asarray(data, dtype=object).ravel()
        except (ValueError, RecursionError):
            raise bad(f"input {name}: data is ragged or nested too deeply") from None
        if not all(isinstance(x, str) for x in flat):
            raise bad(f"input {name}: BYTES data must be strings")
        try:
            return np.array([x.encode() for x in flat], dtype=object)
        except UnicodeEncodeError:
            raise bad(f"input {name}: BYTES data is not valid Unicode (lone surrogate)") from None
    try:
        arr = np.asarray(data)
    except (ValueError, RecursionError):
        raise bad(f"input {name}: data is ragged (nested lists of different lengths) or nested too deeply") from None
    if arr.size and arr.dtype.kind not in "biuf":
        raise bad(f"input {name}: data must be {'true/false' if datatype == 'BOOL' else 'numbers'} for {datatype}")
    if datatype == "BOOL":
        if arr.size and arr.dtype.kind != "b":
            raise bad(f"input {name}: BOOL data must be true/false")
        return arr.astype(dtype).ravel()
    # Booleans among numbers (numpy would read true as 1) are a client bug, not data: refuse them.
    if arr.dtype.kind == "b" or (arr.size and bool in set(map(type, np.asarray(data, dtype=object).ravel()))):
        raise bad(f"input {name}: true/false given for {datatype} (numbers expected)")
    if dtype.kind in "iu" and arr.dtype.kind == "f":
        raise bad(f"input {name}: {datatype} data must be integers")
    if dtype.kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise bad(f"input {name}: value out of range for {datatype}"
                      + (" (negative values for an unsigned type)" if arr.min() < 0 <= info.min else ""))
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(dtype).ravel()
    if dtype.kind == "f" and arr.size and not np.isfinite(out).all():
        raise bad(f"input {name}: value out of range for {datatype}")
    return out


def _check_shape(name: str, shape: Any, limit: int) -> int:
    """The element count of a valid shape: at most MAX_DIMS non-negative integers whose product a request
    could carry at all (a shape of 2**62 elements is refused before anything is allocated)."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise bad(f"input {name}: shape must be a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise bad(f"input {name}: shape has {len(shape)} dimensions (at most {MAX_DIMS})")
    count = math.prod(shape)
    if count > limit:
        raise bad(f"input {name}: shape {shape} holds {count} elements, more than a request can carry")
    return count


def decode_tensors(header: dict[str, Any], binary: bytes, max_elements: int = 1 << 31) -> dict[str, np.ndarray]:
    """The request's input tensors by name (JSON `data` or the binary extension), shapes checked."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad("request needs a non-empty 'inputs' list")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for spec in inputs:
        if not isinstance(spec, dict):
            raise bad("every input must be an object with name, shape, datatype")
        name, shape, datatype = spec.get("name"), spec.get("shape"), spec.get("datatype")
        if not isinstance(name, str) or not name:
            raise bad("input without a name")
        if name in tensors:
            raise bad(f"input {name} given twice")
        count = _check_shape(name, shape, max_elements)
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise bad(f"input {name}: unknown datatype {datatype!r} (one of {', '.join(DTYPES)})")
        dtype = DTYPES[datatype]
        params = spec.get("parameters") or {}
        if not isinstance(params, dict):
            raise bad(f"input {name}: parameters must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise bad(f"input {name}: binary_data_size {size!r} does not fit the {len(binary) - offset} "
                          "binary bytes left")
            raw = binary[offset:offset + size]
            offset += size
            if datatype == "BYTES":
                flat = _bytes_elements(raw, count, name)
            else:
                if size != count * dtype.itemsize:
                    raise bad(f"input {name}: {size} bytes for shape {shape} of {datatype} "
                              f"(needs {count * dtype.itemsize})")
                flat = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
        elif "data" in spec:
            flat = _from_json_data(spec["data"], datatype, dtype, name)
        else:
            raise bad(f"input {name}: neither data nor parameters.binary_data_size")
        if flat.size != count:
            raise bad(f"input {name}: {flat.size} values for shape {shape} ({count} expected)")
        tensors[name] = flat.reshape(shape)
    if offset != len(binary):
        raise bad(f"{len(binary) - offset} bytes of binary data not claimed by any input")
    return tensors


def parse_body(body: bytes, content_encoding: str, header_length: str | None, limit: int,
               json_limit: int) -> tuple[dict[str, Any], bytes]:
    """(JSON inference header, binary data after it) of a request body, inflated (never past `limit`) first."""
    body = inflate(body, content_encoding, limit)
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise bad(f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
        if not 0 < n <= len(body):
            raise bad(f"Inference-Header-Content-Length {n} outside the body of {len(body)} bytes")
        head, binary = body[:n], body[n:]
    else:
        head, binary = body, b""
    check_size(len(head), json_limit, "JSON inference header")  # bulk data belongs in the binary extension
    try:
        header = loads(head, "inference header")
    except ServiceError as exc:
        raise bad(exc.message) from None
    if not isinstance(header, dict):
        raise bad("inference header must be a JSON object")
    return header, binary


def requested_outputs(header: dict[str, Any], available: list[str]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, parameters, binary) of each output the request asks for (all by default): binary when the output's
    `binary_data`, or else the request's `binary_data_output`, says so."""
    request_params = header.get("parameters") or {}
    binary_default = bool(request_params.get("binary_data_output", False)) if isinstance(request_params, dict) \
        else False
    outputs = header.get("outputs")
    if outputs is None:
        return [(n, {}, binary_default) for n in available]
    if not isinstance(outputs, list):
        raise bad("'outputs' must be a list")
    chosen = []
    for out in outputs:
        name = out.get("name") if isinstance(out, dict) else None
        if name not in available:
            raise bad(f"unknown output {name!r} (model has {', '.join(available)})")
        params = out.get("parameters") or {}
        if not isinstance(params, dict):
            raise bad(f"output {name}: parameters must be an object")
        chosen.append((name, params, bool(params.get("binary_data", binary_default))))
    return chosen


def json_output_bytes(count: int) -> int:
    """The most `count` floats can take as JSON data."""
    return count * JSON_BYTES_PER_VALUE


def _classification(logits: np.ndarray, k: Any, labels: list[str]) -> np.ndarray:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise bad(f"classification must be a positive integer, got {k!r}")
    if logits.ndim != 2:
        raise bad(f"classification ranks the classes of [n, classes] scores; this output is "
                  f"{list(logits.shape)} (a text model's logits are [n, T, vocab]: ask for them as they are)")
    k = min(k, logits.shape[-1])
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    rows = [[f"{row[j]:f}:{j}:{labels[j] if j < len(labels) else j}".encode() for j in idx]
            for row, idx in zip(logits, order, strict=True)]
    return np.array(rows, dtype=object)


def encode_outputs(model: str, version: str, header: dict[str, Any], outputs: dict[str, np.ndarray],
                   labels: list[str]) -> tuple[bytes, list[bytes]]:
    """(JSON response header, binary blobs after it) for the outputs the request asked for (all by default).
    Float data of more than JSON_CHUNK values is written in pieces (see JSON_CHUNK): call this off the event loop
    for a large output."""
    out_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    pieces: dict[str, np.ndarray] = {}  # placeholder -> float data written apart
    for name, params, binary in requested_outputs(header, list(outputs)):
        value = outputs[name]
        datatype = "FP32"
        if params.get("classification") is not None:
            value, datatype = _classification(value, params["classification"], labels), "BYTES"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(value.shape)}
        if binary:
            if datatype == "BYTES":
                raw = b"".join(len(b).to_bytes(4, "little") + b for b in value.ravel())
            else:
                raw = np.ascontiguousarray(value, dtype="<f4").tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif datatype == "BYTES":
            entry["data"] = [b.decode() for b in value.ravel()]
        elif value.size > JSON_CHUNK:
            placeholder = f"@data-{uuid.uuid4().hex}@"  # no client text can hold it: replaced by the data below
            pieces[placeholder] = value
            entry["data"] = placeholder
        else:
            entry["data"] = value.ravel().tolist()
        out_json.append(entry)
    body: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": out_json}
    if isinstance(header.get("id"), str):
        body["id"] = header["id"]
    try:
        head = dumps(body)
        if pieces:
            segments: list[bytes] = []
            for placeholder, value in pieces.items():
                before, head = head.split(f'"{placeholder}"'.encode(), 1)
                segments.append(before)
                segments.extend(_float_list(value))
            head = b"".join([*segments, head])
    except NonFiniteOutput:  # JSON has no NaN/Inf; the binary extension carries IEEE floats as they are
        raise non_finite_error("logits; ask for binary_data output to receive them as raw floats") from None
    return head, blobs


def _float_list(value: np.ndarray) -> list[bytes]:
    """`json.dumps(value.ravel().tolist())` in pieces of JSON_CHUNK values (joined, the same bytes)."""
    flat = value.ravel()
    parts = [b"["]
    for start in range(0, flat.size, JSON_CHUNK):
        try:
            text = json.dumps(flat[start:start + JSON_CHUNK].tolist(), allow_nan=False)[1:-1]
        except ValueError as exc:
            raise NonFiniteOutput(str(exc)) from None
        parts.extend((b", " if start else b"", text.encode()))
    parts.append(b"]")
    return parts


def exact_input(tensors: dict[str, np.ndarray], name: str, datatype: str) -> np.ndarray:
    """A request's input by name, of exactly this KServe datatype (a 400 otherwise)."""
    if name not in tensors:
        raise bad(f"missing input {name}")
    t = tensors[name]
    if t.dtype != DTYPES[datatype]:
        raise bad(f"input {name}: expected {datatype}")
    return t
