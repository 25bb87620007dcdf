"""benchmarks.loadtest against a small fake server (raw ASGI on uvicorn, in a thread,
tests/benchmarks/loadtest/fake_server.py): error classes, Server-Timing, /metrics deltas, SSE token timing, prompt
lengths and image workloads. No assertion depends on how fast this machine is: they count requests."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from benchmarks.loadtest import LoadConfig, run
from benchmarks.loadtest.config import ConfigError, IntRange
from benchmarks.loadtest.prom import diff_metrics, histogram_quantile, parse_metrics, sample_value
from benchmarks.loadtest.servertiming import parse_server_timing
from benchmarks.loadtest.sse import SSEParser, StreamStats
from benchmarks.server import free_port
from tests.benchmarks.loadtest.fake_server import FakeServer

pytestmark = pytest.mark.timeout(120)


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
