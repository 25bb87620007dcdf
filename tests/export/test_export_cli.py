"""The export CLI's honesty and feedback: verdict lines, where files go, validation sizing, phase progress."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from export import progress
from export.cli import main
from export.samples import default_samples
from models import registry
from models.checkpoint import Checkpoint, save_checkpoint
from models.deit import DEIT_PRESETS, DeiT, DeiTConfig


def tiny_checkpoint(path: Path, multimax: bool) -> Path:
    config = DeiTConfig(img_size=16, patch_size=8, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                        multimax_attention=multimax, multimax_output=multimax)
    model = DeiT(config)
    return save_checkpoint(Checkpoint("deit", config.to_dict(), model.state_dict()), path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ckpts")
    return {"multimax": tiny_checkpoint(tmp / "mm.pt", True), "softmax": tiny_checkpoint(tmp / "sm.pt", False)}


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], dict]:
    code = main([*args, "--quiet"])
    lines = capsys.readouterr().out.strip().splitlines()
    report_path = Path(lines[-1].removeprefix("report: "))
    return code, lines, json.loads(report_path.read_text())


def test_default_output_goes_to_the_working_directory_not_beside_the_checkpoint(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in ckpts["multimax"].parent.iterdir())
    code, lines, report = run_cli([str(ckpts["multimax"])], capsys)
    assert code == 0 and lines[-2] == "passed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm.onnx", "mm.validation.json"]
    assert sorted(p.name for p in ckpts["multimax"].parent.iterdir()) == before
    # Every phase is timed, in the report and the summary.
    assert {"load checkpoint", "export deit (fp32)", "check graph", "reference (PyTorch)",
            "onnxruntime ORT_ENABLE_ALL", "onnxruntime ORT_ENABLE_BASIC"} <= set(report["phase_seconds"])
    assert any(line.strip().startswith("times: load checkpoint") for line in lines)
    assert "MultiMax nodes (attention + output)" in lines[0]


def test_no_validate_says_not_validated(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, lines, report = run_cli([str(ckpts["multimax"]), "--no-validate"], capsys)
    assert code == 0 and "passed" not in lines[-2] and lines[-2].startswith("not validated")
    assert report["verdict"] == lines[-2] and "validation" not in report


def test_int8_verdict_reports_deltas_as_not_enforced(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, lines, report = run_cli([str(ckpts["multimax"]), "--int8", "--samples", "11"], capsys)
    top1 = min(report["validation"][lvl]["top1_agreement"] for lvl in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"))
    assert code == 0
    assert lines[-2].startswith(f"int8: deltas reported, not enforced: top-1 {top1:.0%}"), lines[-2]
    assert lines[-2] != "passed"


def test_model_without_multimax_says_so(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, lines, _ = run_cli([str(ckpts["softmax"]), "--no-validate"], capsys)
    assert code == 0 and "no MultiMax in this model" in lines[0] and "0 MultiMax nodes" not in lines[0]
    code, lines, _ = run_cli([str(ckpts["multimax"]), "--no-validate", "--inline", "-o", "flat.onnx"], capsys)
    assert "MultiMax (attention + output) inlined" in lines[0]


def test_default_samples_cover_every_batch_size_and_shrink_for_large_models() -> None:
    small = DeiTConfig(img_size=32, patch_size=8, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4)
    assert default_samples(DeiT(small), registry.spec_of("deit", small.to_dict()), (1, 2, 8)) == 100
    big = DeiTConfig(**DEIT_PRESETS["deit_small"], num_classes=1000)
    with torch.device("meta"):  # shapes only: no 22M random weights
        model = DeiT(big)
    spec = registry.spec_of("deit", big.to_dict())
    n = default_samples(model, spec, (1, 2, 8))
    assert n % 11 == 0 and 11 <= n < 100  # whole rounds of 1+2+8: every batch size runs
    assert default_samples(model, spec, (16,)) == 16  # never fewer than one batch of each size


def test_phase_line_ticks_while_a_long_call_is_silent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.05)
    phases = progress.Phases(show=True)
    with phases.phase("export"):
        time.sleep(0.5)  # one call that prints nothing itself
    err = capsys.readouterr().err
    assert err.count("export:") >= 3, err  # the clock was redrawn while the call ran
    assert phases.times["export"] >= 0.5 and phases.summary().startswith("export ")


def test_reference_threads_follow_idle_cores_and_the_callers_setting_survives(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import export.pipeline

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(export.pipeline, "idle_cores", lambda: 1)  # a busy machine
    before = torch.get_num_threads()
    code, lines, report = run_cli([str(ckpts["multimax"]), "--samples", "3"], capsys)
    assert code == 0 and report["torch_threads"] == 1 and "(PyTorch threads 1)" in "\n".join(lines)
    assert torch.get_num_threads() == before
    assert main([str(ckpts["multimax"]), "--threads", "0"]) == 2
