"""`python -m models.training compare` and `plot-simplex` on a tiny budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")  # the train extra

from models.checkpoint import load
from models.training.cli import main


def test_compare_writes_resumable_results_and_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, ckpts = tmp_path / "results.json", tmp_path / "ckpts"
    args = ["compare", "--epochs", "1", "--functions", "softmax,sparsemax,topk_softmax", "-o", str(results), "--quiet"]
    assert main([*args, "--checkpoints", str(ckpts)]) == 0
    data = json.loads(results.read_text())
    assert data["recipe"] == {"epochs": 1, "seed": 0, "threads": 1}
    assert list(data["results"]) == ["softmax", "sparsemax", "topk_softmax"]
    soft, sparse, topk = (data["results"][n] for n in ("softmax", "sparsemax", "topk_softmax"))
    assert soft["trained"].startswith("shipped") and soft["heldout_accuracy"] > 0.95  # the shipped twin
    assert sparse["trained"] == "here" and sparse["epochs"] == 1 and topk["options"] == {"k": 4}
    for r in (soft, sparse, topk):
        assert 0 <= r["multimodality"] <= 1 and 0 <= r["sparsity"] <= 1 and 0 <= r["zero_share"] <= 1
    assert soft["zero_share"] == 0 and topk["zero_share"] == pytest.approx(0.75)  # 16 tokens, k = 4 kept
    _, ckpt, _ = load(ckpts / "digits_sparsemax.pt")
    assert ckpt.config["attention_function"] == "sparsemax"
    out = capsys.readouterr().out
    assert "| sparsemax |" in out and "| entmax15 | | not run yet |" in out
    assert sparse["cpu_seconds"] > 0 and "cpu_seconds" not in soft  # the shipped twin's CPU time is unknown

    # resumed: nothing is redone, and a new function is added to the same file
    before = results.read_text()
    assert main([*args[:4], "softmax,sparsemax", *args[5:]]) == 0
    assert results.read_text() == before and "done before" in capsys.readouterr().out
    assert main(["compare", "--table", "-o", str(results)]) == 0
    assert "| topk_softmax | k=4 |" in capsys.readouterr().out


def test_compare_refuses_unknown_functions_and_missing_results(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "--functions", "nope", "-o", str(tmp_path / "r.json")]) == 2
    assert "unknown function(s) nope" in capsys.readouterr().err
    assert main(["compare", "--table", "-o", str(tmp_path / "r.json")]) == 2
    assert not (tmp_path / "r.json").exists()


def test_plot_simplex_writes_a_png(tmp_path: Path) -> None:
    assert main(["plot-simplex", "-o", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
