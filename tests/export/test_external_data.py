"""Exports with their weights in a data file beside the graph (export.onnx_io), forced on the demo text model by
lowering the threshold (`MULTIMAX_EXTERNAL_DATA_THRESHOLD`; no 2 GB model in CI): graph + data written and
validated, the server's onnxruntime backend answering as with the self-contained file, bad data files refused with
a reason, and a failed write leaving nothing behind."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import pytest

from export import onnx_io
from export.cli import main
from export.genai_folder import MODEL_FILE
from export.onnx_io import THRESHOLD_ENV, load_graph, tensor_bytes
from models.onnx_contract import text_feeds
from models.onnx_weights import ExternalDataError, check_external_data
from service.engine.backends.base import BackendUnavailable
from service.engine.backends.onnxruntime import OnnxRuntimeBackend
from tests.paths import ROOT

DEMO_TEXT = ROOT / "models" / "demo" / "text_multimax.pt"
SMALL = "100000"  # bytes: the demo's 3.4 MB of weights go to the data file, its shapes and scalars stay inline


def export(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*args, "--quiet"])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The demo exported self-contained (not validated: the reference), with external data as a single file and
    as a genai folder."""
    root = tmp_path_factory.mktemp("external")
    code, out, err = export([str(DEMO_TEXT), "-o", str(root / "inline.onnx"), "--no-validate"])
    assert code == 0, out + err
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(THRESHOLD_ENV, SMALL)
        code, out, err = export([str(DEMO_TEXT), "-o", str(root / "external.onnx"), "--samples", "8"])
        assert code == 0, out + err
        code, out, err = export([str(DEMO_TEXT), "-o", str(root / "folder"), "--samples", "8"])
        assert code == 0, out + err
    yield {"inline": root / "inline.onnx", "external": root / "external.onnx", "folder": root / "folder"}


def test_graph_and_data_file_written_and_validated(exports: dict[str, Path]) -> None:
    import json

    inline, external = exports["inline"], exports["external"]
    data = external.with_name("external.onnx.data")
    assert not inline.with_name("inline.onnx.data").exists()
    assert data.is_file() and external.stat().st_size < data.stat().st_size
    graph = load_graph(external)
    assert tensor_bytes(graph) < int(SMALL)  # what stayed inline: the small tensors only
    assert onnx_io.external_files(graph) == [data.name]
    report = json.loads(external.with_name("external.validation.json").read_text())
    assert report["passed"] and report["validation"]["fused_ops"]["failures"] == []
    folder = exports["folder"]
    assert (folder / (MODEL_FILE + ".data")).is_file()
    assert json.loads((folder / "validation.json").read_text())["passed"]


def test_server_backend_answers_as_the_self_contained_export(exports: dict[str, Path]) -> None:
    inline = OnnxRuntimeBackend(exports["inline"], providers=("CPUExecutionProvider",))
    external = OnnxRuntimeBackend(exports["external"], providers=("CPUExecutionProvider",))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 7))
    mask, positions = np.ones((2, 7), np.int64), np.broadcast_to(np.arange(7), (2, 7)).copy()
    got, got_past = external.run_text(ids, mask, positions, external.empty_past(2))
    want, want_past = inline.run_text(ids, mask, positions, inline.empty_past(2))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_past[-1][0], want_past[-1][0])
    assert text_feeds(ids, mask, positions, external.empty_past(2)).keys() == set(external.input_names)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.parent.glob(src.name + "*"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst / src.name


@pytest.mark.parametrize("damage", ["missing", "truncated", "outside"])
def test_bad_data_files_are_refused_with_a_reason(damage: str, exports: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(exports["external"], tmp_path / "m")
    data = path.with_name(path.name + ".data")
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:  # the graph names a file beside its folder
        data.rename(tmp_path / data.name)
        proto = onnx.load(str(path), load_external_data=False)
        for t in proto.graph.initializer:
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = f"../{data.name}"
        path.write_bytes(proto.SerializeToString())
    words = {"missing": "is missing", "truncated": "is truncated", "outside": "outside its folder"}[damage]
    with pytest.raises(ExternalDataError, match=words):
        check_external_data(path, onnx.load(str(path), load_external_data=False))
    with pytest.raises(BackendUnavailable, match=words):
        OnnxRuntimeBackend(path, providers=("CPUExecutionProvider",))


@pytest.mark.slow  # a whole export before the check
def test_truncated_data_at_the_check_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file that is short when the export reads it back: one line, exit code 2, no traceback."""
    monkeypatch.setenv(THRESHOLD_ENV, SMALL)
    publish = onnx_io.publish

    def short(staged: Path, target: Path) -> Path:
        if staged.name.endswith(".data"):
            staged.write_bytes(staged.read_bytes()[:1000])
        return publish(staged, target)

    monkeypatch.setattr(onnx_io, "publish", short)
    code, out, err = export([str(DEMO_TEXT), "-o", str(tmp_path / "m.onnx"), "--no-validate"])
    assert code == 2 and "is truncated" in err and "Traceback" not in err + out


def _disk_full(written: list[Path]) -> object:
    def full(proto: onnx.ModelProto, data: Path, location: str) -> None:
        with open(data, "wb") as fh:
            fh.write(b"\0" * 4096)  # part of the weights, then the disk is full
        written.append(data)
        raise OSError(28, "No space left on device")

    return full


def test_failure_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[Path] = []
    monkeypatch.setattr(onnx_io, "_move_to_file", _disk_full(written))
    (tmp_path / "m.onnx").write_bytes(b"the earlier export")
    proto = onnx.load(str(DEMO_TEXT.with_suffix(".onnx")))
    with pytest.raises(OSError, match="No space left"):
        onnx_io.save_model(proto, tmp_path / "m.onnx", threshold=int(SMALL))
    assert written and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no data file, no staging directory
    assert (tmp_path / "m.onnx").read_bytes() == b"the earlier export"


def test_folder_export_failing_mid_write_exits_2_and_leaves_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THRESHOLD_ENV, SMALL)
    written: list[Path] = []
    monkeypatch.setattr(onnx_io, "_move_to_file", _disk_full(written))
    code, stdout, err = export([str(DEMO_TEXT), "-o", str(tmp_path / "folder"), "--no-validate"])
    assert code == 2 and "No space left on device" in err and "Traceback" not in err + stdout
    assert written and list(tmp_path.iterdir()) == []  # no folder, no staging folder
