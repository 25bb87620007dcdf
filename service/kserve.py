"""Open Inference Protocol (KServe V2), as Triton speaks it over HTTP, with the binary-data extension.

Vision models take `pixel_values` FP32 [n, C, H, W] and return `logits` FP32 [n, classes] through the
same dynamic batcher as /classify; the classification extension (`parameters.classification: k` on
an output) returns "score:index:label" strings as Triton does. Text models take `input_ids` INT64
[n, T] (and optionally `attention_mask`) and return `logits` FP32 [n, T, vocab]: one stateless forward,
run between decode steps. Errors are `{"error": "<message>"}` with a 4xx status.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.errors import LOOKUP, MODEL_CALL, ServiceError, error_responses
from service.jsonio import NonFiniteOutput, check_size, dumps, loads, non_finite_error
from service.lifecycle import deadline, tracked, unless_disconnected
from service.runtime import ModelRuntime, Runtimes

router = APIRouter(tags=["kserve-v2"])
SERVER_NAME = "multimax-serve"
VERSION = "1"
HEADER_LENGTH = "inference-header-content-length"
MAX_DIMS = 8

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": list(DTYPES)},
        "parameters": {"type": "object"},
        "data": {"type": "array"},
    },
}
OPENAPI_INFER: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {
                "type": "object",
                "required": ["inputs"],
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {"type": "object"},
                    "inputs": {"type": "array", "items": _TENSOR, "minItems": 1},
                    "outputs": {"type": "array", "items": {
                        "type": "object", "required": ["name"],
                        "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}}}},
                },
            }},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"},
                                         "description": "binary-data extension: JSON header of "
                                         "Inference-Header-Content-Length bytes, then the tensors' bytes"},
        },
    },
}


LOOKUP_404 = error_responses(True, LOOKUP)[404]


def bad(message: str) -> ServiceError:
    return ServiceError(400, message, code="invalid_tensor")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


# ---- metadata --------------------------------------------------------------------------------------------


def io_spec(rt: ModelRuntime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cfg = rt.entry.config
    if rt.task == "image-classification":
        assert rt.preprocess is not None
        classes = len(rt.entry.labels or [])
        return ([{"name": "pixel_values", "datatype": "FP32", "shape": [-1, *rt.preprocess.shape]}],
                [{"name": "logits", "datatype": "FP32", "shape": [-1, classes]}])
    return ([{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
             {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1], "optional": True}],
            [{"name": "logits", "datatype": "FP32", "shape": [-1, -1, int(cfg["vocab_size"])]}])


def _model(request: Request, name: str, version: str | None) -> ModelRuntime:
    runtimes: Runtimes = request.app.state.runtimes
    rt = runtimes.get(name)
    if version not in (None, "", VERSION):
        raise ServiceError(404, f"model {name!r} has no version {version!r} (only {VERSION})", code="no_version")
    return rt


@router.get("/v2", summary="Server metadata")
async def server_metadata() -> Response:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("multimax-serve")
    except PackageNotFoundError:
        ours = "0.1.0"
    return _json({"name": SERVER_NAME, "version": ours,
                  "extensions": ["binary_tensor_data", "classification", "model_configuration"]})


@router.get("/v2/health/live", summary="Liveness")
async def live() -> Response:
    return _json({"live": True})


_NOT_READY = {"description": "not ready, with the reason", "content": {"application/json": {"schema": {
    "type": "object", "required": ["ready"],
    "properties": {"ready": {"type": "boolean"}, "reason": {"type": "string"}, "name": {"type": "string"}}}}}}


@router.get("/v2/health/ready", responses={503: _NOT_READY},
            summary="Readiness: started, not shutting down, and every served model's worker "
            "alive and not failing (models that failed to load are listed, but do not count)")
async def ready(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    failing = {n: why for n, why in runtimes.problems().items() if n in runtimes.models}
    ok = runtimes.ready and not failing
    body: dict[str, Any] = {"ready": ok}
    if not runtimes.ready:
        body["reason"] = "not started or shutting down"
    elif failing:
        body["reason"] = "; ".join(f"{n}: {why}" for n, why in failing.items())
    return _json(body, 200 if ok else 503)


@router.post("/v2/repository/index", responses=error_responses(True, (400, 413)),
             summary="Every model of the model directory, ready or not, with why not "
             "(Triton's model repository extension)")
async def repository_index(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    problems = runtimes.problems()
    rows = [{"name": n, "version": VERSION, "state": "UNAVAILABLE" if n in problems else "READY",
             "reason": problems.get(n, "")} for n in sorted([*runtimes.models, *runtimes.skipped])]
    body = await request.body()
    if body.strip():
        check_size(len(body), runtimes.settings.max_json_bytes)
        query = loads(body, "request body")
        if not isinstance(query, dict) or not isinstance(query.get("ready", False), bool):
            raise bad("body must be an object with an optional boolean 'ready'")
        if query.get("ready"):
            rows = [r for r in rows if r["state"] == "READY"]
    return _json(rows)


@router.get("/v2/models/{name}", summary="Model metadata", responses=error_responses(True, LOOKUP))
@router.get("/v2/models/{name}/versions/{version}", summary="Model metadata (one version)",
            responses=error_responses(True, LOOKUP))
async def model_metadata(name: str, request: Request, version: str | None = None) -> Response:
    rt = _model(request, name, version)
    inputs, outputs = io_spec(rt)
    for t in inputs:
        t.pop("optional", None)
    body = {"name": rt.name, "versions": [VERSION], "platform": rt.entry.backend.platform,
            "inputs": inputs, "outputs": outputs}
    fused = rt.entry.backend.describe().get("fused_multimax")  # ONNX Runtime: the CPU ops' state, as /v1/models
    if fused is not None:
        body["fused_multimax"] = fused  # an extension field; V2 clients ignore what they do not know
    return _json(body)


@router.get("/v2/models/{name}/ready", summary="Model readiness", responses={400: _NOT_READY, 404: LOOKUP_404})
@router.get("/v2/models/{name}/versions/{version}/ready", summary="Model readiness (one version)",
            responses={400: _NOT_READY, 404: LOOKUP_404})
async def model_ready(name: str, request: Request, version: str | None = None) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    if name in runtimes.skipped and version in (None, "", VERSION):
        return _json({"name": name, "ready": False, "reason": f"failed to load: {runtimes.skipped[name]}"}, 400)
    rt = _model(request, name, version)
    problem = rt.problem if runtimes.ready else "not started or shutting down"
    body: dict[str, Any] = {"name": rt.name, "ready": problem is None}
    if problem is not None:
        body["reason"] = problem
    return _json(body, 200 if problem is None else 400)


@router.get("/v2/models/{name}/config", summary="Model configuration (Triton's extension)",
            responses=error_responses(True, LOOKUP))
@router.get("/v2/models/{name}/versions/{version}/config", summary="Model configuration (one version)",
            responses=error_responses(True, LOOKUP))
async def model_config(name: str, request: Request, version: str | None = None) -> Response:
    rt = _model(request, name, version)
    settings = request.app.state.runtimes.settings
    inputs, outputs = io_spec(rt)

    def triton(t: dict[str, Any]) -> dict[str, Any]:
        return {"name": t["name"], "data_type": f"TYPE_{t['datatype']}", "dims": t["shape"][1:],
                "optional": bool(t.get("optional"))}

    config: dict[str, Any] = {
        "name": rt.name, "platform": rt.entry.backend.platform, "backend": rt.entry.backend.kind,
        "max_batch_size": settings.max_batch_size,
        "input": [triton(t) for t in inputs], "output": [triton(t) for t in outputs],
        "parameters": {"task": {"string_value": rt.task}, "provider": {"string_value": rt.entry.backend.provider}},
    }
    if rt.task == "image-classification":
        config["dynamic_batching"] = {"max_queue_delay_microseconds": int(settings.max_queue_delay_ms * 1000),
                                      "default_queue_policy": {"max_queue_size": settings.max_queue_size}}
    return _json(config)


# ---- infer: decode request ---------------------------------------------------------------------------------


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ServiceError(415, f"Content-Encoding {encoding} not supported (gzip, deflate)", code="bad_encoding")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)  # never inflate past the body limit: a zip bomb stops here
    except zlib.error as exc:
        raise bad(f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise ServiceError(413, f"decompressed body exceeds the limit of {limit} bytes", code="body_too_large")
    return out


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
        return np.array([x.encode() for x in flat], dtype=object)
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


async def read_request(request: Request, limit: int, json_limit: int) -> tuple[dict[str, Any], bytes]:
    body = _inflate(await request.body(), request.headers.get("content-encoding", "").lower(), limit)
    header_length = request.headers.get(HEADER_LENGTH)
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


def _exact(tensors: dict[str, np.ndarray], name: str, datatype: str) -> np.ndarray:
    if name not in tensors:
        raise bad(f"missing input {name}")
    t = tensors[name]
    if t.dtype != DTYPES[datatype]:
        raise bad(f"input {name}: expected {datatype}")
    return t


def vision_rows(rt: ModelRuntime, tensors: dict[str, np.ndarray], max_batch: int) -> np.ndarray:
    assert rt.preprocess is not None
    extra = sorted(set(tensors) - {"pixel_values"})
    if extra:
        raise bad(f"unknown input(s) {', '.join(extra)} (model takes pixel_values)")
    x = _exact(tensors, "pixel_values", "FP32")
    want = rt.preprocess.shape
    if x.ndim != 4 or tuple(x.shape[1:]) != want or x.shape[0] < 1:
        raise bad(f"input pixel_values: shape {list(x.shape)}, expected [n, {', '.join(map(str, want))}] with n >= 1")
    if x.shape[0] > max_batch:
        raise bad(f"input pixel_values: batch {x.shape[0]} exceeds max_batch_size {max_batch}")
    if not np.isfinite(x).all():
        raise bad("input pixel_values holds NaN or Inf")
    return np.ascontiguousarray(x)


def text_inputs(rt: ModelRuntime, tensors: dict[str, np.ndarray], max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    extra = sorted(set(tensors) - {"input_ids", "attention_mask"})
    if extra:
        raise bad(f"unknown input(s) {', '.join(extra)} (model takes input_ids, attention_mask)")
    ids = _exact(tensors, "input_ids", "INT64")
    context, vocab = int(rt.entry.config["block_size"]), int(rt.entry.config["vocab_size"])
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise bad(f"input input_ids: shape {list(ids.shape)}, expected [n, T] with n, T >= 1")
    if ids.shape[0] > max_batch:
        raise bad(f"input input_ids: batch {ids.shape[0]} exceeds max_batch_size {max_batch}")
    if ids.shape[1] > context:
        raise bad(f"input input_ids: {ids.shape[1]} tokens exceed the context of {context}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise bad(f"input input_ids: token ids must be in 0..{vocab - 1}")
    if "attention_mask" in tensors:
        mask = _exact(tensors, "attention_mask", "INT64")
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise bad("input attention_mask: must be 0/1 with the shape of input_ids")
        if not mask[:, -1].all():
            raise bad("input attention_mask: padding goes on the left (the last position must be real)")
    else:
        mask = np.ones_like(ids)
    return np.ascontiguousarray(ids), np.ascontiguousarray(mask)


# ---- infer: encode response ------------------------------------------------------------------------------


def _requested_outputs(header: dict[str, Any], available: list[str]) -> list[tuple[str, dict[str, Any]]]:
    outputs = header.get("outputs")
    if outputs is None:
        return [(n, {}) for n in available]
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
        chosen.append((name, params))
    return chosen


def _classification(logits: np.ndarray, k: Any, labels: list[str]) -> np.ndarray:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise bad(f"classification must be a positive integer, got {k!r}")
    k = min(k, logits.shape[-1])
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    rows = [[f"{row[j]:f}:{j}:{labels[j] if j < len(labels) else j}".encode() for j in idx]
            for row, idx in zip(logits, order, strict=True)]
    return np.array(rows, dtype=object)


def encode_response(rt: ModelRuntime, header: dict[str, Any], outputs: dict[str, np.ndarray]) -> Response:
    request_params = header.get("parameters") or {}
    binary_default = bool(request_params.get("binary_data_output", False)) if isinstance(request_params, dict) \
        else False
    out_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, params in _requested_outputs(header, list(outputs)):
        value = outputs[name]
        datatype = "FP32"
        if params.get("classification") is not None:
            value, datatype = _classification(value, params["classification"], rt.entry.labels or []), "BYTES"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(value.shape)}
        if bool(params.get("binary_data", binary_default)):
            if datatype == "BYTES":
                raw = b"".join(len(b).to_bytes(4, "little") + b for b in value.ravel())
            else:
                raw = np.ascontiguousarray(value, dtype="<f4").tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = [b.decode() for b in value.ravel()] if datatype == "BYTES" else value.ravel().tolist()
        out_json.append(entry)
    body: dict[str, Any] = {"model_name": rt.name, "model_version": VERSION, "outputs": out_json}
    if isinstance(header.get("id"), str):
        body["id"] = header["id"]
    try:
        head = dumps(body)
    except NonFiniteOutput:  # JSON has no NaN/Inf; the binary extension carries IEEE floats as they are
        raise non_finite_error("logits; ask for binary_data output to receive them as raw floats") from None
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


@router.post("/v2/models/{name}/infer", openapi_extra=OPENAPI_INFER, response_class=Response,
             responses=error_responses(True, MODEL_CALL),
             summary="Inference (JSON tensors or the binary-data extension)")
@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=OPENAPI_INFER, response_class=Response,
             responses=error_responses(True, MODEL_CALL),
             summary="Inference on one version")
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    settings = runtimes.settings
    async with tracked(runtimes.metrics, runtimes.label(name), "infer"):
        rt = _model(request, name, version)
        if rt.batcher is not None:  # a request that will get 429 is refused before its body is read
            rt.batcher.check_room()
        if rt.scheduler is not None:
            rt.scheduler.check_exclusive_room()
        header, binary = await read_request(request, settings.max_body_bytes, settings.max_json_bytes)
        tensors = decode_tensors(header, binary, settings.max_body_bytes)
        params = header.get("parameters") or {}
        timeout_us = params.get("timeout") if isinstance(params, dict) else None
        requested = timeout_us / 1e6 if isinstance(timeout_us, (int, float)) and timeout_us > 0 else None
        if rt.task == "image-classification":
            rows = vision_rows(rt, tensors, settings.max_batch_size)
            assert rt.batcher is not None
            future = rt.batcher.enqueue(rows, deadline(settings.request_timeout_s, requested))
            try:
                result = await unless_disconnected(request, future)
            finally:
                future.cancel()
            request.state.timing.set(result.queue_s, result.compute_s)
            outputs = {"logits": result.output}
        else:
            ids, mask = text_inputs(rt, tensors, settings.max_batch_size)
            outputs = {"logits": await _text_forward(rt, ids, mask, request)}
        response = encode_response(rt, header, outputs)
    return response


async def _text_forward(rt: ModelRuntime, ids: np.ndarray, mask: np.ndarray, request: Request) -> np.ndarray:
    import time

    backend = rt.entry.backend
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    arrived = time.perf_counter()
    started: list[float] = []

    def forward() -> np.ndarray:
        started.append(time.perf_counter())
        logits, _ = backend.run_text(ids, mask, positions, backend.empty_past(len(ids)))
        return logits if isinstance(logits, np.ndarray) else logits.float().cpu().numpy()

    assert rt.scheduler is not None
    logits = await unless_disconnected(request, rt.scheduler.run_exclusive(forward))
    done = time.perf_counter()
    request.state.timing.set(started[0] - arrived, done - started[0])
    return logits.astype(np.float32, copy=False)
