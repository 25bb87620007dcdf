"""Fixtures the benchmark tests share."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.paths import ROOT

DEMO_TEXT = ROOT / "models" / "demo" / "text_multimax.pt"


@pytest.fixture(scope="session")
def text_genai_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo text model exported as an onnxruntime-genai folder (once per session)."""
    from export.cli import main as export_main

    out = tmp_path_factory.mktemp("text-genai") / "text-genai"
    with redirect_stdout(io.StringIO()):
        assert export_main([str(DEMO_TEXT), "-o", str(out), "--samples", "4", "--quiet"]) == 0
    return out
