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
from export.onnx_export import export_vision
from models.checkpoint import Checkpoint, load, save_checkpoint
from models.deit import DeiT, DeiTConfig, set_paper_params
from models.demo import DEMO_DIR, TEXT_MULTIMAX, VISION_MULTIMAX, VISION_SOFTMAX
from models.onnx_contract import VISION_INPUT, VISION_OUTPUT
from models.tokenizer import ByteTokenizer
from plugins.trt_plugin import tensorrt_unavailable as trt_unavailable


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("export")
    ckpt = shutil.copy(DEMO_DIR / VISION_MULTIMAX, tmp / "digits.pt")
    assert main([str(ckpt), "--quiet", "-o", str(tmp / "digits.onnx")]) == 0
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
        logits = v[level]["limits"]["logits"]  # export.limits: 1e-4 x max(1, max|logits|)
        assert logits["max_abs"] == v[level]["max_abs"] <= logits["limit"] == pytest.approx(1e-4 * logits["scale"])
        assert logits["scale"] >= 1 and logits["tol"] == 1e-4
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
    monkeypatch.chdir(tmp_path)
    ckpt = shutil.copy(DEMO_DIR / VISION_MULTIMAX, tmp_path / "m.pt")
    monkeypatch.setitem(validate.TOLERANCES, "fp32", validate.Tolerance(0.0, 1.0, True))
    assert main([str(ckpt), "--quiet", "--samples", "4"]) == 1
    report = json.loads((tmp_path / "m.validation.json").read_text())
    assert not report["passed"] and "logits max abs diff" in report["validation"]["failures"][0]
    assert "> limit 0 (= 0 x scale" in report["validation"]["failures"][0]


def test_bad_input_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
    notes = tmp_path / "notes.pt"
    notes.write_text("not a checkpoint")
    assert main([str(notes)]) == 2
    model = DeiT(DeiTConfig(img_size=16, patch_size=8, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2))
    small = save_checkpoint(Checkpoint("deit", model.config.to_dict(), model.state_dict()), tmp_path / "s.pt")
    assert main([str(small), "-o", str(tmp_path / "nope" / "s.onnx")]) == 2
    assert main([str(small), "--opset", "13"]) == 2
    assert main([str(small), "--samples", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        main([str(small), "--fp16", "--int8"])
    assert exc.value.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt", "s.pt"]
    # No TensorRT / GPU here: --trt says why before any work is done.
    if trt_unavailable():
        capsys.readouterr()
        assert main([str(small), "--trt"]) == 2
        assert "--trt:" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt", "s.pt"]


@pytest.fixture(scope="module")
def exported_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("export_text")
    ckpt = shutil.copy(DEMO_DIR / TEXT_MULTIMAX, tmp / "text.pt")
    assert main([str(ckpt), "--quiet", "-o", str(tmp / "text.onnx")]) == 0
    return tmp / "text.onnx", json.loads((tmp / "text.validation.json").read_text())


def test_text_graph_has_kv_cache_io_with_named_axes(exported_text: tuple[Path, dict]) -> None:
    path, report = exported_text
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    n_layer = 4
    inputs, outputs = report["graph"]["inputs"], report["graph"]["outputs"]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")
    ]
    assert list(outputs) == ["logits"] + [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    assert inputs["input_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"][0] == "batch" and isinstance(inputs["attention_mask"][1], str)
    assert inputs["past_key_values.0.key"] == ["batch", 4, "past_sequence", 32]
    assert outputs["logits"] == ["batch", "sequence", 259]
    assert [n.op_type for n in proto.graph.node if n.domain] == ["MultiMax"] * n_layer + ["MultiMaxSigma"]
    props = {p.key: json.loads(p.value) for p in proto.metadata_props}
    assert props["multimax.arch"] == "gpt" and props["multimax.tokenizer"]["type"] == ByteTokenizer.type
    assert props["multimax.config"]["block_size"] == 128


def test_text_validation_covers_prefill_decode_and_greedy_text(exported_text: tuple[Path, dict]) -> None:
    _, report = exported_text
    v = report["validation"]
    assert report["passed"] and v["samples"] >= 100 and v["past_lengths"][0] == 0
    for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"):
        for kind in ("logits", "present"):
            entry = v[level]["limits"][kind]
            assert entry["max_abs"] <= entry["limit"] == pytest.approx(1e-4 * entry["scale"]), (level, kind)
        assert v[level]["limits"]["present"]["max_abs"] == v[level]["present_max_abs"] and v[level]["nan_count"] == 0
    assert v["greedy"] == {"prompts": 16, "tokens": 32, "identical": 16}


def test_text_graph_decodes_from_an_empty_past_like_pytorch(exported_text: tuple[Path, dict]) -> None:
    """Independent of the validator: prefill two left-padded prompts, then two decode steps."""
    path, _ = exported_text
    model, _, _ = load(DEMO_DIR / TEXT_MULTIMAX)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.tensor([[0, 0, 72, 105], [84, 104, 101, 32]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    past = [(torch.zeros(2, 4, 0, 32), torch.zeros(2, 4, 0, 32)) for _ in range(4)]
    for step in range(3):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        logits, *presents = session.run(None, validate._feed(ids, mask, positions.contiguous(), past))
        with torch.no_grad():
            ref, past = model(ids, positions, mask, past)
        np.testing.assert_allclose(logits, ref.numpy(), atol=1e-4, err_msg=f"step {step}")
        for got, want in zip(presents, [t for pair in past for t in pair], strict=True):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
        ids = ref[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)


@pytest.mark.parametrize("flag", ["--fp16", "--int8"])
def test_reduced_precision_variants(tmp_path: Path, flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = shutil.copy(DEMO_DIR / VISION_MULTIMAX, tmp_path / "digits.pt")
    assert main([str(ckpt), flag, "--quiet", "--samples", "24"]) == 0
    precision = flag[2:]
    path = tmp_path / f"digits.{precision}.onnx"
    report = json.loads((tmp_path / f"digits.{precision}.validation.json").read_text())
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert report["precision"] == precision and report["passed"]
    props = {p.key: json.loads(p.value) for p in proto.metadata_props if p.key.startswith("multimax.")}
    assert props["multimax.precision"] == precision
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)" and session.get_outputs()[0].type == "tensor(float)"
    ops = {n.op_type for n in proto.graph.node}
    stats = report["validation"]["ORT_ENABLE_ALL"]
    if precision == "fp16":
        logits = stats["limits"]["logits"]
        assert stats["max_abs"] <= logits["limit"] == pytest.approx(2e-2 * logits["scale"])
        assert stats["top1_agreement"] >= 0.99
        weights = [t for t in proto.graph.initializer if len(t.dims) == 2]
        assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
        # MultiMax nodes stay fp32: each one's input comes out of a Cast to float.
        producers = {o: n for n in proto.graph.node for o in n.output}
        for node in (n for n in proto.graph.node if n.domain == "multimax"):
            cast = producers[node.input[0]]
            assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT
    else:
        assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
        assert stats["nan_count"] == 0 and stats["top1_agreement"] >= 0.9
        # reported, not enforced: the delta beside the scale the rule would hold it to
        logits = stats["limits"]["logits"]
        assert logits["limit"] is None and logits["tol"] is None and logits["scale"] >= 1
        assert logits["relative"] == pytest.approx(stats["max_abs"] / logits["scale"])
        # The fused-ops check is reported like the other int8 deltas: a rounding difference in front of a dynamic
        # quantization moves a value by a whole step (2.2e-3 on the digits model), far above fp32's 1e-5.
        fused = report["validation"]["fused_ops"]
        assert not fused["in_use"] or (fused["atol"] is None and not fused["failures"])


@pytest.mark.parametrize("name", [VISION_MULTIMAX, VISION_SOFTMAX, TEXT_MULTIMAX])
def test_shipped_demo_onnx_matches_its_checkpoint(name: str) -> None:
    """The server's default models: stale files (re-run `python -m export.demos`) fail here."""
    model, ckpt, _ = load(DEMO_DIR / name)
    path = DEMO_DIR / name.replace(".pt", ".onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    props = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    assert props["multimax.arch"] == ckpt.arch and props["multimax.config"] == ckpt.config
    torch.manual_seed(0)
    with torch.no_grad():
        if ckpt.arch == "deit":
            x = torch.randn(8, 1, 32, 32)
            got, want = session.run(None, {VISION_INPUT: x.numpy()})[0], model(x)
        else:
            ids = torch.randint(0, 256, (2, 12))
            mask, positions = torch.ones(2, 12, dtype=torch.long), torch.arange(12).expand(2, 12).contiguous()
            past = [(torch.zeros(2, 4, 0, 32), torch.zeros(2, 4, 0, 32)) for _ in range(4)]
            got, want = session.run(None, validate._feed(ids, mask, positions, past))[0], model(ids)[0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)


def test_large_models_get_external_data_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the protobuf limit the weights go to `<name>.data` (threshold lowered: no 2 GB model in CI)."""
    from export import onnx_export

    model, ckpt, _ = load(DEMO_DIR / VISION_MULTIMAX)
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 100_000)
    out = export_vision(model, ckpt, tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    assert out.stat().st_size < (tmp_path / "big.onnx.data").stat().st_size  # small tensors stay inline
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {VISION_INPUT: x.numpy()})[0], model(x).numpy(), atol=1e-4)
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 10**12)  # re-export small: stale data removed
    export_vision(model, ckpt, tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx"]
