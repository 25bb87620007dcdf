"""Llama / Qwen checkpoints (grouped-query attention: fewer key/value heads than query heads) through the single-file
text export: the exporter and validation take the cache's shape from the model, so the export is validated like
the project's GPT (logits, presents, greedy text, fused ops)."""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest

from export.cli import main
from models.cli import main as models_main


@pytest.mark.parametrize("preset", ["qwen3-tiny"])
def test_grouped_query_checkpoint_exports_and_validates(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert models_main(["init", preset, "-o", "m.pt"]) == 0
    assert main(["m.pt", "--samples", "12", "--quiet"]) == 0
    report = json.loads(Path("m.validation.json").read_text())
    assert report["arch"] == "llama" and report["passed"], report["problems"]
    assert report["validation"]["greedy"]["identical"] == report["validation"]["greedy"]["prompts"]
    past = {i.name: i.shape for i in ort.InferenceSession("m.onnx").get_inputs()}["past_key_values.0.key"]
    assert past[1] == 2  # the key/value heads, not the 4 query heads


def test_genai_folder_needs_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A project-format Llama checkpoint stores no tokenizer: the folder export (which must write one) refuses it
    before writing anything; Hugging Face folders export (tests/export/test_genai_llm_export.py)."""
    assert models_main(["init", "llama-tiny", "-o", str(tmp_path / "l.pt")]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "l.pt"), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "names no tokenizer" in err and "Hugging Face folder" in err and not (tmp_path / "out").exists()
