"""`python -m export`: one MultiMax node per use, function bodies onnxruntime runs, metadata, validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import validate
from export.cli import main
from export.onnx_export import VISION_INPUT, VISION_OUTPUT, export_vision
from models.checkpoint import Checkpoint, load, save_checkpoint
from models.deit import DeiT, DeiTConfig, set_paper_params
from models.demo import DEMO_DIR, TEXT_MULTIMAX, VISION_MULTIMAX, VISION_SOFTMAX


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("export")
    ckpt = shutil.copy(DEMO_DIR / VISION_MULTIMAX, tmp / "digits.pt")
    assert main([str(ckpt), "--quiet"]) == 0
    onnx_path = tmp / "digits.onnx"
    return onnx_path, json.loads((tmp / "digits.validation.json").read_text())


def test_one_node_per_multimax_use_with_function_bodies(exported: tuple[Path, dict]) -> None:
    path, report = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    custom = [n for n in model.graph.node if n.domain == "multimax"]
    # 4 attention layers (no mask in a ViT) + the output layer's modulation of the logits.
    assert [n.op_type for n in custom] == ["MultiMaxNoMask"] * 4 + ["MultiMaxSigma"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in custom[0].attribute}
    sd = torch.load(DEMO_DIR / VISION_MULTIMAX, weights_only=True)["state_dict"]
    np.testing.assert_allclose(attrs["ranges"], sd["blocks.0.attn.ranges"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(attrs["ts"], sd["blocks.0.attn.ts"].numpy(), rtol=1e-6)
    assert attrs["order"] == 2 and attrs["plugin_name"] == b"MultiMaxNoMask"
    bodies = {f.name: [n.op_type for n in f.node] for f in model.functions}
    assert set(bodies) == {"MultiMax", "MultiMaxNoMask", "MultiMaxSigma"}
    assert not any("Pow" in ops for ops in bodies.values())
    assert bodies["MultiMax"][-2:] == ["Add", "Softmax"]  # mask added after the modulation
    assert {o.domain: o.version for o in model.opset_import}[""] >= 18
    assert report["graph"]["inputs"] == {VISION_INPUT: ["batch", 1, 32, 32]}
    assert report["graph"]["outputs"] == {VISION_OUTPUT: ["batch", 10]}


def test_validation_report_meets_tolerances(exported: tuple[Path, dict]) -> None:
    _, report = exported
    v = report["validation"]
    assert report["passed"] and v["passed"] and v["samples"] >= 100
    for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"):
        assert v[level]["max_abs"] <= 1e-4
        assert v[level]["top1_agreement"] == 1.0 and v[level]["nan_count"] == 0
        assert {"mean_abs", "p99_abs", "max_rel", "mean_rel", "p99_rel"} <= set(v[level])


def test_metadata_lets_a_server_use_the_file_alone(exported: tuple[Path, dict]) -> None:
    path, _ = exported
    props = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    assert props["multimax.arch"] == "deit"
    assert props["multimax.labels"] == [str(d) for d in range(10)]
    assert props["multimax.preprocess"]["image_size"] == 32 and props["multimax.preprocess"]["channels"] == "L"
    assert props["multimax.placement"] == {"places": ["attention", "output"], "variant": "second", "inlined": False}
    assert props["multimax.exporter"]["opset"] >= 18
    assert props["multimax.config"]["depth"] == 4


def test_inline_v2_and_real_digits(tmp_path: Path) -> None:
    """--inline gives a flat graph; V2 (affine then first order) exports right; real digits agree too."""
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=4, in_chans=1, num_classes=3, embed_dim=24, depth=2, num_heads=2,
                        variant="v2")
    model = set_paper_params(DeiT(config)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.t.fill_(1.3)
            block.attn.b.fill_(-0.2)
    ckpt = Checkpoint("deit", config.to_dict(), model.state_dict())
    for inline in (False, True):
        out = export_vision(model, ckpt, tmp_path / f"v2_{inline}.onnx", inline=inline)
        proto = onnx.load(str(out))
        onnx.checker.check_model(proto, full_check=True)
        custom = [n for n in proto.graph.node if n.domain]
        assert (custom == []) if inline else (len(custom) == 3 and not proto.graph.node[0].domain)
        if not inline:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in custom[0].attribute}
            assert attrs["order"] == 1 and attrs["ts"][2:] == [0.0, 0.0]
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        x = torch.randn(5, 1, 16, 16)
        got = session.run(None, {VISION_INPUT: x.numpy()})[0]
        np.testing.assert_allclose(got, model(x).detach().numpy(), atol=1e-5)


def test_softmax_twin_has_no_multimax_nodes(tmp_path: Path) -> None:
    model, ckpt, _ = load(DEMO_DIR / VISION_SOFTMAX)
    out = export_vision(model, ckpt, tmp_path / "softmax.onnx")
    assert not [n for n in onnx.load(str(out)).graph.node if n.domain]


def test_missed_tolerance_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = shutil.copy(DEMO_DIR / VISION_MULTIMAX, tmp_path / "m.pt")
    monkeypatch.setattr(validate, "LOGITS_ATOL", 0.0)
    assert main([str(ckpt), "--quiet", "--samples", "4"]) == 1
    report = json.loads((tmp_path / "m.validation.json").read_text())
    assert not report["passed"] and "max abs diff" in report["validation"]["failures"][0]


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
    notes = tmp_path / "notes.pt"
    notes.write_text("not a checkpoint")
    assert main([str(notes)]) == 2
    text = shutil.copy(DEMO_DIR / TEXT_MULTIMAX, tmp_path / "text.pt")
    assert main([str(text)]) == 2
    assert "not available yet" in capsys.readouterr().err
    model = DeiT(DeiTConfig(img_size=16, patch_size=8, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2))
    small = save_checkpoint(Checkpoint("deit", model.config.to_dict(), model.state_dict()), tmp_path / "s.pt")
    assert main([str(small), "-o", str(tmp_path / "nope" / "s.onnx")]) == 2
    assert main([str(small), "--opset", "13"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt", "s.pt", "text.pt"]
