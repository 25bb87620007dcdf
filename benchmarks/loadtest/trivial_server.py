"""A deliberately trivial HTTP/1.1 server (raw asyncio protocol, keep-alive, pipelining) for measuring the load
generator itself: it answers every request with a fixed small JSON body and a Server-Timing header, and serves
a one-counter Prometheus page at /metrics. It stops by itself after --duration seconds.

    python -m benchmarks.loadtest.trivial_server --port 8099 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

BODY = b'{"ok":true}'
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nServer-Timing: queue;dur=0.000, "
            b"compute;dur=0.001\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


class Counter:
    requests = 0


class TrivialHTTP(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:  # every complete request in the buffer (clients may pipeline)
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            length = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17: j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            del self.buf[:total]
            Counter.requests += 1
            if head.startswith(b"get /metrics "):
                text = (b"# TYPE trivial_requests counter\ntrivial_requests_total " + str(Counter.requests).encode()
                        + b"\n")
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                     b"Content-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
            else:
                self.transport.write(RESPONSE)


async def serve(host: str, port: int, duration_s: float, ready: asyncio.Event | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(TrivialHTTP, host, port, backlog=1024, reuse_address=True)
    print(f"trivial server on http://{host}:{port} for {duration_s:g} s", flush=True)
    if ready is not None:
        ready.set()
    async with server:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.serve_forever(), duration_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadtest.trivial_server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8099)
    p.add_argument("--duration", type=float, default=300.0, help="exit after S seconds (default %(default)s)")
    p.add_argument("--no-uvloop", action="store_true", help="use the standard asyncio loop")
    args = p.parse_args(argv)
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
    asyncio.run(serve(args.host, args.port, args.duration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
