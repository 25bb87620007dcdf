"""The reweighting functions under export: one `multimax::<Op>` node per use, function bodies that match the
PyTorch references in onnxruntime (with and without the fused op library), validation by `python -m export`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from export.cli import main
from models import reweighting as rw
from models.checkpoint import Checkpoint, save_checkpoint
from models.deit import DeiT, DeiTConfig
from models.demo import DEMO_DIR, VISION_MULTIMAX
from models.gpt import GPT, GPTConfig
from models.onnx_contract import (
    REWEIGHTING_ATTRIBUTES,
    REWEIGHTING_OPS,
    meta_key,
    read_metadata,
    reweighting_op_types,
)
from models.registry import read_spec
from models.tokenizer import ByteTokenizer
from plugins import ort_ops
from plugins.onnx_functions import attribute_problems, function_protos

# Attributes of the single-node test models (offset/scale per head: 3 heads on axis 1).
ATTRS = {
    "topk_softmax": {"k": 3},
    "gaussian": {"offset": [0.1, -0.3, 0.5], "scale": [0.5, 1.0, 2.0]},
    "laplacian": {"offset": [0.2], "scale": [0.7]},
    "length_scaled": {"eps": 0.1, "m": 0.0},
}
OP_ATOL = 1e-6  # one op, float32 in both: rounding only (sort-based ones included: the inputs have no ties)
MIN = float(np.finfo(np.float32).min)


def single_node(op: str, masked: bool, attrs: dict) -> onnx.ModelProto:
    dims = ["b", "h", "q", "k"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)]
    if masked:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["mb", 1, "q", "k"]))
    node = helper.make_node(op if masked else op + "NoMask", [i.name for i in inputs], ["y"], domain="multimax",
                            plugin_name=op, plugin_version="1", plugin_namespace="multimax", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("multimax", 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=function_protos(18, set(reweighting_op_types())),
                             ir_version=10)


def cases() -> tuple[np.ndarray, np.ndarray]:
    """Scores without ties, and a GPT-like mask: one key left, none left, padding, a soft -3 bias."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 5, 7)) * 3).astype(np.float32)
    mask = np.zeros((1, 1, 5, 7), np.float32)
    mask[..., 0, 1:], mask[..., 1, :], mask[..., 2, 4:], mask[..., 3, 2] = MIN, MIN, MIN, -3.0
    return x, mask


def session(model: onnx.ModelProto, fused: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if fused:
        ort_ops.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
@pytest.mark.parametrize("name", list(REWEIGHTING_OPS))
def test_function_bodies_match_the_references(name: str, masked: bool) -> None:
    op, attrs = REWEIGHTING_OPS[name], ATTRS.get(name, {})
    assert set(attrs) == set(REWEIGHTING_ATTRIBUTES[op])
    model = single_node(op, masked, attrs)
    onnx.checker.check_model(model, full_check=True)
    x, mask = cases()
    feeds = {"x": x} | ({"mask": mask} if masked else {})
    got = session(model, fused=False).run(None, feeds)[0]
    kw = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in attrs.items()}
    fn = rw.FUNCTIONS[name].fn
    assert fn is not None
    want = fn(torch.from_numpy(x), torch.from_numpy(mask) if masked else None, -1, **kw).numpy()
    np.testing.assert_allclose(got, want, atol=OP_ATOL, rtol=0)
    if masked:
        assert (got[..., 0, 0] == 1).all() and (got[..., 0, 1:] == 0).all()  # one key left: exactly 1
        assert (got[..., 1, :] == np.float32(1 / 7)).all()  # none left: uniform
        assert (got[..., 2, 4:] == 0).all() and not np.isnan(got).any()
    body = next(f for f in model.functions if f.name == model.graph.node[0].op_type)
    assert {n.domain for n in body.node} == {""}  # standard ops only: any runtime inlines it


@pytest.mark.parametrize("name", list(REWEIGHTING_OPS))
def test_with_the_fused_library_registered_the_same_results(name: str) -> None:
    """A session with the fused op library (plugins.ort_ops) runs every op: a fused kernel where the library has
    one, else onnxruntime inlines the function body (the library registers the `multimax` domain)."""
    lib = ort_ops.library()
    if not lib.available:
        pytest.skip(f"fused op library unavailable here: {lib.reason}")
    model = single_node(REWEIGHTING_OPS[name], True, ATTRS.get(name, {}))
    x, mask = cases()
    fused = session(model, fused=True).run(None, {"x": x, "mask": mask})[0]
    bodies = session(model, fused=False).run(None, {"x": x, "mask": mask})[0]
    np.testing.assert_allclose(fused, bodies, atol=1e-5, rtol=0)


def _save(tmp: Path, arch: str, model: torch.nn.Module, config: DeiTConfig | GPTConfig) -> Path:
    extra = {"tokenizer": ByteTokenizer().to_dict()} if arch == "gpt" else {"labels": [str(i) for i in range(10)]}
    return save_checkpoint(Checkpoint(arch, config.to_dict(), model.state_dict(), **extra), tmp / f"{arch}.pt")


@pytest.mark.slow  # a full export and validation, 15 s
def test_gpt_with_per_head_gaussian_exports_one_node_per_layer_and_validates(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = GPTConfig.from_preset("gpt-nano", multimax_output=False, attention_function="gaussian")
    model = GPT(config)
    with torch.no_grad():  # trained-looking, different per head and layer
        for i, block in enumerate(model.block_list()):
            assert block.attn.reweight is not None
            block.attn.reweight.offset.copy_(torch.tensor([0.3, -0.2]) * (i + 1))
            block.attn.reweight.log_scale.copy_(torch.tensor([-0.5, 0.4]))
    ckpt = _save(tmp_path, "gpt", model, config)
    assert main([str(ckpt), "--quiet", "--samples", "8", "-o", str(tmp_path / "g.onnx")]) == 0
    proto = onnx.load(str(tmp_path / "g.onnx"))
    nodes = [n for n in proto.graph.node if n.domain == "multimax"]
    assert [n.op_type for n in nodes] == ["GaussianAttention"] * 2  # causal mask: the masked op
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[1].attribute}
    np.testing.assert_allclose(attrs["offset"], [0.6, -0.4], rtol=1e-6)
    np.testing.assert_allclose(attrs["scale"], np.exp([-0.5, 0.4]), rtol=1e-6)
    assert attrs["plugin_name"] == b"GaussianAttention"
    assert {f.name for f in proto.functions} >= {"GaussianAttention"}
    props = {p.key: json.loads(p.value) for p in proto.metadata_props}
    assert props["multimax.config"]["attention_function"] == "gaussian"
    report = json.loads((tmp_path / "g.validation.json").read_text())
    assert report["passed"] and report["attention_function"] == "gaussian"


@pytest.mark.parametrize("name", ["sparsemax"])  # top-k: the served model below
def test_deit_with_a_sparse_function_exports_nomask_nodes_and_validates(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=2,
                        multimax_output=False, attention_function=name)
    model = DeiT(config)
    ckpt = _save(tmp_path, "deit", model, config)
    assert main([str(ckpt), "--quiet", "--samples", "8", "-o", str(tmp_path / "d.onnx")]) == 0
    proto = onnx.load(str(tmp_path / "d.onnx"))
    ops = [n.op_type for n in proto.graph.node if n.domain == "multimax"]
    assert ops == [REWEIGHTING_OPS[name] + "NoMask"] * 2
    # only the bodies the graph uses are attached (MultiMax's three always are)
    names = {f.name for f in proto.functions}
    assert REWEIGHTING_OPS[name] + "NoMask" in names and "EntMax15" not in names


def test_served_model_says_which_function_it_uses(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from models.training.vision import DIGITS_PREPROCESS
    from service.base.config import Settings
    from service.edge.app import create_app

    torch.manual_seed(0)
    config = DeiTConfig(img_size=32, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=2,
                        multimax_output=False, attention_function="topk_softmax", attention_options={"k": 5})
    ckpt = Checkpoint("deit", config.to_dict(), DeiT(config).state_dict(), labels=[str(i) for i in range(10)],
                      preprocess=DIGITS_PREPROCESS)
    save_checkpoint(ckpt, tmp_path / "digits_topk.pt")
    models = tmp_path / "models"
    models.mkdir()
    out = models / "digits_topk.onnx"
    assert main([str(tmp_path / "digits_topk.pt"), "--quiet", "--no-validate", "-o", str(out)]) == 0
    with TestClient(create_app(Settings(model_dir=models))) as client:
        card = client.get("/v1/models/digits_topk").json()
        assert card["attention_function"] == "topk_softmax" and card["attention_options"] == {"k": 5}
        assert client.get("/v2/models/digits_topk").json()["attention_function"] == "topk_softmax"
        image = np.zeros((1, 1, 32, 32), np.float32).tolist()
        r = client.post("/v2/models/digits_topk/infer", json={"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": image}]})
        assert r.status_code == 200, r.text


@pytest.mark.slow  # exports the shipped digits model, 8 s
def test_shipped_demo_exports_as_before(tmp_path: Path) -> None:
    """The config fields and the exporter's new bodies change nothing for MultiMax models: the shipped digits file
    comes out node for node, attribute for attribute, metadata for metadata (only the per-node debug
    metadata, the exporter's source stack traces, name other line numbers)."""
    ckpt = tmp_path / "digits.pt"
    ckpt.write_bytes((DEMO_DIR / VISION_MULTIMAX).read_bytes())
    assert main([str(ckpt), "--quiet", "--no-validate", "-o", str(tmp_path / "digits.onnx")]) == 0

    def stripped(path: Path) -> bytes:
        proto = onnx.load(str(path))
        for node in proto.graph.node:
            del node.metadata_props[:]
        # the one addition since the shipped file: the model description (models.spec), which the compatibility
        # reader derives for the shipped file from its legacy keys, equal to what the new file carries
        spec = [p for p in proto.metadata_props if p.key == meta_key("spec")]
        descriptions.append(read_spec(read_metadata({p.key: p.value for p in proto.metadata_props})))
        for p in spec:
            proto.metadata_props.remove(p)
        return proto.SerializeToString()

    descriptions: list = []
    new = stripped(tmp_path / "digits.onnx")
    assert new == stripped(DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx"))
    assert descriptions[0] == descriptions[1]


def test_attribute_problems_name_each_contract_breach() -> None:
    """The static check of the exporter and the server's load: what a fused op refuses at session creation, for
    function bodies that would fail (or compute nonsense) only when run."""
    gauss = ATTRS["gaussian"]  # 3 heads
    assert attribute_problems(single_node("GaussianAttention", True, gauss)) == []  # dynamic heads: not known

    def fixed(op: str, attrs: dict, dims: list[int]) -> onnx.ModelProto:
        model = single_node(op, False, attrs)
        for d, v in zip(model.graph.input[0].type.tensor_type.shape.dim, dims, strict=False):
            d.dim_value = v
        del model.graph.input[0].type.tensor_type.shape.dim[len(dims):]
        return model

    assert attribute_problems(fixed("GaussianAttention", gauss, [2, 3, 5, 6])) == []
    assert attribute_problems(fixed("LaplacianAttention", {"offset": [0.1], "scale": [2.0]}, [7, 6])) == []
    bad = {
        "3 per-head values for 4 heads": fixed("GaussianAttention", gauss, [2, 4, 5, 6]),
        "need a rank-4 input": fixed("LaplacianAttention", gauss, [5, 6]),
        "same length >= 1, got 3 and 2": single_node("GaussianAttention", True, {**gauss, "scale": [1.0, 2.0]}),
        "every scale must be > 0": single_node("LaplacianAttention", False, {"offset": [0.0], "scale": [-1.0]}),
        "k must be >= 1, got 0": single_node("TopKSoftMax", True, {"k": 0}),
        "eps must be in (0, 1), got 1.5": single_node("LengthScaledSoftMax", False, {"eps": 1.5, "m": 0.0}),
        "m must be >= 0": single_node("LengthScaledSoftMax", False, {"eps": 0.1, "m": -2.0}),
        "missing attribute(s) k": single_node("TopKSoftMax", False, {}),
    }
    for want, model in bad.items():
        problems = attribute_problems(model)
        assert len(problems) == 1 and want in problems[0], (want, problems)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "bodies"])
def test_server_refuses_a_file_with_bad_attributes_and_serves_the_others(
    tmp_path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up off, so the load's own check must catch it: with the fused library the op refuses the session,
    but the function bodies (a GPU provider, or no library) would fail only on the first request."""
    if not fused:
        monkeypatch.setattr(ort_ops, "register", lambda options: False)
    from fastapi.testclient import TestClient

    from models.training.vision import DIGITS_PREPROCESS
    from service.base.config import Settings
    from service.edge.app import create_app

    torch.manual_seed(0)
    models = tmp_path / "models"
    models.mkdir()
    for name in ("good", "bad"):
        config = DeiTConfig(img_size=32, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=1,
                            num_heads=2, multimax_output=False, attention_function="gaussian")
        ckpt = Checkpoint("deit", config.to_dict(), DeiT(config).state_dict(), labels=[str(i) for i in range(10)],
                          preprocess=DIGITS_PREPROCESS)
        save_checkpoint(ckpt, tmp_path / f"{name}.pt")
        assert main([str(tmp_path / f"{name}.pt"), "--quiet", "--no-validate", "-o", str(models / f"{name}.onnx")]) == 0
    proto = onnx.load(str(models / "bad.onnx"))
    node = next(n for n in proto.graph.node if n.op_type == "GaussianAttentionNoMask")
    for a in node.attribute:
        if a.name in ("offset", "scale"):
            a.floats.append(1.0)  # 3 values for 2 heads
    onnx.save(proto, str(models / "bad.onnx"))
    with TestClient(create_app(Settings(model_dir=models, warmup_calls=0))) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["good"]
        image = np.zeros((1, 1, 32, 32), np.float32).tolist()
        r = client.post("/v2/models/good/infer", json={"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 1, 32, 32], "data": image}]})
        assert r.status_code == 200, r.text
        assert client.post("/v2/models/bad/infer", json={"inputs": []}).status_code == 404
    from service.engine.registry import load_models

    loaded, failed = load_models(Settings(model_dir=models, warmup_calls=0))
    assert list(loaded) == ["good"] and "3 per-head values for 2 heads" in str(failed["bad"])
