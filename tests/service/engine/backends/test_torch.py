"""The PyTorch backend (service.engine.backends.torch) serves the project's checkpoints. In-process (FastAPI's
TestClient or straight ASGI; no network)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from models.demo import DEMO_DIR
from service.base.config import Settings
from service.edge.app import create_app


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
