"""Issue 27, hardening: settings that would silently turn a protection off, cross-site requests, path parameters
of any length, CPU-heavy images, idle connections, model files that lie, what an unauthenticated client learns,
strict request types, truncated images, and a Retry-After that follows the queued work."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import onnx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import free_port, start, stop, wait_ready
from models.demo import DEMO_DIR
from service.base.config import Settings, load_settings
from service.base.errors import ServiceError
from service.base.metrics import Metrics
from service.base.pngcheck import missing_rows
from service.edge.app import create_app
from service.engine import vision as vision_module
from service.engine.batcher import DynamicBatcher
from service.engine.decoding import DecodePool
from service.engine.engine_errors import EngineError
from service.engine.runtime import image_pixel_limit
from service.engine.vision import Preprocess
from service.protocols import classify as classify_module
from service.protocols.engine_status import http_error

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


def _png_bytes(size: int = 32, value: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, "PNG")
    return buf.getvalue()


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


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(warmup_calls=0)), raise_server_exceptions=False) as c:
        yield c


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


# ---- 9. images whose data ends early -------------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def short_png(width: int, height: int, rows: int) -> bytes:
    """A greyscale PNG whose (properly terminated) zlib stream holds only `rows` of its `height` rows."""
    raw = b"".join(b"\0" + b"\x80" * width for _ in range(rows))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(raw))
            + _png_chunk(b"IEND", b""))


def test_a_png_whose_rows_stop_early_is_422_not_a_prediction_on_zeros(client: TestClient) -> None:
    r = client.post("/v1/models/digits_multimax/classify", content=short_png(2000, 2000, 10),
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 422, r.text
    assert "ends early" in r.json()["error"]["message"] and "10 of 2000" in r.json()["error"]["message"]
    whole = client.post("/v1/models/digits_multimax/classify", content=short_png(64, 64, 64),
                        headers={"Content-Type": "image/png"})
    assert whole.status_code == 200, whole.text
    last_row_missing = client.post("/v1/models/digits_multimax/classify", content=short_png(64, 64, 63),
                                   headers={"Content-Type": "image/png"})
    assert last_row_missing.status_code == 422


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P", "1", "I;16", "LA"])
def test_complete_pngs_of_every_mode_pass_the_row_check(mode: str) -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (37, 53, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    assert missing_rows(buf.getvalue()) is None
    assert missing_rows(short_png(53, 37, 36)) == (36, 37)


def _jpeg(mode: str = "RGB", size: tuple[int, int] = (96, 80), **options: Any) -> bytes:
    """A JPEG of smooth gradients and noise (every block has AC coefficients), made with Pillow."""
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
    noise = np.random.default_rng(0).integers(0, 255, (h, w))
    rgb = np.stack([(x + y) / 2, np.sin(x / 9) * 120 + 128, noise], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(buf, "JPEG", quality=90, **options)
    return buf.getvalue()


JPEG_KINDS = {"baseline": {}, "progressive": {"progressive": True}, "restart markers": {"restart_marker_blocks": 1},
              "grey": {}, "4:4:4": {"subsampling": 0}}


def _kind(kind: str) -> bytes:
    return _jpeg("L" if kind == "grey" else "RGB", **JPEG_KINDS[kind])


def _pillows(data: bytes, spec: Preprocess) -> np.ndarray:
    """What the preprocessing made of `data` before this check: Pillow's own decoding."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return vision_module.preprocess(image, spec)


@pytest.mark.parametrize("kind", list(JPEG_KINDS))
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, "before EOI"])
@pytest.mark.parametrize("eoi", [False, True], ids=["cut", "cut+EOI"])
def test_a_jpeg_whose_data_ends_early_is_422(kind: str, cut: float | str, eoi: bool) -> None:
    """Cut at 10, 50, 90 % or just before the end-of-image marker; and the same with an end-of-image marker put
    back (what Pillow alone decodes without an error, the missing blocks grey)."""
    data = _kind(kind)
    # just before the marker: without it (cut) / two bytes of scan data fewer, the marker put back (cut+EOI)
    end = len(data) - (4 if eoi else 2) if cut == "before EOI" else int(len(data) * float(cut))
    short = data[:end] + (b"\xff\xd9" if eoi else b"")
    with pytest.raises(ServiceError) as exc:
        vision_module.decode_image(short, 10**8, 1)
    assert exc.value.status == 422
    message = exc.value.message
    assert "ends early" in message or "truncated" in message, message


def test_pillow_alone_decodes_a_cut_jpeg_with_its_end_marker_as_grey() -> None:
    """Why the check exists: the case above that Pillow accepts (if this starts failing, Pillow learned it)."""
    data = _jpeg()
    short = data[:len(data) // 2] + b"\xff\xd9"
    image = Image.open(io.BytesIO(short))
    image.load()
    assert np.all(np.asarray(image)[-8:] == 128)  # libjpeg's grey
    with pytest.raises(ServiceError, match="ends early"):
        vision_module.decode_image(short, 10**8, 1)


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_progressive_jpeg_cut_after_any_whole_scan_is_422(mode: str) -> None:
    """Cut where a scan starts and given an end marker: valid to libjpeg (coefficients left unrefined)."""
    data = _jpeg(mode, progressive=True)
    scans = [i for i in range(2, len(data) - 1) if data[i:i + 2] == b"\xff\xda"]
    assert len(scans) >= 5
    for scan in scans[1:]:
        with pytest.raises(ServiceError, match="JPEG data ends early: component"):
            vision_module.decode_image(data[:scan] + b"\xff\xd9", 10**8, 1)


@pytest.mark.parametrize("kind", list(JPEG_KINDS))
def test_whole_jpegs_decode_to_the_same_input_as_pillows(kind: str) -> None:
    data = _kind(kind)
    for spec in (Preprocess.from_metadata({"channels": "RGB", "image_size": 64, "resize": 72}),
                 Preprocess.from_metadata({"channels": "L", "image_size": 32})):
        expected = _pillows(data, spec)
        for blob in (data, data + b"trailing bytes after the end marker \xff\xd8"):
            assert np.array_equal(vision_module.load_and_preprocess(blob, spec, 10**8, 1), expected), kind


def test_cmyk_and_rotated_jpegs_still_decode() -> None:
    spec = Preprocess.from_metadata({"channels": "RGB", "image_size": 32})
    cmyk = _jpeg("CMYK")
    assert np.array_equal(vision_module.load_and_preprocess(cmyk, spec, 10**8, 1), _pillows(cmyk, spec))
    with pytest.raises(ServiceError, match="ends early"):
        vision_module.decode_image(cmyk[:len(cmyk) // 2] + b"\xff\xd9", 10**8, 1)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the decoded image is upright, 80 wide and 96 high
    buf = io.BytesIO()
    Image.open(io.BytesIO(_jpeg())).save(buf, "JPEG", exif=exif.tobytes())
    assert vision_module.decode_image(buf.getvalue(), 10**8, 1).size == (80, 96)


def test_pillow_never_loads_truncated_images_in_the_server() -> None:
    create_app(Settings(models=("digits_multimax",), warmup_calls=0))
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_a_cut_jpeg_fails_alone_among_concurrent_requests_over_a_real_socket(served: tuple[str, Any]) -> None:
    """Eight requests at once (batched together by the model's batcher), one of them a JPEG cut in half with its
    end marker put back: that one is 422, the other seven get the answers they get alone."""
    url, log = served
    good = [_jpeg("L", (48, 48 + i)) for i in range(7)]
    bad = _jpeg("L", (48, 48))
    bad = bad[:len(bad) // 2] + b"\xff\xd9"

    def classify(data: bytes) -> httpx.Response:
        return httpx.post(f"{url}/v1/models/digits_multimax/classify", content=data,
                          headers={"Content-Type": "image/jpeg"}, timeout=60)

    alone = [classify(d).json()["predictions"] for d in good]
    for _ in range(3):
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(classify, [*good[:3], bad, *good[3:]]))
        refused = answers.pop(3)
        assert refused.status_code == 422 and "ends early" in refused.json()["error"]["message"], refused.text
        assert [r.status_code for r in answers] == [200] * 7
        for got, want in zip((r.json()["predictions"][0] for r in answers), (a[0] for a in alone), strict=True):
            assert [p["label"] for p in got] == [p["label"] for p in want]  # batched: the same up to float rounding
            assert np.allclose([p["probability"] for p in got], [p["probability"] for p in want], atol=1e-5)
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    assert "Traceback" not in _log_text(log)


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


# ---- 6. model files that lie ------------------------------------------------------------------------------------


def _lying_text_model(path: Path, block_size: int) -> None:
    """The demo text model with metadata claiming a context of `block_size` (its position table has 128 rows)."""
    model = onnx.load(str(DEMO_DIR / "text_multimax.onnx"))
    for prop in model.metadata_props:
        if prop.key == "multimax.config":
            config = json.loads(prop.value)
            config["block_size"] = block_size
            prop.value = json.dumps(config)
    onnx.save(model, str(path))


def test_model_files_that_lie_are_refused_at_load_with_the_reason(tmp_path: Path) -> None:
    _lying_text_model(tmp_path / "liar.onnx", 256)
    shutil.copy(DEMO_DIR / "digits_multimax.onnx", tmp_path / "digits_multimax.onnx")
    for version in ("1", "01"):  # the same version twice
        (tmp_path / "versions" / version).mkdir(parents=True)
        shutil.copy(DEMO_DIR / "digits_softmax.onnx", tmp_path / "versions" / version / "model.onnx")
    with open(tmp_path / "huge.onnx", "wb") as f:
        f.truncate(6_000_000)  # sparse: larger than every real model here, costs no disk
    settings = Settings(model_dir=tmp_path, warmup_calls=0, max_model_bytes=5_000_000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        index = {r["name"]: r for r in c.post("/v2/repository/index").json()}
        assert index["liar"]["state"] == "UNAVAILABLE"
        assert "context of 256 tokens does not fit the graph" in index["liar"]["reason"]
        assert index["huge"]["state"] == "UNAVAILABLE" and "max-model-bytes" in index["huge"]["reason"]
        assert index["versions"]["version"] == "1" and index["versions"]["state"] == "READY"
        assert [r["name"] for r in c.post("/v2/repository/index").json()].count("versions") == 1
        assert c.get("/v2/health/ready").status_code == 200  # the others serve
        r = c.post("/v1/completions", json={"model": "liar", "prompt": "x" * 200, "max_tokens": 1})
        assert r.status_code == 404 and "context of 256" in r.json()["error"]["message"]


def test_a_text_model_whose_context_fits_its_graph_loads(tmp_path: Path) -> None:
    _lying_text_model(tmp_path / "honest.onnx", 64)  # claims less than the table holds: fine
    with TestClient(create_app(Settings(model_dir=tmp_path, warmup_calls=0))) as c:
        r = c.post("/v1/completions", json={"model": "honest", "prompt": "x" * 60, "max_tokens": 4})
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"model": "honest", "prompt": "x" * 62, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ---- 4. CPU-heavy inputs --------------------------------------------------------------------------------------------


def _zero_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (side, side), 0).save(buf, "PNG")
    return buf.getvalue()


def test_the_default_pixel_limit_follows_the_model_and_requests_are_admitted_from_headers(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = client.app.state.runtimes.models["digits_multimax"]  # type: ignore[attr-defined]
    assert (rt.max_image_pixels, rt.max_request_pixels) == (4_000_000, 16_000_000)  # a 32-pixel model
    assert image_pixel_limit(Settings(), Preprocess.from_metadata({"image_size": 224, "resize": 256})) == (
        256 * 256 ** 2, 4 * 256 * 256 ** 2)
    r = client.post("/v1/models/digits_multimax/classify", content=_zero_png(2100),
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 422 and "limit of 4000000 pixels" in r.json()["error"]["message"]
    decoded: list[int] = []
    original = classify_module.load_and_preprocess
    monkeypatch.setattr(classify_module, "load_and_preprocess", lambda *a: decoded.append(1) or original(*a))
    images = [base64.b64encode(_zero_png(1900)).decode()] * 5  # 18 MP in all: over the 16 MP budget
    r = client.post("/v1/models/digits_multimax/classify", json={"images": images})
    assert r.status_code == 413 and "per request" in r.json()["error"]["message"]
    assert not decoded  # refused from the headers: nothing was decoded
    r = client.post("/v1/models/digits_multimax/classify", json={"images": images[:4]})
    assert r.status_code == 200 and len(decoded) == 4


def test_the_deadline_covers_decoding(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    original = classify_module.load_and_preprocess

    def slow(*args: Any) -> Any:
        time.sleep(0.5)
        return original(*args)

    monkeypatch.setattr(classify_module, "load_and_preprocess", slow)
    images = [base64.b64encode(_png_bytes()).decode()] * 8  # 8 x 0.5 s on at most 4 threads: > 0.6 s
    r = client.post("/v1/models/digits_multimax/classify?timeout=0.6", json={"images": images})
    assert r.status_code == 504 and "decoded" in r.json()["error"]["message"]


def test_one_clients_images_do_not_hold_up_anothers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storm of big (36 MP, allowed here on purpose) images from three clients over real sockets, then an
    ordinary 32x32 request: its image is decoded at the next free thread, ahead of the storm's waiting images
    (under first-come order all nine would go first), and it is answered correctly."""
    settings = Settings(models=("digits_multimax",), warmup_calls=0, max_image_pixels=40_000_000,
                        max_request_pixels=400_000_000, decode_threads=2)
    starts: list[int] = []  # the side of each image as its decoding starts
    original = classify_module.load_and_preprocess

    def recording(data: bytes, *args: Any) -> Any:
        starts.append(Image.open(io.BytesIO(data)).size[0])
        return original(data, *args)

    monkeypatch.setattr(classify_module, "load_and_preprocess", recording)
    big = _zero_png(6000)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []

    def storm() -> None:
        files = [("file", (f"{j}.png", big, "image/png")) for j in range(3)]
        statuses.append(httpx.post(f"{url}/v1/models/digits_multimax/classify", files=files, timeout=120).status_code)

    try:
        wait_ready(url)
        storms = [threading.Thread(target=storm) for _ in range(3)]
        for t in storms:
            t.start()
        deadline = time.monotonic() + 60
        while len(starts) < 2:  # both threads are decoding the storm
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(f"{url}/v1/models/digits_multimax/classify", content=_png_bytes(32, 0),
                       headers={"Content-Type": "image/png"}, timeout=120)
        assert r.status_code == 200 and r.json()["predictions"][0]
        for t in storms:
            t.join(timeout=120)
        assert statuses == [200, 200, 200]
        ordinary = starts.index(32)
        assert len(starts) == 10 and len(starts) - ordinary - 1 >= 2, starts  # storm images decoded after it
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# ---- 10. Retry-After follows the queued work ----------------------------------------------------------------------


def test_retry_after_follows_the_queued_work_not_the_model_call() -> None:
    """The model call takes microseconds, but the event loop is busy (a flood being parsed; here a task that holds
    it 50 ms at a time), so 40 queued requests take seconds to drain. Retry-After must say seconds, not 1."""
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        batcher = DynamicBatcher("m", lambda x: x, ThreadPoolExecutor(1), Metrics(), max_batch_size=1,
                                 max_delay_s=0.0, max_queue=40)
        batcher.start()
        busy = True

        async def flood() -> None:
            while busy:
                time.sleep(0.05)  # the loop is held, as by parsing many requests
                await asyncio.sleep(0)

        hog = loop.create_task(flood())
        due = time.perf_counter() + 120
        futures = [batcher.enqueue(np.zeros((1, 2), np.float32), due) for _ in range(40)]
        while batcher.queued > 35:  # a few batches measured
            await asyncio.sleep(0)
        futures += [batcher.enqueue(np.zeros((1, 2), np.float32), due) for _ in range(40 - batcher.queued)]
        with pytest.raises(EngineError) as refused:
            batcher.check_room()
        retry_after = int(http_error(refused.value).headers["Retry-After"])
        results = await asyncio.gather(*futures)
        busy = False
        await hog
        await batcher.close()
        return retry_after, max(r.queue_s for r in results)

    retry_after, waited = asyncio.run(main())
    assert waited >= 2.0  # 40 queued requests, at least one 50 ms hold of the loop each
    assert retry_after >= 0.5 * waited, (retry_after, waited)


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


def test_a_failing_model_never_turns_the_readiness_of_the_others() -> None:
    app = create_app(Settings(models=("digits_multimax", "text_multimax"), warmup_calls=0))
    text = app.state.runtimes.models["text_multimax"].entry.backend

    def broken(*args: Any) -> Any:
        raise RuntimeError("index 200 is out of bounds for the position table")

    text.run_text = broken
    with TestClient(app, raise_server_exceptions=False) as c:
        for _ in range(6):
            r = c.post("/v1/completions", json={"model": "text_multimax", "prompt": "a", "max_tokens": 2})
            assert r.status_code == 500
        assert c.get("/v2/models/text_multimax/ready").status_code == 400
        assert c.get("/v2/models/digits_multimax/ready").json() == {"name": "digits_multimax", "ready": True}
        r = c.post("/v1/models/digits_multimax/classify", content=_png_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200
        assert 'multimax_model_ready{model="digits_multimax"} 1.0' in c.get("/metrics").text


def test_large_images_that_could_not_start_before_the_deadline_get_429_with_the_queued_time() -> None:
    """One thread decoding 2 MP images at 0.2 s each, ten queued: a new request with 0.5 s left is refused at once,
    Retry-After the queued work's seconds; one with time enough, and one of small images, are admitted."""
    async def main() -> tuple[int, str]:
        pool = DecodePool(1)

        def work() -> int:
            time.sleep(0.2)
            return 1

        far = time.perf_counter() + 60
        storm = asyncio.ensure_future(pool.run([(2_000_000, work)] * 10, far))
        while pool.queued_seconds() == 0:  # the first image measured the rate
            await asyncio.sleep(0.01)
        with pytest.raises(ServiceError) as refused:
            pool.check_room([2_000_000], time.perf_counter() + 0.5)
        pool.check_room([2_000_000], far)  # time enough: admitted
        pool.check_room([32 * 32], time.perf_counter() + 0.5)  # small: the express thread takes it
        small = await pool.run([(32 * 32, lambda: 2)], time.perf_counter() + 0.5)  # and it is decoded in time
        assert small == [2] and not storm.done()
        await storm
        pool.close()
        return refused.value.status, refused.value.headers["Retry-After"]

    status, retry_after = asyncio.run(main())
    assert status == 429 and int(retry_after) >= 1
