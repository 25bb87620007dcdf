"""Pure ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect detection).

* `ServerTiming`: every response carries `Server-Timing: queue;dur=..., compute;dur=..., total;dur=...`
  (milliseconds); endpoints that queue or compute fill in those two through `request.state.timing`.
* `BodyLimit`: a body over the limit is refused with 413, from its Content-Length before anything is
  read, or while it streams in when no length was declared; a body that takes longer than its time
  limit to arrive gets 408; a client that disconnects while uploading ends its request as cancelled
  (499, counted as `cancelled`), not as a server error.
* `ContainErrors` (innermost): an exception no handler took is the app's JSON 500 here, and the keep-alive
  connection stays usable (see the class).
* `GraceExpiry`: when uvicorn's shutdown grace period runs out it cancels the requests still running;
  one not yet answered gets the documented JSON 503, a running stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.base.errors import error_response, openai_body
from service.protocols.endpoint import count_refused

log = logging.getLogger(__name__)


@dataclass
class Timing:
    queue_s: float = 0.0
    compute_s: float = 0.0

    def set(self, queue_s: float, compute_s: float) -> None:
        self.queue_s, self.compute_s = queue_s, compute_s


class HttpMiddleware:
    """Passes everything but HTTP (lifespan) straight through; subclasses implement `handle`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class ServerTiming(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        timing = Timing()
        scope.setdefault("state", {})["timing"] = timing

        async def send_with_timing(message: Message) -> None:
            if message["type"] == "http.response.start":
                total = (time.perf_counter() - start) * 1000
                value = f"queue;dur={timing.queue_s * 1000:.3f}, compute;dur={timing.compute_s * 1000:.3f}, " \
                        f"total;dur={total:.3f}"
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"server-timing", value.encode())]
            await send(message)

        await self.app(scope, receive, send_with_timing)


class BodyTooLarge(HTTPException):
    """An HTTPException, not a ServiceError: FastAPI passes those through when they happen while it reads a
    body for validation (anything else there becomes a 400 "error parsing the body")."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyTimeout(HTTPException):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"request body not received within {seconds:g} s", headers={"Connection": "close"})


class UploadAbandoned(HTTPException):
    """The client disconnected before its body was complete: nobody will read the answer."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected while uploading")


class BodyLimit(HttpMiddleware):
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > self.max_bytes:
                    too_large = declared > self.max_bytes
                    status = 413 if too_large else 400
                    message = BodyTooLarge(self.max_bytes).detail if too_large else "invalid Content-Length"
                    count_refused(scope.get("app"), scope, status)
                    response = error_response(scope["path"], status, message,
                                              code="body_too_large" if too_large else "invalid_header",
                                              headers={"Connection": "close"})
                    await response(scope, receive, send)
                    return
        received = 0
        complete = False
        due = None if self.timeout_s is None else time.monotonic() + self.timeout_s

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete or due is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, due - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyTimeout(self.timeout_s or 0.0) from None  # answered 408 by the app's handler
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # the app's HTTPException handler answers 413
            elif message["type"] == "http.disconnect" and not complete:
                raise UploadAbandoned()
            return message

        await self.app(scope, limited_receive, send)


class GraceExpiry(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started: dict[bytes, bytes] = {}
        finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.start":
                started.update((k.lower(), v) for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if finished:
                raise
            # uvicorn cancels the requests still running when its shutdown grace period is over: answer them.
            message = "server is shutting down: the request did not finish within the shutdown grace period"
            if not started:
                response = error_response(scope["path"], 503, message, code="shutting_down",
                                          headers={"Connection": "close", "Retry-After": "1"})
                await response(scope, receive, send)
            elif started.get(b"content-type", b"").startswith(b"text/event-stream"):
                body = openai_body(503, message, "shutting_down")
                event = b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                raise


class ContainErrors(HttpMiddleware):
    """An exception that no exception handler took, answered as the app's JSON 500 inside the middleware stack.

    Left to Starlette's outermost error middleware, the same 500 is sent and the exception then re-raised, and
    uvicorn closes the keep-alive connection without having said `Connection: close`: a client's next request on
    it fails with a connection error. Answered here, nothing is re-raised and the connection serves on. An
    exception after the response started (a stream) still propagates: the body is cut, the connection must end."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            response = error_response(str(scope.get("path", "")), 500, f"internal error: {type(exc).__name__}",
                                      code="internal_error")
            await response(scope, receive, send)
