"""An export whose validation could not run a check says so in its verdict (`passed (1 check skipped: ...)`) and
its report (`skipped`), with exit code 0: `passed` alone means every check ran and held (issue 37)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from export.cli import main
from export.summary import skipped_checks, verdict
from models.checkpoint import Checkpoint, save_checkpoint
from models.deit import DeiT, DeiTConfig
from models.gpt import GPT, GPTConfig
from models.tokenizer import ByteTokenizer
from plugins import ort_ops


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], dict]:
    code = main([*args, "--quiet"])
    lines = capsys.readouterr().out.strip().splitlines()
    report_path = Path(lines[-1].removeprefix("report: "))
    return code, lines, json.loads(report_path.read_text())


def test_an_export_without_onnxruntime_genai_names_the_skipped_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32)
    ckpt = save_checkpoint(Checkpoint("gpt", config.to_dict(), GPT(config).state_dict(),
                                      tokenizer=ByteTokenizer().to_dict()), tmp_path / "tiny_gpt.pt")
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # `import onnxruntime_genai` fails: not installed
    code, lines, report = run_cli([str(ckpt), "-o", str(tmp_path / "tiny.genai"), "--samples", "8"], capsys)
    assert code == 0 and report["passed"]
    assert "  onnxruntime-genai: not checked, onnxruntime-genai is not installed" in "\n".join(lines)
    assert lines[-2] == "passed (1 check skipped: onnxruntime-genai not installed)" == report["verdict"]
    (skip,) = report["skipped"]
    assert skip["check"] == "onnxruntime-genai" and skip["skipped"] == "onnxruntime-genai not installed"
    assert skip["reason"].startswith("onnxruntime-genai is not installed")


def test_an_export_without_the_fused_library_names_the_skipped_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fused ops could not be compared with their bodies (MULTIMAX_ORT_OPS=0, no compiler, ...)."""
    config = DeiTConfig(img_size=16, patch_size=8, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2)
    ckpt = save_checkpoint(Checkpoint("deit", config.to_dict(), DeiT(config).state_dict()), tmp_path / "tiny.pt")
    monkeypatch.setattr(ort_ops, "library", lambda: ort_ops.Library(None, "turned off by MULTIMAX_ORT_OPS"))
    code, lines, report = run_cli([str(ckpt), "-o", str(tmp_path / "tiny.onnx"), "--samples", "11"], capsys)
    assert code == 0 and report["passed"]
    assert "  fused ops (onnxruntime): not used, turned off by MULTIMAX_ORT_OPS" in lines
    assert lines[-2] == "passed (1 check skipped: fused ops library unavailable)" == report["verdict"]
    assert report["skipped"] == [{"check": "fused ops", "skipped": "fused ops library unavailable",
                                  "reason": "turned off by MULTIMAX_ORT_OPS"}]


def _report(validation: dict, problems: list[str] | None = None, precision: str = "fp32", nodes: int = 3) -> dict:
    report = {"problems": problems or [], "validation": validation, "arch": "gpt", "precision": precision,
              "graph": {"multimax_nodes": nodes}}
    report["skipped"] = skipped_checks(report)
    return report


def test_the_verdict_counts_and_names_every_skipped_check() -> None:
    enforced = {"tol": 1e-4, "top1_min": 1.0}
    genai = {"checked": False, "reason": "onnxruntime-genai is not installed (x)",
             "skipped": "onnxruntime-genai not installed"}
    fused = {"in_use": False, "reason": "cannot build it: no compiler", "failures": []}
    assert verdict(_report({"tolerance": enforced, "fused_ops": {"in_use": True}})) == "passed"
    # a graph without fused nodes (no MultiMax, or --inline) has no fused ops to check: nothing was skipped
    no_nodes = {"in_use": False, "reason": "the model has no multimax nodes", "failures": []}
    assert verdict(_report({"tolerance": enforced, "fused_ops": no_nodes}, nodes=0)) == "passed"
    both = _report({"tolerance": enforced, "fused_ops": fused, "genai": genai})
    assert verdict(both) == ("passed (2 checks skipped: fused ops library unavailable; "
                             "onnxruntime-genai not installed)")
    tokenizer = {"checked": True, "tokenizer": {"checked": False, "reason": "r",
                                                "skipped": "onnxruntime-genai's tokenizer cannot read a WordLevel "
                                                           "tokenizer.json"}}
    assert verdict(_report({"tolerance": enforced, "genai": tokenizer})) == (
        "passed (1 check skipped: onnxruntime-genai's tokenizer cannot read a WordLevel tokenizer.json)")
    # reported-only variants keep their line and add the skips; a failure stays a failure
    logits = {"max_abs": 0.5, "tol": None, "scale": 20.0, "limit": None, "relative": 0.025}
    stats = {"next_token_agreement": 0.9, "max_abs": 0.5, "limits": {"logits": logits}}
    reported = _report({"tolerance": {"tol": None, "top1_min": None}, "genai": genai,
                        "ORT_ENABLE_ALL": stats, "ORT_ENABLE_BASIC": stats}, precision="int4")
    assert verdict(reported) == ("int4: deltas reported, not enforced: top-1 90%, max|diff| 0.5 = 0.025 x scale 20 "
                                 "(no NaN: checked); 1 check skipped: onnxruntime-genai not installed")
    assert verdict(_report({"tolerance": enforced, "genai": genai}, ["x: too far"])) == "FAILED: x: too far"
