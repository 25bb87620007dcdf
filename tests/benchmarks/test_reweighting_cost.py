"""benchmarks.reweighting_cost with a tiny budget: the Softmax -> reweighting-node rewrite, every function's fused op
and body timed against the twin, their outputs agreeing, and the command's argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from benchmarks import reweighting_cost
from models.multimax import paper_params
from models.onnx_contract import REWEIGHTING_OPS
from models.reweighting import OTHER_FUNCTIONS
from plugins import ort_ops
from plugins.ort_ops.graphs import scores_model


@pytest.fixture
def twin(lib: ort_ops.Library, tmp_path: Path) -> Path:  # lib: skips or fails without the library
    path = tmp_path / "twin.onnx"
    path.write_bytes(scores_model("Softmax", *paper_params(0), heads=6))  # scores (B, 6, T, T) -> Softmax
    return path


def test_every_function_timed_against_the_twin(twin: Path, tmp_path: Path) -> None:
    feed = {"scores": np.random.default_rng(0).standard_normal((1, 6, 11, 11)).astype(np.float32) * 8}
    out = reweighting_cost.run(twin, feed, list(OTHER_FUNCTIONS), 1, 1, 1, 6, tmp_path)
    assert list(out) == list(OTHER_FUNCTIONS)
    for name, r in out.items():
        assert r["softmax"]["ratio_to_softmax"] == 1.0, name
        assert r["fused"]["ratio_to_softmax"] > 0 and r["body"]["median_ms"] > 0, name
        assert r["max_abs_fused_vs_body"] <= 1e-5, name
        swapped = onnx.load(str(tmp_path / f"twin_{name}.onnx"))
        assert [n.op_type for n in swapped.graph.node] == ["Mul", REWEIGHTING_OPS[name] + "NoMask", "Mul"]
    table = reweighting_cost.markdown({"date": "d", "command": "c", "machine": "m", "batch": 1, "functions": out})
    assert "| sparsemax |" in table and "| length_scaled |" in table


def test_a_graph_without_softmax_or_on_another_axis_is_refused() -> None:
    model = onnx.load_from_string(scores_model("MultiMaxNoMask", *paper_params(0)))
    with pytest.raises(ValueError, match="no Softmax node"):
        reweighting_cost.swap_softmax(model, "sparsemax", 6)
    model = onnx.load_from_string(scores_model("Softmax", *paper_params(0)))
    next(a for a in model.graph.node[1].attribute if a.name == "axis").i = 1
    with pytest.raises(ValueError, match="reduces over axis 1"):
        reweighting_cost.swap_softmax(model, "sparsemax", 6)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--only", "nosuchmax"], ["--twin", "/nonexistent.onnx"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        reweighting_cost.main(argv)
    assert exc.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_node_mode_runs_from_the_command_line(twin: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["--node", "1", "--rounds", "1", "--calls", "1", "--threads", "1", "--only", "topk_softmax", "-o", str(out)]
    assert reweighting_cost.main(argv) == 0
    results = json.loads(out.read_text())
    assert list(results["functions"]) == ["topk_softmax"] and "scores of std 1.0" in results["what"]
    assert "| topk_softmax |" in capsys.readouterr().out
