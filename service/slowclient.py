"""A bound on how long a connection may take to send a request's headers (uvicorn has none).

uvicorn closes idle keep-alive connections, but a client that sends one byte of a request line and then
trickles the rest (slowloris) holds its connection open forever. With this protocol the clock starts
at the connection's first byte (or the next request's first byte) and the headers must be complete
within `header_timeout_s`; otherwise the server answers 408 and closes. The body has its own bound
(`service.middleware.BodyLimit`), which answers 408 as JSON.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY = json.dumps({"error": {"message": "request headers not received in time", "type": "timeout", "param": None,
                              "code": "header_timeout"}}).encode()
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._between_requests() and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and self._header_timer is not None:  # a request's headers are complete
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.write(_408)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def header_timeout_protocol(seconds: float) -> Any:
    """The protocol class to give uvicorn (`http=`), with its header timeout set."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})
