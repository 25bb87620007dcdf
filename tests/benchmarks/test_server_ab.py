"""benchmarks/server_ab.py: two sides of one folder, one with an option, report every figure and a ratio to the
first side; bad input exits 2 with one line (timings are never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from benchmarks import server_ab
from tests.paths import ROOT


@pytest.fixture(scope="module")
def folder(text_genai_folder: Path) -> Path:
    return text_genai_folder


@pytest.mark.slow
def test_two_sides_report_their_figures_and_the_ratio(folder: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ab.json"
    assert server_ab.main([f"run={folder}", f"off={folder}@{ROOT}", "--arg", "off=--ort-spinning=off",
                           "--streams", "1,2", "--rounds", "2", "--max-tokens", "4", "--prompt-len", "4",
                           "--threads", "1", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [s["options"] for s in report["sides"]] == [[], ["--ort-spinning=off"]]
    assert report["ratios"]["run"] == {"1": 1.0, "2": 1.0}
    for label in ("run", "off"):
        for n in ("1", "2"):
            assert report["results"][label][n]["tok_s"] > 0
            assert report["ratios"][label][n] > 0
    assert "| 2 | off |" in capsys.readouterr().out


def test_bad_input_exits_2(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in ([[], "at least one side"], [[f"a={tmp_path}"], "not an onnxruntime-genai folder"],
                       [[f"a={folder}@{tmp_path}"], "not a source tree"], [[f"a={folder}", f"a={folder}"], "twice"],
                       [[f"a={folder}", "--arg", "b=--x"], "--arg is LABEL=OPTION"],
                       [[f"a={folder}", "--streams", "1,x"], "invalid literal"],
                       [[f"a={folder}", "--rounds", "0"], "at least 1"],
                       [[f"a={folder}", "--max-tokens", "100000"], "is over the context of"]):
        assert server_ab.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (argv, err)  # one line
