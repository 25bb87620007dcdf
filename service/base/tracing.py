"""OpenTelemetry tracing (optional extra `otel`): one span per request, with child spans for its phases.

    request span "POST /v1/models/{name}/classify"   (service.edge.access; attributes: request id, model, endpoint)
      preprocess   reading and decoding the body into model inputs (`phase`)
      queue        waiting for a batch / a decode slot                (`record_timing`, from the measured times)
      model        the model call (for a stream: until the first token)
      encode       building the response body (`phase`)

Nothing here imports OpenTelemetry unless tracing is configured, and every helper is a no-op for a request
without a span, so tracing costs nothing when it is off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

from service.base.context import current

OTEL_EXTRA_HINT = "pip install 'multimax-serve[otel]' (opentelemetry-sdk and the OTLP exporter)"
TRACER_NAME = "multimax-serve"


class TracingUnavailable(ValueError):
    pass


def require_otel() -> None:
    """Raise TracingUnavailable (a ValueError: exit code 2 at start) when the otel extra is not installed."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(f"otlp_endpoint needs the otel extra, which is not installed ({exc}): "
                                 f"{OTEL_EXTRA_HINT}") from None


def otlp_tracer_provider(endpoint: str) -> Any:
    """A TracerProvider that batches spans to an OTLP/HTTP endpoint (service.name from OTEL_SERVICE_NAME, else
    multimax-serve). The exporter sends in a background thread: a slow collector never holds up a request."""
    require_otel()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": TRACER_NAME}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def tracer_of(provider: Any) -> Any:
    return None if provider is None else provider.get_tracer(TRACER_NAME)


def start_request_span(tracer: Any, method: str, headers: Iterable[tuple[bytes, bytes]]) -> Any:
    """The server span of one request (ASGI headers), continuing the client's trace when it sent a W3C
    traceparent."""
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    # extract() only when there is something to continue: a span under an extracted empty context costs the SDK
    # about 20 us more than one without (measured with timeit on this machine).
    parent = None
    if any(k == b"traceparent" for k, _ in headers):
        parent = extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers})
    return tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes={"http.request.method": method})


def end_request_span(span: Any, method: str, route: str | None, path: str, status: int, request_id: str,
                     model: str | None, endpoint: str | None, error: BaseException | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.update_name(f"{method} {route}" if route else method)  # (no raw paths in names: unbounded)
    span.set_attribute("url.path", path)
    if route:
        span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("multimax.request_id", request_id)
    if model:
        span.set_attribute("multimax.model", model)
    if endpoint:
        span.set_attribute("multimax.endpoint", endpoint)
    if error is not None:
        span.record_exception(error)
    if status >= 500 or error is not None:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def _child_attributes() -> dict[str, str]:
    ctx = current()
    assert ctx is not None
    attrs = {"multimax.request_id": ctx.request_id}
    if ctx.model:
        attrs["multimax.model"] = ctx.model
    return attrs


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A child span of the current request around a block (no-op without tracing)."""
    ctx = current()
    if ctx is None or ctx.span is None or not ctx.span.is_recording():  # (a request the sampler left out)
        yield
        return
    from opentelemetry.trace import set_span_in_context

    span = ctx.tracer.start_span(name, context=set_span_in_context(ctx.span), attributes=_child_attributes())
    try:
        yield
    except BaseException as exc:
        span.record_exception(exc)
        raise
    finally:
        span.end()


def record_timing(queue_s: float, compute_s: float) -> None:
    """Child spans `queue` and `model` of the current request, placed from measured durations that ended now
    (the batch ran on a worker thread for several requests: its times are measured there, not spanned)."""
    ctx = current()
    if ctx is None or ctx.span is None or not ctx.span.is_recording():
        return
    from opentelemetry.trace import set_span_in_context

    parent = set_span_in_context(ctx.span)
    end = time.time_ns()
    model_start = end - int(compute_s * 1e9)
    queue_start = model_start - int(queue_s * 1e9)
    for name, start, stop in (("queue", queue_start, model_start), ("model", model_start, end)):
        span = ctx.tracer.start_span(name, context=parent, start_time=start, attributes=_child_attributes())
        span.end(end_time=stop)
