"""The outermost layer of the app: each request's id, its access log line and its trace span.

It wraps everything, Starlette's error middleware included, so every response carries `X-Request-Id`: errors
answered by middleware (401, 413, 408), the 500 of an unexpected exception, streams. The id is the client's
`X-Request-Id` when that follows the rule (service.base.context.ID_RULE), else a new one; a request whose id breaks
the rule is answered 400 (under a new id) rather than silently renamed, so the client learns that its id
was not used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.routing import Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.base.context import CURRENT, HEADER, ID_RULE, RequestContext, new_id, valid_id
from service.base.errors import error_response
from service.base.tracing import end_request_span, start_request_span

access_log = logging.getLogger("service.access")
MAX_LOGGED_PATH = 256


def printable(text: str, limit: int = MAX_LOGGED_PATH) -> str:
    """A client-chosen string made safe for a log line (no newlines or control characters), bounded."""
    text = text[:limit]
    return text if text.isprintable() else ascii(text)[1:-1]


def _client_id(scope: Scope) -> tuple[str | None, bool]:
    """(the client's request id, whether it is acceptable); (None, True) when it sent none."""
    for name, value in scope.get("headers", ()):
        if name == HEADER.encode():
            text = value.decode("latin-1")
            return text, valid_id(text)
    return None, True


class RequestTracking:
    def __init__(self, app: ASGIApp, tracer: Any = None, log_requests: bool = False,
                 response_header: bool = True) -> None:
        self.app = app
        self.tracer = tracer
        self.log_requests = log_requests
        self.response_header = response_header  # off under Ray Serve, whose proxy adds the same header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        client_id, acceptable = _client_id(scope)
        request_id = client_id if client_id is not None and acceptable else new_id()
        ctx = RequestContext(request_id)
        if self.tracer is not None:
            ctx.span = start_request_span(self.tracer, scope["method"], scope.get("headers", ()))
            ctx.tracer = self.tracer
        token = CURRENT.set(ctx)
        status = 500  # until a response starts: what Starlette answers an exception that escapes the app
        header = (HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.response_header:
                    message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        error: BaseException | None = None
        try:
            if not acceptable:
                response = error_response(scope["path"], 400, f"X-Request-Id must be {ID_RULE}",
                                          code="invalid_request_id", param="X-Request-Id")
                await response(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except BaseException as exc:
            error = exc
            if isinstance(exc, asyncio.CancelledError) and status == 500:
                status = 499  # cancelled before an answer: the client left (or the shutdown grace ran out)
            raise
        finally:
            try:
                self._finish(scope, ctx, status, start, error)
            finally:
                CURRENT.reset(token)

    def _finish(self, scope: Scope, ctx: RequestContext, status: int, start: float,
                error: BaseException | None) -> None:
        route = route_path(scope.get("route"))
        if ctx.span is not None:
            end_request_span(ctx.span, scope["method"], route, scope["path"], status, ctx.request_id, ctx.model,
                             ctx.endpoint, error)
        if not self.log_requests:
            return
        timing = (scope.get("state") or {}).get("timing")
        fields: dict[str, Any] = {
            "method": scope["method"], "path": printable(scope["path"]), "status": status,
            "duration_ms": round((time.perf_counter() - start) * 1000, 3),
            "client": (scope.get("client") or ("-",))[0],
        }
        if timing is not None and ctx.endpoint is not None:  # a model endpoint: it queued and computed
            fields |= {"queue_ms": round(timing.queue_s * 1000, 3), "compute_ms": round(timing.compute_s * 1000, 3)}
        access_log.info("%s %s %d %.1f ms", fields["method"], fields["path"], status, fields["duration_ms"],
                        extra=fields)


def route_path(route: Any) -> str | None:
    """The path template of the route a request matched ("/v2/models/{name}/infer"), None for none (or a host)."""
    return route.path if isinstance(route, (Route, WebSocketRoute, Mount)) else None
