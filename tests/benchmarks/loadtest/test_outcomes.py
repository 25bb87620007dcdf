"""benchmarks.loadtest against a small fake server (raw ASGI on uvicorn, in a thread): bounds, open-loop schedules,
coordinated omission, error classes, Server-Timing, /metrics deltas, SSE token timing, output files, knee
detection and the command line. No assertion depends on how fast this machine is: they count requests."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from benchmarks.loadtest import LoadConfig, find_knee, run
from benchmarks.loadtest.cli import main
from benchmarks.loadtest.config import ConfigError, IntRange
from benchmarks.loadtest.prom import diff_metrics, histogram_quantile, parse_metrics, sample_value
from benchmarks.loadtest.report import CSV_COLUMNS
from benchmarks.loadtest.schedule import bounded, send_offsets
from benchmarks.loadtest.servertiming import parse_server_timing
from benchmarks.loadtest.sse import SSEParser, StreamStats
from benchmarks.loadtest.sweep import analyse
from benchmarks.server import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


# ---- the fake server ------------------------------------------------------------------------------------------


class FakeServer:
    """The endpoints the load tester uses, with trivial compute. Model names pick behaviours:
    `fake` answers 200 at once; `errs` cycles 200, 404, 429, 500, and a hang (for timeouts); `stall` pauses the
    whole server for STALL_S once, at request STALL_AT; `hang` never answers in time; `text` streams tokens;
    `broken` streams without [DONE]. Chat: `text` streams OpenAI chat deltas with usage, `nousage` without.
    With `api_key` set, every request without `Authorization: Bearer <api_key>` is a 401."""

    STALL_AT, STALL_S = 20, 1.0

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.stall_until = 0.0
        self.api_key: str | None = None
        self.chat_bodies: list[dict[str, Any]] = []

    def reset(self) -> None:
        self.counts.clear()
        self.stall_until = 0.0
        self.api_key = None
        self.chat_bodies.clear()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        if self.api_key is not None and dict(scope["headers"]).get(b"authorization") != \
                f"Bearer {self.api_key}".encode():
            return await self._json(send, 401, {"error": {"message": "invalid API key"}})
        if method == "POST" and path == "/v1/chat/completions":
            return await self._chat(send, json.loads(body))
        if method == "GET" and path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in ("fake", "errs", "stall", "hang", "text", "broken",
                                                           "nousage")]
            return await self._json(send, 200, {"object": "list", "data": data})
        if method == "GET" and path == "/v2/models/fake":
            return await self._json(send, 200, {"name": "fake", "inputs": [
                {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 1, 4, 4]}]})
        if method == "GET" and path == "/metrics":
            return await self._metrics(send)
        if method == "POST" and path == "/v1/completions":
            return await self._complete(send, json.loads(body))
        if method == "POST" and path.startswith(("/v1/models/", "/v2/models/")):
            model = path.split("/")[3]
            n = self.counts[model]
            self.counts[model] += 1
            if path.startswith("/v2/"):
                inputs = json.loads(body)["inputs"]
                assert inputs[0]["name"] == "pixel_values" and inputs[0]["shape"] == [1, 1, 4, 4]
            if model == "errs":
                kind = ("ok", "404", "429", "500", "hang")[n % 5]
                if kind == "hang":
                    await asyncio.sleep(5)  # past the client's timeout
                elif kind != "ok":
                    headers = [(b"retry-after", b"1")] if kind == "429" else []
                    return await self._json(send, int(kind), {"error": kind}, headers)
            if model == "hang":
                await asyncio.sleep(5)
            if model == "stall":
                now = time.perf_counter()
                if n == self.STALL_AT:
                    self.stall_until = now + self.STALL_S
                if now < self.stall_until:  # a server-wide pause: everything arriving now waits it out
                    await asyncio.sleep(self.stall_until - now)
            timing = [(b"server-timing", b'queue;dur=2.5, compute;dur=4;desc="fake, model", total;dur=7')]
            return await self._json(send, 200, {"predictions": [[{"label": "7", "probability": 0.9}]]}, timing)
        return await self._json(send, 404, {"error": "not found"})

    @staticmethod
    async def _json(send: Any, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        data = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *(headers or [])]})
        await send({"type": "http.response.body", "body": data})

    async def _metrics(self, send: Any) -> None:
        served = sum(v for k, v in self.counts.items() if k != "completions")
        text = ("# TYPE fake_requests counter\n"
                f'fake_requests_total{{endpoint="classify"}} {served}\n'
                "# TYPE fake_latency_seconds histogram\n"
                f'fake_latency_seconds_bucket{{le="0.005"}} {served}\n'
                f'fake_latency_seconds_bucket{{le="+Inf"}} {served}\n'
                f"fake_latency_seconds_count {served}\n"
                f"fake_latency_seconds_sum {served * 0.004}\n"
                "# TYPE fake_up gauge\nfake_up 1\n")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": text.encode()})

    async def _complete(self, send: Any, req: dict[str, Any]) -> None:
        self.counts["completions"] += 1
        n = int(req["max_tokens"])
        if not req.get("stream"):
            return await self._json(send, 200, {"choices": [{"text": "x" * n}],
                                                "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"server-timing", b"queue;dur=1")]})
        for i in range(n):
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": "ab"[i % 2], "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
        tail = f"data: {json.dumps(usage)}\n\n" + ("" if req["model"] == "broken" else "data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": tail.encode()})


    async def _chat(self, send: Any, req: dict[str, Any]) -> None:
        """OpenAI's chat stream: the role first, then content deltas ("ab cd " each: 1 chunk, several tokens),
        then the finish reason, then usage (if asked for and the model is not `nousage`)."""
        self.counts["chat"] += 1
        self.chat_bodies.append(req)
        n = int(req["max_tokens"])
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": req["model"]}
        if not req.get("stream"):
            return await self._json(send, 200, {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ab cd " * n}, "finish_reason": "length"}]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        deltas = [{"role": "assistant", "content": ""}] + [{"content": "ab cd "}] * n
        for delta in deltas:
            await asyncio.sleep(0.001)
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        tail = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        events = [tail]
        if (req.get("stream_options") or {}).get("include_usage") and req["model"] != "nousage":
            events.append({**base, "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2 * n,
                                                            "total_tokens": 11 + 2 * n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": text.encode()})


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FakeServer]]:
    app = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# ---- bounds and schedules ---------------------------------------------------------------------------------------


def test_closed_loop_count_bound_sends_exactly_n(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, model="fake", concurrency=4, requests=37, warmup_s=0.2))
    assert res.sent == res.ok == 37
    warmup = app.counts["fake"] - 37
    assert warmup >= 1  # the warm-up ran, and was not counted
    app.reset()
    res = run(LoadConfig(url=url, model="fake", concurrency=5, requests=3))
    assert res.sent == 3 and app.counts["fake"] == 3  # fewer requests than workers


def test_open_loop_count_bound_and_infer_workload(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, workload="infer", model="fake", rate=200, requests=25))
    assert res.sent == res.ok == 25 == app.counts["fake"]
    assert res.send_lag_ms is not None and res.service_time_ms is not None


def test_constant_schedule_is_exact() -> None:
    offsets = list(bounded(send_offsets(50.0), duration_s=10.0, requests=None))
    assert len(offsets) == 500
    assert all(math.isclose(t, i / 50.0) for i, t in enumerate(offsets))
    assert len(list(bounded(send_offsets(50.0), duration_s=10.0, requests=7))) == 7


def test_poisson_schedule_has_the_mean_rate_and_exponential_gaps() -> None:
    rate, n = 100.0, 20_000
    offsets = list(bounded(send_offsets(rate, poisson=True, seed=3), None, n))
    assert len(offsets) == n and offsets == sorted(offsets)
    assert (n - 1) / offsets[-1] == pytest.approx(rate, rel=0.03)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # CV of exp = 1
    # counted in fixed windows, arrivals scatter like Poisson counts (variance ~ mean), unlike constant spacing
    windows = Counter(int(t) for t in offsets if t < 150)
    counts = [windows[i] for i in range(150)]
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.35)
    assert list(bounded(send_offsets(rate, True, 3), None, 50)) == offsets[:50]  # seeded: reproducible


def test_open_loop_latency_includes_a_stall_that_closed_loop_hides(fake: tuple[str, FakeServer]) -> None:
    """Coordinated omission. The server pauses ~1 s once. A closed loop (one request at a time) sees one slow
    request; an open loop charges the pause to every request scheduled during it, even when it could not send
    them (in-flight cap 1), because their latency counts from the schedule."""
    url, app = fake
    slow = 0.3  # s: well under the 1 s stall, far above a normal response
    app.reset()
    closed = run(LoadConfig(url=url, model="stall", concurrency=1, requests=120, keep_samples=True))
    closed_slow = sum(s.latency > slow for s in closed.samples)
    app.reset()
    cfg = LoadConfig(url=url, model="stall", rate=50, requests=120, max_in_flight=1, keep_samples=True)
    opened = run(cfg)
    open_slow = sum(s.latency > slow for s in opened.samples)
    open_slow_from_send = sum(s.service_time > slow for s in opened.samples)
    assert closed.ok == opened.ok == 120
    assert closed_slow <= 2
    assert open_slow_from_send <= 2  # measured from the actual send, the stall looks like one slow request...
    assert open_slow >= 15  # ...from the schedule, the ~50 requests due during it were late (~35 by > 0.3 s)
    assert opened.generator["cap_hits"] > 0 and opened.generator["warnings"]
    assert opened.hist is not None and opened.hist.count_above_ms(slow * 1000) >= 15


# ---- outcomes, server-side numbers, streaming -------------------------------------------------------------------


def test_errors_are_classified(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, model="errs", concurrency=1, requests=10, timeout_s=0.5))
    assert res.sent == 10 and res.ok == 2
    assert res.errors == {"4xx": 2, "429": 2, "5xx": 2, "timeout": 2, "connection": 0, "stream": 0, "other": 0}
    assert res.status_codes == {"200": 2, "404": 2, "429": 2, "500": 2}
    assert res.error_fraction == pytest.approx(0.8)


def test_a_hung_server_cannot_keep_a_run_going(fake: tuple[str, FakeServer]) -> None:
    url, _ = fake
    # open loop: requests that cannot get an in-flight slot within their timeout fail without being sent
    res = run(LoadConfig(url=url, model="hang", rate=100, requests=30, timeout_s=0.2, max_in_flight=2))
    assert res.sent == res.errors["timeout"] == 30
    assert res.error_examples["timeout"] in ("timeout", "not sent: the in-flight cap stayed full for the whole timeout")
    # closed loop with a count bound: after 50 timeouts in a row it stops instead of sending all 10000
    res = run(LoadConfig(url=url, model="hang", concurrency=5, requests=10_000, timeout_s=0.1))
    assert 50 <= res.sent < 100 and res.errors["timeout"] == res.sent
    assert any("stopped early" in w for w in res.generator["warnings"])


def test_connection_errors_are_classified() -> None:
    from benchmarks.loadtest.client import execute, make_session
    from benchmarks.loadtest.workloads import RequestSpec

    async def go() -> str:
        async with make_session(1, 2.0) as session:
            return (await execute(session, f"http://127.0.0.1:{free_port()}", RequestSpec("GET", "/"), 0)).outcome

    assert asyncio.run(go()) == "connection"


def test_server_timing_parsing() -> None:
    assert parse_server_timing("queue;dur=6.520, compute;dur=11.862, total;dur=66.926") == {
        "queue": 6.52, "compute": 11.862, "total": 66.926}
    assert parse_server_timing('db;desc="a, b; c";dur=3, cache;desc=hit, app;dur="1.5"') == {"db": 3.0, "app": 1.5}
    assert parse_server_timing("miss, x;dur=1, x;dur=2") == {"x": 1.0}  # first value of a repeated name wins
    assert parse_server_timing("") == {} and parse_server_timing(None) == {}
    assert parse_server_timing("bad;dur=abc") == {}


def test_server_timing_and_metrics_are_reported(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, model="fake", concurrency=2, requests=30, warmup_s=0.1))
    assert res.server_timing_ms["queue"]["p50"] == pytest.approx(2.5, rel=0.01)
    assert res.server_timing_ms["compute"]["mean"] == pytest.approx(4.0, rel=0.01)
    delta = res.metrics_delta
    assert delta is not None
    assert delta["fake_requests"]["series"] == [{"labels": {"endpoint": "classify"}, "delta": 30}]  # not warm-up
    hist = delta["fake_latency_seconds"]["series"][0]
    assert hist["count"] == 30 and hist["mean"] == pytest.approx(0.004)
    assert "fake_up" not in delta  # an unchanged gauge is left out


def test_metrics_diff_is_generic() -> None:
    before = parse_metrics(
        '# TYPE reqs counter\nreqs_total{model="a",code="200"} 10\nreqs_total{model="b",code="200"} 5\n'
        "# TYPE lat_seconds histogram\n"
        'lat_seconds_bucket{le="0.1"} 1\nlat_seconds_bucket{le="1"} 2\nlat_seconds_bucket{le="+Inf"} 2\n'
        "lat_seconds_count 2\nlat_seconds_sum 0.6\nlat_seconds_created 1.7e9\n"
        "# TYPE q gauge\nq 3\n"
        "untyped_thing_total 4\n")
    after = parse_metrics(
        '# HELP reqs requests\n# TYPE reqs counter\nreqs_total{code="200",model="a"} 25\n'
        'reqs_total{model="b",code="200"} 5\nreqs_total{model="c",code="500"} 2\n'
        "# TYPE lat_seconds histogram\n"
        'lat_seconds_bucket{le="0.1"} 51\nlat_seconds_bucket{le="1"} 102\nlat_seconds_bucket{le="+Inf"} 102\n'
        "lat_seconds_count 102\nlat_seconds_sum 30.6\nlat_seconds_created 1.7e9\n"
        "# TYPE q gauge\nq 7\n"
        "untyped_thing_total 1 1700000000000\n")
    d = diff_metrics(before, after)
    reqs = {s["labels"]["model"]: s["delta"] for s in d["reqs"]["series"]}
    assert reqs == {"a": 15, "c": 2}  # label order does not matter; unchanged series are left out
    lat = d["lat_seconds"]["series"][0]
    assert lat["count"] == 100 and lat["sum"] == pytest.approx(30.0) and lat["mean"] == pytest.approx(0.3)
    assert lat["p50"] == pytest.approx(0.1) and lat["p99"] == pytest.approx(0.1 + 0.9 * 49 / 50)
    assert d["q"]["series"] == [{"labels": {}, "before": 3, "after": 7}]
    assert d["untyped_thing_total"]["series"][0] == {"labels": {}, "delta": 1, "reset": True}
    assert histogram_quantile(0.5, [(math.inf, 0)]) is None
    assert parse_metrics('x{a="q\\"uote, and \\\\"} 1\n').samples == {("x", (("a", 'q"uote, and \\'),)): 1.0}
    # A line the parser rejects costs that line only; sample_value picks one series by a subset of its labels.
    page = 'ok 1\nnot a {metric line\n# TYPE q gauge\nq 2\n# TYPE r counter\nr_total{a="1",b="x"} 3\nr_total{a="2"} 4\n'
    assert parse_metrics(page).samples[("q", ())] == 2 and ("ok", ()) in parse_metrics(page).samples
    assert sample_value(page, "r_total", a="2") == 4
    with pytest.raises(KeyError):
        sample_value(page, "r_total")  # two series match


def test_sse_parser_and_token_timing() -> None:
    parser = SSEParser()
    stream = [b": keep-alive\n", b"data: {\"choices\":[{\"text\":\"a\"}]}\n", b"\n",
              b"event: x\r\n", b"data: {\"choices\":[{\"text\":\"\"}]}\r\n", b"\r\n",  # empty text: no token
              b"data: {\"choices\":[{\"text\":\"bc\"}]}\n", b"\n",
              b"data: {\"choices\":[{\"delta\":{\"content\":\"d\"}}]}\n", b"\n",
              b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":5}}\n", b"\n",
              b"data: [DONE]\n"]  # no final blank line: flushed at the end
    times = iter([1.10, 1.20, 1.25, 1.45, 1.50, 1.60])
    stats = StreamStats()
    for line in stream:
        data = parser.feed_line(line)
        if data is not None:
            stats.on_event(data, next(times))
    stats.on_event(parser.flush() or "", next(times))
    assert stats.done and stats.error is None
    assert stats.token_times == [1.10, 1.25, 1.45]
    assert stats.ttft(1.0) == pytest.approx(0.10)
    assert stats.itls() == pytest.approx([0.15, 0.20])
    assert stats.tokens == 5  # from usage, though only 3 chunks carried text
    assert stats.tpot() == pytest.approx((1.45 - 1.10) / 4)
    bad = StreamStats()
    bad.on_event('{"error": {"message": "boom"}}', 0.0)
    assert bad.error == "boom"
    multi = SSEParser()
    assert multi.feed_line("data: a") is None and multi.feed_line("data: b") is None and multi.feed_line("") == "a\nb"


def test_generate_streaming_end_to_end(fake: tuple[str, FakeServer]) -> None:
    url, app = fake
    app.reset()
    cfg = LoadConfig(url=url, workload="generate", model="text", concurrency=3, requests=9,
                     prompt_len=IntRange(4, 8), max_tokens=IntRange(5, 9), slo_ms=60_000, keep_samples=True)
    res = run(cfg)
    assert res.ok == 9 and app.counts["completions"] == 9
    gen = res.generation
    assert gen is not None
    assert gen["output_tokens"] == sum(s.output_tokens for s in res.samples)
    assert all(5 <= s.output_tokens <= 9 for s in res.samples)
    assert gen["ttft_ms"]["count"] == 9
    # chunks may arrive coalesced (then a gap is ~0), but never more gaps than tokens - 1
    assert 0 < gen["itl_ms"]["count"] <= sum(s.output_tokens - 1 for s in res.samples)
    assert res.server_timing_ms["queue"]["p50"] == pytest.approx(1.0, rel=0.01)
    assert res.goodput_rps is not None and res.good_fraction == 1.0 and res.slo_met
    broken = run(LoadConfig(url=url, workload="generate", model="broken", concurrency=1, requests=2,
                            max_tokens=IntRange(3, 3)))
    assert broken.errors["stream"] == 2 and broken.ok == 0
    plain = run(LoadConfig(url=url, workload="generate", model="text", concurrency=1, requests=2,
                           max_tokens=IntRange(4, 4), stream=False))
    assert plain.ok == 2 and plain.generation is not None and plain.generation["output_tokens"] == 8


def test_prompts_follow_the_length_distribution() -> None:
    from benchmarks.loadtest.workloads import GenerateWorkload

    wl = GenerateWorkload(LoadConfig(workload="generate", concurrency=1, requests=1,
                                     prompt_len=IntRange(8, 32), max_tokens=IntRange(16, 64)))
    specs = [wl.request(i) for i in range(400)]
    assert all(8 <= s.prompt_tokens <= 32 and 16 <= s.max_tokens <= 64 for s in specs)
    assert {s.prompt_tokens for s in specs} >= {8, 32} and {s.max_tokens for s in specs} >= {16, 64}
    assert wl.request(7) == specs[7]  # the same request index always sends the same request


def test_image_workloads(tmp_path: Path) -> None:
    import base64

    from benchmarks.loadtest.images import generate_images
    from benchmarks.loadtest.workloads import build_workload

    for i, (data, _) in enumerate(generate_images(3)):
        (tmp_path / f"{i}.png").write_bytes(data)
    (tmp_path / "notes.txt").write_text("not an image")
    raw = build_workload(LoadConfig(images=tmp_path, concurrency=1, requests=1, top_k=3))
    spec = raw.request(4)
    assert spec.path == "/v1/models/digits_multimax/classify?top_k=3"
    assert spec.headers == {"Content-Type": "image/png"} and spec.body == (tmp_path / "1.png").read_bytes()
    batched = build_workload(LoadConfig(images=tmp_path, concurrency=1, requests=1, batch=2)).request(0)
    images = json.loads(batched.body or b"")["images"]
    assert [base64.b64decode(x) for x in images] == [(tmp_path / f"{i}.png").read_bytes() for i in (0, 1)]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no \.png"):
        build_workload(LoadConfig(images=empty, concurrency=1, requests=1))
    infer = build_workload(LoadConfig(workload="infer", concurrency=1, requests=1, batch=3), None).request(0)
    tensor = json.loads(infer.body or b"")["inputs"][0]
    assert tensor["shape"] == [3, 1, 32, 32] and len(tensor["data"]) == 3 * 32 * 32


# ---- sweep analysis ------------------------------------------------------------------------------------------------


def test_knee_on_synthetic_curves() -> None:
    # closed loop: throughput doubles with concurrency up to ~400/s, then latency absorbs the load (Little's law)
    conc = [1, 2, 4, 8, 16]
    thr = [100, 200, 390, 410, 415]
    p50 = [c / t * 1000 for c, t in zip(conc, thr, strict=True)]  # Little's law
    knee = find_knee(conc, thr, p50, [0.0] * 5)
    assert knee.index == 2 and "scaled" in knee.reason
    assert [st["saturated"] for st in knee.steps] == [False, False, True, True]
    # 4 -> 8 gains 5%, but if 16 then reached 500/s the server was not saturated at 4 yet
    assert find_knee(conc, [100, 200, 390, 410, 500], p50, [0.0] * 5).index is None
    # open loop, coarse rate grid: 40 -> 80 still gains a quarter of the step, but the queue explodes
    assert find_knee([10, 20, 40, 80], [10, 20, 40, 50], [5, 5, 6, 900], [0] * 4).index == 2
    # open loop near capacity: throughput still follows the rate while median latency takes off
    assert find_knee([100, 200, 300, 400, 500], [100, 200, 300, 397, 487], [7, 9, 12.8, 16.7, 89],
                     [0] * 5).index == 3
    # a batching server: throughput stalls from 1 to 2, grows again as batches fill, peaks at 8
    batching = find_knee([1, 2, 4, 8, 16, 32], [420, 455, 624, 768, 676, 662], [2.2, 3.9, 6.1, 9.6, 22.9, 45.3],
                         [0] * 6)
    assert batching.index == 3 and [st["saturated"] for st in batching.steps] == [False, False, False, True, True]
    # fine grid: the knee is the last point that still scaled
    assert find_knee([40, 45, 50, 55, 60], [40, 45, 50, 50.5, 50.6], [5, 5, 6, 300, 900], [0] * 5).index == 2
    # load shedding: 429s instead of latency
    assert find_knee([1, 2, 4], [100, 200, 205], [10, 10, 10.5], [0, 0, 0.3]).index == 1
    # still scaling, and noise in latency alone does not make a knee
    none = find_knee([1, 2, 4, 8], [100, 199, 401, 790], [10, 12, 10, 11], [0] * 4)
    assert none.index is None and "extend the sweep" in none.reason
    assert find_knee([1, 2], [0, 0], [None, None], [1, 1]).index is None


def test_goodput_and_slo_over_a_sweep(fake: tuple[str, FakeServer]) -> None:
    url, _ = fake
    points = [run(LoadConfig(url=url, model="fake", concurrency=c, requests=20, slo_ms=60_000)) for c in (1, 2)]
    points.append(run(LoadConfig(url=url, model="errs", concurrency=4, requests=10, timeout_s=0.5,
                                 slo_ms=60_000)))
    sw = analyse(points)
    assert all(p.goodput_rps is not None for p in points)
    assert points[0].slo_met and points[1].slo_met and not points[2].slo_met  # 80% errors
    assert sw.max_load_meeting_slo == 1
    assert sw.best_goodput in (0, 1)
    assert sw.to_dict()["max_load_meeting_slo"]["load"] == 2


# ---- command line and files --------------------------------------------------------------------------------------


def test_cli_writes_json_csv_and_plots(fake: tuple[str, FakeServer], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = fake
    out = tmp_path / "sweep"
    rc = main(["--url", url, "--model", "fake", "--sweep-concurrency", "1,2", "--requests", "15", "--quiet",
               "--slo-p99-ms", "5000", "--out", str(out), "--save-requests"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "knee" in text and "SLO" in text
    data = json.loads((out / "results.json").read_text())
    assert [r["load"] for r in data["results"]] == [1.0, 2.0] and data["sweep"]["loads"] == [1.0, 2.0]
    assert data["results"][0]["latency_ms"]["p99.9"] > 0 and data["results"][0]["histogram"].startswith("HIST")
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert list(rows[0]) == list(CSV_COLUMNS) and [r["Concurrency"] for r in rows] == ["1", "2"]
    assert int(rows[1]["Request Count"]) == 15 and int(rows[0]["p99 latency"]) > 0
    for png in ("latency_vs_throughput.png", "latency_histogram.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "requests_1.csv").read_text().splitlines()) == 16
    single = tmp_path / "single"
    assert main(["--url", url, "--model", "fake", "--rate", "100", "--requests", "10", "--poisson", "--quiet",
                 "--out", str(single)]) == 0
    assert "latency" in capsys.readouterr().out
    assert json.loads((single / "results.json").read_text())["sweep"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--requests", "5"], "exactly one of"),
    (["--concurrency", "2"], "refusing to run unbounded"),
    (["--concurrency", "2", "--rate", "5", "--requests", "5"], "exactly one of"),
    (["--rate", "-5", "--duration", "1"], "must be > 0"),
    (["--concurrency", "0", "--requests", "5"], "must be >= 1"),
    (["--sweep-rate", "10,5", "--requests", "5"], "strictly increasing"),
    (["--sweep-concurrency", "1,x", "--requests", "5"], "comma-separated"),
    (["--concurrency", "1", "--requests", "5", "--prompt-len", "9:3"], "LO:HI"),
    (["--concurrency", "1", "--requests", "5", "--url", "ftp://x"], "--url"),
    (["--concurrency", "1", "--requests", "5", "--workload", "nope"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unreachable_server_or_model_exits_2(fake: tuple[str, FakeServer], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--requests", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["--url", fake[0], "--model", "missing", "--concurrency", "1", "--requests", "1", "--quiet"]) == 2
    assert "not served" in capsys.readouterr().err


def test_python_api_refuses_unbounded_runs() -> None:
    with pytest.raises(ConfigError, match="unbounded"):
        run(LoadConfig(concurrency=1))


def test_module_entry_point_exits_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loadtest", "--rate", "10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("python -m benchmarks.loadtest: error:") and "Traceback" not in proc.stderr


# ---- chat, tokenizers, API keys ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer.json: "ab cd " is two tokens, whatever chunks it arrives in."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "cd": 2, "the": 3, "quick": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_chat_workload_streams_and_counts(fake: tuple[str, FakeServer], word_tokenizer: Path) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, workload="chat", model="text", concurrency=2, requests=6, keep_samples=True,
                         max_tokens=IntRange(3, 5), system_prompt="Be brief.",
                         extra_body={"response_format": {"type": "json_object"}}))
    assert res.ok == 6 and app.counts["chat"] == 6
    body = app.chat_bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"] and body["messages"][1]["content"]
    assert body["response_format"] == {"type": "json_object"}  # --extra-body
    assert all(s.output_tokens == 2 * max_tokens and s.prompt_tokens == 11  # the server's usage
               for s, max_tokens in zip(sorted(res.samples, key=lambda s: s.index),
                                        [b["max_tokens"] for b in app.chat_bodies], strict=False))
    assert res.generation is not None and res.generation["ttft_ms"]["count"] == 6
    # No usage: the streamed text counted with the tokenizer (2 words a chunk), not the chunks (1 a delta)
    counted = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=3, keep_samples=True,
                             max_tokens=IntRange(4, 4), tokenizer=word_tokenizer))
    assert [s.output_tokens for s in counted.samples] == [8, 8, 8]
    chunks = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=1, keep_samples=True,
                            max_tokens=IntRange(4, 4)))
    assert chunks.samples[0].output_tokens == 24  # no --tokenizer: byte-level (the demo models), 6 bytes a chunk
    whole = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=2, keep_samples=True,
                           max_tokens=IntRange(3, 3), stream=False, tokenizer=word_tokenizer))
    assert whole.ok == 2 and [s.output_tokens for s in whole.samples] == [6, 6]


def test_prompt_lengths_are_in_the_tokenizers_tokens(word_tokenizer: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from benchmarks.loadtest.tokens import load_counter
    from benchmarks.loadtest.workloads import _CORPUS, ChatWorkload, GenerateWorkload

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_CORPUS] * 5, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "bpe"
    folder.mkdir()
    bpe.save(str(folder / "tokenizer.json"))
    cfg = LoadConfig(workload="generate", concurrency=1, requests=1, prompt_len=IntRange(3, 6),
                     tokenizer=folder)  # a folder holding tokenizer.json
    wl = GenerateWorkload(cfg)
    counter = load_counter(folder)
    assert len(counter.encode(_CORPUS)) < len(_CORPUS) / 3  # words, not bytes: lengths really are in tokens
    for i in range(20):
        spec = wl.request(i)
        prompt = json.loads(spec.body or b"")["prompt"]
        assert 3 <= spec.prompt_tokens <= 6 and spec.prompt_tokens == len(counter.encode(prompt))
    chat = ChatWorkload(LoadConfig(workload="chat", concurrency=1, requests=1))
    spec = chat.request(0)
    assert spec.path == "/v1/chat/completions"
    assert json.loads(spec.body or b"")["messages"][0]["role"] == "user"
    with pytest.raises(ConfigError, match="not a tokenizers file"):
        load_counter(Path(__file__))
    assert load_counter(word_tokenizer).encode("ab cd ab") == [1, 2, 1]


def test_api_key_is_sent_and_never_written(fake: tuple[str, FakeServer], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    url, app = fake
    app.reset()
    app.api_key = "s3cret-key"
    try:
        with pytest.raises(ConfigError, match="give --api-key"):
            run(LoadConfig(url=url, workload="chat", model="text", concurrency=1, requests=1))
        with pytest.raises(ConfigError, match="check --api-key"):
            run(LoadConfig(url=url, workload="chat", model="text", concurrency=1, requests=1, api_key="wrong"))
        out = tmp_path / "run"
        code = main(["--url", url, "--workload", "chat", "--model", "text", "--concurrency", "1", "--requests", "2",
                     "--max-tokens", "2", "--api-key", "s3cret-key", "--out", str(out), "--quiet", "--no-metrics"])
        assert code == 0 and app.counts["chat"] == 2
        written = "".join(p.read_text(errors="replace") for p in out.iterdir() if p.suffix in (".json", ".csv"))
        assert "s3cret-key" not in written and "s3cret-key" not in capsys.readouterr().out
    finally:
        app.api_key = None
