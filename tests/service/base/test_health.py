"""Startup survives bad model files (each skipped with one log line and listed with its reason), and a model's
readiness turns false when its worker dies or keeps failing, without turning the server's."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

from benchmarks.server import free_port, wait_ready
from models.demo import DEMO_DIR
from service.base.config import Settings
from service.base.health import FAILING_AFTER
from service.edge.app import create_app


def _edit_checkpoint(src: Path, dst: Path, edit: Any) -> None:
    obj = torch.load(src, map_location="cpu", weights_only=True)
    edit(obj)
    torch.save(obj, dst)


def _edit_onnx(src: Path, dst: Path, key: str, value: Any) -> None:
    proto = onnx.load(str(src))
    for prop in proto.metadata_props:
        if prop.key == f"multimax.{key}":
            prop.value = json.dumps(value)
    onnx.save(proto, str(dst))


BAD = {  # name -> (how it is made, words its reason must hold)
    "truncated_onnx": (lambda d: (d / "truncated_onnx.onnx").write_bytes((DEMO_DIR / "digits_softmax.onnx")
                                                                         .read_bytes()[:3000]), "onnxruntime"),
    "garbage_pt": (lambda d: (d / "garbage_pt.pt").write_bytes(b"PK\x03\x04 not really a zip"), "corrupt"),
    "channels": (lambda d: _edit_checkpoint(DEMO_DIR / "digits_softmax.pt", d / "channels.pt",
                                            lambda o: o["preprocess"].update(channels="CMYK")), "channels"),
    "zero_std": (lambda d: _edit_checkpoint(DEMO_DIR / "digits_softmax.pt", d / "zero_std.pt",
                                            lambda o: o["preprocess"].update(std=[0.0])), "std"),
    "interpolation": (lambda d: _edit_checkpoint(DEMO_DIR / "digits_softmax.pt", d / "interpolation.pt",
                                                 lambda o: o["preprocess"].update(interpolation="sinc")), "sinc"),
    "tokenizer": (lambda d: _edit_checkpoint(DEMO_DIR / "text_multimax.pt", d / "tokenizer.pt",
                                             lambda o: o["tokenizer"].update(type="bpe")), "tokenizer"),
    # A config claiming a million layers would allocate far more than the machine has: refused from the keys.
    "absurd_depth": (lambda d: _edit_checkpoint(DEMO_DIR / "text_multimax.pt", d / "absurd_depth.pt",
                                                lambda o: o["config"].update(n_layer=1_000_000)), "layers"),
    "wide_config": (lambda d: _edit_checkpoint(DEMO_DIR / "text_multimax.pt", d / "wide_config.pt",
                                               lambda o: o["config"].update(n_embd=1 << 20)), "shape"),
    "short_labels": (lambda d: _edit_onnx(DEMO_DIR / "digits_softmax.onnx", d / "short_labels.onnx", "labels",
                                          [str(i) for i in range(9)]), "labels"),
    "wrong_size": (lambda d: _edit_onnx(DEMO_DIR / "digits_softmax.onnx", d / "wrong_size.onnx", "preprocess",
                                        {"channels": "L", "image_size": 64, "mean": [0.5], "std": [0.5]}),
                   "pixel_values"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for good in ("digits_multimax.onnx", "text_multimax.onnx"):
        shutil.copy(DEMO_DIR / good, d / good)
    for make, _ in BAD.values():
        make(d)
    return d


def test_bad_model_files_are_skipped_each_with_one_line_and_listed_with_why(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="service")
    start = time.perf_counter()
    app = create_app(Settings(model_dir=model_dir))
    assert time.perf_counter() - start < 60  # nothing tried to allocate a million layers
    for name in BAD:
        lines = [r for r in caplog.records if r.getMessage().startswith(f"{name}: not served:")]
        assert len(lines) == 1 and "\n" not in lines[0].getMessage() and lines[0].exc_info is None, name
    with TestClient(app, raise_server_exceptions=False) as client:
        assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"digits_multimax", "text_multimax"}
        index = {row["name"]: row for row in client.post("/v2/repository/index").json()}
        assert set(index) == {"digits_multimax", "text_multimax", *BAD}
        for name, (_, why) in BAD.items():
            assert index[name]["state"] == "UNAVAILABLE" and why in index[name]["reason"], index[name]
        assert index["digits_multimax"] == {"name": "digits_multimax", "version": "1", "state": "READY", "reason": ""}
        ready_only = client.post("/v2/repository/index", json={"ready": True}).json()
        assert {row["name"] for row in ready_only} == {"digits_multimax", "text_multimax"}
        metrics = client.get("/metrics").text
        assert 'multimax_model_ready{model="absurd_depth"} 0.0' in metrics
        assert 'multimax_model_ready{model="digits_multimax"} 1.0' in metrics
        r = client.get("/v2/models/zero_std/ready")
        assert r.status_code == 400 and "std" in r.json()["reason"]
        r = client.post("/v1/models/zero_std/classify", content=b"x", headers={"content-type": "image/png"})
        assert r.status_code == 404 and "failed to load" in r.json()["error"]["message"]
        assert client.get("/v2/health/ready").status_code == 200  # the served models are all ready
        r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (32, 32), 10).save(buf, "PNG")
    return buf.getvalue()


def test_a_model_that_keeps_failing_turns_only_its_own_readiness_and_back_after_a_success() -> None:
    """Changed on purpose (issue 27, item 6): the server's readiness no longer turns 503 when one model keeps
    failing; only that model's readiness does. Five bad calls to one model must not take the others out of a
    load balancer, and with no traffic the breaker would never reset."""
    app = create_app(Settings(models=("digits_multimax", "text_multimax")))
    backend = app.state.runtimes.models["digits_multimax"].entry.backend
    original = backend.run_vision
    broken = {"on": True}

    def flaky(x: np.ndarray) -> np.ndarray:
        if broken["on"]:
            raise RuntimeError("device lost")
        return original(x)

    backend.run_vision = flaky
    image = _png()
    with TestClient(app, raise_server_exceptions=False) as client:
        def classify() -> int:
            return client.post("/v1/models/digits_multimax/classify", content=image,
                               headers={"content-type": "image/png"}).status_code

        for _ in range(FAILING_AFTER - 1):
            assert classify() == 500
        assert client.get("/v2/models/digits_multimax/ready").status_code == 200  # a few failures: maybe the inputs
        assert classify() == 500
        r = client.get("/v2/health/ready")
        assert r.status_code == 200 and r.json()["ready"] is True and r.json()["models_not_ready"] == 1
        assert "device lost" in r.json()["not_ready"]["digits_multimax"]  # no key configured: every client may know
        r = client.get("/v2/models/digits_multimax/ready")
        assert r.status_code == 400 and r.json()["ready"] is False and "failed" in r.json()["reason"]
        assert client.get("/v2/models/text_multimax/ready").status_code == 200  # the other model is fine
        assert 'multimax_model_ready{model="digits_multimax"} 0.0' in client.get("/metrics").text
        broken["on"] = False
        assert classify() == 200
        assert client.get("/v2/health/ready").json() == {"ready": True}
        assert client.get("/v2/models/digits_multimax/ready").json() == {"name": "digits_multimax", "ready": True}


def test_a_single_model_that_keeps_failing_leaves_the_server_ready() -> None:
    """Even alone: out of the load balancer, no request would come to reset its breaker, ever."""
    app = create_app(Settings(models=("digits_multimax",), warmup_calls=0))
    rt = app.state.runtimes.models["digits_multimax"]
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(FAILING_AFTER):
            rt.batcher.health.failed("RuntimeError: device lost")
        assert client.get("/v2/models/digits_multimax/ready").status_code == 400
        assert client.get("/v2/health/ready").status_code == 200


def test_a_dead_worker_turns_its_model_not_ready_and_the_server_only_when_no_worker_runs() -> None:
    """A dead loop is one model's trouble while another model serves (Ray's health check replaces the replica);
    with every served model's loop dead nothing can answer, and the server is not ready."""
    app = create_app(Settings(models=("digits_multimax", "text_multimax"), warmup_calls=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v2/health/ready").status_code == 200
        runtimes = app.state.runtimes

        async def kill(task: asyncio.Task[None]) -> None:
            task.cancel()
            await asyncio.sleep(0)

        client.portal.call(kill, runtimes.models["text_multimax"].scheduler._task)
        r = client.get("/v2/health/ready")
        assert r.status_code == 200 and "worker stopped" in r.json()["not_ready"]["text_multimax"]
        assert client.get("/v2/models/text_multimax/ready").status_code == 400
        assert client.get("/v2/models/digits_multimax/ready").status_code == 200
        client.portal.call(kill, runtimes.models["digits_multimax"].batcher._task)
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and r.json()["reason"] == "no served model's worker is running"


def test_over_a_real_socket_one_model_failing_leaves_the_other_and_the_server_ready() -> None:
    """uvicorn on a loopback port: the text model raises on every call while a client keeps sending to it; the
    classifier keeps answering 200 throughout, the server's readiness stays 200, the text model's turns 400."""
    app = create_app(Settings(models=("digits_multimax", "text_multimax"), warmup_calls=0))

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost")

    app.state.runtimes.models["text_multimax"].entry.backend.run_text = broken
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    failures: list[int] = []
    stop_failing = threading.Event()

    def fail_repeatedly() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop_failing.is_set():
                r = c.post(f"{url}/v1/completions", json={"model": "text_multimax", "prompt": "a", "max_tokens": 2})
                failures.append(r.status_code)

    try:
        wait_ready(url)
        failing = threading.Thread(target=fail_repeatedly)
        failing.start()
        with httpx.Client(timeout=30) as c:
            statuses = []
            while len(failures) < 3 * FAILING_AFTER:
                r = c.post(f"{url}/v1/models/digits_multimax/classify", content=_png(),
                           headers={"content-type": "image/png"})
                statuses.append((r.status_code, c.get(f"{url}/v2/health/ready").status_code))
            stop_failing.set()
            failing.join(timeout=60)
            assert statuses and set(statuses) == {(200, 200)}, statuses
            assert failures and set(failures) == {500}
            own = c.get(f"{url}/v2/models/text_multimax/ready")
            assert own.status_code == 400 and "model calls failed" in own.json()["reason"]
            assert c.get(f"{url}/v2/models/digits_multimax/ready").status_code == 200
            r = c.get(f"{url}/v2/health/ready")
            assert r.status_code == 200 and r.json()["models_not_ready"] == 1
    finally:
        stop_failing.set()
        server.should_exit = True
        thread.join(timeout=30)
