"""The service on Ray Serve (`python -m service.ray`): two replicas on the demo models behind Ray's HTTP proxy.

Ray binds its services to the machine's network interface, so the cluster runs in a network namespace that has
only loopback: the test process's main thread enters it (setns), and the server, Ray's processes and every
client request live there. Where no namespace can be made (not root, no `ip`), the Ray tests skip and say so.
The options, the metrics hub and the health check are tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient

from benchmarks.loadtest.prom import parse_metrics
from benchmarks.netns import NamespaceUnavailable, loopback_namespace
from benchmarks.server import free_port, stop
from models.demo import DEMO_DIR
from service.base.config import Settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.edge.ray.metrics import MetricsHub, snapshot
from service.edge.ray.options import argv_from_mapping, parse
from tests.paths import ROOT

START_TIMEOUT_S = 240  # a local Ray start is 15-20 s on 2 idle cores; replicas load their models after


# ---- without a cluster ---------------------------------------------------------------------------------------


def test_options_reuse_the_service_options_and_check_the_ray_ones(capsys: pytest.CaptureFixture[str]) -> None:
    settings, scale = parse(["--replicas", "2", "--max-batch-size", "8", "--port", "9001"], )
    assert (settings.max_batch_size, settings.port, scale.replicas) == (8, 9001, 2)
    opts = scale.deployment_options(settings)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 2 * max(8, settings.max_running_sequences)
    assert opts["max_queued_requests"] == 2 * opts["max_ongoing_requests"]
    assert opts["backpressure_config"].status_code == 429 and opts["backpressure_config"].retry_after_s == 1
    assert opts["graceful_shutdown_timeout_s"] == settings.graceful_timeout_s

    assert scale.proxy == "python" and scale.ray_environment()["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    _, auto = parse(["--min-replicas", "0", "--max-replicas", "4", "--target-ongoing-requests", "6", "--proxy",
                     "haproxy"])
    assert auto.ray_environment() == {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    cfg = auto.deployment_options(Settings())["autoscaling_config"]
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas, cfg.target_ongoing_requests) == (0, 4, 1, 6)

    for bad, why in ((["--replicas", "2", "--max-replicas", "3"], "either --replicas"),
                     (["--min-replicas", "3", "--max-replicas", "2"], "exceeds max_replicas"),
                     (["--replicas", "0"], "at least 1"), (["--max-batch-size", "0"], "at least 1")):
        with pytest.raises(SystemExit) as exc:
            parse(bad)
        assert exc.value.code == 2 and why in capsys.readouterr().err


def test_builder_args_map_to_the_same_options() -> None:
    argv = argv_from_mapping({"replicas": 2, "model_dir": "models/demo", "models": ["a", "b"], "torch_compile": True})
    assert argv == ["--replicas", "2", "--model-dir", "models/demo", "--models", "a,b", "--torch-compile", "True"]
    settings, scale = parse(argv)
    assert settings.models == ("a", "b") and settings.torch_compile and scale.replicas == 2


def test_cli_refuses_a_bad_model_dir_before_starting_ray(tmp_path: Path) -> None:
    for args, why in ((["--model-dir", str(tmp_path / "none")], "does not exist"),
                      (["--model-dir", str(tmp_path)], "no model file"),
                      (["--models", "nope"], "no model nope")):
        proc = subprocess.run([sys.executable, "-m", "service.ray", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_metrics_hub_labels_each_replica_and_drops_dead_ones() -> None:
    a, b = Metrics(), Metrics()
    for m, n in ((a, 3), (b, 5)):
        m.init_model("digits", ("classify",))
        m.requests.labels("digits", "classify", "success").inc(n)
        m.request_duration.labels("digits", "classify").observe(0.01)
    hub = MetricsHub(expire_s=60)
    hub.push("r1", "node-a", 11, snapshot(a.registry))
    hub.push("r2", "node-b", 12, snapshot(b.registry))
    page = parse_metrics(hub.render()[0].decode())
    key = (("endpoint", "classify"), ("model", "digits"), ("outcome", "success"))
    assert page.samples[("multimax_requests_total", (*key, ("replica", "r1")))] == 3
    assert page.samples[("multimax_requests_total", (*key, ("replica", "r2")))] == 5
    assert page.types["multimax_request_duration_seconds"] == "histogram"
    assert page.samples[("multimax_replica_info", (("node", "node-b"), ("pid", "12"), ("replica", "r2")))] == 1
    hub.forget("r1")
    assert hub.replicas() == ["r2"]
    hub.expire_s = 0.0
    time.sleep(0.01)
    assert hub.replicas() == [] and b"multimax_requests_total" not in hub.render()[0]


def test_health_check_fails_when_a_models_loop_died() -> None:
    from service.edge.ray.replica import ServiceReplica

    replica = ServiceReplica.__new__(ServiceReplica)  # its __init__ asks Ray for the replica's id
    replica.replica, replica.runtimes = "r1", None
    replica.check_health()  # before the app is built: nothing to check
    with TestClient(create_app(Settings(models=("digits_multimax", "text_multimax")))) as client:
        runtimes = client.app.state.runtimes
        replica.runtimes = runtimes
        replica.check_health()
        batcher = runtimes.models["digits_multimax"].batcher
        client.portal.call(lambda: _cancel(batcher._task))  # the loop dies as a bug would kill it
        assert runtimes.dead_loops() == ["digits_multimax"]
        with pytest.raises(RuntimeError, match="digits_multimax has died"):
            replica.check_health()
    assert runtimes.dead_loops() == []  # stopped on purpose: not a failure


def test_replica_app_keeps_api_keys_and_uses_the_proxys_request_id() -> None:
    """The app a replica builds has the service's API keys; it takes the id Ray's proxy passes on (the client's
    or the proxy's own) for its error bodies, and leaves the X-Request-Id header to the proxy (no duplicate)."""
    from service.edge.ray.replica import ServiceReplica

    replica = ServiceReplica.__new__(ServiceReplica)  # its __init__ asks Ray for the replica's id
    replica.settings = Settings(models=("digits_multimax",), api_key=("k1",))
    replica.replica, replica.hub, replica.metrics_push_s = "r1", None, 3600.0  # (no hub: its push fails, logged)
    app = replica.__serve_build_asgi_app__()
    with TestClient(app) as client:
        r = client.get("/v1/models", headers={"x-request-id": "from-proxy"})
        assert r.status_code == 401 and r.json()["error"]["request_id"] == "from-proxy"
        assert "x-request-id" not in r.headers
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/v2/health/ready").status_code == 200


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# ---- a two-replica deployment in a loopback-only network namespace -------------------------------------------


def cluster(test: Any) -> Any:
    """Marks a test that needs the Ray deployment: `ray` and `slow`, bounded in time."""
    return pytest.mark.ray(pytest.mark.slow(pytest.mark.timeout(300)(test)))


class RayServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    pytest.importorskip("ray", reason="Ray Serve is the optional `ray` extra (pip install -e '.[ray]')")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(loopback_namespace("mmx-ray-test"))
        except NamespaceUnavailable as exc:
            pytest.skip(f"Ray tests need a loopback-only network namespace and none can be made here: {exc}")
        port = free_port()
        log = tmp_path_factory.mktemp("ray") / "server.log"
        # small limits so that backpressure shows with a few dozen requests; one decode slot per replica so
        # that streams queue and last long enough to be in flight at the shutdown
        cmd = [sys.executable, "-m", "service.ray", "--replicas", "2", "--port", str(port), "--replica-cpus", "0.5",
               "--intra-op-threads", "1", "--max-ongoing-requests", "4", "--max-queued-requests", "4",
               "--max-running-sequences", "1", "--metrics-push-s", "0.5", "--health-check-period-s", "2",
               "--graceful-timeout-s", "60"]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        server = RayServer(proc, f"http://127.0.0.1:{port}", log)
        try:
            end = time.monotonic() + START_TIMEOUT_S
            while "ready: http" not in server.log_text():
                if proc.poll() is not None or time.monotonic() > end:
                    pytest.fail(f"python -m service.ray did not come up (exit {proc.poll()}):\n"
                                f"{server.log_text()[-3000:]}")
                time.sleep(0.5)
            yield server
        finally:
            stop(proc, timeout=90)  # Ray's drain takes longer than the single process's


def _page(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text).samples


def _by_replica(samples: dict[Any, float], name: str, **want: str) -> dict[str, float]:
    """Values of one metric summed per replica over the series whose labels include `want`."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        d = dict(labels)
        if sample == name and all(d.get(k) == v for k, v in want.items()):
            out[d["replica"]] = out.get(d["replica"], 0.0) + value
    return out


def _replicas(url: str) -> dict[str, int]:
    """replica id -> pid, from the deployment's /metrics."""
    return {dict(labels)["replica"]: int(dict(labels)["pid"])
            for (sample, labels) in _page(url) if sample == "multimax_replica_info"}


@cluster
def test_official_clients_through_the_proxy(ray_server: RayServer) -> None:
    import openai
    import tritonclient.http as httpclient

    url = ray_server.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert {m.id for m in client.models.list()} == {"digits_multimax", "digits_softmax", "text_multimax",
                                                    "llama_seglu"}
    done = client.completions.create(model="text_multimax", prompt="Return the", max_tokens=20, temperature=0.7,
                                     seed=5)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 20
    stream = client.completions.create(model="text_multimax", prompt="Return the", max_tokens=20, temperature=0.7,
                                       seed=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len(chunks) > 2  # streamed in pieces through the proxy, not one buffered answer
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text  # same seed, either replica
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 30
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")

    triton = httpclient.InferenceServerClient(url.removeprefix("http://"))
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready("digits_multimax")
    x = np.random.default_rng(1).uniform(-1, 1, (4, 1, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(str(DEMO_DIR / "digits_multimax.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(["logits"], {"pixel_values": x})[0]
    for binary in (True, False):
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        result = triton.infer("digits_multimax", [inp],
                              outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary)])
        assert np.allclose(result.as_numpy("logits"), want, atol=1e-5)
    triton.close()

    r = httpx.post(f"{url}/v1/models/digits_multimax/classify", json={"images": []}, timeout=10,
                   headers={"X-Request-Id": "ray-id-1"})
    assert r.status_code == 400 and r.json()["error"]["param"]  # the service's own errors, unchanged
    # the client's id, once (from the proxy), and the same in the body
    assert r.headers.get_list("x-request-id") == ["ray-id-1"] and r.json()["error"]["request_id"] == "ray-id-1"
    assert "total;dur=" in r.headers["server-timing"]


def _classify_image() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@cluster
def test_both_replicas_serve_and_metrics_count_every_request(ray_server: RayServer) -> None:
    url, png, n = ray_server.url, _classify_image(), 40
    labels = {"model": "digits_multimax", "endpoint": "classify"}
    time.sleep(1.0)  # the baseline must hold every earlier request: each replica's numbers are <= 0.5 s old
    first = _page(url)
    total = _by_replica(first, "multimax_requests_total", **labels)
    before = _by_replica(first, "multimax_requests_total", outcome="success", **labels)
    timings = []
    for _ in range(n):
        r = httpx.post(f"{url}/v1/models/digits_multimax/classify", content=png,
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200, r.text
        timings.append(r.headers["server-timing"])
    assert all("queue;dur=" in t and "compute;dur=" in t for t in timings)
    deadline = time.monotonic() + 20
    while True:  # the other replica's numbers arrive within --metrics-push-s
        page = _page(url)
        after = _by_replica(page, "multimax_requests_total", **labels)
        served = {r: after.get(r, 0) - total.get(r, 0) for r in after}
        if sum(served.values()) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(served.values()) == n  # every request counted once, in the deployment's one page
    ok = _by_replica(page, "multimax_requests_total", outcome="success", **labels)
    assert sum(ok.values()) - sum(before.values()) == n  # ... and as a success
    assert len([r for r, v in served.items() if v > 0]) == 2, served  # the proxy spread them over both replicas
    assert len(_replicas(url)) == 2


@cluster
def test_saturated_replicas_answer_429_with_retry_after(ray_server: RayServer) -> None:
    # 2 replicas x 4 ongoing + 4 queued in the proxy: 12 requests fit, the rest must be refused at once
    async def burst() -> list[httpx.Response]:
        body = {"model": "text_multimax", "prompt": "Busy", "max_tokens": 60, "temperature": 0}
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{ray_server.url}/v1/completions", json=body)
                                          for _ in range(40)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    if codes.count(200) < 8 and set(codes) <= {200, 429}:
        # Under a full test run on 2 loaded cores Ray's proxy once refused more than the capacity (5 of 40 served;
        # the test passes alone and in most full runs): one more burst, the same assertions
        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    refused = [r for r in responses if r.status_code == 429]
    assert refused and codes.count(200) >= 8, codes
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses if r.status_code == 200)


def _is_descendant(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


@cluster
def test_a_killed_replica_is_replaced_and_the_service_keeps_answering(ray_server: RayServer) -> None:
    url, png = ray_server.url, _classify_image()
    old = _replicas(url)
    assert len(old) == 2
    victim, pid = sorted(old.items())[0]
    assert _is_descendant(pid, ray_server.proc.pid)  # one of this test's own processes
    os.kill(pid, signal.SIGKILL)
    codes: list[int] = []
    replaced = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/models/digits_multimax/classify", content=png,
                       headers={"Content-Type": "image/png"}, timeout=30)
        codes.append(r.status_code)
        new = set(_replicas(url)) - set(old)
        if new:
            served = _by_replica(_page(url), "multimax_requests_total", model="digits_multimax",
                                 endpoint="classify", outcome="success")
            if any(served.get(r, 0) > 0 for r in new):
                replaced = new
                break
        time.sleep(0.2)
    assert replaced, f"no replacement replica served within 120 s: {_replicas(url)}"
    assert codes.count(200) == len(codes), codes  # the surviving replica answered while the new one started
    assert victim not in replaced


@cluster
def test_sigterm_drains_in_flight_streams(ray_server: RayServer) -> None:
    # 8 streams fill both replicas (4 ongoing each); with one decode slot per replica most of them are still
    # waiting for it when the signal comes. The service sends a stream's headers once it admitted it.
    url, n = ray_server.url, 8
    body = {"model": "text_multimax", "prompt": "Drain", "max_tokens": 100, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    async def stream(client: httpx.AsyncClient, admitted: asyncio.Event) -> tuple[int, list[str], float]:
        events: list[str] = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            admitted.set()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        return r.status_code, events, time.monotonic()

    async def scenario() -> tuple[list[tuple[int, list[str], float]], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            admitted = [asyncio.Event() for _ in range(n)]
            tasks = []
            for event in admitted:  # a little apart: a burst could overflow the proxy's small queue (4): 429
                tasks.append(asyncio.ensure_future(stream(client, event)))
                await asyncio.sleep(0.05)
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in admitted)), 60)
            signalled = time.monotonic()
            ray_server.proc.send_signal(signal.SIGTERM)
            return list(await asyncio.gather(*tasks)), signalled

    results, signalled = asyncio.run(scenario())
    assert ray_server.proc.wait(timeout=120) == 0
    for code, events, _ in results:
        assert code == 200 and events[-1] == "[DONE]", (code, events[-3:])
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        assert finish[-1] == "length" and json.loads(events[-2])["usage"]["completion_tokens"] == 100
    late = [t for *_, t in results if t > signalled]
    assert late, "every stream ended before the signal: the test proved nothing"
    log = ray_server.log_text()
    assert "stopped" in log and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):  # the proxy is gone with the cluster
        httpx.get(f"{url}/v1/models", timeout=5)
