"""The export pipeline as a library function, and the export's speed-ups that must not change its output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from export import fast_rewrites, fused_check, validate
from export.onnx_export import ExportError, export_text, export_vision
from export.pipeline import ExportOptions, ExportReport, export_checkpoint
from models.checkpoint import Checkpoint, save_checkpoint
from models.deit import DeiT, DeiTConfig
from models.gpt import GPT, GPTConfig
from models.loading import CheckpointError
from plugins import ort_ops


def tiny_deit() -> tuple[DeiT, Checkpoint]:
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=8, in_chans=1, num_classes=3, embed_dim=8, depth=2, num_heads=2,
                        multimax_attention=True, multimax_output=True)
    model = DeiT(config).eval()
    return model, Checkpoint("deit", config.to_dict(), model.state_dict())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, checkpoint = tiny_deit()
    return save_checkpoint(checkpoint, tmp_path_factory.mktemp("pipeline") / "tiny.pt")


def test_export_checkpoint_returns_the_report_it_writes(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "tiny.onnx"
    out.parent.mkdir()
    report = export_checkpoint(ckpt, ExportOptions(output=out, samples=11, progress=False))
    assert isinstance(report, ExportReport) and report.onnx == out and out.is_file()
    assert report.passed and report.exit_code == 0 and report.verdict == "passed" and report.problems == []
    assert json.loads(report.report_path.read_text()) == report.data
    assert report.report_path == tmp_path / "sub" / "tiny.validation.json"
    assert report.data["checkpoint"] == str(ckpt) and report.data["onnx"] == str(out)  # as given
    assert report.summary.splitlines()[-2:] == ["passed", f"report: {report.report_path}"]
    assert report.data["validation"]["samples"] == 11


def test_report_names_files_relative_to_a_directory(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny.onnx"
    options = ExportOptions(output=out, validate=False, progress=False, report_relative_to=tmp_path)
    data = export_checkpoint(ckpt, options).data
    assert data["onnx"] == "tiny.onnx" and not Path(data["checkpoint"]).is_absolute()
    assert (tmp_path / data["checkpoint"]).resolve() == ckpt.resolve()
    assert data["verdict"].startswith("not validated")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ExportOptions(opset=17), "opset 17 is too old"),
        (ExportOptions(samples=0), "--samples must be >= 1"),
        (ExportOptions(threads=0), "--threads must be >= 1"),
        (ExportOptions(batch_sizes=()), "batch sizes must be >= 1"),
        (ExportOptions(precision="int3"), "unknown precision 'int3'"),  # type: ignore[arg-type]
        (ExportOptions(precision="int4"), "--int4: only for the onnxruntime-genai folder export"),
    ],
)
def test_bad_options_raise_before_anything_is_written(
    ckpt: Path, tmp_path: Path, options: ExportOptions, message: str
) -> None:
    options = ExportOptions(**{**options.__dict__, "output": tmp_path / "x.onnx"})
    with pytest.raises(ExportError, match=message):
        export_checkpoint(ckpt, options)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_checkpoint_raises_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        export_checkpoint(tmp_path / "missing.pt", ExportOptions(output=tmp_path / "x.onnx", progress=False))
    assert list(tmp_path.iterdir()) == []


def test_the_fused_check_reuses_the_validation_session(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three onnxruntime sessions: ORT_ENABLE_ALL (fused ops, whose outputs the fused check reuses), BASIC, and the
    function bodies; the check still finds a difference when the fused outputs are off."""
    if not ort_ops.library().available:
        pytest.skip(f"fused ops library not available: {ort_ops.library().reason}")
    made: list[bool] = []
    real = validate.cpu_session
    def recording(*a: Any, **k: Any) -> Any:
        made.append(k.get("fused", True))
        return real(*a, **k)

    real_graph = fused_check.graph_session
    def recording_graph(*a: Any, **k: Any) -> Any:
        made.append(False)  # the function bodies from a graph whose weights stay in the file (export.onnx_io)
        return real_graph(*a, **k)

    # validate builds the level sessions, fused_check the function-body one: count both
    monkeypatch.setattr(validate, "cpu_session", recording)
    monkeypatch.setattr(fused_check, "cpu_session", recording)
    monkeypatch.setattr(fused_check, "graph_session", recording_graph)
    report = export_checkpoint(ckpt, ExportOptions(output=tmp_path / "t.onnx", samples=11, progress=False))
    assert report.passed and made == [True, True, False]
    fused = report.data["validation"]["fused_ops"]
    assert fused["in_use"] and fused["feeds"] == 3 and fused["max_abs_vs_function_bodies"] <= fused["atol"]
    feeds = [{"pixel_values": torch.randn(2, 1, 16, 16).numpy()}]
    bodies = real(tmp_path / "t.onnx", fused=False).run(None, feeds[0])
    off = validate.compare_fused(tmp_path / "t.onnx", feeds, [[o + 1e-3 for o in bodies]])
    assert off["failures"] and off["max_abs_vs_function_bodies"] == pytest.approx(1e-3, rel=1e-3)


def test_filtered_rewrite_rules_wrap_most_rules() -> None:
    rules = fast_rewrites.rewriter._DEFAULT_REWRITE_RULES
    wrapped = fast_rewrites.filtered(rules)
    assert len(wrapped) == len(rules)
    assert sum(isinstance(r, fast_rewrites._OpTypeFiltered) for r in wrapped) >= len(rules) // 2
    with fast_rewrites.op_type_filtered_rewrites():
        assert rules != fast_rewrites.rewriter._DEFAULT_REWRITE_RULES
    assert fast_rewrites.rewriter._DEFAULT_REWRITE_RULES is rules


@pytest.mark.parametrize("arch", ["deit", "gpt"])
def test_filtered_rewrites_give_byte_identical_files(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if arch == "deit":
        model, checkpoint = tiny_deit()
        exporter = export_vision
    else:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8)
        model = GPT(config).eval()
        checkpoint = Checkpoint("gpt", config.to_dict(), model.state_dict())
        exporter = export_text
    fast = exporter(model, checkpoint, tmp_path / "fast.onnx").read_bytes()
    monkeypatch.setattr(fast_rewrites, "filtered", lambda rules: rules)  # onnxscript's rules as they come
    stock = exporter(model, checkpoint, tmp_path / "stock.onnx").read_bytes()
    assert fast == stock
