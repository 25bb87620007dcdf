"""The export's fused-ops check on every kernel path this CPU has (MULTIMAX_ORT_ISA forces each), at fp32 and fp16.

Each node is held to float32 rounding on its own inputs whatever the precision; the model's outputs with and
without the library are held to the variant's limit. A path the CPU has is never first run on a user's machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from export import fused_check, limits
from export.fused_check import NODE_ATOL, compare_fused, fused_summary
from export.limits import FUSED_FP32_TOL as FUSED_ATOL
from export.pipeline import ExportOptions, export_checkpoint
from export.validate import TOLERANCES
from models.demo import DEMO_DIR, TEXT_MULTIMAX, VISION_MULTIMAX
from models.onnx_contract import VISION_INPUT
from plugins import ort_ops

ISAS = ("portable", "avx2", "avx512")


@pytest.fixture(scope="module")
def fp16_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp16") / "digits.fp16.onnx"
    options = ExportOptions(output=out, precision="fp16", validate=False, progress=False)
    return export_checkpoint(DEMO_DIR / VISION_MULTIMAX, options).onnx


def image_feeds(n: int = 4) -> list[dict[str, np.ndarray]]:
    """Random images as the validation draws them (standard normal), batches of 1 to 8."""
    rng = np.random.default_rng(0)
    return [{VISION_INPUT: rng.standard_normal((b, 1, 32, 32)).astype(np.float32)} for b in (1, 8, 3, 8)[:n]]


def forced(isa: str, lib: ort_ops.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa} (paths here: {', '.join(lib.kernel_paths)})")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)


@pytest.mark.parametrize("isa", ISAS)
def test_fp32_export_agrees_with_its_bodies_on_every_path(
    lib: ort_ops.Library, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    forced(isa, lib, monkeypatch)
    report = compare_fused(DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx"), image_feeds())
    assert report["kernel_path"] == isa and not report["failures"], report
    assert report["max_abs_vs_function_bodies"] <= FUSED_ATOL
    assert report["nodes"]["count"] == 5 and report["nodes"]["max_abs"] <= NODE_ATOL  # 4 blocks + the output


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_export_holds_each_node_to_float32_rounding_on_every_path(
    lib: ort_ops.Library, fp16_digits: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fp16 graph's MultiMax nodes compute in float32: each agrees with its body to float32 rounding on its
    own inputs; the outputs (fp16 layers after the nodes) are held to the fp16 variant's limit."""
    forced(isa, lib, monkeypatch)
    limit = TOLERANCES["fp16"].fused_tol
    report = compare_fused(fp16_digits, image_feeds(), atol=limit)
    assert report["kernel_path"] == isa and not report["failures"], report
    assert report["nodes"]["max_abs"] <= NODE_ATOL and report["atol"] == limit
    assert limit is not None and report["max_abs_vs_function_bodies"] <= limit
    line = fused_summary(report)
    assert f"fused ops (onnxruntime, {isa})" in line and "each of 5 nodes on its own inputs" in line


@pytest.mark.parametrize("isa", ISAS)
def test_text_export_nodes_on_every_path(lib: ort_ops.Library, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped text model (masked attention MultiMax over a KV cache, the output sigma) on each path."""
    forced(isa, lib, monkeypatch)
    path = DEMO_DIR / TEXT_MULTIMAX.replace(".pt", ".onnx")
    proto = onnx.load(str(path), load_external_data=False)
    n_layer = sum(1 for node in proto.graph.node if node.op_type == "MultiMax")
    rng = np.random.default_rng(1)
    feeds = []
    for batch, past, new in ((1, 0, 7), (2, 5, 1)):
        feed: dict[str, np.ndarray] = {
            "input_ids": rng.integers(0, 256, (batch, new)).astype(np.int64),
            "attention_mask": np.ones((batch, past + new), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + new), (batch, new)).astype(np.int64),
        }
        for value in proto.graph.input:
            if value.name.startswith("past_key_values"):
                dims = value.type.tensor_type.shape.dim
                feed[value.name] = rng.standard_normal((batch, dims[1].dim_value, past, dims[3].dim_value)).astype(
                    np.float32
                )
        feeds.append(feed)
    report = compare_fused(path, feeds)
    assert report["kernel_path"] == isa and not report["failures"], report
    assert report["nodes"]["count"] == n_layer + 1 and report["nodes"]["max_abs"] <= NODE_ATOL


def test_a_node_that_disagrees_with_its_body_fails_whatever_the_outputs_limit(
    lib: ort_ops.Library, fp16_digits: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel off by 1e-3 on one node fails the check even where the outputs' limit (fp16's 2e-2, or int8's
    none) would let it pass: the node check does not depend on the precision."""
    real = fused_check._open

    def off_by_a_little(model: Any, level: Any, spinning: bool, fused: bool) -> Any:
        if fused and isinstance(model, bytes):
            proto = onnx.load_from_string(model)
            node = proto.graph.node[0]
            if node.op_type == "MultiMaxSigma":  # the output layer's sigma, shifted on the fused side only
                ranges = next(a for a in node.attribute if a.name == "ranges")
                ranges.floats[1] += 1e-3
                model = proto.SerializeToString()
        return real(model, level, spinning, fused)

    monkeypatch.setattr(fused_check, "_open", off_by_a_little)
    for atol in (TOLERANCES["fp16"].fused_tol, None):
        report = compare_fused(fp16_digits, image_feeds(2), atol=atol)
        assert report["nodes"]["max_abs"] > NODE_ATOL and report["nodes"]["worst"].startswith("MultiMaxSigma")
        assert len(report["failures"]) == 1 and "on the same inputs" in report["failures"][0]


# ---- the outputs' limit scales with the outputs (issue 37: a fairseq LM's logits of ~10 failed a correct export) --

HEAD_GAIN = 8.0  # the digits model's head x8: logits up to ~80 (sigma's squares make them grow faster than x8)
REAL_OPEN = fused_check._open


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped digits export with its classifier's weights and bias scaled (by a power of two: exactly), so its
    logits are as large as a language model's; the graph and its fused nodes are unchanged."""
    proto = onnx.load(str(DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx")))
    for tensor in proto.graph.initializer:
        if tensor.name in ("model.head.weight", "model.head.bias"):
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * np.float32(HEAD_GAIN),
                                                         tensor.name))
    path = tmp_path_factory.mktemp("large") / "digits_large_logits.onnx"
    onnx.save(proto, str(path))
    return path


@pytest.mark.parametrize("isa", ISAS)
def test_large_logits_are_held_to_a_limit_that_grows_with_them_on_every_path(
    lib: ort_ops.Library, large_logits: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A correct model whose logits reach ~80: float32 rounding differences grow with the values (measured 2.3e-5
    to 3.8e-5 here, over the absolute 1e-5 on every path), so the outputs are held to 1e-5 x max(1, max|output|)."""
    forced(isa, lib, monkeypatch)
    report = compare_fused(large_logits, image_feeds())
    assert report["kernel_path"] == isa and not report["failures"], report
    assert 30 <= report["output_scale"] <= 200, report["output_scale"]
    assert report["atol"] == FUSED_ATOL and report["limit"] == pytest.approx(FUSED_ATOL * report["output_scale"])
    assert report["max_abs_vs_function_bodies"] <= report["limit"]
    assert report["nodes"]["passed"] and report["nodes"]["count"] == 5
    line = fused_summary(report)
    assert f"(limit {report['limit']:.2e} = 1e-05 x scale {report['output_scale']:.3g})" in line, line


def _wrong_output_sigma(delta: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fused session (the model's and each node's alone) runs the output layer's sigma with its second range
    shifted by `delta`; the function bodies stay right."""

    def wrong(model: Any, level: Any, spinning: bool, fused: bool) -> Any:
        if fused:
            proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
            for node in proto.graph.node:
                if node.op_type == "MultiMaxSigma":
                    next(a for a in node.attribute if a.name == "ranges").floats[1] += delta
            model = proto.SerializeToString()
        return REAL_OPEN(model, level, spinning, fused)

    monkeypatch.setattr(fused_check, "_open", wrong)


@pytest.mark.parametrize("isa", ISAS)
def test_a_wrong_fused_op_still_fails_on_large_logits_on_every_path(
    lib: ort_ops.Library, large_logits: Path, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scaled limit does not let a wrong kernel through: off by 1e-2 the outputs miss their limit (and the
    node its own); off by 1e-3, within the outputs' scaled limit, the node check still fails it."""
    forced(isa, lib, monkeypatch)
    _wrong_output_sigma(1e-2, monkeypatch)
    report = compare_fused(large_logits, image_feeds())
    assert report["kernel_path"] == isa and report["max_abs_vs_function_bodies"] > report["limit"]
    assert len(report["failures"]) == 2, report["failures"]
    assert report["failures"][0].startswith("fused ops: model outputs max abs diff")
    assert f"(= 1e-05 x scale {report['output_scale']:.3g}) vs function bodies" in report["failures"][0]
    assert "on the same inputs" in report["failures"][1]
    _wrong_output_sigma(1e-3, monkeypatch)
    report = compare_fused(large_logits, image_feeds())
    assert len(report["failures"]) == 1 and "MultiMaxSigma" in report["failures"][0], report["failures"]
    assert "on the same inputs" in report["failures"][0]


def test_small_outputs_keep_the_absolute_limit() -> None:
    """Below magnitude 1 the scale is 1: the limit is the variant's own, as tight as before."""
    small = [np.full((2, 3), 0.5, np.float32), np.array([-0.9], np.float32)]
    assert limits.scale(small) == 1.0
    assert limits.scale([*small, np.array([[3.0, -42.5]], np.float32)]) == 42.5
    assert limits.scale([np.array([np.nan, 2.0], np.float32)]) == 2.0
