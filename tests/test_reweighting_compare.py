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


def test_train_step_ratios_go_into_the_results_and_their_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from benchmarks import reweighting_train_cost

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"recipe": {"epochs": 1}, "results": {}}))
    args = ["--rounds", "1", "--steps", "1", "--only", "sparsemax", "--into", str(results), "-o", str(tmp_path / "o")]
    assert reweighting_train_cost.main(args) == 0
    data = json.loads(results.read_text())
    assert data["recipe"] == {"epochs": 1}  # the rest kept
    ratios = data["train_step"]["ratio_to_softmax"]
    assert list(ratios) == ["softmax", "sparsemax"] and ratios["softmax"] == 1.0 and ratios["sparsemax"] > 0
    assert "| sparsemax | " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        reweighting_train_cost.main(["--steps", "0"])
    assert exc.value.code == 2


def test_the_docs_tables_are_the_shipped_results() -> None:
    """README's and docs/REWEIGHTING.md's results tables are `compare --table` of docs/reweighting_results.json."""
    import re

    from models.training.compare import RESULTS, table

    want = table(json.loads(RESULTS.read_text()))
    for doc in ("README.md", "docs/REWEIGHTING.md"):
        found = re.search(r"<!-- results-table -->\n(.*?)\n<!-- /results-table -->", Path(doc).read_text(), re.S)
        assert found is not None and found.group(1) == want, f"{doc}: run `python -m models.training compare --table`"
