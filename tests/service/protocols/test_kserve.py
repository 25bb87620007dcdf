"""The KServe V2 protocol: server and model metadata, JSON and binary-extension inference equal to the session's,
text models, and malformed tensors as a 4xx. In-process (FastAPI's TestClient or straight ASGI; no network)."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from fastapi.testclient import TestClient

from models.demo import DEMO_DIR
from plugins import ort_ops
from tests.service.support import TOK


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
