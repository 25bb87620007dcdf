"""Issue 27, hardening: settings that would silently turn a protection off, cross-site requests, path parameters
of any length, CPU-heavy images, idle connections, model files that lie, what an unauthenticated client learns,
strict request types, truncated images, and a Retry-After that follows the queued work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import start, stop
from models.demo import DEMO_DIR
from service.app import create_app
from service.config import Settings, load_settings

# ---- 1. a setting that silently disables a protection ----------------------------------------------------------

BLANK_PROTECTIONS = [
    (["--api-key", ""], {}, "--api-key"),
    (["--api-key", " "], {}, "--api-key"),
    (["--api-key", " , "], {}, "--api-key"),
    ([], {"MULTIMAX_SERVE_API_KEY": ""}, "MULTIMAX_SERVE_API_KEY"),
    ([], {"MULTIMAX_SERVE_API_KEY": " , "}, "MULTIMAX_SERVE_API_KEY"),
    (["--api-key-file", " "], {}, "--api-key-file"),
    ([], {"MULTIMAX_SERVE_AUTH_HEALTH": ""}, "MULTIMAX_SERVE_AUTH_HEALTH"),
    (["--auth-metrics", " "], {}, "--auth-metrics"),
    (["--cors-allow-origins", ","], {}, "--cors-allow-origins"),
    ([], {"MULTIMAX_SERVE_CORS_ALLOW_METHODS": " "}, "MULTIMAX_SERVE_CORS_ALLOW_METHODS"),
    (["--cors-allow-headers", ""], {}, "--cors-allow-headers"),
    (["--ssl-certfile", ""], {}, "--ssl-certfile"),
    ([], {"MULTIMAX_SERVE_SSL_KEYFILE": " "}, "MULTIMAX_SERVE_SSL_KEYFILE"),
    ([], {"MULTIMAX_SERVE_SSL_KEYFILE_PASSWORD": ""}, "MULTIMAX_SERVE_SSL_KEYFILE_PASSWORD"),
]


@pytest.mark.parametrize(("argv", "env", "named"), BLANK_PROTECTIONS)
def test_a_blank_protection_option_exits_2_naming_it(argv: list[str], env: dict[str, str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in err and "protection" in err and "Traceback" not in err


def test_a_blank_key_stops_the_real_server_before_it_binds() -> None:
    run = subprocess.run([sys.executable, "-m", "service", "--port", "1", "--api-key", " , "], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MULTIMAX_SERVE_API_KEY": "ignored"})
    assert run.returncode == 2 and "--api-key" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("limit", ["--max-body-bytes", "--max-json-bytes", "--max-image-pixels",
                                   "--max-queue-size", "--max-images-per-request", "--header-timeout-s",
                                   "--body-timeout-s", "--request-timeout-s"])
def test_a_limit_of_zero_is_refused_not_unlimited(limit: str) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings([limit, "0"], {})
    assert exc.value.code == 2


def test_real_values_still_work() -> None:
    s = load_settings(["--api-key", "k1,k2", "--cors-allow-origins", "https://app.example"],
                      {"MULTIMAX_SERVE_AUTH_HEALTH": "true"})
    assert s.api_keys == ("k1", "k2") and s.auth_health and s.cors_allow_origins == ("https://app.example",)


# ---- a real server, shared by the tests below ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    """`python -m service` (the demo models) on a free loopback port: (URL, its log file)."""
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start(output=log)
        try:
            yield url, log
        finally:
            stop(proc)


def _log_text(log: Any) -> str:
    log.seek(0)
    return str(log.read())


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
        assert "digits_multimax" not in json.dumps(anonymous) and "1 model" in anonymous["reason"]
        keyed_view = client.get("/v2/health/ready", headers=AUTH).json()
        assert "digits_multimax" in keyed_view["reason"] and "/srv/secret" not in keyed_view["reason"]
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
