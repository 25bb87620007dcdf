"""Every vision cell of the conformance matrix: each DeiT kind through each artifact, classified as the paper's
formulas over the raw weights classify it (tests/models/test_deit.py's reference_forward: no nn.Module of the project),
on an image preprocessed as timm/DeiT's evaluation transform does (resize the shorter side to 32/0.875, here
the image's own size, then the center crop 32, ImageNet mean and std)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from tests.conformance.builders import DEIT, DEIT_EPS, DEIT_HEADS, deit_state_dict
from tests.conformance.conftest import model_name
from tests.conformance.matrix import EXACT_ARTIFACTS, VISION_FEATURES, Kind, cell, cells

pytestmark = pytest.mark.slow

SIDE = round(DEIT["img"] / 0.875)  # 37: the resize is the identity, the crop takes pixels 2..33
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _image(seed: int) -> tuple[bytes, np.ndarray]:
    """A PNG of SIDE x SIDE random pixels and the (3, 32, 32) tensor the evaluation transform makes of it."""
    pixels = (np.random.default_rng(seed).random((SIDE, SIDE, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    left = (SIDE - DEIT["img"]) // 2
    crop = pixels[left:left + DEIT["img"], left:left + DEIT["img"]].astype(np.float64) / 255.0
    return buf.getvalue(), ((crop - MEAN) / STD).transpose(2, 0, 1).astype(np.float32)


def _reference(kind: Kind, x: np.ndarray) -> np.ndarray:
    from tests.models.test_deit import reference_forward

    with torch.no_grad():
        # V2: attention is t*x+b then first order, the output MultiMax first order (the official V2 commit)
        logits = reference_forward(deit_state_dict(kind), torch.from_numpy(x)[None], heads=DEIT_HEADS, eps=DEIT_EPS,
                                   order=1 if kind.options.get("v2") else 2)
    return logits[0].double().numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _limit(artifact: str, values: np.ndarray) -> float:
    return (1e-3 if artifact in EXACT_ARTIFACTS else 0.1) * max(1.0, float(np.abs(values).max()))


def check_classify(client: TestClient, name: str, kind: Kind, artifact: str) -> None:
    png, x = _image(1)
    probs = _softmax(_reference(kind, x))
    r = client.post(f"/v1/models/{name}/classify?top_k=3", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    got = r.json()["predictions"][0]
    assert [p["probability"] for p in got] == pytest.approx(np.sort(probs)[::-1][:3], abs=_limit(artifact, probs))
    if artifact in EXACT_ARTIFACTS:
        assert [p["index"] for p in got] == list(np.argsort(probs)[::-1][:3])
    else:
        assert got[0]["index"] in np.argsort(probs)[::-1][:2]


def _infer(client: TestClient, name: str, x: np.ndarray, **parameters: Any) -> Any:
    body: dict[str, Any] = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, *x.shape],
                                        "data": x.ravel().tolist()}]}
    if parameters:
        body["outputs"] = [{"name": "logits", "parameters": parameters}]
    r = client.post(f"/v2/models/{name}/infer", json=body)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]


def check_kserve_infer(client: TestClient, name: str, kind: Kind, artifact: str) -> None:
    _, x = _image(2)
    ref = _reference(kind, x)
    out = _infer(client, name, x)
    np.testing.assert_allclose(np.asarray(out["data"]).reshape(out["shape"])[0], ref, atol=_limit(artifact, ref))


def check_kserve_classification(client: TestClient, name: str, kind: Kind, artifact: str) -> None:
    _, x = _image(3)
    ref = _reference(kind, x)
    out = _infer(client, name, x, classification=3)
    entries = [s.split(":") for s in out["data"]]
    assert out["datatype"] == "BYTES" and len(entries) == 3
    scores = [float(e[0]) for e in entries]
    assert scores == pytest.approx(np.sort(ref)[::-1][:3], abs=_limit(artifact, ref))
    if artifact in EXACT_ARTIFACTS:
        assert [int(e[1]) for e in entries] == list(np.argsort(ref)[::-1][:3])


CHECKS = {"classify": check_classify, "kserve_infer": check_kserve_infer,
          "kserve_classification": check_kserve_classification}


def test_every_vision_feature_has_a_check() -> None:
    assert set(CHECKS) == set(VISION_FEATURES)


@pytest.mark.parametrize(("kind", "artifact", "feature"), cells("vision"),
                         ids=[f"{k.name}-{a}-{f}" for k, a, f in cells("vision")])
def test_vision_cell(kind: Kind, artifact: str, feature: str, client: TestClient) -> None:
    assert cell(kind, artifact, feature).works
    CHECKS[feature](client, model_name(kind, artifact), kind, artifact)
