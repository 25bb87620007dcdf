"""Tracing a request (issue 14): request ids, text and JSON logs, OpenTelemetry spans. In-process through TestClient,
plus one uvicorn thread for the OTLP exporter's real socket."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.base.config import Settings, load_settings
from service.base.context import MAX_ID_LENGTH
from service.base.logs import configure_logging
from service.edge.app import create_app
from tests.service.edge.support import MODEL, TEXT, png

# ---- request ids --------------------------------------------------------------------------------------------


def test_a_request_without_an_id_gets_a_new_one_each_time(open_client: TestClient) -> None:
    ids = {open_client.get("/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)


@pytest.mark.parametrize("rid", ["abc-123", "0af7651916cd43dd8448eb211c80319c", "a" * MAX_ID_LENGTH,
                                 "01HZX3K2:trace/7+x=@.y_z"])
def test_a_valid_client_id_is_kept(open_client: TestClient, rid: str) -> None:
    r = open_client.get("/v1/models", headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid


@pytest.mark.parametrize("rid", ["a" * (MAX_ID_LENGTH + 1), "has space", "semi;colon", "quote\"", "tab\tx",
                                 "bell\x07", "ünïcode", "<script>"])
def test_a_hostile_client_id_is_refused_under_a_new_id(open_client: TestClient, rid: str) -> None:
    r = open_client.get("/v1/models", headers={"X-Request-Id": rid.encode()})
    assert r.status_code == 400
    new = r.headers["x-request-id"]
    assert new != rid and len(new) == 32
    error = r.json()["error"]
    assert error["code"] == "invalid_request_id" and error["request_id"] == new
    assert rid not in r.text  # not echoed
    r = open_client.get("/v2/health/live", headers={"X-Request-Id": rid.encode()})
    assert r.status_code == 400 and r.json() == {"error": r.json()["error"], "request_id": r.headers["x-request-id"]}


def test_every_error_carries_the_id_in_header_and_body(open_client: TestClient) -> None:
    rid = {"X-Request-Id": "err-1"}
    cases = [
        (open_client.get("/v1/models/nope", headers=rid), False),  # 404 from a handler
        (open_client.get("/no/such/route", headers=rid), False),  # 404 from the router
        (open_client.post("/v1/completions", json={"model": TEXT}, headers=rid), False),  # 400 validation
        (open_client.post(f"/v1/models/{MODEL}/classify", content=b"x", headers={**rid, "content-type": "text/x"}),
         False),  # 415
        (open_client.post(f"/v2/models/{MODEL}/infer", content=b"{", headers=rid), True),  # KServe 400
        (open_client.get("/v2/models/nope", headers=rid), True),
    ]
    for r, kserve in cases:
        assert 400 <= r.status_code < 500 and r.headers["x-request-id"] == "err-1", r.text
        body = r.json()
        assert (body["request_id"] if kserve else body["error"]["request_id"]) == "err-1"


def test_middleware_answers_carry_the_id() -> None:
    """413 from the body limit (before routing) and 500 from an unexpected exception (Starlette's outermost
    error middleware) still carry the id."""
    app = create_app(Settings(models=(MODEL,), max_body_bytes=100))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unexpected")

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(f"/v1/models/{MODEL}/classify", content=b"\0" * 500,
                        headers={"content-type": "image/png", "X-Request-Id": "big-1"})
        assert r.status_code == 413 and r.headers["x-request-id"] == "big-1"
        assert r.json()["error"]["request_id"] == "big-1"
        r = client.get("/boom", headers={"X-Request-Id": "boom-1"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "boom-1"
        assert r.json()["error"]["request_id"] == "boom-1"


def test_concurrent_requests_each_get_their_own_id_even_when_refused() -> None:
    """429 (queue full) and 504 (deadline) answered while other requests run: each response, and each log
    line, carries its own request's id (the context never leaks between concurrent requests)."""
    from tests.service.support import slow_vision, started

    app = create_app(Settings(models=(MODEL,), max_batch_size=1, max_queue_size=2))
    calls: list[int] = []
    slow_vision(app, MODEL, 0.15, calls)
    image = png()

    async def main() -> list[httpx.Response]:
        async with started(app) as client:
            return await asyncio.gather(*(
                client.post(f"/v1/models/{MODEL}/classify", content=image,
                            params={"timeout": 0.2} if i % 2 else {},
                            headers={"content-type": "image/png", "X-Request-Id": f"conc-{i}"}) for i in range(8)))

    responses = asyncio.run(main())
    codes = {r.status_code for r in responses}
    assert 200 in codes and 429 in codes, codes
    for i, r in enumerate(responses):
        assert r.headers["x-request-id"] == f"conc-{i}"
        if r.status_code != 200:
            assert r.json()["error"]["request_id"] == f"conc-{i}"


def test_streams_carry_the_id(open_client: TestClient) -> None:
    with open_client.stream("POST", "/v1/completions", json={"model": TEXT, "prompt": "ab", "max_tokens": 3,
                                                              "stream": True},
                            headers={"X-Request-Id": "stream-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "stream-1"
        assert r.read().endswith(b"data: [DONE]\n\n")


# ---- logs ---------------------------------------------------------------------------------------------------


def test_json_log_lines_carry_request_id_model_endpoint_status_durations(log_lines: io.StringIO,
                                                                          open_client: TestClient) -> None:
    r = open_client.post(f"/v1/models/{MODEL}/classify", content=png(),
                         headers={"content-type": "image/png", "X-Request-Id": "log-1"})
    assert r.status_code == 200
    records = [json.loads(line) for line in log_lines.getvalue().splitlines()]  # every line one JSON object
    access = [x for x in records if x["logger"] == "service.access" and x["request_id"] == "log-1"]
    assert len(access) == 1
    a = access[0]
    assert a["level"] == "INFO" and a["model"] == MODEL and a["endpoint"] == "classify" and a["status"] == 200
    assert a["method"] == "POST" and a["path"] == f"/v1/models/{MODEL}/classify"
    assert a["duration_ms"] >= a["compute_ms"] > 0 and a["queue_ms"] >= 0
    datetime.datetime.fromisoformat(a["time"])


def test_a_log_line_inside_a_request_carries_its_id(log_lines: io.StringIO) -> None:
    app = create_app(Settings(models=(MODEL,)))

    @app.get("/speak")
    async def speak() -> dict[str, str]:
        logging.getLogger("service.test").warning("about this request")
        await asyncio.sleep(0)
        return {}

    with TestClient(app) as client:
        client.get("/speak", headers={"X-Request-Id": "inner-1"})
    lines = [json.loads(x) for x in log_lines.getvalue().splitlines()]
    assert [x["request_id"] for x in lines if x["message"] == "about this request"] == ["inner-1"]


def test_text_log_format_and_unprintable_paths() -> None:
    buf = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging("text", "info", buf)
    try:
        with TestClient(create_app(Settings(models=(MODEL,), access_log=True))) as client:
            client.get("/v1/models%0Afake%20line", headers={"X-Request-Id": "text-1"})
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = [x for x in buf.getvalue().splitlines() if "[text-1]" in x]
    assert len(lines) == 1 and "service.access [text-1]: GET /v1/models\\nfake line 404" in lines[0]


# ---- OpenTelemetry ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[TestClient, Any]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with TestClient(create_app(Settings(), tracer_provider=provider), raise_server_exceptions=False) as client:
        yield client, exporter


def _trace_of(exporter: Any, request_id: str) -> tuple[Any, dict[str, Any]]:
    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.parent is None and s.attributes.get("multimax.request_id") == request_id]
    assert len(root) == 1, [s.name for s in spans]
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root[0].context.span_id}
    return root[0], children


@pytest.mark.parametrize(("method", "path", "kwargs", "model", "phases"), [
    ("POST", f"/v1/models/{MODEL}/classify", {"content": png(), "headers": {"content-type": "image/png"}},
     MODEL, {"preprocess", "queue", "model", "encode"}),
    ("POST", f"/v2/models/{MODEL}/infer", {"json": {"inputs": [{"name": "pixel_values", "datatype": "FP32",
                                                                 "shape": [1, 1, 32, 32], "data": [0.0] * 1024}]}},
     MODEL, {"preprocess", "queue", "model", "encode"}),
    ("POST", "/v1/completions", {"json": {"model": TEXT, "prompt": "ab", "max_tokens": 3}},
     TEXT, {"preprocess", "tokenize", "queue", "model", "encode"}),
])
def test_one_span_per_request_with_its_phases(traced: tuple[TestClient, Any], method: str, path: str,
                                              kwargs: dict[str, Any], model: str, phases: set[str]) -> None:
    client, exporter = traced
    rid = f"trace-{abs(hash(path))}"
    kwargs = {**kwargs, "headers": {**kwargs.get("headers", {}), "X-Request-Id": rid}}
    r = client.request(method, path, **kwargs)
    assert r.status_code == 200, r.text
    root, children = _trace_of(exporter, rid)
    assert set(children) == phases
    assert root.attributes["multimax.model"] == model and root.attributes["http.response.status_code"] == 200
    assert root.name.startswith(method + " /v")
    for name, child in children.items():
        assert child.attributes["multimax.request_id"] == rid
        # (a completion names its model in the body: known only once that is read)
        assert child.attributes.get("multimax.model") == model or (name == "preprocess" and model == TEXT)
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    assert children["queue"].end_time == children["model"].start_time
    assert children["preprocess"].end_time <= children["queue"].end_time


def test_traces_continue_the_clients_trace_and_mark_errors(traced: tuple[TestClient, Any]) -> None:
    client, exporter = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = client.get("/v1/models/nope", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
                                               "X-Request-Id": "trace-404"})
    assert r.status_code == 404
    spans = [s for s in exporter.get_finished_spans() if s.attributes.get("multimax.request_id") == "trace-404"]
    assert len(spans) == 1 and format(spans[0].context.trace_id, "032x") == trace_id
    assert spans[0].attributes["http.response.status_code"] == 404 and spans[0].name == "GET /v1/models/{name}"
    client.get("/no/such/route", headers={"X-Request-Id": "trace-noroute"})
    unrouted = [s for s in exporter.get_finished_spans() if s.attributes.get("multimax.request_id") == "trace-noroute"]
    assert [s.name for s in unrouted] == ["GET"]  # no route: the method alone (raw paths would be unbounded)


def test_a_request_the_sampler_leaves_out_makes_no_spans() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with TestClient(create_app(Settings(models=(MODEL,)), tracer_provider=provider)) as client:
        r = client.post(f"/v1/models/{MODEL}/classify", content=png(), headers={"content-type": "image/png"})
        assert r.status_code == 200 and r.headers["x-request-id"]
    assert exporter.get_finished_spans() == ()


def test_otlp_endpoint_without_the_extra_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(SystemExit) as exc:
        load_settings(["--otlp-endpoint", "http://127.0.0.1:4318/v1/traces"], {})
    assert exc.value.code == 2
    assert "pip install 'multimax-serve[otel]'" in capsys.readouterr().err


def test_otlp_endpoint_receives_the_spans() -> None:
    """The real exporter, to a collector on the loopback interface: the spans arrive as OTLP/HTTP protobuf."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
        with TestClient(create_app(Settings(models=(MODEL,), otlp_endpoint=endpoint))) as client:
            client.get("/v1/models", headers={"X-Request-Id": "otlp-1"})
        # the lifespan's end flushed the batch
    finally:
        collector.shutdown()
    spans = [s for req in received for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["GET /v1/models"]
    attrs = {a.key: a.value.string_value for a in spans[0].attributes}
    assert attrs["multimax.request_id"] == "otlp-1"
