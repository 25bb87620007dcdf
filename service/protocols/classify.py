"""`POST /v1/models/{name}/classify`: decode request -> (dynamic batch -> predict -> unbatch) -> encode response.

An image arrives as the raw body (`image/png`, `image/jpeg`, ...), as a multipart upload (every file
part is one image), or as JSON `{"images": [base64, ...]}` (data URLs accepted). Each image is decoded
and preprocessed on its own, so a broken one fails only its request, before anything is batched.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.datastructures import UploadFile
from starlette.responses import Response

from service.base.bodies import media_type, read_body
from service.base.errors import MODEL_CALL, ServiceError, bad_request, error_responses
from service.base.jsonio import check_size, dumps, loads, non_finite_error
from service.base.tracing import phase
from service.engine.batcher import BatchResult
from service.engine.decoding import DecodePool
from service.engine.runtime import VisionRuntime, output_probabilities
from service.engine.vision import Preprocess, header_pixels, load_and_preprocess
from service.protocols.endpoint import model_call, model_endpoint

router = APIRouter(tags=["classification"])
T = TypeVar("T")

_BINARY = {"schema": {"type": "string", "format": "binary"}}
OPENAPI_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "image/png": _BINARY,
            "image/jpeg": _BINARY,
            "image/webp": _BINARY,
            "application/octet-stream": _BINARY,
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}},
                           "required": ["file"]},
            },
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"images": {"type": "array", "items": {"type": "string", "format": "byte"},
                                              "minItems": 1}},
                    "required": ["images"],
                },
            },
        },
    },
}


class Prediction(BaseModel):
    label: str
    index: int
    probability: float


class ClassificationResponse(BaseModel):
    model: str
    object: str = "classification"
    predictions: list[list[Prediction]]  # per image, the top-k labels by probability


def _b64(item: Any, index: int) -> bytes:
    if not isinstance(item, str):
        raise bad_request(f"images[{index}] must be a base64 string, got {type(item).__name__}", "images")
    if item.startswith("data:"):
        item = item.split(",", 1)[-1]  # data:image/png;base64,....
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"images[{index}] is not valid base64", "images") from None


def _images_json(body: bytes, limit: int, json_limit: int) -> list[bytes]:
    # Base64 has no commas: more than two per image (one in a data URL) means a body of many small values,
    # the kind that is slow to parse. Counting them is C-speed, so such a body costs nothing to refuse.
    if body.count(b",") > 2 * limit + 8:
        check_size(len(body), json_limit)
    payload = loads(body)
    images = payload.get("images") if isinstance(payload, dict) else None
    if not isinstance(images, list) or not images:
        raise bad_request('JSON body must be {"images": [base64, ...]} with at least one image', "images")
    if len(images) > limit:
        raise bad_request(f"at most {limit} images per request, got {len(images)}", "images")
    return [_b64(item, i) for i, item in enumerate(images)]


async def read_images(request: Request, limit: int, json_limit: int, body_limit: int) -> list[bytes]:
    """decode_request, first half: the request's image files as bytes (4xx for a malformed request)."""
    media = media_type(request)
    if media.startswith("image/") or media == "application/octet-stream":
        return [await read_body(request, body_limit)]
    if media == "multipart/form-data":
        if request.headers.get("content-encoding", "identity").strip().lower() != "identity":
            raise ServiceError(415, "Content-Encoding is not supported with multipart/form-data: compress the "
                               "parts' files, or send the images raw or as JSON", code="bad_encoding")
        form = await request.form(max_files=limit + 1, max_fields=limit + 16)
        try:
            files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not files:
                raise bad_request("multipart upload without a file part", "file")
            if len(files) > limit:
                raise bad_request(f"at most {limit} images per request, got {len(files)}", "file")
            return [await f.read() for f in files]
        finally:
            await form.close()
    if media == "application/json":
        return _images_json(await read_body(request, body_limit), limit, json_limit)
    shown = media or "none"
    raise ServiceError(415, f"content type {shown} not accepted: send an image (image/png, image/jpeg, ...), "
                            "multipart/form-data or application/json", code="unsupported_media_type")


def _numbered(i: int, count: int, work: Callable[[], T]) -> Callable[[], T]:
    """`work`, whose 4xx names the image it is about when the request has several."""
    def run() -> T:
        try:
            return work()
        except ServiceError as exc:
            if count > 1:
                exc.message = f"images[{i}]: {exc.message}"
            raise
    return run


def _admit(blobs: list[bytes], rt: VisionRuntime, min_side: int) -> list[int]:
    """Each image's pixels from its header, within the per-image limit and, all together, the request's budget:
    nothing is decoded for a request that would be refused."""
    pixels = [_numbered(i, len(blobs), partial(header_pixels, b, rt.max_image_pixels, min_side))()
              for i, b in enumerate(blobs)]
    if sum(pixels) > rt.max_request_pixels:
        raise ServiceError(413, f"{len(blobs)} images of {sum(pixels)} pixels in all exceed the limit of "
                           f"{rt.max_request_pixels} pixels per request (max_request_pixels)", code="image_too_large")
    return pixels


async def decode_request(request: Request, rt: VisionRuntime, settings: Any, due: float) -> np.ndarray:
    """The request as model rows (n, C, H, W): read; admit from the images' headers (one worker-thread hop);
    then decode and preprocess every image on the shared decode pool, by the request's deadline `due`."""
    blobs = await read_images(request, settings.max_images_per_request, settings.max_json_bytes,
                              settings.max_body_bytes)
    pixels = await asyncio.to_thread(_admit, blobs, rt, settings.min_image_side)
    pool: DecodePool = request.app.state.runtimes.decoder
    pool.check_room(pixels, due)
    jobs = [(n, _numbered(i, len(blobs), partial(_decode_one, blob, rt.preprocess, rt.max_image_pixels,
                                                 settings.min_image_side)))
            for i, (n, blob) in enumerate(zip(pixels, blobs, strict=True))]
    rows: list[np.ndarray] = await pool.run(jobs, due)
    return np.stack(rows)


def _decode_one(blob: bytes, spec: Preprocess, max_pixels: int, min_side: int) -> np.ndarray:
    return load_and_preprocess(blob, spec, max_pixels, min_side)  # (looked up at call time: tests record it)


def encode_response(name: str, labels: list[str], probs: np.ndarray, top_k: int) -> dict[str, Any]:
    k = min(top_k, probs.shape[-1])
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    predictions = [
        [{"label": labels[j] if j < len(labels) else str(j), "index": int(j), "probability": float(row[j])}
         for j in idx]
        for row, idx in zip(probs, order, strict=True)
    ]
    return {"model": name, "object": "classification", "predictions": predictions}


QUERY_PARAMETERS = [
    {"name": "top_k", "in": "query", "required": False, "description": "labels to return per image (at most the "
     "class count)", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 5}},
    {"name": "timeout", "in": "query", "required": False, "description": "seconds; shortens the server's deadline",
     "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600}},
]


def query_params(request: Request) -> tuple[int, float | None]:
    """top_k and timeout, parsed by hand: FastAPI's parameter machinery costs more than the model on small
    images (the OpenAPI schema still documents both, through QUERY_PARAMETERS)."""
    q = request.query_params
    try:
        top_k = int(q.get("top_k", 5))
    except ValueError:
        raise bad_request("top_k: must be an integer", "top_k") from None
    if not 1 <= top_k <= 1000:
        raise bad_request("top_k: must be in 1..1000", "top_k")
    timeout = None
    if "timeout" in q:
        try:
            timeout = float(q["timeout"])
        except ValueError:
            raise bad_request("timeout: must be a number of seconds", "timeout") from None
        if not 0 < timeout <= 3600:  # also refuses NaN
            raise bad_request("timeout: must be in (0, 3600] seconds", "timeout")
    return top_k, timeout


@router.post("/v1/models/{name}/classify", openapi_extra=OPENAPI_BODY | {"parameters": QUERY_PARAMETERS},
             response_class=Response,
             responses={200: {"model": ClassificationResponse, "description": "top-k labels per image"},
                        **error_responses(False, MODEL_CALL)},
             summary="Classify images: top-k labels with probabilities")
@model_endpoint("classify")
async def classify(name: str, request: Request) -> Response:
    async with model_call(request, name) as call:
        settings = call.settings
        top_k, timeout = query_params(request)
        rt = call.runtime(name, VisionRuntime)
        rt.batcher.check_room()  # a request that will get 429 is refused before its body is read
        due = call.deadline(timeout)  # decoding counts against the deadline too
        with phase("preprocess"):
            rows = await decode_request(request, rt, settings, due)
        step = settings.max_batch_size
        chunks = [rows[i:i + step] for i in range(0, len(rows), step)]
        futures = [rt.batcher.enqueue(c, due) for c in chunks]
        work = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        try:
            done = await call.wait(work)
        finally:
            for f in futures:
                f.cancel()  # client gone or a sibling chunk failed: drop what has not started (no-op when done)
        results = cast(list[BatchResult], done if isinstance(done, list) else [done])
        call.timing(max(r.queue_s for r in results), max(r.compute_s for r in results))
        probs = output_probabilities(rt.output_function, np.concatenate([r.output for r in results]))
        if not np.isfinite(probs).all():
            raise non_finite_error("probabilities")
        with phase("encode"):
            body = dumps(encode_response(name, rt.labels, probs, top_k))
    return Response(body, media_type="application/json")
