"""Issue 27, hardening in the engine: model files that lie are refused at load, CPU-heavy images neither hold up other
clients nor outlive their deadline, a failing model leaves the others ready, and Retry-After follows the queued work."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image

from benchmarks.server import free_port, wait_ready
from models.demo import DEMO_DIR
from service.base.config import Settings
from service.base.errors import ServiceError
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.batcher import DynamicBatcher
from service.engine.decoding import DecodePool
from service.engine.engine_errors import EngineError
from service.engine.runtime import image_pixel_limit
from service.engine.vision import Preprocess
from service.protocols import classify as classify_module
from service.protocols.engine_status import http_error
from tests.service.support import _png_bytes

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
