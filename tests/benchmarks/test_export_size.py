"""benchmarks.export_size on its tiny shape: the folder it makes (sharded, SegLU head, tokenizer with a chat
template), the child's peak-RSS report, one measured export with external data, and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import export_size
from export.onnx_io import THRESHOLD_ENV


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_size.make_folder("tiny", tmp_path_factory.mktemp("cache"))


def test_folder_is_sharded_with_a_seglu_head_and_made_once(tiny: Path) -> None:
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # save_pretrained's shards, as the 0.5b folder's
    assert {"lm_head.multimax_ranges", "lm_head.multimax_ts", "lm_head.weight"} <= set(index["weight_map"])
    config = json.loads((tiny / "config.json").read_text())
    assert config["multimax_modules"] == ["lm_head"] and config["tie_word_embeddings"] is False
    assert config["hidden_size"] == export_size.SHAPES["tiny"].hidden
    assert "chat_template" in (tiny / "tokenizer_config.json").read_text() or (tiny / "chat_template.jinja").is_file()
    assert export_size.weight_bytes(tiny) == sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
    stamp = (tiny / "done").stat().st_mtime_ns
    assert export_size.make_folder("tiny", tiny.parent) == tiny and (tiny / "done").stat().st_mtime_ns == stamp


def test_child_reports_exit_code_and_peak_rss(tmp_path: Path) -> None:
    report = tmp_path / "rss.json"
    code = export_size.child(report, [str(tmp_path / "missing"), "--quiet"])
    data = json.loads(report.read_text())
    assert code == 2 and data["code"] == 2
    assert data["peak_rss_bytes"] > 50_000_000  # this process with torch loaded: tens of MB at least


def test_export_run_measures_an_export_with_external_data(tiny: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THRESHOLD_ENV, "100000")  # the child inherits it: the tiny model's weights go to the data file
    row = export_size.export_run(tiny, "fp32", tmp_path, ["--no-validate"])
    assert row["exit_code"] == 0, row["verdict"]
    assert set(row["files"]) == {"model.onnx", "model.onnx.data"}
    assert row["files"]["model.onnx.data"] > row["files"]["model.onnx"]
    assert row["peak_rss_bytes"] > row["weights_bytes"] and row["peak_rss_over_weights"] > 1
    line = export_size.table([row]).splitlines()[-1]
    assert line.startswith("| tiny | fp32 |") and f"{row['peak_rss_bytes'] / 1e9:.2f} GB" in line


def test_unknown_precision_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        export_size.main(["--shape", "tiny", "--precision", "int8"])
    assert exc.value.code == 2 and "fp32 and/or int4" in capsys.readouterr().err
