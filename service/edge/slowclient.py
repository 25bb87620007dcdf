"""Bounds on connections that uvicorn has not: how long a connection may take to send a request's headers, how
long it may stay open without sending anything, and how many may be open at once.

uvicorn closes idle keep-alive connections, but a client that sends one byte of a request line and then
trickles the rest (slowloris) holds its connection open forever. With this protocol the clock starts
at the connection's first byte (or the next request's first byte) and the headers must be complete
within `header_timeout_s`; otherwise the server answers 408 and closes. The body has its own bound
(`service.edge.middleware.BodyLimit`), which answers 408 as JSON.

A connection that never sends a byte is closed after `idle_timeout_s` (uvicorn's keep-alive timeout starts only
after a first response). Beyond `max_connections` open connections a new one is still accepted, but its
request is answered 503 (JSON, `Connection: close`) unless it is a health probe (a model's readiness too), and
it gets at most `OVER_LIMIT_IDLE_S` to send it: a flood of silent connections cannot hold the server's sockets, and the
probes of a load balancer or an orchestrator keep their answers while it lasts.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's C parser (httptools), as its http="auto" prefers: h11, pure Python, costs several times more
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; uvicorn's own fallback kept
    BaseProtocol = H11Protocol  # type: ignore[assignment,misc]

from service.base.errors import error_response

HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
MODEL_READY = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/ready")  # a model's readiness: a probe too
OVER_LIMIT_IDLE_S = 1.0  # a connection beyond the limit must send its request within this

# A request's line and headers may take this many bytes (h11 bounded them at 16 KiB; httptools, the faster parser
# used here, does not bound them at all): more is answered 431 and the connection closed, before it is buffered.
MAX_HEADER_BYTES = 64 * 1024


def _closing_reply(status: bytes, message: str, kind: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_408 = _closing_reply(b"408 Request Timeout", "request headers not received in time", "timeout", "header_timeout")
_431 = _closing_reply(b"431 Request Header Fields Too Large",
                      f"the request line and headers are over {MAX_HEADER_BYTES} bytes", "invalid_request_error",
                      "headers_too_large")


def over_limit_app(app: ASGIApp, limit: int) -> ASGIApp:
    """`app` for a connection beyond the limit: health probes as usual, everything else a clean 503."""
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS or MODEL_READY.fullmatch(scope["path"]):
            await app(scope, receive, send)
            return
        response = error_response(scope["path"], 503, f"too many open connections (the limit is {limit}): retry "
                                  "later", code="too_many_connections",
                                  headers={"Connection": "close", "Retry-After": "1"})
        await response(scope, receive, send)
    return refuse


class HeaderTimeoutProtocol(BaseProtocol):
    header_timeout_s = 10.0
    idle_timeout_s = 10.0
    max_connections = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # of the request whose headers are still coming
        self._header_tail = b""  # its last 3 bytes: the blank line that ends the headers may span two reads
        super().connection_made(transport)
        idle = self.idle_timeout_s
        if len(self.connections) > self.max_connections:
            self.app = over_limit_app(self.app, self.max_connections)
            idle = min(idle, OVER_LIMIT_IDLE_S)
        self._idle_timer: asyncio.TimerHandle | None = self.loop.call_later(idle, self._silent_too_long)

    def _silent_too_long(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            self.transport.close()  # it never said anything: nothing to answer

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._between_requests():
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)
                self._header_bytes, self._header_tail = 0, b""
            if self._headers_too_long(data):
                return
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and self._header_timer is not None:  # a request's headers are complete
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_long(self, data: bytes) -> bool:
        """Count the request head's bytes up to the blank line that ends it; over MAX_HEADER_BYTES: 431, closed,
        and `data` never reaches the parser."""
        window = self._header_tail + data
        end = window.find(b"\r\n\r\n")
        self._header_bytes += end + 4 - len(self._header_tail) if end >= 0 else len(data)
        self._header_tail = window[-3:]
        if self._header_bytes <= MAX_HEADER_BYTES or self.transport.is_closing():
            return False
        self.transport.write(_431)
        self.transport.close()
        return True

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.write(_408)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._idle_timer = None
        super().connection_lost(exc)


def header_timeout_protocol(seconds: float, idle_timeout_s: float = 10.0, max_connections: int = 1000) -> Any:
    """The protocol class to give uvicorn (`http=`), with its timeouts and connection limit set."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {
        "header_timeout_s": seconds, "idle_timeout_s": idle_timeout_s, "max_connections": max_connections})
