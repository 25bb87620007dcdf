"""Helpers shared by the service's in-process tests: images as a client uploads them, the app's workers run in
the test's event loop, a deliberately slow vision model, an error body's `error` object, and text backends wrapped
to misbehave on cue (`Wrapped`, `Steered`)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from models.tokenizer import ByteTokenizer
from service.engine.vision import Preprocess

TOK = ByteTokenizer()


# ---- in-process: uploads, the app's workers, errors ----------------------------------------------------------


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


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


# ---- images and requests -------------------------------------------------------------------------------------


SPEC = Preprocess.from_metadata({"channels": "L", "image_size": 32, "resize": 32, "interpolation": "bilinear",
                                 "crop": "center", "mean": [0.5], "std": [0.5]})


def _jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG")
    return buf.getvalue()


def _classify(client: TestClient, data: bytes, content_type: str = "image/png", **kw: Any) -> httpx.Response:
    return client.post("/v1/models/digits_multimax/classify", content=data, headers={"content-type": content_type},
                       **kw)


def _complete(client: TestClient, **body: Any) -> httpx.Response:
    # json.dumps escapes lone surrogates ("\\ud800"); an HTTP client's own encoder refuses them
    return client.post("/v1/completions", content=json.dumps({"model": "text_multimax"} | body),
                       headers={"content-type": "application/json"})


# ---- hardening (issue 27): a real server's log, an upload ----------------------------------------------------


def _log_text(log: Any) -> str:
    log.seek(0)
    return str(log.read())


def _png_bytes(size: int = 32, value: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, "PNG")
    return buf.getvalue()


# ---- text backends that misbehave on cue ------------------------------------------------------------------------


class Wrapped:
    """A text backend as the decode loop sees it (service.engine.backends.base.CachedDecoder), every call passed to
    `inner`: subclasses change `run_text`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.keeps_last_logits, self.cache = inner.keeps_last_logits, inner.cache

    def empty_past(self, batch: int) -> Any:
        return self.inner.empty_past(batch)

    def reserve(self, positions: int) -> None:
        self.inner.reserve(positions)

    def host_logits(self, logits: Any) -> Any:
        return self.inner.host_logits(logits)

    def run_text(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Any,
                 last_only: bool = False) -> Any:
        return self.inner.run_text(ids, mask, positions, past, last_only)


class Steered(Wrapped):
    """The model, except: at a position in `script` the logits make that token the greedy choice; at a position in
    `nan_at` the row's logits are NaN (its numbers went bad). Logits are torch tensors (a folder's PyTorch model) or
    numpy arrays (ONNX Runtime: a folder's export)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.script: dict[int, int] = {}
        self.nan_at: set[int] = set()

    def run_text(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Any,
                 last_only: bool = False) -> Any:
        logits, presents = self.inner.run_text(ids, mask, positions, past, last_only)
        if not self.script and not self.nan_at:
            return logits, presents
        logits = logits.copy() if isinstance(logits, np.ndarray) else logits.clone()
        for row, pos in enumerate(positions[:, -1].tolist()):
            if pos in self.script:
                logits[row, -1] = -1e4
                logits[row, -1, self.script[pos]] = 1e4
            if pos in self.nan_at:
                logits[row, -1] = float("nan")
        return logits, presents
