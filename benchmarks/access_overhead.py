"""What request ids, API keys and tracing cost per request: each layer alone around a trivial ASGI app.

    python -m benchmarks.access_overhead [--rounds 7] [--requests 20000]

Contenders, interleaved round after round: the bare app; request tracking with the client's X-Request-Id;
with an id it must generate; the API-key check against three keys; request tracking with an OpenTelemetry
request span (SDK, batched to an exporter that drops them). Each round calls each contender `--requests`
times in a loop (no network, no HTTP parsing, no model), so what remains is the layer's own cost; the result
is the median over rounds of (contender - bare), in microseconds per request, and of the ratio.

Then whole requests, as a user sees the cost: `--app-requests` sequential classifications of one 32x32 PNG
through the full app in-process (httpx's ASGI transport, the digits model on ONNX Runtime), with tracing off
and on (request span and its five child spans), interleaved the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.base.tracing import tracer_of
from service.edge.access import RequestTracking
from service.edge.auth import ApiKeyAuth, OpenPaths

HEADERS = [(b"host", b"bench"), (b"user-agent", b"bench"), (b"accept", b"*/*"), (b"authorization", b"Bearer k3")]
WITH_ID = [*HEADERS, (b"x-request-id", b"bench-1")]


async def bare(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _receive() -> Message:
    return {"type": "http.request", "body": b""}


async def _send(message: Message) -> None:
    pass


def _drop_processor() -> Any:
    """Batched export, as in production, to an exporter that drops the spans."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    return BatchSpanProcessor(Drop())


def _provider() -> Any:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    provider.add_span_processor(_drop_processor())
    return provider


async def _seconds_per_request(app: ASGIApp, headers: list[tuple[bytes, bytes]], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers, "query_string": b""}
        await app(scope, _receive, _send)
    return (time.perf_counter() - start) / n


def _png() -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


async def whole_requests(rounds: int, requests: int) -> None:
    import httpx

    from service.base.config import Settings
    from service.edge.app import create_app

    provider = _provider()
    apps = {"tracing off": create_app(Settings(models=("digits_multimax",))),
            "tracing on": create_app(Settings(models=("digits_multimax",)), tracer_provider=provider)}
    image = _png()
    times: dict[str, list[float]] = {name: [] for name in apps}
    for app in apps.values():
        app.state.runtimes.start()
    try:
        for i in range(rounds):
            for name, app in apps.items():
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as client:
                    start = time.perf_counter()
                    for _ in range(requests):
                        r = await client.post("/v1/models/digits_multimax/classify", content=image,
                                              headers={"content-type": "image/png"})
                        assert r.status_code == 200, r.text
                    times[name].append((time.perf_counter() - start) / requests)
            print(f"round {i + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.3f} ms" for n, t in times.items()), flush=True)
    finally:
        for app in apps.values():
            await app.state.runtimes.stop()
    off, on = times["tracing off"], times["tracing on"]
    extra = statistics.median(b - a for a, b in zip(off, on, strict=True))
    ratio = statistics.median(b / a for a, b in zip(off, on, strict=True))
    print(f"classify with tracing: +{extra * 1e6:.0f} us per request ({ratio:.3f} x without; median of {rounds} "
          f"rounds; {statistics.median(off) * 1e3:.2f} ms per request without)")


async def run(rounds: int, requests: int) -> None:
    contenders: dict[str, tuple[ASGIApp, list[tuple[bytes, bytes]]]] = {
        "bare app": (bare, WITH_ID),
        "request id (client's)": (RequestTracking(bare), WITH_ID),
        "request id (generated)": (RequestTracking(bare), HEADERS),
        "API key (3 keys)": (ApiKeyAuth(bare, ("k1", "k2", "k3"), OpenPaths(False, False)), WITH_ID),
        "request id + trace span": (RequestTracking(bare, tracer=tracer_of(_provider())), WITH_ID),
    }
    base = next(iter(contenders))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(rounds):
        for name, (app, headers) in contenders.items():
            times[name].append(await _seconds_per_request(app, headers, requests))
        print(f"round {i + 1}: " + ", ".join(f"{n} {t[-1] * 1e6:.2f} us" for n, t in times.items()), flush=True)
    for name, values in times.items():
        if name == base:
            continue
        extra = statistics.median(v - b for v, b in zip(values, times[base], strict=True))
        ratio = statistics.median(v / b for v, b in zip(values, times[base], strict=True))
        print(f"{name}: +{extra * 1e6:.2f} us per request ({ratio:.2f} x the bare app; median of {rounds} rounds)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.access_overhead",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--app-requests", type=int, default=300)
    args = parser.parse_args(argv)
    asyncio.run(run(args.rounds, args.requests))
    asyncio.run(whole_requests(args.rounds, args.app_requests))


if __name__ == "__main__":
    main()
