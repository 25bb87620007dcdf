"""One error type for everything a request can do wrong, and the two JSON shapes clients expect.

OpenAI-style endpoints answer `{"error": {"message", "type", "param", "code"}}`; the KServe V2
endpoints answer `{"error": "<message>"}` as that protocol specifies. Which shape is chosen by path.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.responses import Response

from service.base.context import current_id

log = logging.getLogger(__name__)

# outcome label of the requests counter, by status
# (401 and 403 are counted apart, under no model: an unauthenticated or cross-site client does not count against
# the model it named)
OUTCOME_BY_STATUS = {401: "unauthorized", 403: "forbidden", 429: "rejected", 413: "rejected", 503: "rejected",
                     504: "timeout", 408: "timeout", 499: "cancelled"}

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a wrong key (code invalid_api_key)
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


class ServiceError(Exception):
    """A request that cannot be served as asked; `status` is the HTTP status it gets."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def outcome(self) -> str:
        if self.status in OUTCOME_BY_STATUS:
            return OUTCOME_BY_STATUS[self.status]
        return "invalid_input" if self.status < 500 else "error"


def shown(text: str, limit: int = 64) -> str:
    """A client's value as an error message quotes it: repr, cut to `limit` characters (a path parameter or a
    field may be megabytes long; the answer and the log line stay short)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])(?:[A-Za-z]:)?[/\\](?:[^\s'\"/\\:]+[/\\])*([^\s'\"/\\:,;)]+)")


def without_paths(text: str) -> str:
    """`text` with every absolute file path cut to its file name: reasons shown on open routes (readiness, the
    repository index) must not tell an unauthenticated client where the server keeps its files."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1), text)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ServiceError:
    return ServiceError(400, message, param=param, code=code)


def openai_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    error = {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}
    request_id = current_id()
    if request_id is not None:
        error["request_id"] = request_id  # beside OpenAI's four fields: what to quote when reporting the error
    return {"error": error}


def kserve_body(message: str) -> dict[str, Any]:
    request_id = current_id()
    return {"error": message} if request_id is None else {"error": message, "request_id": request_id}


def is_kserve(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def error_response(path: str, status: int, message: str, *, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = kserve_body(message) if is_kserve(path) else openai_body(status, message, code, param)
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


# ---- OpenAPI: the error statuses each endpoint really returns, with their body shape ----------------------

_WHY = {
    400: "invalid request: malformed body, value out of range, tensor that does not fit the model",
    401: "missing or wrong API key (when the server has API keys)",
    403: "a browser request from an origin --cors-allow-origins does not allow (or, for load/unload, model "
         "control is disabled: --model-control none)",
    404: "unknown model, version or route",
    408: "request body not received within body_timeout_s",
    413: "body over max_body_bytes (JSON: over max_json_bytes), also once inflated; images over "
         "max_request_pixels together",
    415: "content type or encoding not accepted",
    422: "image that cannot be used (corrupt, too large, too small), or a model output that is not finite",
    429: "queue full; Retry-After says when to retry",
    500: "the model failed on this request's input (other requests are unaffected)",
    503: "server shutting down (or the model is not ready), or too many open connections",
    504: "deadline passed while the request was queued (or its images were being decoded)",
}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
                   "request_id": {"type": "string"}}}}}
_KSERVE_ERROR = {"type": "object", "required": ["error"],
                 "properties": {"error": {"type": "string"}, "request_id": {"type": "string"}}}

MODEL_CALL = (400, 403, 404, 408, 413, 415, 422, 429, 500, 503, 504)  # endpoints that run a model
LOOKUP = (404,)  # metadata of one model


def error_responses(kserve: bool, statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    schema = _KSERVE_ERROR if kserve else _OPENAI_ERROR
    return {status: {"description": _WHY[status], "content": {"application/json": {"schema": schema}}}
            for status in statuses}
