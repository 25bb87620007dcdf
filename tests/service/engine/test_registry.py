"""The model registry (service.engine.registry): which backend serves each model, a CPU machine's providers,
broken or missing model files at startup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from models.demo import DEMO_DIR
from service.base.config import Settings
from service.engine.registry import RegistryError, choose, load_registry
from tests.paths import ROOT


def test_backend_choice_per_model() -> None:
    both = {"onnxruntime": Path("a.onnx"), "torch": Path("a.pt")}
    assert choose(both, "auto") == "onnxruntime"
    assert choose(both, "torch") == "torch"
    assert choose({"torch": Path("a.pt")}, "onnxruntime") == "torch"  # falls back to what exists
    assert choose({"tensorrt": Path("a.engine")}, "torch") is None  # never an engine unless allowed


def test_cpu_machine_requests_only_the_cpu_provider_and_logs_no_provider_error() -> None:
    code = ("import logging; logging.basicConfig(level='INFO');"
            "from service.engine.backends.onnxruntime import OnnxRuntimeBackend; from models.demo import DEMO_DIR;"
            "b = OnnxRuntimeBackend(DEMO_DIR / 'digits_multimax.onnx'); print(b.provider)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    if "CUDAExecutionProvider" in out.stdout or "Tensorrt" in out.stdout:
        pytest.skip("this machine has a usable GPU provider")
    assert out.stdout.strip() == "CPUExecutionProvider"
    assert "[E:" not in out.stderr and "[W:" not in out.stderr and "rror" not in out.stderr, out.stderr


def test_tensorrt_backend_without_tensorrt_is_a_clear_startup_error() -> None:
    from plugins.trt_plugin import tensorrt_unavailable

    if tensorrt_unavailable() is None:
        pytest.skip("TensorRT and a GPU are present")
    with pytest.raises(RegistryError, match="--backend tensorrt: "):
        load_registry(Settings(backend="tensorrt"))


def test_broken_model_file_is_skipped_and_the_rest_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "good.onnx").symlink_to(DEMO_DIR / "digits_multimax.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx file")
    (tmp_path / "lonely.engine").write_bytes(b"engine without metadata")
    entries = load_registry(Settings(model_dir=tmp_path))
    assert list(entries) == ["good"]
    assert "broken" in caplog.text and "lonely" in caplog.text


def test_empty_or_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="no servable model"):
        load_registry(Settings(model_dir=tmp_path))
    with pytest.raises(RegistryError, match="does not exist"):
        load_registry(Settings(model_dir=tmp_path / "nope"))
    with pytest.raises(RegistryError, match="not found"):
        load_registry(Settings(models=("nope",)))


def test_main_exits_2_on_an_empty_model_dir(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "service", "--model-dir", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "error: no servable model" in out.stderr
