"""Bounded work per request and strict JSON: whatever one client sends costs it a 4xx, never a 5xx, a stalled
event loop, a huge allocation or a response that is not JSON."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.base.config import Settings
from service.base.errors import ServiceError
from service.base.kserve_codec import decode_tensors
from service.edge.app import create_app
from service.engine.vision import Preprocess, preprocess
from service.protocols import classify as classify_module


def _strict(text: str | bytes) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"response holds bare {name}: not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # 40 MP images (the 8 x 2,000,000 one below): above the digits models' own default limit (4 MP)
    settings = Settings(max_json_bytes=256 * 1024, max_image_pixels=40_000_000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _infer(client: TestClient, model: str, inputs: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return client.post(f"/v2/models/{model}/infer", content=json.dumps({"inputs": inputs} | extra),
                       headers={"content-type": "application/json"})


# ---- strict JSON out ----------------------------------------------------------------------------------------


def test_non_finite_model_output_is_a_clear_422_never_bare_nan(client: TestClient) -> None:
    x = np.full((1, 1, 32, 32), 3.0e38, np.float32)  # finite inputs at the float32 limit: the logits are not
    r = _infer(client, "digits_multimax", [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32],
                                            "data": x.ravel().tolist()}])
    body = _strict(r.text)
    assert r.status_code == 422 and "not finite" in body["error"], r.text
    # The binary extension carries IEEE floats: there the same output is delivered as it is.
    head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32],
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    r = client.post("/v2/models/digits_multimax/infer", content=head + x.tobytes(),
                    headers={"inference-header-content-length": str(len(head))})
    assert r.status_code == 200
    n = int(r.headers["inference-header-content-length"])
    assert not np.isfinite(np.frombuffer(r.content[n:], "<f4")).all()


def test_classify_with_non_finite_probabilities_is_422_json() -> None:
    app = create_app(Settings(models=("digits_multimax",)))
    backend = app.state.runtimes.models["digits_multimax"].entry.backend
    backend.run_vision = lambda x: np.full((len(x), 10), np.nan, np.float32)
    image = io.BytesIO()
    Image.new("L", (32, 32), 128).save(image, "PNG")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/models/digits_multimax/classify", content=image.getvalue(),
                   headers={"content-type": "image/png"})
    assert r.status_code == 422 and _strict(r.text)["error"]["code"] == "non_finite_output"


# ---- strict and bounded JSON in -----------------------------------------------------------------------------

NESTED = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", NESTED),
    ("/v1/completions", b'{"model": "text_multimax", "prompt": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}"),
    ("/v1/models/digits_multimax/classify", b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v2/models/digits_multimax/infer", NESTED),
    ("/v2/models/digits_multimax/infer", b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1], '
                                         b'"data": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}]}"),
    ("/v2/models/text_multimax/infer", b'{"inputs": [{"name": "input_ids", "datatype": "BYTES", "shape": [1], '
                                       b'"data": ' + b"[" * 5000 + b'"a"' + b"]" * 5000 + b"}]}"),
    ("/v2/repository/index", NESTED),
])
def test_deeply_nested_json_is_a_4xx_never_a_recursion_error(client: TestClient, path: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in (400, 413), r.text
    _strict(r.text)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_bare_nan_in_a_request_is_refused(client: TestClient, constant: str) -> None:
    body = f'{{"model": "text_multimax", "prompt": "a", "temperature": {constant}}}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_millions_of_token_ids_are_refused_before_they_are_parsed(client: TestClient) -> None:
    body = json.dumps({"model": "text_multimax", "prompt": [1] * 2_000_000}).encode()
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "max_json_bytes" in r.json()["error"]["message"]


def test_prompt_longer_than_the_context_is_refused_before_validation(client: TestClient,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from service.protocols import openai_api

    validated: list[int] = []
    original = openai_api.CompletionRequest.model_validate
    monkeypatch.setattr(openai_api.CompletionRequest, "model_validate",
                        lambda obj: validated.append(1) or original(obj))
    r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": [[1] * 129]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not validated
    r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": [1] * 20, "max_tokens": 1})
    assert r.status_code == 200 and validated


def test_a_large_json_parse_does_not_need_the_event_loop_for_long(client: TestClient) -> None:
    """The limit is what bounds a parse: the largest body it admits (all small numbers, the slowest JSON there
    is) is refused or parsed, and a body just over it is refused from its length."""
    limit = 256 * 1024
    data = ("[" + "1," * (limit // 2 - 64))[:limit - 200] + "1]"
    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1], "data": 0}]})
    body = body.replace('"data": 0', f'"data": {data}')
    assert len(body) <= limit
    r = client.post("/v2/models/text_multimax/infer", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "values for shape" in r.json()["error"]
    r = client.post("/v2/models/text_multimax/infer", content=body + " " * limit,
                    headers={"content-type": "application/json"})
    assert r.status_code == 413


# ---- KServe V2 tensors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "why"), [
    ({"datatype": "UINT64", "shape": [2], "data": [True, False]}, "true/false"),
    ({"datatype": "INT64", "shape": [3], "data": [1, True, 2]}, "true/false"),
    ({"datatype": "FP32", "shape": [2], "data": [1.5, False]}, "true/false"),
    ({"datatype": "FP32", "shape": [2], "data": ["1", "2"]}, "numbers"),
    ({"datatype": "UINT8", "shape": [2], "data": [1, -1]}, "unsigned"),
    ({"datatype": "FP16", "shape": [1], "data": [1e10]}, "out of range"),
    ({"datatype": "BOOL", "shape": [2], "data": [1, 0]}, "true/false"),
    ({"datatype": "INT64", "shape": [1] * 40, "data": [1]}, "dimensions"),
    ({"datatype": "INT64", "shape": [2**40, 2**40], "data": [1]}, "more than a request can carry"),
    ({"datatype": 5, "shape": [1], "data": [1]}, "unknown datatype"),
    ({"datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 1 << 40}}, "binary_data_size"),
])
def test_every_datatype_and_shape_mismatch_is_400_naming_the_input(spec: dict[str, Any], why: str) -> None:
    with pytest.raises(ServiceError) as exc:
        decode_tensors({"inputs": [{"name": "x_in"} | spec]}, b"\0" * 16, max_elements=1 << 24)
    assert exc.value.status == 400 and "x_in" in exc.value.message and why in exc.value.message


def test_absurd_shapes_over_http_are_400(client: TestClient) -> None:
    for shape in ([1] * 70, [2**62, 4], [0] * 9):
        r = _infer(client, "text_multimax", [{"name": "input_ids", "datatype": "INT64", "shape": shape, "data": []}])
        assert r.status_code == 400 and "input_ids" in r.json()["error"], (shape, r.text)


# ---- images -------------------------------------------------------------------------------------------------


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height), 200).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def test_extreme_aspect_ratio_never_makes_a_huge_intermediate(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Preprocess.from_metadata({"channels": "RGB", "image_size": 32, "resize": 36, "interpolation": "bicubic"})
    image = Image.new("L", (8, 3_000_000), 100)  # 24 M pixels: under the pixel limit, absurd in shape
    largest: list[int] = []
    original = Image.Image.resize

    def recording(self: Image.Image, size: tuple[int, int], *args: Any, **kwargs: Any) -> Image.Image:
        largest.append(size[0] * size[1])
        assert size[0] * size[1] <= 64 * 64, f"resize to {size}"
        return original(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recording)
    out = preprocess(image, spec)
    assert out.shape == (3, 32, 32) and np.allclose(out, out[0, 0, 0])
    assert largest and max(largest) == 32 * 32


def test_extreme_aspect_ratio_over_http_is_answered(client: TestClient) -> None:
    data = _png(8, 2_000_000)
    assert len(data) < 100_000
    r = client.post("/v1/models/digits_multimax/classify", content=data, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text


def test_every_image_is_decoded_off_the_event_loop(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    original = classify_module.load_and_preprocess

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(classify_module, "load_and_preprocess", recording)
    r = client.post("/v1/models/digits_multimax/classify", content=_png(8, 8), headers={"content-type": "image/png"})
    assert r.status_code == 200 and len(threads) == 1
    loop_thread = client.portal.call(lambda: threading.current_thread().name)  # the app's event loop thread
    assert threads[0] != loop_thread


# ---- overload: cheap 429 with a measured Retry-After --------------------------------------------------------


def test_429_is_answered_before_the_body_is_read_with_a_measured_retry_after() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1, max_queue_size=2))
    backend = app.state.runtimes.models["digits_multimax"].entry.backend
    original = backend.run_vision

    gate = threading.Event()  # held while the queue must stay full: a sleep alone races with the queueing
    gate.set()
    computing = threading.Event()  # the worker has taken a batch

    def slow(x: np.ndarray) -> np.ndarray:
        computing.set()
        time.sleep(0.6)
        gate.wait(timeout=60)
        return original(x)

    backend.run_vision = slow
    image = _png(32, 32)

    async def main() -> tuple[int, dict[str, str], bool]:
        rt = app.state.runtimes
        rt.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                def post() -> Any:
                    return c.post("/v1/models/digits_multimax/classify", content=image,
                                  headers={"content-type": "image/png"})

                assert (await post()).status_code == 200  # one batch measured: 0.6 s
                gate.clear()
                computing.clear()
                # One computing (held), then two queued: sent together, the third could find the first still
                # queued and be refused itself, leaving nothing computing and a shorter Retry-After.
                busy = [asyncio.ensure_future(post())]
                until = time.monotonic() + 30
                while not computing.is_set() and time.monotonic() < until:
                    await asyncio.sleep(0.01)
                busy += [asyncio.ensure_future(post()) for _ in range(2)]
                while rt.models["digits_multimax"].batcher.queued < 2:
                    if time.monotonic() >= until:  # say where the three requests are, so a failure explains itself
                        states = [f.result().status_code if f.done() and not f.exception() else
                                  repr(f.exception()) if f.done() else "pending" for f in busy]
                        raise AssertionError(f"the two requests never queued: queued "
                                             f"{rt.models['digits_multimax'].batcher.queued}, requests {states}, "
                                             f"gate held {not gate.is_set()}, threads "
                                             f"{sorted(t.name for t in threading.enumerate())}")
                    await asyncio.sleep(0.01)
                read = False

                async def receive() -> dict[str, Any]:
                    nonlocal read
                    read = True
                    return {"type": "http.request", "body": image, "more_body": False}

                sent: list[dict[str, Any]] = []

                async def send(message: dict[str, Any]) -> None:
                    sent.append(message)

                scope = {"type": "http", "method": "POST", "path": "/v1/models/digits_multimax/classify",
                         "raw_path": b"/v1/models/digits_multimax/classify", "query_string": b"",
                         "headers": [(b"content-type", b"image/png"), (b"content-length", str(len(image)).encode())],
                         "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
                         "root_path": "", "state": {}}
                await app(scope, receive, send)
                gate.set()
                assert [r.status_code for r in await asyncio.gather(*busy)] == [200, 200, 200]
        finally:
            gate.set()
            await rt.stop()
        headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
        return sent[0]["status"], headers, read

    status, headers, read = asyncio.run(main())
    assert status == 429 and not read
    # two queued, one batch each of ~0.6 s, plus the one computing: about 2 s, never the old constant 1
    assert int(headers["retry-after"]) >= 2


def test_kserve_text_forwards_are_a_bounded_queue() -> None:
    app = create_app(Settings(models=("text_multimax",), max_waiting_sequences=2))
    backend = app.state.runtimes.models["text_multimax"].entry.backend
    original = backend.run_text

    def slow(*args: Any) -> Any:
        time.sleep(0.3)
        return original(*args)

    backend.run_text = slow
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 4], "data": [1, 2, 3, 4]}]}

    async def main() -> list[int]:
        app.state.runtimes.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                rs = await asyncio.gather(*(c.post("/v2/models/text_multimax/infer", json=body) for _ in range(5)))
        finally:
            await app.state.runtimes.stop()
        return sorted(r.status_code for r in rs)

    assert asyncio.run(main()) == [200, 200, 429, 429, 429]
