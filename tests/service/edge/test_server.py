"""The service over real HTTP (uvicorn on a free port): the official OpenAI and Triton clients unchanged, a
schemathesis run against the server's own OpenAPI schema, streams whose clients leave, graceful shutdown."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import in_thread, start, stop
from models.demo import DEMO_DIR
from service.base.config import Settings
from service.edge.app import create_app


@pytest.fixture(scope="module")
def service_server() -> Iterator[str]:
    """`python -m service` with its defaults (the demo models), on a free port."""
    proc, url = start()
    try:
        yield url
    finally:
        stop(proc)


# ---- official clients ------------------------------------------------------------------------------------


def test_openai_client_works_unchanged(service_server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{service_server}/v1", api_key="unused", max_retries=0)
    ids = {m.id for m in client.models.list()}
    assert ids == {"digits_multimax", "digits_softmax", "text_multimax", "llama_seglu"}
    done = client.completions.create(model="text_multimax", prompt="Return the", max_tokens=20, temperature=0.7,
                                     seed=5)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 20 and done.usage.prompt_tokens == 10
    stream = client.completions.create(model="text_multimax", prompt="Return the", max_tokens=20, temperature=0.7,
                                       seed=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 30
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="text_multimax", prompt="x", max_tokens=1000)
    assert "context length" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_tritonclient_http_works_unchanged(service_server: str) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(service_server.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits_multimax")
    meta = client.get_model_metadata("digits_multimax")
    assert meta["inputs"][0]["shape"] == [-1, 1, 32, 32]
    assert client.get_model_config("digits_multimax")["max_batch_size"] >= 1
    x = np.random.default_rng(1).uniform(-1, 1, (4, 1, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(str(DEMO_DIR / "digits_multimax.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(["logits"], {"pixel_values": x})[0]
    for binary in (True, False):
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("logits", binary_data=binary)
        result = client.infer("digits_multimax", [inp], outputs=[out], request_id="abc")
        assert np.allclose(result.as_numpy("logits"), want, atol=1e-5)
        assert result.get_response()["id"] == "abc"
    top = client.infer("digits_multimax", [inp],
                       outputs=[httpclient.InferRequestedOutput("logits", class_count=3)]).as_numpy("logits")
    assert top.shape == (4, 3) and int(top[0, 0].decode().split(":")[1]) == int(want[0].argmax())
    bad = httpclient.InferInput("pixel_values", [1, 1, 32, 32], "FP32")
    bad.set_data_from_numpy(np.full((1, 1, 32, 32), np.nan, np.float32))
    with pytest.raises(Exception, match="NaN or Inf"):
        client.infer("digits_multimax", [bad])
    client.close()


# ---- schemathesis ------------------------------------------------------------------------------------------


VISION_MODELS = ("digits_multimax", "digits_softmax")
ALL_MODELS = (*VISION_MODELS, "text_multimax")


def _pin(case: Any, i: int) -> None:
    """Real model names and versions in the path (random names would only ever reach the 404 branch)."""
    params = case.path_parameters
    if params is None:
        return
    if "name" in params:
        pool = VISION_MODELS if case.path.endswith("/classify") else ALL_MODELS
        params["name"] = pool[i % len(pool)]
    if "version" in params:
        params["version"] = "1"


def test_no_input_makes_the_server_fail(service_server: str) -> None:
    """Every operation of the server's own OpenAPI schema, fed generated valid and invalid requests for the real
    models: no 5xx, and every response (status, content type, body) is one the schema documents. Positive data
    may still get a 400 (a prompt longer than the context, a tensor of the wrong shape: the schema cannot say
    everything), which the schema lists with its reason."""
    schema = schemathesis.openapi.from_url(f"{service_server}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures: list[str] = []
    operations = 0
    cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                      phases=[Phase.explicit, Phase.generate])
            def run(case: Any) -> None:
                nonlocal cases
                cases += 1
                _pin(case, cases)
                case.call_and_validate(checks=checks, timeout=60)

            try:
                run()
            except Unsatisfiable:
                pass  # no invalid request exists for it (e.g. GET /metrics has no parameters to break)
            except Exception as exc:  # collect: one report names every failing operation
                failures.append(f"{operation.label} ({mode}): {str(exc)[:2000]}")
    print(f"schemathesis: {cases} cases over {operations} operations")
    assert operations >= 15 and cases >= 20 * operations
    assert not failures, "\n\n".join(failures)


# ---- streams whose clients leave -------------------------------------------------------------------------


def _generated_total(url: str) -> float:
    return sample_value(httpx.get(f"{url}/metrics").text, "multimax_generation_tokens_total", model="text_multimax")


def _gauge(url: str, which: str) -> float:
    return sample_value(httpx.get(f"{url}/metrics").text, f"multimax_{which}_sequences", model="text_multimax")


def test_a_closed_stream_frees_its_slot_at_once() -> None:
    app = create_app(Settings(models=("text_multimax",), max_running_sequences=1))
    scheduler_rt = app.state.runtimes.models["text_multimax"]
    backend = scheduler_rt.entry.backend
    original = backend.run_text

    def slow(*args: Any) -> Any:
        time.sleep(0.03)  # 100 tokens take 3 s: the client's departure is far from the natural end
        return original(*args)

    backend.run_text = slow
    with in_thread(app) as url:
        body = {"model": "text_multimax", "prompt": "The", "max_tokens": 100, "stream": True, "temperature": 0}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
        # The response is closed: within a few steps the row is gone and a waiting request gets the slot.
        r = httpx.post(f"{url}/v1/completions", json=body | {"stream": False, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        generated = _generated_total(url)
        assert generated < 40  # 3 for the second request, a handful (not 100) for the abandoned one
        time.sleep(0.2)
        assert _generated_total(url) == generated
        metrics = httpx.get(f"{url}/metrics").text
        assert 'multimax_running_sequences{model="text_multimax"} 0.0' in metrics
        assert 'multimax_requests_total{endpoint="completions",model="text_multimax",outcome="cancelled"} 1.0' \
            in metrics


# ---- graceful shutdown -------------------------------------------------------------------------------------


def test_sigterm_finishes_in_flight_streams_then_exits() -> None:
    # PyTorch with one thread: a few ms per token, so three queued 100-token streams outlast the signal by ~1 s
    # (two threads on a busy 2-core machine can be 50x slower: OpenMP workers wait on each other).
    proc, url = start("--models", "text_multimax", "--backend", "torch", "--max-running-sequences", "1",
                       "--intra-op-threads", "1", "--log-level", "info")
    results: list[dict[str, Any]] = []
    first_chunk = threading.Event()

    def stream(i: int) -> None:
        body = {"model": "text_multimax", "prompt": f"Stream {i}", "max_tokens": 100, "stream": True,
                "temperature": 0}
        events = []
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        first_chunk.set()
            results.append({"status": r.status_code, "events": events})
        except httpx.HTTPError as exc:
            results.append({"status": repr(exc), "events": events})

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        deadline = time.monotonic() + 30
        # all three accepted before the signal (on a loaded machine the first may already have finished)
        while _gauge(url, "running") + _gauge(url, "waiting") + len(results) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{url}/v1/models", timeout=5)
        for t in threads:
            t.join(timeout=60)
        # uvicorn re-raises the signal once shut down, so a supervisor sees "ended by SIGTERM"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(results) == 3
    for res in results:
        assert res["status"] == 200, res  # every accepted stream ran to its natural end
        assert res["status"] == 200 and res["events"][-1] == "[DONE]"
        last = json.loads(res["events"][-2])
        assert last["usage"]["completion_tokens"] == 100 and last["choices"][0]["finish_reason"] == "length"
    log = proc.stdout.read() if proc.stdout else ""
    assert "all models stopped" in log and "Traceback" not in log

