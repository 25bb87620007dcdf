"""export.genai_fusions on graphs traced from Hugging Face folders that transformers made (Llama 3 RoPE scaling,
Qwen2 biases, Qwen3 per-head q/k norms): the fused graph computes what the unfused one does, prefill and decode,
up to the last position of the context; what the pass does not recognise stays as it was."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("transformers")

from export.genai_fusions import COS_CACHE, fuse_decoder
from export.genai_graph import export_genai_text
from export.onnx_export import text_spec_of
from export.pipeline import ExportOptions, _load_hf_folder
from tests.models.hf_folder.reference import arch_configs, make_folder, train_tokenizer


@pytest.fixture(scope="module")
def unfused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[onnx.ModelProto, int]]:
    """Per architecture: the traced decoder graph without fusions, and its context length."""
    root = tmp_path_factory.mktemp("fusions")
    train_tokenizer(root / "tokenizer")
    out = {}
    for name, (config, how) in arch_configs().items():
        if name not in ("llama", "qwen2", "qwen3"):
            continue
        folder = make_folder(root / name, root / "tokenizer", config, **how)
        model, ckpt, _ = _load_hf_folder(folder, ExportOptions())
        spec = text_spec_of(ckpt)
        path = export_genai_text(model, ckpt, root / f"{name}.onnx", spec=spec, fuse=False)
        out[name] = (onnx.load(str(path)), spec.context_length)
        if name == "qwen2":  # fp16: the norms between Casts, RoPE tables in fp16
            path = export_genai_text(model, ckpt, root / f"{name}_fp16.onnx", spec=spec, precision="fp16", fuse=False)
            out[f"{name}_fp16"] = (onnx.load(str(path)), spec.context_length)
    return out


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    from plugins import ort_ops

    options = ort.SessionOptions()
    options.log_severity_level = 3
    lib = ort_ops.library()
    if lib.available:
        options.register_custom_ops_library(str(lib.path))
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, ids: np.ndarray, start: int, past: list[np.ndarray]) -> list[np.ndarray]:
    """One call over `ids` at positions start.. with `past` (each (B, kv, start, head)): logits, then presents."""
    batch, new = ids.shape
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, start + new), np.int64),
             "position_ids": np.tile(np.arange(start, start + new, dtype=np.int64), (batch, 1))}
    names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    feeds |= dict(zip(names, past, strict=True))
    return session.run(None, feeds)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen2_fp16"])
def test_fused_graph_computes_what_the_unfused_one_does(name: str,
                                                        unfused: dict[str, tuple[onnx.ModelProto, int]]) -> None:
    plain, context = unfused[name]
    fused = copy.deepcopy(plain)
    done = fuse_decoder(fused, context)
    onnx.checker.check_model(fused, full_check=True)
    assert done.rotary > 0 and done.rms_norm > 0 and done.packed_matmuls > 0 and not done.why_not_rotary
    ops = {n.op_type for n in fused.graph.node}
    assert {"RotaryEmbedding", "SkipSimplifiedLayerNormalization"} <= ops and "Neg" not in ops
    assert len(fused.graph.node) < 0.7 * len(plain.graph.node)
    a, b = _session(plain), _session(fused)
    limit = 2e-2 if name.endswith("fp16") else 1e-4  # fp16: the fused norm adds and scales before rounding
    rng = np.random.default_rng(0)
    past_shapes = [(2, *[d.dim_value for d in i.type.tensor_type.shape.dim[1:2]], 0,
                    i.type.tensor_type.shape.dim[3].dim_value) for i in plain.graph.input
                   if i.name.startswith("past_key_values.")]
    dtypes = [np.float16 if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else np.float32
              for i in plain.graph.input if i.name.startswith("past_key_values.")]
    empty = [np.zeros(s, d) for s, d in zip(past_shapes, dtypes, strict=True)]
    # a prefill of two rows at the start, then one row's that ends on the context's last position (the caches'
    # last row; onnxruntime's attention takes a past with several new tokens for one row only), and a decode
    # step of two rows after a prefill
    for start, rows, new in ((0, 2, 5), (context - 3, 1, 3)):
        ids = rng.integers(3, 200, (rows, new)).astype(np.int64)
        past = [rng.standard_normal((rows, e.shape[1], start, e.shape[3])).astype(e.dtype) * 0.1 for e in empty]
        want, got = _run(a, ids, start, past), _run(b, ids, start, past)
        for w, g in zip(want, got, strict=True):
            scale = max(1.0, float(np.abs(w).max()))
            assert np.abs(w.astype(np.float64) - g).max() <= limit * scale, (name, start)
    prefill = _run(a, rng.integers(3, 200, (2, 4)).astype(np.int64), 0, empty)
    step = rng.integers(3, 200, (2, 1)).astype(np.int64)
    want, got = _run(a, step, 4, prefill[1:]), _run(b, step, 4, prefill[1:])
    assert np.abs(want[0] - got[0]).max() <= limit * max(1.0, float(np.abs(want[0]).max()))


def test_what_the_pass_does_not_recognise_stays(unfused: dict[str, tuple[onnx.ModelProto, int]]) -> None:
    plain, context = unfused["llama"]
    # cos/sin that read another graph input than the position ids: the rotations stay, with the reason
    mixed = copy.deepcopy(plain)
    cos = next(n for n in mixed.graph.node if n.op_type == "Cos")
    scale = onnx.helper.make_node("Mul", [cos.input[0], "rope_scale"], ["rope_scaled"])
    mixed.graph.input.append(onnx.helper.make_tensor_value_info("rope_scale", onnx.TensorProto.FLOAT, [1]))
    order = [m for n in mixed.graph.node for m in ((scale, n) if n is cos else (n,))]
    cos.input[0] = "rope_scaled"
    del mixed.graph.node[:]
    mixed.graph.node.extend(order)
    done = fuse_decoder(mixed, context)
    assert done.rotary == 0 and "rope_scale" in done.why_not_rotary
    assert not any(n.op_type == "RotaryEmbedding" for n in mixed.graph.node)
    assert all(t.name != COS_CACHE for t in mixed.graph.initializer)
    # the embeddings' RMSNorm has no residual Add before it: it stays seven nodes; every other norm is fused
    fused = copy.deepcopy(plain)
    fuse_decoder(fused, context)
    assert sum(n.op_type == "Pow" for n in fused.graph.node) == 1
    # and a graph without any of the shapes comes back as it was
    tiny = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])],
        [onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "w")]), ir_version=10)
    before = tiny.SerializeToString()
    assert fuse_decoder(tiny, 16).as_dict()["nodes removed"] == 0 and tiny.SerializeToString() == before


def test_a_long_chain_of_residual_norms_is_fused_and_computes_the_same() -> None:
    nodes, inits = [], [onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                        onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                        onnx.numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
                        onnx.numpy_helper.from_array(np.ones(8, np.float32), "w")]
    x = "x0"
    for i in range(2000):
        s = f"s{i}"
        nodes += [onnx.helper.make_node("Add", [x, "x0"], [s]),
                  onnx.helper.make_node("Pow", [s, "two"], [f"p{i}"]),
                  onnx.helper.make_node("ReduceMean", [f"p{i}", "axes"], [f"m{i}"], keepdims=1),
                  onnx.helper.make_node("Add", [f"m{i}", "eps"], [f"a{i}"]),
                  onnx.helper.make_node("Sqrt", [f"a{i}"], [f"q{i}"]),
                  onnx.helper.make_node("Reciprocal", [f"q{i}"], [f"r{i}"]),
                  onnx.helper.make_node("Mul", [s, f"r{i}"], [f"n{i}"]),
                  onnx.helper.make_node("Mul", ["w", f"n{i}"], [f"x{i + 1}"])]
        x = f"x{i + 1}"
    proto = onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "chain", [onnx.helper.make_tensor_value_info("x0", onnx.TensorProto.FLOAT, [1, 8])],
        [onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [1, 8])], inits),
        opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    want = _session(proto).run(None, {"x0": np.arange(8, dtype=np.float32)[None] / 8})[0]
    assert fuse_decoder(proto, 16).rms_norm == 2000
    got = _session(proto).run(None, {"x0": np.arange(8, dtype=np.float32)[None] / 8})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
