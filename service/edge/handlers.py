"""The app's exception handlers: every error, whatever raised it, in the JSON shape of its endpoint's protocol
(see service.base.errors), counted once in the request metrics."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.base.errors import ServiceError, error_response
from service.engine.engine_errors import EngineError
from service.protocols.endpoint import count_refused
from service.protocols.engine_status import http_error
from service.protocols.lifecycle import CountedHTTPException

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def _without_fastapi_422(app: FastAPI) -> None:
    """FastAPI documents a 422 `HTTPValidationError` for every route with parameters; this server answers
    validation failures with 400 in its own shape, so those 422s are never returned and leave the schema."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for op in operations.values():
                    responses = op.get("responses", {})
                    if "HTTPValidationError" in json.dumps(responses.get("422", {})):
                        del responses["422"]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def install_handlers(app: FastAPI) -> None:
    _without_fastapi_422(app)
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(request.url.path, exc.status, exc.message, code=exc.code, param=exc.param,
                              headers=exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> Response:
        # Model endpoints map these in `lifecycle.tracked`; this catches one raised outside a tracked call.
        return await _service_error(request, http_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        count_refused(request.app, request.scope, 400)
        return error_response(request.url.path, 400, message, code="invalid_value", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = {413: "body_too_large", 408: "body_timeout", 499: "client_disconnected"}.get(exc.status_code)
        if exc.status_code != 404 and not isinstance(exc, CountedHTTPException):
            count_refused(request.app, request.scope, exc.status_code)  # refused before the endpoint ran
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(request.url.path, exc.status_code, message, code=code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # Reached only by an exception outside service.edge.middleware.ContainErrors (in a middleware): Starlette
        # re-raises it after this response and uvicorn then drops the connection, so the response says so.
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}", code="internal_error",
                              headers={"Connection": "close"})
