"""Fixtures shared by the tests of the HTTP edge: what the server logs during a test (JSON), the demo models served
in-process with access logs on."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.base.config import Settings
from service.base.logs import configure_logging
from service.edge.app import create_app


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Everything logged during the test, through the server's own logging set-up (JSON)."""
    buf = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging("json", "info", buf)
    try:
        yield buf
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.fixture(scope="module")
def open_client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(access_log=True)), raise_server_exceptions=False) as client:
        yield client
