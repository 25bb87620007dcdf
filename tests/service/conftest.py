"""Fixtures shared by the service's tests in several layers' folders.

In-process (tests/service/{base,edge,engine,protocols}/ from the former test_service.py): held-out digits as uploads,
the demo models served through TestClient, the demo text model. The hardening tests (issue 27): `served`, a real
`python -m service` with its log, and `client`, the demo models in-process without warm-up."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from benchmarks.server import start, stop
from models.checkpoint import load
from models.demo import DEMO_DIR
from models.training.vision import digits_split
from service.base.config import Settings
from service.edge.app import create_app
from tests.service.support import png

# ---- in-process: uploads and the demo models -----------------------------------------------------------------


@pytest.fixture(scope="module")
def service_digits() -> list[tuple[bytes, int]]:
    """Held-out digits as PNG files (what a client would upload) with their labels."""
    _, _, x, y = digits_split(seed=0)
    return [(png(Image.fromarray((x[i, 0].numpy() * 255).round().astype(np.uint8), "L")), int(y[i]))
            for i in range(24)]


@pytest.fixture(scope="module")
def service_client() -> Iterator[TestClient]:
    """The demo models (ONNX Runtime) served in-process; the demo LLM's folder from its export, made before it
    answers (wait: under auto it would answer on PyTorch until its background export is done)."""
    with TestClient(create_app(Settings(folder_export="wait")), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def service_text_model() -> Any:
    model, _, _ = load(DEMO_DIR / "text_multimax.pt")
    return model


# ---- hardening (issue 27): a real server, and the demo models without warm-up --------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    """`python -m service` (the demo models) on a free loopback port: (URL, its log file)."""
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start(output=log)
        try:
            yield url, log
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(warmup_calls=0)), raise_server_exceptions=False) as c:
        yield c
