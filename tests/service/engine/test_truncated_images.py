"""Issue 27, hardening: images whose data ends early (PNG rows, baseline, progressive and restart-marker JPEGs) are a
422, never a prediction on grey or zeros; whole images still decode as Pillow does."""

from __future__ import annotations

import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile

from service.base.config import Settings
from service.base.errors import ServiceError
from service.base.pngcheck import missing_rows
from service.edge.app import create_app
from service.engine import vision as vision_module
from service.engine.vision import Preprocess
from tests.service.support import _log_text


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
