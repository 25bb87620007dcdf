"""Property tests (hypothesis): whatever bytes reach the image decoder, the JSON readers or the KServe V2 codec,
the answer is a value or a 4xx ServiceError, and over HTTP a 2xx or a 4xx; never an exception escaping."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from service.base.config import Settings
from service.base.errors import ServiceError
from service.base.jsonio import loads
from service.base.kserve_codec import DTYPES, decode_tensors
from service.edge.app import create_app
from service.engine.vision import Preprocess, load_and_preprocess
from service.protocols.classify import _images_json

EXAMPLES = 150
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COUNTS: dict[str, int] = {}


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


def _encoded(fmt: str, mode: str, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 77).save(buf, fmt)
    return buf.getvalue()


SEEDS = [_encoded(f, m, s) for f, m, s in (("PNG", "L", (32, 32)), ("PNG", "RGBA", (40, 9)), ("JPEG", "RGB", (33, 20)),
                                           ("GIF", "P", (16, 16)), ("BMP", "RGB", (12, 50)), ("TIFF", "I;16", (20, 20)),
                                           ("WEBP", "RGB", (24, 24)))]


@st.composite
def damaged_images(draw: st.DrawFn) -> bytes:
    """A real image file with bytes flipped, cut or spliced in: the inputs that reach deep into the decoders."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[pos:pos + draw(st.integers(1, 64))]
        else:
            data[pos:pos] = draw(st.binary(max_size=16))
    return bytes(data)


SPEC = Preprocess.from_metadata({"channels": "RGB", "image_size": 16, "resize": 18, "interpolation": "bicubic"})


@FUZZ
@given(data=st.one_of(st.binary(max_size=512), damaged_images()))
def test_image_decoder_answers_an_array_or_a_4xx(data: bytes) -> None:
    _count("image decoder")
    try:
        out = load_and_preprocess(data, SPEC, max_pixels=4_000_000, min_side=4)
    except ServiceError as exc:
        assert 400 <= exc.status < 500
    else:
        assert out.shape == (3, 16, 16) and out.dtype == np.float32 and np.isfinite(out).all()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30)


@FUZZ
@given(data=st.one_of(st.binary(max_size=256), json_values.map(lambda v: json.dumps(v).encode())))
def test_json_readers_answer_a_value_or_a_400(data: bytes) -> None:
    _count("JSON readers")
    for read in (lambda: loads(data), lambda: _images_json(data, 4, 1024)):
        try:
            read()
        except ServiceError as exc:
            assert 400 <= exc.status < 500


tensor_specs = st.fixed_dictionaries(
    {"name": st.one_of(st.text(max_size=4), st.integers()),
     "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=10), json_values),
     "datatype": st.one_of(st.sampled_from(list(DTYPES)), st.text(max_size=6))},
    optional={"data": json_values,
              "parameters": st.one_of(json_values, st.fixed_dictionaries(
                  {"binary_data_size": st.one_of(st.integers(-4, 64), st.booleans(), st.text(max_size=3))}))})


@FUZZ
@given(inputs=st.one_of(st.lists(tensor_specs, max_size=3), json_values), binary=st.binary(max_size=64))
def test_v2_codec_answers_tensors_or_a_400(inputs: Any, binary: bytes) -> None:
    _count("V2 codec")
    try:
        tensors = decode_tensors({"inputs": inputs}, binary, max_elements=1 << 20)
    except ServiceError as exc:
        assert exc.status == 400
    else:
        assert all(isinstance(t, np.ndarray) for t in tensors.values())


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(max_json_bytes=64 * 1024)), raise_server_exceptions=False) as c:
        yield c


ROUTES = ["/v1/completions", "/v1/models/digits_multimax/classify", "/v2/models/digits_multimax/infer",
          "/v2/models/text_multimax/infer", "/v2/repository/index"]


@FUZZ
@given(route=st.sampled_from(ROUTES),
       body=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                      st.lists(tensor_specs, min_size=1, max_size=2).map(lambda i: json.dumps({"inputs": i}).encode()),
                      damaged_images()),
       content_type=st.sampled_from(["application/json", "image/png", "application/octet-stream", "text/plain"]),
       header_length=st.one_of(st.none(), st.integers(-1, 400).map(str), st.text(max_size=3)))
def test_any_body_on_any_route_gets_2xx_or_4xx(client: TestClient, route: str, body: bytes, content_type: str,
                                               header_length: str | None) -> None:
    _count("HTTP bodies")
    headers = {"content-type": content_type}
    if header_length is not None and header_length.isascii() and header_length.isprintable():
        headers["inference-header-content-length"] = header_length
    r = client.post(route, content=body, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text)

    def refuse(name: str) -> Any:
        raise AssertionError(f"bare {name} in a response")

    if r.headers.get("content-type", "").startswith("application/json"):
        json.loads(r.text, parse_constant=refuse)


def test_zz_report_counts() -> None:
    print("hypothesis examples:", ", ".join(f"{k} {v}" for k, v in COUNTS.items()))
