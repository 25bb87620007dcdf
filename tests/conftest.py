"""Fixtures shared by test files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session", autouse=True)
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The cache of Hugging Face folders' exports (service.engine.folder_export) for this session: a folder served
    under the default --folder-export auto (the demo LLM, a test's tiny model) is exported once per session, never
    into the user's ~/.cache; `python -m service` started by a test inherits it. A MULTIMAX_SERVE_EXPORT_CACHE set
    before the run is kept (a cache kept between runs: entries are keyed by content, code and versions)."""
    name = "MULTIMAX_SERVE_EXPORT_CACHE"
    given = os.environ.get(name)
    cache = Path(given) if given else tmp_path_factory.mktemp("export-cache")
    os.environ[name] = str(cache)
    yield cache
    if given is None:
        os.environ.pop(name, None)


@pytest.fixture(scope="session", autouse=True)
def folder_export_waits() -> Iterator[None]:
    """`python -m service` started by a test exports a Hugging Face folder before the model answers (wait), as before
    issue 50 made auto's export run in the background: a short-lived test server would otherwise start an export
    it stops at exit, and its answers would come from PyTorch or the export by timing
    (tests/service/engine/test_background_export.py tests auto)."""
    name = "MULTIMAX_SERVE_FOLDER_EXPORT"
    given = os.environ.get(name)
    os.environ[name] = given or "wait"
    yield
    if given is None:
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real pretrained SmolLM2-135M-Instruct as a Hugging Face folder (tests/pretrained.py)."""
    from tests.pretrained import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="session")
def smollm2_seglu() -> Path:
    """SmolLM2-135M-Instruct with SegLU tensors on its head, as PaddleFleet writes them (tests/pretrained.py)."""
    from tests.pretrained import smollm2_folder

    return smollm2_folder(seglu=True)
