"""Class names: the `--labels FILE` formats, `models init` / `export --labels`, and serving a vision model that has
none (issue 28: a model a user makes must be servable; its classes are named by index until a file names them)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from export.cli import main as export_main
from models.checkpoint import IMAGENET_PREPROCESS, Checkpoint, save_checkpoint
from models.cli import main as models_main
from models.deit import DeiT, DeiTConfig
from models.labels import index_labels, read_labels
from models.loading import CheckpointError
from models.onnx_contract import proto_props, read_metadata
from service.base.config import Settings
from service.edge.app import create_app

NAMES = ["cat", "dog", "bird", "fish"]
IMAGENET_INDEX = {"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"], "2": ["n01484850", "great white shark"],
                  "3": ["n01491361", "tiger shark"]}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def png(seed: int = 0, size: tuple[int, int] = (40, 30)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def small_deit(path: Path, classes: int = 4, labels: list[str] | None = None) -> Path:
    """A 16x16 RGB DeiT (fast to export) with ImageNet preprocessing at its size, labels as given."""
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=8, num_classes=classes, embed_dim=16, depth=1, num_heads=2)
    preprocess = IMAGENET_PREPROCESS | {"image_size": 16, "resize": 18}
    ckpt = Checkpoint("deit", config.to_dict(), DeiT(config).state_dict(), labels=labels, preprocess=preprocess)
    return save_checkpoint(ckpt, path)


def onnx_labels(path: Path) -> list[str] | None:
    return read_metadata(proto_props(onnx.load(str(path), load_external_data=False))).labels


# ---- the formats ---------------------------------------------------------------------------------------


def test_three_formats_read_the_same_names(tmp_path: Path) -> None:
    assert read_labels(write(tmp_path / "a.txt", "cat\ndog \r\nbird\nfish\n\n"), 4) == NAMES
    assert read_labels(write(tmp_path / "b.json", json.dumps(NAMES)), 4) == NAMES
    index = read_labels(write(tmp_path / "c.json", json.dumps(IMAGENET_INDEX)), 4)
    assert index == ["tench", "goldfish", "great white shark", "tiger shark"]
    # key order in the file does not matter; {"0": "name"} is read too; duplicates are allowed (ImageNet has two cranes)
    shuffled = {"1": "b", "0": "crane", "2": "crane"}
    assert read_labels(write(tmp_path / "d.json", json.dumps(shuffled))) == ["crane", "b", "crane"]
    assert index_labels(3) == ["0", "1", "2"]


@pytest.mark.parametrize(("name", "text", "message"), [
    ("short.txt", "cat\ndog\nbird\n", "3 labels for a model of 4 classes"),
    ("blank.txt", "cat\n\ndog\nbird\n", "line 2 is blank"),
    ("empty.txt", "  \n", "empty file"),
    ("bad.json", '["cat", "dog",', "invalid JSON"),
    ("numbers.json", "[0, 1, 2, 3]", "entry 0 is 0; expected a non-empty string"),
    ("gap.json", '{"0": "a", "1": "b", "2": "c", "5": "d"}', "3 is missing"),
    ("keys.json", '{"zero": "a"}', "key 'zero' is not a class index"),
    ("triple.json", '{"0": ["n1", "a", "x"]}', "class 0 is"),
])
def test_bad_label_files_are_one_line_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        read_labels(write(tmp_path / name, text), 4)


def test_unreadable_label_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        read_labels(tmp_path / "missing.txt")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_labels(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(CheckpointError, match="not UTF-8"):
        read_labels(tmp_path / "latin1.txt")


# ---- models init --labels ------------------------------------------------------------------------------


def test_init_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = write(tmp_path / "labels.txt", "\n".join(NAMES))
    out = tmp_path / "t.pt"
    assert models_main(["init", "deit_tiny", "--num-classes", "4", "--labels", str(labels), "-o", str(out)]) == 0
    assert torch.load(out, weights_only=True)["labels"] == NAMES
    capsys.readouterr()
    # The count must match: exit 2 naming both counts, nothing written.
    bad = tmp_path / "bad.pt"
    assert models_main(["init", "deit_tiny", "--labels", str(labels), "-o", str(bad)]) == 2
    assert "4 labels for a model of 1000 classes" in one_error_line(capsys) and not bad.exists()
    assert models_main(["init", "gpt-nano", "--labels", str(labels), "-o", str(bad)]) == 2
    assert "--labels is for image classifiers; gpt-nano is a text model" in one_error_line(capsys)
    assert not bad.exists()


# ---- export --labels, the replacing notice, the load flags -------------------------------------------


def test_export_labels_attach_and_errors_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = small_deit(tmp_path / "s.pt", labels=["a", "b", "c", "d"])
    index = write(tmp_path / "index.json", json.dumps(IMAGENET_INDEX))
    assert export_main([str(ckpt), "--no-validate", "--quiet", "--labels", str(index)]) == 0
    assert onnx_labels(tmp_path / "s.onnx") == ["tench", "goldfish", "great white shark", "tiger shark"]
    capsys.readouterr()
    three = write(tmp_path / "three.txt", "a\nb\nc\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert export_main([str(ckpt), "--no-validate", "--quiet", "--labels", str(three), "-o", "x.onnx"]) == 2
    assert one_error_line(capsys) == f"error: --labels {three}: 3 labels for a model of 4 classes"
    assert export_main([str(ckpt), "--quiet", "--labels", "missing.txt", "-o", "x.onnx"]) == 2
    assert one_error_line(capsys) == "error: --labels missing.txt: no such file"
    text = tmp_path / "gpt.pt"
    assert models_main(["init", "gpt-nano", "-o", str(text)]) == 0
    capsys.readouterr()
    assert export_main([str(text), "--quiet", "--labels", str(three), "-o", "x.onnx"]) == 2
    assert "--labels is for image classifiers" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "gpt.pt"])


def test_export_says_when_it_replaces_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = small_deit(tmp_path / "s.pt")
    assert export_main([str(ckpt), "--no-validate", "--quiet"]) == 0
    assert "replacing" not in capsys.readouterr().err
    labels = write(tmp_path / "l.txt", "a\nb\nc\nd")
    assert export_main([str(ckpt), "--no-validate", "--quiet", "--labels", str(labels)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["replacing existing s.onnx"]
    assert onnx_labels(tmp_path / "s.onnx") == ["a", "b", "c", "d"]


def test_export_takes_the_load_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A DeiT training checkpoint (official layout, EMA weights, args without eps): export takes --ema, --num-heads,
    --ln-eps, --qk-scale, --variant as `models info` does."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    model, ema = DeiT(config).state_dict(), DeiT(config).state_dict()
    path = tmp_path / "official.pt"
    torch.save({"model": {f"module.{k}": v for k, v in model.items()}, "model_ema": ema, "epoch": 3,
                "args": {"model": "custom"}}, path)
    assert export_main([str(path), "--no-validate", "--quiet"]) == 2
    assert "pass num_heads (--num-heads) and ln_eps (--ln-eps)" in one_error_line(capsys)
    assert export_main([str(path), "--no-validate", "--quiet", "--num-heads", "2"]) == 2
    assert "cannot tell the LayerNorm eps" in one_error_line(capsys)
    assert not (tmp_path / "official.onnx").exists()
    code = export_main([str(path), "--samples", "2", "--batch-sizes", "1", "--quiet", "--ema", "--num-heads", "4",
                        "--ln-eps", "1e-5", "--qk-scale", "16**-0.5", "--variant", "first"])
    assert code == 0, capsys.readouterr()
    meta = read_metadata(proto_props(onnx.load("official.onnx")))
    assert meta.config is not None
    assert (meta.config["num_heads"], meta.config["ln_eps"], meta.config["qk_scale"], meta.config["variant"]) == (
        4, 1e-5, 0.25, "first")
    report = json.loads((tmp_path / "official.validation.json").read_text())
    assert report["passed"]
    # --ema exported the EMA weights: the head's weight in the graph is the EMA one, not the model's.
    init = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load("official.onnx").graph.initializer}
    head = init["model.head.weight"].reshape(ema["head.weight"].shape)
    assert np.array_equal(head, ema["head.weight"].numpy()) and not np.allclose(head, model["head.weight"].numpy())
    # ... and the export of an official-code checkpoint (no labels in it) is served, classes named by index.
    served = tmp_path / "served"
    served.mkdir()
    (tmp_path / "official.onnx").rename(served / "official.onnx")
    with TestClient(create_app(Settings(model_dir=served, max_batch_size=2))) as client:
        r = client.post("/v1/models/official/classify", content=png(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        assert sorted(p["label"] for p in r.json()["predictions"][0]) == ["0", "1", "2"]


# ---- serving a model a user made -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`models init deit_tiny` + `export` with no labels (user.onnx), and `models init --labels` (named.pt)."""
    tmp = tmp_path_factory.mktemp("user")
    served = tmp / "served"
    served.mkdir()
    assert models_main(["init", "deit_tiny", "--num-classes", "4", "-o", str(tmp / "user.pt")]) == 0
    assert export_main([str(tmp / "user.pt"), "-o", str(served / "user.onnx"), "--samples", "2", "--batch-sizes",
                        "1,2", "--quiet"]) == 0
    labels = write(tmp / "labels.txt", "\n".join(NAMES))
    assert models_main(["init", "deit_tiny", "--num-classes", "4", "--labels", str(labels), "-o",
                        str(served / "named.pt")]) == 0
    yield served


@pytest.mark.slow  # a deit_tiny export and two 224x224 models warmed up: about a minute on 2 busy cores
def test_a_user_made_deit_is_served_with_index_names(user_models: Path) -> None:
    assert onnx_labels(user_models / "user.onnx") is None  # the file really has none
    # Warm-up at batch sizes up to 2 only: the default (up to 32 images of 224x224) costs a minute on 2 cores.
    with TestClient(create_app(Settings(model_dir=user_models, max_batch_size=2))) as client:
        r = client.post("/v1/models/user/classify?top_k=4", content=png(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"][0]
        assert sorted(p["label"] for p in preds) == ["0", "1", "2", "3"]
        assert all(p["label"] == str(p["index"]) for p in preds)
        r = client.post("/v1/models/named/classify?top_k=4", content=png(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        assert sorted(p["label"] for p in r.json()["predictions"][0]) == sorted(NAMES)
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert cards["user"]["labels"] == ["0", "1", "2", "3"] and cards["named"]["labels"] == NAMES
        assert cards["user"]["task"] == "image-classification"
        for name in ("user", "named"):
            meta = client.get(f"/v2/models/{name}").json()
            assert meta["outputs"][0]["shape"] == [-1, 4], meta
            assert meta["inputs"][0]["shape"] == [-1, 3, 224, 224], meta
        # KServe classification extension: "score:index:label", label = the index without names.
        body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 224, 224],
                            "data": [0.0] * (3 * 224 * 224)}],
                "outputs": [{"name": "logits", "parameters": {"classification": 2}}]}
        r = client.post("/v2/models/user/infer", json=body)
        assert r.status_code == 200, r.text
        entries = r.json()["outputs"][0]["data"]
        assert len(entries) == 2 and all(e.split(":")[1] == e.split(":")[2] for e in entries)


def test_a_vision_model_without_preprocess_names_what_is_missing(tmp_path: Path) -> None:
    config = DeiTConfig(img_size=16, patch_size=8, num_classes=4, embed_dim=16, depth=1, num_heads=2)
    save_checkpoint(Checkpoint("deit", config.to_dict(), DeiT(config).state_dict()), tmp_path / "bare.pt")
    small_deit(tmp_path / "ok.pt")
    with TestClient(create_app(Settings(model_dir=tmp_path))) as client:
        index = client.post("/v2/repository/index").json()
    why = {m["name"]: m.get("reason") for m in index}
    assert not why["ok"]
    assert why["bare"] == "bare.pt: a vision model needs preprocess metadata; the file has none"
