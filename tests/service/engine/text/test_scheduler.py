"""The inference service in-process: settings, registry, preprocessing, batching, generation, every endpoint
and every kind of bad input (through FastAPI's TestClient or straight ASGI; no network)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import itertools
import json
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from models.checkpoint import load
from models.demo import DEMO_DIR
from models.generate import generate
from models.tokenizer import ByteTokenizer
from models.training.vision import digits_split
from plugins import ort_ops
from service.base.config import Settings, build_parser, load_settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.backends.cache_numpy import NumpyCache, _row_room
from service.engine.backends.cache_ops import LEFT, RIGHT, CacheOps
from service.engine.backends.cache_torch import TorchCache
from service.engine.batcher import DynamicBatcher
from service.engine.engine_errors import EngineError
from service.engine.registry import RegistryError, choose, load_registry
from service.engine.text import IncrementalDetokenizer
from service.engine.text.sampler import SamplingParams
from service.engine.text.scheduler import GenSequence, TextScheduler
from service.engine.vision import Preprocess, decode_image, preprocess
from service.protocols.engine_status import http_error

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()


# ---- helpers -------------------------------------------------------------------------------------------


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def service_digits() -> list[tuple[bytes, int]]:
    """Held-out digits as PNG files (what a client would upload) with their labels."""
    _, _, x, y = digits_split(seed=0)
    return [(png(Image.fromarray((x[i, 0].numpy() * 255).round().astype(np.uint8), "L")), int(y[i]))
            for i in range(24)]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height (one empty IDAT): the header of a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def service_client() -> Iterator[TestClient]:
    """The demo models (ONNX Runtime) served in-process."""
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as client:
        yield client


@asynccontextmanager
async def started(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's workers in this event loop and talk to it over ASGI (for concurrency tests)."""
    runtimes = app.state.runtimes
    runtimes.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client
    finally:
        await runtimes.stop()


def slow_vision(app: FastAPI, name: str, seconds: float, calls: list[int]) -> None:
    """Make a model's forward slow (and record its batch sizes) so queues build up deterministically."""
    backend = app.state.runtimes.models[name].entry.backend
    original = backend.run_vision

    def run(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        time.sleep(seconds)
        return original(x)

    backend.run_vision = run


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


# ---- settings ------------------------------------------------------------------------------------------


def test_settings_come_from_env_and_cli_with_cli_winning() -> None:
    env = {"MULTIMAX_SERVE_PORT": "9001", "MULTIMAX_SERVE_MAX_BATCH_SIZE": "4", "MULTIMAX_SERVE_MODELS": "a,b",
           "MULTIMAX_SERVE_TORCH_COMPILE": "yes"}
    s = load_settings([], env)
    assert (s.port, s.max_batch_size, s.models, s.torch_compile) == (9001, 4, ("a", "b"), True)
    assert load_settings(["--port", "9002"], env).port == 9002
    assert load_settings([], {}).model_dir == DEMO_DIR


@pytest.mark.parametrize("env", [{"MULTIMAX_SERVE_PORT": "x"}, {"MULTIMAX_SERVE_BACKEND": "tpu"},
                                 {"MULTIMAX_SERVE_MAX_BATCH_SIZE": "0"}, {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "-1"},
                                 {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "101"}])
def test_bad_settings_exit_2_with_one_line(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings([], env)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_lists_every_option_with_its_environment_variable() -> None:
    text = build_parser().format_help()
    for option in ("--host", "--port", "--model-dir", "--backend", "--max-batch-size", "--max-queue-delay-ms",
                   "--max-queue-size", "--max-body-bytes", "--max-running-sequences", "--request-timeout-s"):
        assert option in text
    assert "MULTIMAX_SERVE_PORT" in text and "MULTIMAX_SERVE_MAX_BATCH_SIZE" in text


def test_cli_help_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0 and "--max-queue-delay-ms" in out.stdout


# ---- registry and backends --------------------------------------------------------------------------------


def test_backend_choice_per_model() -> None:
    both = {"onnxruntime": Path("a.onnx"), "torch": Path("a.pt")}
    assert choose(both, "auto") == "onnxruntime"
    assert choose(both, "torch") == "torch"
    assert choose({"torch": Path("a.pt")}, "onnxruntime") == "torch"  # falls back to what exists
    assert choose({"tensorrt": Path("a.engine")}, "torch") is None  # never an engine unless allowed


def test_cpu_machine_requests_only_the_cpu_provider_and_logs_no_provider_error() -> None:
    code = ("import logging; logging.basicConfig(level='INFO');"
            "from service.engine.backends.onnxruntime import OnnxRuntimeBackend; from models.demo import DEMO_DIR;"
            "b = OnnxRuntimeBackend(DEMO_DIR / 'digits_multimax.onnx'); print(b.provider)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    if "CUDAExecutionProvider" in out.stdout or "Tensorrt" in out.stdout:
        pytest.skip("this machine has a usable GPU provider")
    assert out.stdout.strip() == "CPUExecutionProvider"
    assert "[E:" not in out.stderr and "[W:" not in out.stderr and "rror" not in out.stderr, out.stderr


def test_tensorrt_backend_without_tensorrt_is_a_clear_startup_error() -> None:
    from plugins.trt_plugin import tensorrt_unavailable

    if tensorrt_unavailable() is None:
        pytest.skip("TensorRT and a GPU are present")
    with pytest.raises(RegistryError, match="--backend tensorrt: "):
        load_registry(Settings(backend="tensorrt"))


def test_broken_model_file_is_skipped_and_the_rest_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "good.onnx").symlink_to(DEMO_DIR / "digits_multimax.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx file")
    (tmp_path / "lonely.engine").write_bytes(b"engine without metadata")
    entries = load_registry(Settings(model_dir=tmp_path))
    assert list(entries) == ["good"]
    assert "broken" in caplog.text and "lonely" in caplog.text


def test_empty_or_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="no servable model"):
        load_registry(Settings(model_dir=tmp_path))
    with pytest.raises(RegistryError, match="does not exist"):
        load_registry(Settings(model_dir=tmp_path / "nope"))
    with pytest.raises(RegistryError, match="not found"):
        load_registry(Settings(models=("nope",)))


def test_main_exits_2_on_an_empty_model_dir(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "service", "--model-dir", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "error: no servable model" in out.stderr


# ---- preprocessing --------------------------------------------------------------------------------------


SPEC = Preprocess.from_metadata({"channels": "L", "image_size": 32, "resize": 32, "interpolation": "bilinear",
                                 "crop": "center", "mean": [0.5], "std": [0.5]})


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P", "I;16", "LA", "1", "CMYK"])
def test_preprocess_takes_any_image_mode_to_the_model_shape(mode: str) -> None:
    image = Image.new("RGB", (48, 40), (200, 100, 50)).convert(mode)
    x = preprocess(decode_image(png(image) if mode != "CMYK" else _jpeg(image), 10**7, 8), SPEC)
    assert x.shape == (1, 32, 32) and x.dtype == np.float32 and np.isfinite(x).all()
    assert -1.0 <= x.min() <= x.max() <= 1.0


def _jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG")
    return buf.getvalue()


def test_exif_orientation_is_honoured() -> None:
    image = Image.new("L", (40, 20), 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: "rotate 90 degrees clockwise to display"
    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif)
    assert decode_image(buf.getvalue(), 10**7, 8).size == (20, 40)


def test_preprocess_resizes_the_shorter_side_and_center_crops() -> None:
    spec = Preprocess.from_metadata({"channels": "RGB", "image_size": 4, "resize": 4, "mean": [0, 0, 0],
                                     "std": [1, 1, 1], "interpolation": "nearest"})
    arr = np.zeros((4, 12, 3), np.uint8)
    arr[:, 4:8] = 255  # white middle third of a wide image
    x = preprocess(Image.fromarray(arr), spec)
    assert x.shape == (3, 4, 4) and np.allclose(x, 1.0)


def test_preprocess_matches_the_training_normalisation(service_digits: list[tuple[bytes, int]]) -> None:
    _, _, x, _ = digits_split(seed=0)
    got = preprocess(decode_image(service_digits[0][0], 10**7, 8), SPEC)
    want = ((x[0].numpy() * 255).round() / 255 - 0.5) / 0.5
    assert np.abs(got - want).max() < 1e-5


# ---- classification ------------------------------------------------------------------------------------


def test_models_endpoint_lists_every_model_in_openai_format(service_client: TestClient) -> None:
    r = service_client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    cards = {m["id"]: m for m in body["data"]}
    assert set(cards) == {"digits_multimax", "digits_softmax", "text_multimax", "llama_seglu"}
    assert cards["digits_multimax"]["task"] == "image-classification"
    assert cards["text_multimax"]["task"] == "text-generation"
    assert cards["text_multimax"]["context_length"] == 128
    # the demo LLM's folder runs on PyTorch, with the fused SegLU where the library builds
    llm = cards.pop("llama_seglu")
    assert llm["task"] == "text-generation" and llm["backend"] == "torch" and llm["context_length"] == 256
    assert (llm.get("fused_seglu") == "cpu") is ort_ops.library().available
    for card in cards.values():
        assert card["object"] == "model" and card["backend"] == "onnxruntime"
        assert card["provider"].endswith("ExecutionProvider")
    fused = ort_ops.library().available  # the fused MultiMax CPU ops, where they build
    for name in ("digits_multimax", "text_multimax"):
        assert cards[name]["fused_multimax"]["in_use"] is fused
        # which library: a checkout builds it on first use, a wheel install carries it (tests/test_wheel.py)
        assert cards[name]["fused_multimax"]["source"] == ort_ops.library().source
        assert (cards[name]["fused_multimax"]["source"] != "unavailable") is fused
    assert cards["digits_softmax"]["fused_multimax"] == {"in_use": False, "reason": "the model has no multimax nodes"}
    assert service_client.get("/v1/models/digits_softmax").json()["id"] == "digits_softmax"


def test_classify_raw_png_is_accurate_and_carries_server_timing(
    service_client: TestClient, service_digits: list[tuple[bytes, int]]
) -> None:
    correct = 0
    for data, label in service_digits:
        r = service_client.post("/v1/models/digits_multimax/classify", content=data,
                                headers={"content-type": "image/png"})
        assert r.status_code == 200
        top = r.json()["predictions"][0]
        assert len(top) == 5 and top[0]["probability"] >= top[1]["probability"]
        correct += top[0]["label"] == str(label)
    assert correct >= len(service_digits) - 1
    timing = r.headers["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing


def test_classify_probabilities_equal_softmax_of_the_onnx_session(
    service_client: TestClient, service_digits: list[tuple[bytes, int]]
) -> None:
    data = service_digits[3][0]
    r = service_client.post("/v1/models/digits_multimax/classify?top_k=10", content=data,
                            headers={"content-type": "image/png"})
    probs = {p["index"]: p["probability"] for p in r.json()["predictions"][0]}
    session = ort.InferenceSession(str(DEMO_DIR / "digits_multimax.onnx"), providers=["CPUExecutionProvider"])
    x = preprocess(decode_image(data, 10**7, 8), SPEC)[None]
    logits = session.run(["logits"], {"pixel_values": x})[0][0]
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert np.allclose([probs[i] for i in range(10)], want, atol=1e-5)


def test_classify_multipart_and_json_base64(service_client: TestClient,
                                           service_digits: list[tuple[bytes, int]]) -> None:
    (a, la), (b, lb) = service_digits[0], service_digits[1]
    r = service_client.post("/v1/models/digits_softmax/classify?top_k=1",
                            files=[("file", ("a.png", a, "image/png")), ("file", ("b.png", b, "image/png"))])
    assert r.status_code == 200
    assert [p[0]["label"] for p in r.json()["predictions"]] == [str(la), str(lb)]
    images = [base64.b64encode(a).decode(), "data:image/png;base64," + base64.b64encode(b).decode()]
    r = service_client.post("/v1/models/digits_softmax/classify", params={"top_k": 3}, json={"images": images})
    assert r.status_code == 200
    preds = r.json()["predictions"]
    assert [len(p) for p in preds] == [3, 3] and [p[0]["label"] for p in preds] == [str(la), str(lb)]


def _classify(client: TestClient, data: bytes, content_type: str = "image/png", **kw: Any) -> httpx.Response:
    return client.post("/v1/models/digits_multimax/classify", content=data, headers={"content-type": content_type},
                       **kw)


def test_not_an_image_is_422(service_client: TestClient) -> None:
    r = _classify(service_client, b"hello, I am text")
    assert r.status_code == 422 and "not an image" in error_of(r)["message"]


def test_truncated_image_is_422(service_client: TestClient, service_digits: list[tuple[bytes, int]]) -> None:
    data = service_digits[0][0]
    r = _classify(service_client, data[: len(data) // 2])
    assert r.status_code == 422 and "truncated" in error_of(r)["message"]
    jpeg = _jpeg(Image.new("RGB", (64, 64), (10, 200, 30)))
    r = _classify(service_client, jpeg[:200], "image/jpeg")
    assert r.status_code == 422


def test_1x1_image_is_422(service_client: TestClient) -> None:
    r = _classify(service_client, png(Image.new("L", (1, 1))))
    assert r.status_code == 422 and "too small" in error_of(r)["message"]


def test_decompression_bomb_is_refused_from_its_header(service_client: TestClient) -> None:
    for side in (20000, 8000):  # beyond Pillow's own bomb limit, and beyond only the server's (40 Mpixel)
        r = _classify(service_client, png_header_only(side, side))
        assert r.status_code == 422 and error_of(r)["code"] == "image_too_large"
        assert "pixels" in error_of(r)["message"]


def test_wrong_content_type_is_415(service_client: TestClient, service_digits: list[tuple[bytes, int]]) -> None:
    r = _classify(service_client, service_digits[0][0], "text/plain")
    assert r.status_code == 415 and error_of(r)["type"] == "unsupported_media_type"
    r = service_client.post("/v1/models/digits_multimax/classify", content=service_digits[0][0])
    assert r.status_code == 415


@pytest.mark.parametrize("payload", [{"images": "abc"}, {"imgs": []}, {"images": []}, {"images": ["@@@"]},
                                     {"images": [123]}, [1, 2]])
def test_json_of_the_wrong_shape_is_400(service_client: TestClient, payload: Any) -> None:
    r = service_client.post("/v1/models/digits_multimax/classify", json=payload)
    assert r.status_code == 400 and error_of(r)["message"]


def test_invalid_json_and_bad_multipart_are_400(service_client: TestClient) -> None:
    r = _classify(service_client, b"{not json", "application/json")
    assert r.status_code == 400
    r = service_client.post("/v1/models/digits_multimax/classify", data={"x": "1"},
                            files={"notfile": ("", b"", "")})
    assert r.status_code in (400, 422)


def test_unknown_model_is_404_and_wrong_task_is_400(service_client: TestClient,
                                                    service_digits: list[tuple[bytes, int]]) -> None:
    r = service_client.post("/v1/models/nope/classify", content=service_digits[0][0],
                            headers={"content-type": "image/png"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = service_client.post("/v1/models/text_multimax/classify", content=service_digits[0][0],
                            headers={"content-type": "image/png"})
    assert r.status_code == 400 and error_of(r)["code"] == "wrong_task"
    assert service_client.get("/v1/models/nope").status_code == 404
    r = service_client.get("/no/such/route")
    assert r.status_code == 404 and "error" in r.json()


def test_bad_query_parameters_are_400(service_client: TestClient, service_digits: list[tuple[bytes, int]]) -> None:
    for params in ({"top_k": 0}, {"top_k": "many"}, {"timeout": -1}):
        r = _classify(service_client, service_digits[0][0], params=params)
        assert r.status_code == 400, params
        assert error_of(r)["param"] in ("top_k", "timeout")


def test_body_over_the_limit_is_413() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_body_bytes=2000))
    with TestClient(app) as client:
        r = client.post("/v1/models/digits_multimax/classify", content=b"\0" * 5000,
                        headers={"content-type": "image/png"})
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
            for _ in range(5):
                yield b"\0" * 1000

        r = client.post("/v1/models/digits_multimax/classify", content=chunks(), headers={"content-type": "image/png"})
        assert r.status_code == 413
        r = client.post("/v2/models/digits_multimax/infer", content=b"\0" * 5000)
        assert r.status_code == 413 and isinstance(r.json()["error"], str)
        r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413  # not FastAPI's "error parsing the body" 400
        metrics = client.get("/metrics").text
        assert 'endpoint="classify",model="digits_multimax",outcome="rejected"} 2.0' in metrics
        assert 'endpoint="completions",model="_unknown",outcome="rejected"} 1.0' in metrics


# ---- dynamic batching -----------------------------------------------------------------------------------


def _batcher(predict: Any, **kw: Any) -> DynamicBatcher:
    from concurrent.futures import ThreadPoolExecutor

    args = {"max_batch_size": 8, "max_delay_s": 0.005, "max_queue": 64} | kw
    return DynamicBatcher("m", predict, ThreadPoolExecutor(1), Metrics(), **args)


def test_batcher_groups_concurrent_requests_and_returns_each_its_rows() -> None:
    calls: list[int] = []

    def predict(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        time.sleep(0.02)
        return x * 2

    async def main() -> None:
        b = _batcher(predict)
        b.start()
        far = time.perf_counter() + 30
        results = await asyncio.gather(*(b.submit(np.full((1, 3), i, np.float32), far) for i in range(20)))
        await b.close()
        for i, r in enumerate(results):
            assert np.array_equal(r.output, np.full((1, 3), 2 * i))
        assert sum(calls) == 20 and max(calls) > 1 and max(calls) <= 8

    asyncio.run(main())


def test_a_broken_input_fails_only_its_own_request() -> None:
    def predict(x: np.ndarray) -> np.ndarray:
        if (x < 0).any():
            raise RuntimeError("poisoned row")
        time.sleep(0.005)
        return x

    async def main() -> None:
        b = _batcher(predict, max_delay_s=0.05)
        b.start()
        far = time.perf_counter() + 30
        tasks = [b.submit(np.full((1, 2), -1.0 if i == 3 else i, np.float32), far) for i in range(6)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        assert isinstance(results[3], EngineError) and http_error(results[3]).status == 500
        assert all(not isinstance(r, Exception) for i, r in enumerate(results) if i != 3)

    asyncio.run(main())


def test_full_queue_answers_429_with_retry_after() -> None:
    async def main() -> None:
        b = _batcher(lambda x: (time.sleep(0.2), x)[1], max_batch_size=1, max_queue=2)
        b.start()
        far = time.perf_counter() + 30
        tasks = [asyncio.ensure_future(b.submit(np.zeros((1, 1), np.float32), far)) for _ in range(6)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        rejected = [http_error(r) for r in results if isinstance(r, EngineError)]
        assert rejected and all(r.status == 429 and int(r.headers["Retry-After"]) >= 1 for r in rejected)
        assert len(rejected) < 6

    asyncio.run(main())


def test_deadline_and_departed_clients_are_dropped_before_compute() -> None:
    seen: list[float] = []

    def predict(x: np.ndarray) -> np.ndarray:
        seen.extend(x[:, 0].tolist())
        time.sleep(0.2)
        return x

    async def main() -> None:
        b = _batcher(predict, max_batch_size=1)
        b.start()
        far = time.perf_counter() + 30
        first = asyncio.ensure_future(b.submit(np.full((1, 1), 1, np.float32), far))
        await asyncio.sleep(0.05)  # the model is busy with `first` now
        expiring = asyncio.ensure_future(b.submit(np.full((1, 1), 2, np.float32), time.perf_counter() + 0.05))
        leaving = asyncio.ensure_future(b.submit(np.full((1, 1), 3, np.float32), far))
        staying = asyncio.ensure_future(b.submit(np.full((1, 1), 4, np.float32), far))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(EngineError) as exc:
            await expiring
        assert http_error(exc.value).status == 504
        await first
        await staying
        await b.close()
        assert seen == [1.0, 4.0]

    asyncio.run(main())


def test_http_queue_full_gives_429_with_retry_after() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1, max_queue_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.15, calls)
    image = png(Image.new("L", (32, 32), 128))

    async def main() -> None:
        async with started(app) as client:
            responses = await asyncio.gather(*(client.post("/v1/models/digits_multimax/classify", content=image,
                                                           headers={"content-type": "image/png"}) for _ in range(5)))
            codes = sorted(r.status_code for r in responses)
            assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
            r429 = next(r for r in responses if r.status_code == 429)
            assert int(r429.headers["retry-after"]) >= 1 and error_of(r429)["code"] == "queue_full"
            metrics = (await client.get("/metrics")).text
            assert 'multimax_requests_total{endpoint="classify",model="digits_multimax",outcome="rejected"}' in metrics

    asyncio.run(main())


def test_http_request_deadline_gives_504() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.3, calls)
    image = png(Image.new("L", (32, 32), 128))

    async def main() -> None:
        async with started(app) as client:
            busy = asyncio.ensure_future(client.post("/v1/models/digits_multimax/classify", content=image,
                                                     headers={"content-type": "image/png"}))
            while not calls:  # the first request is computing (images are decoded in a thread: no fixed sleep)
                await asyncio.sleep(0.01)
            r = await client.post("/v1/models/digits_multimax/classify", params={"timeout": 0.05}, content=image,
                                  headers={"content-type": "image/png"})
            assert r.status_code == 504 and error_of(r)["code"] == "deadline_exceeded"
            assert (await busy).status_code == 200

    asyncio.run(main())


def test_request_whose_client_left_is_dropped_before_compute() -> None:
    """Straight ASGI: the second request's client disconnects while it is queued; its image never runs."""
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.3, calls)
    body = png(Image.new("L", (32, 32), 128))

    async def request(disconnect_after: float | None) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(disconnect_after if disconnect_after is not None else 3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/models/digits_multimax/classify", "raw_path": b"",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"image/png"),
                                                                   (b"content-length", str(len(body)).encode())],
                 "client": ("test", 1), "server": ("test", 80), "state": {}, "app": app}
        await app(scope, receive, send)
        return sent

    async def main() -> None:
        runtimes = app.state.runtimes
        runtimes.start()
        try:
            first = asyncio.ensure_future(request(None))
            while not calls:  # `first` is computing (images are decoded in a thread: no fixed sleep)
                await asyncio.sleep(0.01)
            gone = await request(0.05)  # queued behind `first`, then the client leaves
            done = await first
        finally:
            await runtimes.stop()
        assert done[0]["status"] == 200
        assert gone[0]["status"] == 499
        assert calls == [1]  # only the first request's image reached the model
        metrics = runtimes.metrics.render()[0].decode()
        assert 'endpoint="classify",model="digits_multimax",outcome="cancelled"} 1.0' in metrics

    asyncio.run(main())


# ---- KV cache surgery ----------------------------------------------------------------------------------


def _cache(kind: str, layout: str = LEFT) -> CacheOps:
    """The cache operations of the array type `kind`, as a backend declares them."""
    return NumpyCache(layout) if kind == "numpy" else TorchCache(layout)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_kv_merge_pads_left_and_select_trims_padding(kind: str) -> None:
    def arr(x: np.ndarray) -> Any:
        return x if kind == "numpy" else torch.from_numpy(x)

    a = np.arange(2 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 5, 2)
    b = np.ones((1, 1, 3, 2), np.float32)
    mask_a = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    mask_b = np.ones((1, 3), np.int64)
    past, mask = _cache(kind).merge([(arr(a), arr(a))], mask_a, [(arr(b), arr(b))], mask_b)
    k = np.asarray(past[0][0])
    assert k.shape == (3, 1, 5, 2) and mask.tolist()[2] == [0, 0, 1, 1, 1]
    assert np.array_equal(k[2, :, 2:], b[0]) and not k[2, :, :2].any()
    past, mask = _cache(kind).select(past, mask, [1, 2])  # row 0 (the only one using columns 0, 1) leaves
    assert mask.shape == (2, 3) and np.asarray(past[0][1]).shape == (2, 1, 3, 2)
    assert np.array_equal(np.asarray(past[0][0])[0], a[1, :, 2:])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_kv_right_padded_layout_pads_and_trims_at_the_end(kind: str) -> None:
    """GroupQueryAttention's layout: each row's positions first; the mask stays right-aligned as ever."""
    def arr(x: np.ndarray) -> Any:
        return x if kind == "numpy" else torch.from_numpy(x)

    a = np.arange(2 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 5, 2)
    a[1, :, 3:] = 0  # row 1 holds 3 positions, at the start
    b = np.ones((1, 1, 3, 2), np.float32)
    mask_a = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    past, mask = _cache(kind, RIGHT).merge([(arr(a), arr(a))], mask_a, [(arr(b), arr(b))],
                                          np.ones((1, 3), np.int64))
    k = np.asarray(past[0][0])
    assert k.shape == (3, 1, 5, 2) and mask.tolist()[2] == [0, 0, 1, 1, 1]
    assert np.array_equal(k[2, :, :3], b[0]) and not k[2, :, 3:].any()
    past, mask = _cache(kind, RIGHT).select(past, mask, [1, 2])  # the 5-long row leaves: 2 mask columns go
    assert mask.shape == (2, 3) and np.asarray(past[0][1]).shape == (2, 1, 5, 2)  # the buffer keeps them as room
    assert np.array_equal(np.asarray(past[0][0])[0, :, :3], a[1, :, :3])  # the row's own positions, from the start
    assert np.array_equal(np.asarray(past[0][0])[1, :, :3], b[0])
    # a buffer with room merges with a shorter one: the shorter is padded at its end
    longer = np.zeros((1, 1, 9, 2), np.float32)
    merged, mask2 = _cache(kind, RIGHT).merge(past, mask, [(arr(longer), arr(longer))], np.ones((1, 4), np.int64))
    assert np.asarray(merged[0][0]).shape == (3, 1, 9, 2) and mask2.shape == (3, 4)


@pytest.mark.parametrize("layout", [LEFT, RIGHT])
def test_a_longer_newcomer_merges_into_one_new_numpy_buffer_as_the_torch_path_does(layout: str) -> None:
    """A newcomer with a longer history than the batch (every running row needs padding) is merged into one new
    buffer a layer: its values over the mask's columns are the torch path's (the same cache as tensors), the
    padding is zeros, and the buffer keeps rows of room for the next join."""
    rng = np.random.default_rng(3)
    k = rng.normal(size=(2, 1, 8, 2)).astype(np.float32)  # 2 rows, a buffer of 8 columns, 3 of them real
    mask = np.array([[0, 1, 1], [1, 1, 1]], np.int64)
    if layout == LEFT:
        k[0, :, 0] = 0
    else:
        k[0, :, 2:] = 0
    newcomer = rng.normal(size=(1, 1, 6, 2)).astype(np.float32)
    new_mask = np.ones((1, 6), np.int64)
    merged, merged_mask = NumpyCache(layout).merge([(k, k.copy())], mask, [(newcomer, newcomer.copy())], new_mask)
    want, want_mask = TorchCache(layout).merge([(torch.from_numpy(k[:, :, :3].copy()),) * 2], mask,
                                               [(torch.from_numpy(newcomer),) * 2], new_mask)
    assert np.array_equal(merged_mask, want_mask) and merged_mask.shape == (3, 6)
    got = merged[0][0]
    assert got.shape[:2] == (3, 1) and got.shape[2] >= 6
    assert np.array_equal(got[:, :, :6], want[0][0].numpy()[:, :, :6])
    assert _row_room(got) is not None  # rows of room behind the view


def test_a_full_cache_grows_to_the_hint_within_its_bounds() -> None:
    from service.engine.backends.base import grown_length as grown

    assert grown(33, 96, 1024) == 96  # 32-token prompts asking 64 tokens: one buffer for all of it
    assert grown(33, 0, 1024) == 66 and grown(33, 33, 1024) == 66  # no hint beyond the step: doubling
    assert grown(33, 1000, 1024) == 132  # at most four times what the step must hold
    assert grown(5, 1000, 1024) == 64  # ... or the smallest buffer doubling gives
    assert grown(300, 5000, 1024) == 1024 and grown(300, 5000, 0) == 1200  # never past the context (0: unknown)
    assert grown(40, 50, 1024) == 50  # no more than the rows may reach


@pytest.mark.parametrize("layout", [LEFT, RIGHT])
def test_numpy_cache_rows_leave_and_join_inside_one_buffer(layout: str) -> None:
    """Leaving rows are filled by the last rows (row copies) and the cache becomes a view of the buffer's first
    rows; a newcomer that fits the batch's columns is written into the rows behind, not a copy of the cache."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(4, 1, 8, 2)).astype(np.float32)  # 4 rows, buffer of 8 columns (room after the mask's 5)
    rows = [k[i].copy() for i in range(4)]
    mask = np.array([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    past, mask2, order = NumpyCache(layout).remove_rows([(k, k + 1)], mask, [1, 2])  # rows 0 and 3 leave
    assert order == [2, 1]  # row 2 moved into row 0's place
    kept = past[0][0]
    assert kept.shape == (2, 1, 8 if layout == RIGHT else 7, 2)
    if layout == RIGHT:  # no column trimmed from the buffer: a view of the same memory
        assert kept.ctypes.data == k.ctypes.data and np.array_equal(kept[0], rows[2])
        assert np.array_equal(past[0][1][1], rows[1] + 1)
    else:  # the first column is padding for rows 1 and 2 now: trimmed
        assert np.array_equal(kept[0], rows[2][:, 1:]) and np.array_equal(kept[1], rows[1][:, 1:])
    assert mask2.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    # a newcomer of 2 positions joins: into the buffer's spare rows when the cache is a view with some
    new = np.full((1, 1, 2, 2), 7.0, np.float32)
    merged, mask3 = NumpyCache(layout).merge(past, mask2, [(new, new)], np.ones((1, 2), np.int64))
    km = merged[0][0]
    assert km.shape[0] == 3 and mask3.tolist()[2] == [0, 0, 1, 1]
    if layout == RIGHT:
        assert km.ctypes.data == k.ctypes.data  # written in place
        assert np.array_equal(km[2, :, :2], new[0]) and not km[2, :, 2:4].any()
    else:
        assert np.array_equal(km[2, :, 2:4], new[0]) and not km[2, :, :2].any()
    assert np.array_equal(km[0], kept[0]) and np.array_equal(km[1], kept[1])
    # a newcomer longer than the batch's history: every row is padded (the general path), same result as before
    longer = np.full((1, 1, 6, 2), 3.0, np.float32)
    merged2, mask4 = NumpyCache(layout).merge(merged, mask3, [(longer, longer)], np.ones((1, 6), np.int64))
    assert mask4.shape == (4, 6) and mask4[:3, :2].sum() == 0
    assert np.array_equal(merged2[0][0][3, :, :6], longer[0])
    # a torch cache is selected as before (copied, in keep's order)
    t = torch.from_numpy(k.copy())
    tpast, tmask, torder = TorchCache(layout).remove_rows([(t, t)], mask, [1, 2])
    assert torder == [1, 2] and tmask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert torch.equal(tpast[0][0][0, :, -4:], torch.from_numpy(rows[1][:, -4:]))


def test_the_byte_tokenizers_stream_holds_back_possible_stop_prefixes_and_partial_utf8() -> None:
    stream = IncrementalDetokenizer(TOK.decode, TOK.encode("hi"), ["END"], TOK.joins_next)
    ids = TOK.encode("ab")
    assert stream.step(ids) == "ab"
    ids += TOK.encode("EN")
    assert stream.step(ids) == ""  # might become END
    ids += TOK.encode("x")
    assert stream.step(ids) == "ENx"
    ids += list("é".encode())[:1]
    assert stream.step(ids) == ""  # half a character
    ids += list("é".encode())[1:]
    assert stream.step(ids, final=True) == "é"


# ---- generation scheduler -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service_text_model() -> Any:
    model, _, _ = load(DEMO_DIR / "text_multimax.pt")
    return model


def _scheduler(backend_kind: str, max_running: int = 8) -> TextScheduler:
    from concurrent.futures import ThreadPoolExecutor

    if backend_kind == "torch":
        from service.engine.backends.torch import TorchBackend

        backend: Any = TorchBackend(DEMO_DIR / "text_multimax.pt", device="cpu")
    else:
        from service.engine.backends.onnxruntime import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx")
    return TextScheduler("text", backend, TOK, 128, ThreadPoolExecutor(1), Metrics(), max_running, 64)


async def _wait(seq: GenSequence, tokens: int | None = None) -> None:
    while not (seq.done or (tokens is not None and seq.generated >= tokens)):
        await seq.changed.wait()
        seq.changed.clear()


@pytest.mark.parametrize("backend_kind", ["torch", "onnxruntime"])
def test_sequences_joining_a_running_batch_generate_what_they_would_alone(
    backend_kind: str, service_text_model: Any
) -> None:
    """Greedy output of sequences merged mid-decode (left-padded caches of different lengths, rows leaving and
    columns trimmed) equals the reference generation of each prompt on its own."""
    prompts = ["Return the", "If the file is", "A", "This module provides the"]
    lengths = [60, 12, 40, 25]

    async def main() -> list[GenSequence]:
        sched = _scheduler(backend_kind)
        sched.start()
        seqs = [GenSequence(TOK.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(prompts, lengths, strict=True)]
        sched.submit(seqs[:1])
        await _wait(seqs[0], 5)
        sched.submit(seqs[1:3])  # join while the first is decoding
        await _wait(seqs[1])
        sched.submit(seqs[3:])  # join after one has left
        for s in seqs:
            await _wait(s)
        await sched.close()
        assert sched.steps["prefill"] == 3
        return seqs

    seqs = asyncio.run(main())
    for prompt, n, seq in zip(prompts, lengths, seqs, strict=True):
        want = generate(service_text_model, TOK.encode(prompt), n, temperature=0.0)[0]
        assert seq.tokens == want, prompt
        assert seq.finish_reason == "length" and seq.generated == n
    assert seqs[1].finished < seqs[0].finished  # the short one did not wait for the long one
    assert seqs[1].started < seqs[0].finished


def test_an_idle_model_prefills_a_burst_of_arrivals_together(service_text_model: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients starting together reach the scheduler a little apart (each handler parses its request first): an
    idle model waits for the burst and prefills it once; a lone request does not wait. (The gap is widened here so
    that a loaded machine's timer lag cannot split the burst.)"""
    from service.engine.text import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "BURST_GAP_S", 0.05)
    monkeypatch.setattr(scheduler_module, "BURST_MAX_S", 5.0)
    prompts = ["Return the", "If the file is", "A", "This module provides the", "x", "The"]

    async def main() -> tuple[TextScheduler, list[GenSequence]]:
        sched = _scheduler("onnxruntime")
        sched.start()
        lone = GenSequence(TOK.encode("A"), SamplingParams(max_tokens=2, temperature=0.0))
        sched.submit([lone])
        await _wait(lone)
        assert sched.steps["burst_waits"] == 0 and sched.steps["prefill"] == 1
        await asyncio.sleep(0.1)  # the model is idle again
        seqs = [GenSequence(TOK.encode(p), SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
        sched.submit(seqs[:1])
        await asyncio.sleep(0)
        for seq in seqs[1:]:
            sched.submit([seq])
            await asyncio.sleep(0.001)  # the next client a millisecond later
        for seq in seqs:
            await _wait(seq)
        await sched.close()
        return sched, seqs

    sched, seqs = asyncio.run(main())
    assert sched.steps["burst_waits"] == 1
    assert sched.steps["prefill"] == 2 and sched.steps["prefill_prompts"] == 7  # the lone one, then all six at once
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.tokens == generate(service_text_model, TOK.encode(prompt), 6, temperature=0.0)[0], prompt


def test_the_scheduler_tells_the_backend_how_far_its_cache_may_grow() -> None:
    """After each prefill the backend hears the batch's width plus the most tokens a running row may still
    generate (its max_tokens, capped by the context): what it sizes a growing cache buffer to."""
    sched = _scheduler("onnxruntime")
    heard: list[int] = []
    sched.backend.reserve = heard.append  # type: ignore[method-assign]

    async def main() -> None:
        sched.start()
        first = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=30, temperature=0.0))
        sched.submit([first])
        await _wait(first, 5)
        short = GenSequence(TOK.encode("If the file is"), SamplingParams(max_tokens=3, temperature=0.0))
        sched.submit([short])
        await _wait(short)
        long = GenSequence(TOK.encode("A"), SamplingParams(max_tokens=500, temperature=0.0))
        sched.submit([long])
        for seq in (first, long):
            await _wait(seq)
        await sched.close()

    asyncio.run(main())
    assert len(heard) == 3
    assert heard[0] == len(TOK.encode("Return the")) + 30 - 1  # the prompt, and 29 tokens after the first
    assert heard[1] >= heard[0]  # the first row may still need its room: the newcomer asks less
    assert heard[2] == 128  # 500 tokens would pass the context


@pytest.mark.parametrize("backend_kind", ["torch", "onnxruntime"])
def test_a_long_prompt_arriving_while_rows_decode_is_prefilled_in_chunks_between_their_steps(
    backend_kind: str, service_text_model: Any
) -> None:
    """Long prompts (two choices of one, then another) that arrive while a sequence decodes are prefilled
    `prefill_chunk` tokens a call, each chunk after a decode step of the running rows, the second prompt after
    the first; every sequence's greedy text is still the model's own. On an idle model a long prompt is one call."""
    sched = _scheduler(backend_kind)
    sched.prefill_chunk = 8
    sched.prefix_cache.budget = 0  # whole prompts' chunks are counted here (the prefix cache's: test_prefix_cache)
    widths: list[int] = []  # tokens fed by each model call, in order
    run_text = sched.backend.run_text

    def recording(ids: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        widths.append(ids.shape[1])
        return run_text(ids, *args, **kwargs)

    sched.backend.run_text = recording  # type: ignore[method-assign]
    running_prompt, long_prompts = "Return the", ["This module provides the functions", "If the file is missing, the"]
    group = object()

    async def main() -> list[GenSequence]:
        sched.start()
        running = GenSequence(TOK.encode(running_prompt), SamplingParams(max_tokens=40, temperature=0.0))
        sched.submit([running])
        await _wait(running, 3)
        choices = [GenSequence(TOK.encode(long_prompts[0]), SamplingParams(max_tokens=6, temperature=0.0),
                               group=group) for _ in range(2)]
        other = GenSequence(TOK.encode(long_prompts[1]), SamplingParams(max_tokens=6, temperature=0.0))
        sched.submit(choices)
        sched.submit([other])
        for seq in (running, *choices, other):
            await _wait(seq)
        assert sched.steps["prefill_chunks"] == 5 + 4  # 34 and 27 tokens, 8 a chunk
        idle = GenSequence(TOK.encode(long_prompts[0]), SamplingParams(max_tokens=2, temperature=0.0))
        sched.submit([idle])
        await _wait(idle)
        assert sched.steps["prefill_chunks"] == 5 + 4  # nothing decoded beside it: one call
        await sched.close()
        return [running, *choices, other, idle]

    seqs = asyncio.run(main())
    for seq in seqs:
        want = generate(service_text_model, seq.prompt, seq.params.max_tokens, temperature=0.0)[0]
        assert seq.error is None and seq.tokens == want, TOK.decode(seq.prompt)
    chunks = [i for i, w in enumerate(widths) if w == 8]
    assert len(chunks) == 7 and widths.count(2) == 1 and widths.count(3) == 1  # the prompts' last chunks: 2, 3
    assert all(1 in widths[a + 1:b] for a, b in itertools.pairwise(chunks))  # a decode step between chunks
    assert widths[-2:] == [len(long_prompts[0]), 1]  # the idle model's prefill: one call, then its decode step


def test_a_cancelled_sequence_frees_its_slot_at_the_next_step() -> None:
    async def main() -> None:
        sched = _scheduler("onnxruntime", max_running=1)
        sched.start()
        long = GenSequence(TOK.encode("The"), SamplingParams(max_tokens=120, temperature=0.0))
        short = GenSequence(TOK.encode("The"), SamplingParams(max_tokens=3, temperature=0.0))
        sched.submit([long])
        await _wait(long, 2)
        sched.submit([short])
        assert sched.waiting == 1 and sched.running == 1
        sched.cancel(long)
        assert sched.running == 0
        await _wait(short)
        await sched.close()
        assert short.finish_reason == "length" and long.generated < 60 and long.finish_reason is None

    asyncio.run(main())


@pytest.mark.parametrize("interval", [0.0, 60.0])
def test_every_step_reaches_the_loop_as_its_own_step_however_the_worker_batches_its_wake_ups(
        interval: float, monkeypatch: pytest.MonkeyPatch, service_text_model: Any) -> None:
    """The worker wakes the loop at most every handoff_interval_s (--stream-interval-ms; or every HANDOFF_MAX_STEPS
    steps); each step is still applied on its own and in order (seq.steps: one mark per step, what a stream sends
    one event for), and the tokens are the reference generation's."""
    from service.engine.text import scheduler

    drains = 0

    async def main() -> GenSequence:
        sched = _scheduler("onnxruntime")
        sched.handoff_interval_s = interval
        drain = sched._drain

        def counting() -> None:
            nonlocal drains
            drains += 1
            drain()

        monkeypatch.setattr(sched, "_drain", counting)
        sched.start()
        seq = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0))
        sched.submit([seq])
        await _wait(seq)
        await sched.close()
        return seq

    seq = asyncio.run(main())
    assert seq.tokens == generate(service_text_model, TOK.encode("Return the"), 40, temperature=0.0)[0]
    assert seq.finish_reason == "length" and seq.steps == list(range(1, 41))
    if interval:  # one wake-up per HANDOFF_MAX_STEPS steps, plus a drain each time the worker returns
        assert drains <= 40 // scheduler.HANDOFF_MAX_STEPS + 4, drains


def test_stream_interval_ms_is_each_decode_loops_hand_off_interval() -> None:
    assert load_settings([], {}).stream_interval_ms == 1.0
    settings = load_settings(["--stream-interval-ms", "4.5", "--models", "text_multimax"], {})
    loops = [rt.scheduler for rt in create_app(settings).state.runtimes.models.values() if hasattr(rt, "scheduler")]
    assert loops and all(loop.handoff_interval_s == 0.0045 for loop in loops)


def test_seeded_sampling_does_not_depend_on_batch_mates() -> None:
    async def run(extra: int) -> list[int]:
        sched = _scheduler("onnxruntime")
        sched.start()
        target = GenSequence(TOK.encode("Return"), SamplingParams(max_tokens=30, temperature=0.9, seed=7))
        others = [GenSequence(TOK.encode("x" * (i + 1)), SamplingParams(max_tokens=20, seed=i)) for i in range(extra)]
        sched.submit([target, *others])
        for s in (target, *others):
            await _wait(s)
        await sched.close()
        return target.tokens

    alone, crowded = asyncio.run(run(0)), asyncio.run(run(5))
    assert alone == crowded


def test_stop_sequence_and_eos_end_a_sequence() -> None:
    async def main() -> None:
        sched = _scheduler("onnxruntime")
        sched.start()
        free = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0, logprobs=1))
        sched.submit([free])
        await _wait(free)
        text = TOK.decode(free.tokens)
        stop = text[5:8]  # three tokens, sampled in three steps: the stop removes tokens the loop already has
        cut = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                   stop=(stop.encode(),), logprobs=1))
        sched.submit([cut])
        await _wait(cut)
        await sched.close()
        assert TOK.decode(cut.tokens) == text[: text.index(stop)] and cut.finish_reason == "stop"
        kept = len(cut.tokens)  # the logprobs stay one a token, and are the free run's own
        assert len(free.logprobs.chosen) == len(free.tokens) == 40
        assert cut.logprobs.chosen == free.logprobs.chosen[:kept] and cut.logprobs.top == free.logprobs.top[:kept]
        assert cut.steps[-1] == kept < max(cut.steps)  # the last step took back tokens an earlier step had

    asyncio.run(main())


# ---- completions ----------------------------------------------------------------------------------------


def _complete(client: TestClient, **body: Any) -> httpx.Response:
    # json.dumps escapes lone surrogates ("\\ud800"); an HTTP client's own encoder refuses them
    return client.post("/v1/completions", content=json.dumps({"model": "text_multimax"} | body),
                       headers={"content-type": "application/json"})


def test_completion_greedy_matches_the_reference_and_counts_usage(service_client: TestClient,
                                                                  service_text_model: Any) -> None:
    r = _complete(service_client, prompt="Return the", max_tokens=30, temperature=0)
    assert r.status_code == 200
    body = r.json()
    want = generate(service_text_model, TOK.encode("Return the"), 30, temperature=0.0)[0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == TOK.decode(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 30, "total_tokens": 40}
    assert "queue;dur=" in r.headers["server-timing"]


def test_completion_defaults_and_batch_of_prompts(service_client: TestClient) -> None:
    r = _complete(service_client, prompt=["Hello", "World!"], seed=3)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 11 and body["usage"]["completion_tokens"] <= 32  # 16 each by default
    r = _complete(service_client, prompt=TOK.encode("Hi"), max_tokens=0)
    assert r.json()["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


def _sse(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_yields_the_same_text_ends_in_done_and_reports_usage(service_client: TestClient) -> None:
    body = {"prompt": "If the file", "max_tokens": 25, "temperature": 0.8, "seed": 11}
    whole = _complete(service_client, **body).json()
    r = _complete(service_client, stream=True, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == whole["usage"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    r = _complete(service_client, stream=True, stream_options={"include_usage": True}, **body)
    chunks = _sse(r.text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x" * 200}, "prompt"),
    ({"prompt": "hi", "max_tokens": 200}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": "hi", "n": 99}, "n"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "best_of": 2, "n": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "hi", "stop": "\udfff"}, "stop"),
    ({}, "prompt"),
])
def test_bad_completion_requests_are_400_with_openai_errors(service_client: TestClient, body: dict[str, Any],
                                                            param: str) -> None:
    r = _complete(service_client, **body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"].startswith(param)


def test_nan_temperature_unknown_model_and_wrong_task(service_client: TestClient) -> None:
    raw = b'{"model": "text_multimax", "prompt": "a", "temperature": NaN}'
    r = service_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = service_client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = service_client.post("/v1/completions", json={"model": "digits_multimax", "prompt": "a"})
    assert r.status_code == 400 and error_of(r)["code"] == "wrong_task"
    r = service_client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400


# ---- KServe V2 -------------------------------------------------------------------------------------------


def test_kserve_server_and_model_metadata(service_client: TestClient) -> None:
    assert service_client.get("/v2").json()["name"] == "multimax-serve"
    assert service_client.get("/v2/health/live").status_code == 200
    assert service_client.get("/v2/health/ready").json() == {"ready": True}
    meta = service_client.get("/v2/models/digits_multimax").json()
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 1, 32, 32]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    card = service_client.get("/v1/models/digits_multimax").json()  # the fused CPU ops' state, in both APIs
    assert meta["fused_multimax"] == card["fused_multimax"]
    assert meta["fused_multimax"]["in_use"] is ort_ops.library().available
    twin = service_client.get("/v2/models/digits_softmax").json()
    assert twin["fused_multimax"] == {"in_use": False, "reason": "the model has no multimax nodes"}
    assert service_client.get("/v2/models/digits_multimax/ready").status_code == 200
    assert service_client.get("/v2/models/text_multimax/versions/1").json()["inputs"][0]["name"] == "input_ids"
    config = service_client.get("/v2/models/digits_multimax/config").json()
    assert config["max_batch_size"] == 16 and config["input"][0]["data_type"] == "TYPE_FP32"
    r = service_client.get("/v2/models/nope")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    assert service_client.get("/v2/models/digits_multimax/versions/7").status_code == 404


def _pixels(n: int = 2) -> np.ndarray:
    return np.random.default_rng(0).uniform(-1, 1, (n, 1, 32, 32)).astype(np.float32)


def _direct_logits(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(DEMO_DIR / "digits_multimax.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"pixel_values": x})[0]


def test_kserve_infer_json_matches_the_session(service_client: TestClient) -> None:
    x = _pixels()
    body = {"id": "r1", "inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                                    "data": x.ravel().tolist()}]}
    r = service_client.post("/v2/models/digits_multimax/infer", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["id"] == "r1" and out["model_name"] == "digits_multimax"
    logits = np.array(out["outputs"][0]["data"], np.float32).reshape(out["outputs"][0]["shape"])
    assert np.allclose(logits, _direct_logits(x), atol=1e-5)
    assert "compute;dur=" in r.headers["server-timing"]


def test_kserve_binary_extension_classification_and_gzip(service_client: TestClient) -> None:
    x = _pixels(3)
    header = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [3, 1, 32, 32],
                          "parameters": {"binary_data_size": x.nbytes}}],
              "outputs": [{"name": "logits", "parameters": {"binary_data": True}},
                          {"name": "logits", "parameters": {"classification": 2}}]}
    head = json.dumps(header).encode()
    r = service_client.post("/v2/models/digits_multimax/infer", content=gzip.compress(head + x.tobytes()),
                            headers={"Inference-Header-Content-Length": str(len(head)), "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    meta = json.loads(r.content[:n])
    size = meta["outputs"][0]["parameters"]["binary_data_size"]
    logits = np.frombuffer(r.content[n:n + size], np.float32).reshape(3, 10)
    want = _direct_logits(x)
    assert np.allclose(logits, want, atol=1e-5)
    top = meta["outputs"][1]["data"]
    assert len(top) == 6 and int(top[0].split(":")[1]) == int(want[0].argmax())


def test_kserve_text_model_forward(service_client: TestClient, service_text_model: Any) -> None:
    ids = np.array([TOK.encode("Hello")], np.int64)
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 5], "data": ids.ravel().tolist()}]}
    r = service_client.post("/v2/models/text_multimax/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [1, 5, 259]
    with torch.no_grad():
        want = service_text_model(torch.from_numpy(ids))[0].numpy()
    assert np.allclose(np.array(out["data"], np.float32).reshape(1, 5, 259), want, atol=1e-3)


def _infer(client: TestClient, inputs: list[dict[str, Any]], model: str = "digits_multimax",
           **extra: Any) -> httpx.Response:
    return client.post(f"/v2/models/{model}/infer", json={"inputs": inputs} | extra)


BAD_TENSORS = [
    [{"name": "pixel_values", "datatype": "INT64", "shape": [1, 1, 32, 32], "data": [0] * 1024}],  # dtype
    [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 16, 16], "data": [0.0] * 256}],  # shape
    [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": [0.0] * 10}],  # count
    [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": ["a"] * 1024}],  # strings
    [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": [[1.0], [1.0, 2.0]]}],  # ragged
    [{"name": "pixel_values", "datatype": "FP32", "shape": [0, 1, 32, 32], "data": []}],  # empty batch
    [{"name": "pixel_values", "datatype": "FP32", "shape": [17, 1, 32, 32], "data": [0.0] * 17 * 1024}],  # > max
    [{"name": "pixel_values", "datatype": "FP99", "shape": [1], "data": [0]}],  # unknown datatype
    [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 1, 32, 32], "data": [0.0] * 1024}],  # bad shape
    [{"name": "other", "datatype": "FP32", "shape": [1], "data": [0.0]}],  # unknown input
    [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32]}],  # no data
    [{"datatype": "FP32", "shape": [1], "data": [0.0]}],  # no name
    ["not an object"],
]


@pytest.mark.parametrize("inputs", BAD_TENSORS)
def test_kserve_bad_tensors_are_400(service_client: TestClient, inputs: list[Any]) -> None:
    r = _infer(service_client, inputs)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_kserve_nan_and_inf_are_400(service_client: TestClient, value: str) -> None:
    data = ", ".join(["0.5"] * 1023 + [value])
    spec = '"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32]'
    raw = f'{{"inputs": [{{{spec}, "data": [{data}]}}]}}'.encode()
    r = service_client.post("/v2/models/digits_multimax/infer", content=raw,
                            headers={"content-type": "application/json"})
    assert r.status_code == 400 and f"{value.lstrip('-')} is not valid JSON" in r.json()["error"]  # RFC 8259
    x = np.zeros((1, 1, 32, 32), np.float32)
    x[0, 0, 3, 3] = float(value.replace("Infinity", "inf"))
    head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32],
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    r = service_client.post("/v2/models/digits_multimax/infer", content=head + x.tobytes(),
                            headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400


@pytest.mark.parametrize(("body", "headers"), [
    (b"{not json", {}),
    (b"[]", {}),
    (b'{"inputs": []}', {}),
    (b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], '
     b'"parameters": {"binary_data_size": 4096}}]}', {}),  # claims binary data that is not there
    (b'{"inputs": 1}xx', {"Inference-Header-Content-Length": "12"}),
    (b"{}", {"Inference-Header-Content-Length": "99"}),
    (b"{}", {"Inference-Header-Content-Length": "x"}),
    (b"garbage", {"Content-Encoding": "gzip"}),
])
def test_kserve_malformed_requests_are_4xx(service_client: TestClient, body: bytes, headers: dict[str, str]) -> None:
    r = service_client.post("/v2/models/digits_multimax/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str)


def test_kserve_text_bad_inputs_are_400(service_client: TestClient) -> None:
    for inputs in (
        [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 900]}],  # outside the vocabulary
        [{"name": "input_ids", "datatype": "INT64", "shape": [1, 200], "data": [1] * 200}],  # beyond the context
        [{"name": "input_ids", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}],
        [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1.5, 2]}],
        [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
         {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 0]}],
    ):
        r = _infer(service_client, inputs, "text_multimax")
        assert r.status_code == 400, (inputs, r.text)


# ---- metrics and docs -----------------------------------------------------------------------------------


def test_metrics_cover_requests_batches_and_generation(service_client: TestClient) -> None:
    _complete(service_client, prompt="abc", max_tokens=4)
    _classify(service_client, b"not an image")
    r = service_client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("multimax_request_duration_seconds_bucket", "multimax_queue_seconds_bucket",
                 "multimax_compute_seconds_bucket", "multimax_batch_size_bucket", "multimax_pending_requests",
                 "multimax_time_to_first_token_seconds_bucket", "multimax_inter_token_latency_seconds_bucket",
                 "multimax_e2e_request_latency_seconds_bucket", "multimax_prompt_tokens_total",
                 "multimax_generation_tokens_total", "multimax_running_sequences", "multimax_waiting_sequences"):
        assert name in text, name
    assert 'multimax_requests_total{endpoint="classify",model="digits_multimax",outcome="invalid_input"}' in text
    assert 'multimax_requests_total{endpoint="completions",model="text_multimax",outcome="success"}' in text
    assert "server-timing" in r.headers


def test_openapi_and_docs(service_client: TestClient) -> None:
    schema = service_client.get("/openapi.json").json()
    for path in ("/v1/models", "/v1/completions", "/v1/models/{name}/classify", "/v2/models/{name}/infer",
                 "/metrics", "/v2/health/ready"):
        assert path in schema["paths"], path
    assert service_client.get("/docs").status_code == 200


# ---- PyTorch backend ----------------------------------------------------------------------------------


def test_torch_backend_serves_the_checkpoints(tmp_path: Path, service_digits: list[tuple[bytes, int]]) -> None:
    for name in ("digits_multimax.pt", "text_multimax.pt", "digits_multimax.onnx"):
        (tmp_path / name).symlink_to(DEMO_DIR / name)
    with TestClient(create_app(Settings(model_dir=tmp_path, backend="torch"))) as client:
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert {c["backend"] for c in cards.values()} == {"torch"}
        assert cards["text_multimax"]["provider"] == "cpu (eager)"
        data, label = service_digits[5]
        r = client.post("/v1/models/digits_multimax/classify", content=data, headers={"content-type": "image/png"})
        assert r.json()["predictions"][0][0]["label"] == str(label)
        r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": "Return the", "max_tokens": 8,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        meta = client.get("/v2/models/digits_multimax").json()
        assert meta["platform"] == "pytorch_libtorch" and "fused_multimax" not in meta
