"""Pure ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect detection).

* `ServerTiming`: every response carries `Server-Timing: queue;dur=..., compute;dur=..., total;dur=...`
  (milliseconds); endpoints that queue or compute fill in those two through `request.state.timing`.
* `BodyLimit`: a body over the limit is refused with 413, from its Content-Length before anything is
  read, or while it streams in when no length was declared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_response
from service.lifecycle import count_refused


@dataclass
class Timing:
    queue_s: float = 0.0
    compute_s: float = 0.0

    def set(self, queue_s: float, compute_s: float) -> None:
        self.queue_s, self.compute_s = queue_s, compute_s


class ServerTiming:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
                    count_refused(scope.get("app"), scope["path"], status)
                    response = error_response(scope["path"], status, message,
                                              code="body_too_large" if too_large else "invalid_header",
                                              headers={"Connection": "close"})
                    await response(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # the app's HTTPException handler answers 413
            return message

        await self.app(scope, limited_receive, send)
