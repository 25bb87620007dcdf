"""Issue 27, hardening at the HTTP edge: path parameters of any length or content (fuzzed too), what an unauthenticated
client learns, cross-site requests, strict request types and content encodings, idle connections."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import start, stop
from models.demo import DEMO_DIR
from service.base.config import Settings
from service.edge.app import create_app
from tests.service.support import _log_text, _png_bytes

# ---- 3. path parameters of any length or content --------------------------------------------------------------


LONG = "9" * 5000
PATHS = [
    ("GET", f"/v2/models/digits_multimax/versions/{LONG}/ready"),
    ("GET", f"/v2/models/digits_multimax/versions/{LONG}"),
    ("GET", f"/v2/models/digits_multimax/versions/{LONG}/config"),
    ("POST", f"/v2/models/digits_multimax/versions/{LONG}/infer"),
    ("GET", "/v2/models/digits_multimax/versions/%C2%B2/ready"),  # a Unicode digit
    ("GET", "/v2/models/digits_multimax/versions/-1/ready"),
    ("GET", "/v2/models/digits_multimax/versions/%00/ready"),
    ("GET", f"/v2/models/{'x' * 20000}/ready"),
    ("GET", f"/v1/models/{'x' * 20000}"),
    ("POST", f"/v1/models/{LONG}/classify"),
    ("GET", "/v2/models/%F0%9F%92%A5%2F..%2F/ready"),
]


@pytest.mark.parametrize(("method", "path"), PATHS, ids=lambda p: p[:40] if isinstance(p, str) else p)
def test_every_path_parameter_gets_a_4xx_and_no_traceback(served: tuple[str, Any], method: str, path: str) -> None:
    url, log = served
    body = {"inputs": [{"name": "pixel_values", "shape": [1, 1, 32, 32], "datatype": "FP32",
                        "data": [0.0] * 1024}]} if method == "POST" else None
    r = httpx.request(method, url + path, json=body, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert len(json.dumps(error)) < 1000  # a 20,000-character name is not echoed whole
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    assert "Traceback" not in _log_text(log)


# ---- 7. what an unauthenticated client learns -----------------------------------------------------------------


KEY = "k-hardening-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("digits_multimax", "digits_softmax", "text_multimax")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    """The demo models and one broken file, with an API key: (client, model directory)."""
    model_dir = tmp_path_factory.mktemp("models")
    for name in ("digits_multimax.onnx", "text_multimax.onnx"):
        shutil.copy(DEMO_DIR / name, model_dir / name)
    (model_dir / "broken.onnx").write_bytes(b"not an onnx file")
    settings = Settings(model_dir=model_dir, api_key=(KEY,), warmup_calls=0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client, model_dir


def test_open_routes_name_no_other_model_and_no_path(keyed: tuple[TestClient, Path]) -> None:
    client, model_dir = keyed
    unknown = client.get("/v2/models/nope/ready")
    assert unknown.status_code == 404 and not any(m in unknown.text for m in MODELS)
    broken = client.get("/v2/models/broken/ready")
    assert broken.status_code == 400 and broken.json()["reason"]
    assert str(model_dir) not in broken.text and "/tmp" not in broken.text
    index = client.post("/v2/repository/index", headers=AUTH).json()
    reason = next(r["reason"] for r in index if r["name"] == "broken")
    assert "broken.onnx" in reason, reason
    assert str(model_dir) not in json.dumps(index)
    # A model that keeps failing: the server's readiness names it only to a client with the key.
    rt = client.app.state.runtimes.models["digits_multimax"]  # type: ignore[attr-defined]
    rt.batcher.health.failed("RuntimeError: from /srv/secret/place/model.onnx")
    try:
        for _ in range(4):
            rt.batcher.health.failed("RuntimeError: from /srv/secret/place/model.onnx")
        anonymous = client.get("/v2/health/ready").json()
        assert "digits_multimax" not in json.dumps(anonymous) and anonymous["models_not_ready"] == 1
        assert "/srv/secret" not in json.dumps(anonymous) and anonymous["ready"] is True
        keyed_view = client.get("/v2/health/ready", headers=AUTH).json()
        assert "digits_multimax" in keyed_view["not_ready"] and "/srv/secret" not in json.dumps(keyed_view)
        own = client.get("/v2/models/digits_multimax/ready").json()
        assert "model.onnx" in own["reason"] and "/srv/secret" not in own["reason"]
    finally:
        rt.batcher.health.succeeded()


def test_401s_are_counted_apart_from_the_model(keyed: tuple[TestClient, Path]) -> None:
    client, _ = keyed

    def count(model: str, outcome: str) -> float:
        text = client.get("/metrics").text
        return sample_value(text, "multimax_requests_total", model=model, endpoint="classify", outcome=outcome)

    before = count("digits_multimax", "invalid_input")
    for _ in range(3):
        r = client.post("/v1/models/digits_multimax/classify", content=b"x", headers={"Content-Type": "image/png"})
        assert r.status_code == 401
    assert count("digits_multimax", "invalid_input") == before
    assert count("_unknown", "unauthorized") == 3


# ---- 2. cross-site requests --------------------------------------------------------------------------------------


FOREIGN = "https://evil.example"


@pytest.fixture(scope="module")
def controlled() -> Iterator[str]:
    """A server with model control on, no API key and one allowed CORS origin (a real socket)."""
    proc, url = start("--model-control", "explicit", "--cors-allow-origins", "https://app.example",
                      "--models", "digits_multimax,text_multimax", "--warmup-calls", "0")
    try:
        yield url
    finally:
        stop(proc)


def test_a_foreign_page_cannot_unload_a_model_or_run_one(controlled: str) -> None:
    url = controlled
    simple = {"Origin": FOREIGN, "Content-Type": "text/plain"}
    r = httpx.post(f"{url}/v2/repository/models/digits_multimax/unload", headers=simple, content=b"", timeout=30)
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]
    completion = json.dumps({"model": "text_multimax", "prompt": "a", "max_tokens": 1}).encode()
    r = httpx.post(f"{url}/v1/completions", headers=simple, content=completion, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
    files = {"file": ("x.png", _png_bytes(), "image/png")}
    r = httpx.post(f"{url}/v1/models/digits_multimax/classify", headers={"Origin": "null"}, files=files, timeout=30)
    assert r.status_code == 403
    assert httpx.get(f"{url}/v2/models/digits_multimax/ready", timeout=30).status_code == 200  # still served
    # Non-browser clients (no Origin) keep working: curl -F uploads, JSON clients.
    r = httpx.post(f"{url}/v1/models/digits_multimax/classify", files=files, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json=json.loads(completion), timeout=30)
    assert r.status_code == 200, r.text
    # The allowed origin and the server's own pages (/docs) may call.
    for origin in ("https://app.example", url):
        r = httpx.post(f"{url}/v1/completions", json=json.loads(completion), headers={"Origin": origin}, timeout=30)
        assert r.status_code == 200, (origin, r.text)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert sample_value(metrics, "multimax_requests_total", model="_unknown", endpoint="completions",
                        outcome="forbidden") == 1


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/completions", "text/plain"),
    ("/v1/completions", "application/x-www-form-urlencoded"),
    ("/v1/completions", "multipart/form-data; boundary=x"),
    ("/v2/models/digits_multimax/infer", "text/plain"),
    ("/v2/repository/index", "text/plain"),
    ("/v2/repository/models/digits_multimax/unload", "application/x-www-form-urlencoded"),
])
def test_json_routes_refuse_the_content_types_of_simple_requests(controlled: str, path: str,
                                                                 content_type: str) -> None:
    body = json.dumps({"model": "text_multimax", "prompt": "a", "max_tokens": 1}).encode()
    r = httpx.post(controlled + path, content=body, headers={"Content-Type": content_type}, timeout=30)
    assert r.status_code == 415, r.text
    assert "application/json" in r.text
    assert httpx.get(f"{controlled}/v2/models/digits_multimax/ready", timeout=30).status_code == 200


# ---- 8. strict types, and content encodings ----------------------------------------------------------------------


@pytest.mark.parametrize("field", [{"max_tokens": "10"}, {"stream": "true"}, {"echo": "yes"}, {"n": "16"},
                                   {"prompt": [[False]]}, {"prompt": [True, 1]}, {"max_tokens": True},
                                   {"temperature": "0.5"}, {"logprobs": "1"}, {"seed": "5"},
                                   {"stream_options": {"include_usage": "true"}, "stream": True},
                                   {"max_tokens": 10.0}])
def test_completion_fields_are_not_coerced(client: TestClient, field: dict[str, Any]) -> None:
    body = {"model": "text_multimax", "prompt": "a", "max_tokens": 2} | field
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_numbers_booleans_and_token_ids_of_the_right_type_still_work(client: TestClient) -> None:
    body = {"model": "text_multimax", "prompt": [[65, 66]], "max_tokens": 2, "temperature": 0, "top_p": 1,
            "echo": False, "stream": False, "n": 1, "logit_bias": {}, "seed": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_gzip_bodies_are_inflated_within_the_limits(client: TestClient) -> None:
    body = json.dumps({"model": "text_multimax", "prompt": "Return the", "max_tokens": 2, "temperature": 0})
    plain = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    for encoding, data in (("gzip", gzip.compress(body.encode())), ("deflate", zlib.compress(body.encode()))):
        r = client.post("/v1/completions", content=data,
                        headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    bomb = gzip.compress(b" " * (4 * 1024 * 1024) + body.encode())  # 4 MiB of JSON whitespace: over max_json_bytes
    r = client.post("/v1/completions", content=bomb,
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413
    r = client.post("/v1/completions", content=body,
                    headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=gzip.compress(body.encode())[:20],
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["error"]["message"]
    r = client.post("/v1/models/digits_multimax/classify", content=gzip.compress(_png_bytes()),
                    headers={"Content-Type": "image/png", "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text


# ---- 5. connections ------------------------------------------------------------------------------------------------


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True  # reset: closed too


def test_silent_connections_are_closed_and_a_flood_is_refused_while_probes_answer() -> None:
    limit = 20
    proc, url = start("--models", "digits_multimax", "--warmup-calls", "0", "--max-connections", str(limit),
                      "--idle-timeout-s", "2")
    port = int(url.rsplit(":", 1)[1])
    silent: list[socket.socket] = []
    try:
        with httpx.Client(timeout=10) as keep:  # a client connected before the flood keeps its connection
            assert keep.get(f"{url}/v1/models").status_code == 200
            for _ in range(2 * limit):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.2)
            probe = httpx.get(f"{url}/v2/health/ready", timeout=10)
            assert probe.status_code == 200  # the probe answers during the flood
            live = httpx.get(f"{url}/v2/health/live", timeout=10)
            assert live.status_code == 200
            assert httpx.get(f"{url}/v2/models/digits_multimax/ready", timeout=10).status_code == 200
            refused = httpx.get(f"{url}/v1/models", timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
            assert refused.headers["connection"] == "close" and refused.headers["retry-after"] == "1"
            assert keep.get(f"{url}/v1/models").status_code == 200
            # Every silent connection is closed by the server (those over the limit first, within ~1 s).
            assert all(_closed_by_server(s, 5) for s in silent)
            assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
    finally:
        for s in silent:
            s.close()
        stop(proc)


# ---- 3 (fuzzed). arbitrary path parameters on every route that takes them ---------------------------------------


SEGMENT = st.one_of(st.text(min_size=1, max_size=300), st.from_regex(r"[0-9]{1,6000}", fullmatch=True),
                    st.sampled_from(["digits_multimax", "text_multimax", "1", "01", "0", "-1", "²"]))


ROUTES = ["/v2/models/{n}/ready", "/v2/models/{n}/versions/{v}/ready", "/v2/models/{n}/versions/{v}",
          "/v2/models/{n}/versions/{v}/config", "/v1/models/{n}"]


@given(name=SEGMENT, version=SEGMENT, route=st.sampled_from(ROUTES))
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_any_path_parameter_gets_an_answer_never_a_5xx(client: TestClient, name: str, version: str,
                                                       route: str) -> None:
    path = route.format(n=quote(name, safe=""), v=quote(version, safe=""))
    r = client.get(path)
    assert r.status_code < 500, (path[:100], r.status_code, r.text[:200])
    assert r.status_code in (200, 400, 404, 405), (path[:100], r.status_code)
