"""Open Inference Protocol (KServe V2), as Triton speaks it over HTTP, with the binary-data extension.

Vision models take `pixel_values` FP32 [n, C, H, W] and return `logits` FP32 [n, classes] through the
same dynamic batcher as /classify; the classification extension (`parameters.classification: k` on
an output) returns "score:index:label" strings as Triton does. Text models take `input_ids` INT64
[n, T] (and optionally `attention_mask`) and return `logits` FP32 [n, T, vocab]: one stateless forward,
run between decode steps. Errors are `{"error": "<message>"}` with a 4xx status.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from models.onnx_contract import LOGITS, attention_function, output_function
from service.base.bodies import JSON, require_media
from service.base.context import authenticated
from service.base.errors import LOOKUP, MODEL_CALL, error_responses
from service.base.jsonio import dumps
from service.base.kserve_codec import DTYPES, HEADER_LENGTH, decode_tensors, encode_outputs, parse_body
from service.base.tracing import phase
from service.engine.runtime import ModelRuntime, Runtimes
from service.protocols.endpoint import model_call, model_endpoint

router = APIRouter(tags=["kserve-v2"])
SERVER_NAME = "multimax-serve"
OFF_LOOP_VALUES = 1 << 16  # an output this large is encoded on a thread (JSON of 64K floats: ~10 ms)

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


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


# ---- metadata --------------------------------------------------------------------------------------------


def io_spec(rt: ModelRuntime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return rt.kserve_io()


def _model(request: Request, name: str, version: str | None) -> ModelRuntime:
    runtimes: Runtimes = request.app.state.runtimes
    return runtimes.get(name, version)


def _versions(request: Request, name: str) -> list[str]:
    return [str(v) for v in request.app.state.runtimes.versions[name]]


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
            summary="Readiness of the server: started, not shutting down, and some served model's worker running "
            "(or no model served yet). One model's failures turn only its own /v2/models/{name}/ready")
async def ready(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    why = server_not_ready(runtimes)
    body: dict[str, Any] = {"ready": why is None}
    if why is not None:
        body["reason"] = why
    failing = {n: problem for n, problem in runtimes.problems().items() if n in runtimes.models}
    if failing:  # informational: the server stays ready while some model serves
        body["models_not_ready"] = len(failing)
        if authenticated(request.scope):  # an open route: no model names for a client without a key
            body["not_ready"] = failing
    # repository loads in progress (their previous versions, if any, serve meanwhile), for a client with a key
    if runtimes.loading and authenticated(request.scope):
        body["loading"] = {n: [str(v) for v in sorted(vs)] for n, vs in sorted(runtimes.loading.items())}
    return _json(body, 200 if why is None else 503)


def server_not_ready(runtimes: Runtimes) -> str | None:
    """Why the server as a whole should get no traffic, or None.

    A model's own trouble never counts: a model that keeps failing (its breaker, service.base.health) is only its own
    readiness, or five bad requests to one model would take every model of the server out of a load balancer, and
    with no traffic left to succeed the breaker would never reset. The server is not ready while it is not started
    or shutting down, or when it serves models but every one's batcher or decode loop has died (nothing could
    answer; a dead loop is a defect no request repairs). A server with no model served (all failed to load, or
    waiting for the repository API) is ready: the repository API answers.
    """
    if not runtimes.ready:
        return "not started or shutting down"
    if runtimes.models and all(not rt.worker.alive for rt in runtimes.models.values()):
        return "no served model's worker is running"
    return None


@router.get("/v2/models/{name}", summary="Model metadata", responses=error_responses(True, LOOKUP))
@router.get("/v2/models/{name}/versions/{version}", summary="Model metadata (one version)",
            responses=error_responses(True, LOOKUP))
async def model_metadata(name: str, request: Request, version: str | None = None) -> Response:
    rt = _model(request, name, version)
    inputs, outputs = io_spec(rt)
    for t in inputs:
        t.pop("optional", None)
    body: dict[str, Any] = {"name": rt.name, "versions": _versions(request, name),
                            "platform": rt.entry.backend.platform,
            "inputs": inputs, "outputs": outputs}
    fused = rt.entry.backend.describe().get("fused_multimax")  # ONNX Runtime: the CPU ops' state, as /v1/models
    if fused is not None:
        body["fused_multimax"] = fused  # an extension field; V2 clients ignore what they do not know
    body["attention_function"] = attention_function(rt.entry.config)  # extension, as in /v1/models
    body["output_function"] = output_function(rt.entry.config)  # extension: the outputs are the logits before it
    body["model_info"] = rt.entry.model_info()  # extension: architecture, MultiMax placement, tokenizer, context
    return _json(body)


@router.get("/v2/models/{name}/ready", summary="Model readiness", responses={400: _NOT_READY, 404: LOOKUP_404})
@router.get("/v2/models/{name}/versions/{version}/ready", summary="Model readiness (one version)",
            responses={400: _NOT_READY, 404: LOOKUP_404})
async def model_ready(name: str, request: Request, version: str | None = None) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    if name not in runtimes.models and name in runtimes.names():
        return _json({"name": name, "ready": False, "reason": runtimes.why_not(name)}, 400)
    rt = runtimes.get(name, version, list_served=False)  # an open route (a probe): it names no other model
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
        **rt.kserve_config(settings),  # a vision model's dynamic batching
    }
    return _json(config)


async def read_request(request: Request, limit: int, json_limit: int) -> tuple[dict[str, Any], bytes]:
    # JSON, or the binary-data extension (Triton's client sends that with no content type, or octet-stream)
    require_media(request, (JSON, "application/octet-stream"))
    return parse_body(await request.body(), request.headers.get("content-encoding", ""),
                      request.headers.get(HEADER_LENGTH), limit, json_limit)


def encode_response(rt: ModelRuntime, header: dict[str, Any], outputs: dict[str, np.ndarray]) -> Response:
    head, blobs = encode_outputs(rt.name, str(rt.version), header, outputs, rt.labels)
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
@model_endpoint("infer")
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    async with model_call(request, name) as call:
        settings = call.settings
        rt = call.hold(_model(request, name, version))
        rt.check_infer_room()  # a request that will get 429 is refused before its body is read
        with phase("preprocess"):
            header, binary = await read_request(request, settings.max_body_bytes, settings.max_json_bytes)
            tensors = decode_tensors(header, binary, settings.max_body_bytes)
        params = header.get("parameters") or {}
        timeout_us = params.get("timeout") if isinstance(params, dict) else None
        requested = timeout_us / 1e6 if isinstance(timeout_us, (int, float)) and timeout_us > 0 else None
        run = rt.kserve_call(header, tensors, settings)  # checked (400) before it queues
        result = await call.wait(run(call.deadline(requested)))
        call.timing(result.queue_s, result.compute_s)
        outputs = {LOGITS: result.output}
        with phase("encode"):
            if sum(v.size for v in outputs.values()) > OFF_LOOP_VALUES:
                response = await asyncio.to_thread(encode_response, rt, header, outputs)
            else:
                response = encode_response(rt, header, outputs)
    return response
