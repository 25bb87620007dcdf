"""Fixtures shared by test files."""

from __future__ import annotations

import os

import pytest

from plugins import ort_ops


@pytest.fixture(scope="module")
def lib() -> ort_ops.Library:
    """The fused onnxruntime ops; where CI requires them (MULTIMAX_REQUIRE_ORT_OPS=1) a missing library fails."""
    found = ort_ops.library()
    if not found.available:
        if os.environ.get("MULTIMAX_REQUIRE_ORT_OPS") == "1":
            pytest.fail(f"fused MultiMax ops required but unavailable: {found.reason}")
        pytest.skip(f"fused MultiMax ops unavailable: {found.reason}")
    return found
