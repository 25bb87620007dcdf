"""The fused reweighting ops of the custom-op library (plugins.ort_ops, src/reweight.inc): each op, masked and
NoMask, against the PyTorch reference (models.reweighting) and its ONNX function body in a real onnxruntime
session, on every kernel path, row lengths across the vector widths, the contract's masking edge rows, ties,
large and small magnitudes, per-head parameters; attribute errors as statuses; output in x's buffer.

MULTIMAX_REQUIRE_ORT_OPS=1 (CI) makes an unavailable library a failure (the `lib` fixture of test_ort_ops).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.fused_check import compare_fused, fused_summary
from export.limits import FUSED_FP32_TOL as FUSED_ATOL
from models import reweighting as rw
from models.onnx_contract import REWEIGHTING_OPS
from plugins import ort_ops
from plugins.ort_ops.graphs import reweighting_model, reweighting_scores_model
from plugins.reweight_kernel_cases import ATTRS
from tests.plugins.test_ort_ops import session

MIN = float(np.finfo(np.float32).min)
HEADS = 3
LENGTHS = (1, 2, 7, 17, 197)  # below, across and off the 4/8/16-lane vector widths
LONG = 1031  # one long row (normal scores only: the reference is slow there)
FUSED_OPS = set(ort_ops.OPS) - set(ort_ops.MULTIMAX_OPS)


def reference(name: str, x: np.ndarray, mask: np.ndarray | None, attrs: dict[str, Any]) -> np.ndarray:
    fn = rw.FUNCTIONS[name].fn
    assert fn is not None
    kw = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in attrs.items()}
    return fn(torch.from_numpy(x), None if mask is None else torch.from_numpy(mask), -1, **kw).numpy()


def edge_masks(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Decoder-like masks (B, 1, T, n): random, all masked but one, fully masked rows, finfo.min / -inf /
    -1e4 (masked) and soft biases above -1e4 (not masked), and a mask broadcast along the row."""
    random = np.where(rng.random((2, 1, 6, n)) < 0.3, MIN, 0.0).astype(np.float32)
    random[..., 0, :] = np.where(rng.random(n) < 0.5, -np.inf, -1e4)  # masked by -inf / exactly -1e4
    random[..., 0, 0] = 0.0
    random[..., 1, :] = np.where(rng.random(n) < 0.5, -20.0, -3.0)  # soft biases: nothing masked
    one_left = np.full((2, 1, 6, n), MIN, np.float32)
    one_left[..., rng.integers(0, n)] = 0.0
    fully = random.copy()
    fully[0, 0, 2] = MIN
    fully[1, 0, 3] = -np.inf
    return {"masked": random, "all-but-one": one_left, "fully-masked-rows": fully}


def inputs(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Scores (2, 3, 6, n): normal, ties (small integers: top-k's k-th value tied, SparseMax supports with
    equal entries), large and small magnitudes, a constant row."""
    x = (rng.standard_normal((2, HEADS, 6, n)) * 3).astype(np.float32)
    ties = rng.integers(-2, 3, (2, HEADS, 6, n)).astype(np.float32)
    const = np.full((2, HEADS, 6, n), 0.37, np.float32)
    return {"normal": x, "ties": ties, "large": x * 300, "small": x * 1e-4, "constant": const}


def check(got: np.ndarray, want: np.ndarray, mask: np.ndarray | None, where: str) -> None:
    assert not np.isnan(got).any(), where
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0, err_msg=where)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5, err_msg=where)
    assert (got >= 0).all(), where
    if mask is not None:
        m = np.broadcast_to(mask, got.shape)
        kept = (m > -1e4).sum(-1, keepdims=True)
        assert (got[(m <= -1e4) & (kept > 0)] == 0).all(), f"{where}: masked entries must be exactly 0"
        assert (got[np.broadcast_to(kept == 1, got.shape) & (m > -1e4)] == 1).all(), f"{where}: one left gets 1"
        n = got.shape[-1]
        assert (got[np.broadcast_to(kept == 0, got.shape)] == np.float32(1 / n)).all(), f"{where}: empty row uniform"


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("name", list(REWEIGHTING_OPS))
def test_fused_op_matches_reference_and_body(
    lib: ort_ops.Library,
    name: str,
    isa: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa} (paths here: {', '.join(lib.kernel_paths)})")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)
    op, attrs = REWEIGHTING_OPS[name], ATTRS.get(name, {})
    rng = np.random.default_rng(len(name))
    for suffix in ("", "NoMask"):
        model = reweighting_model(op + suffix, attrs)
        fused1, fused2, body = session(model, True, 1), session(model, True, 2), session(model, False)
        runs_before = ort_ops.run_counts()[0]
        for n in (*LENGTHS, LONG):
            masks = edge_masks(rng, n) if not suffix else {"unmasked": None}
            for kind, x in inputs(rng, n).items():
                if n == LONG and kind != "normal":
                    continue
                if kind == "large" and name in ("gaussian", "laplacian"):
                    continue  # |y - mean| ~ 1e3: the float32 mean's rounding alone moves z by O(1) (ill-conditioned)
                for mkind, mask in masks.items():
                    where = f"{op}{suffix} {isa} n={n} {kind} {mkind}"
                    feed = {"x": x} if mask is None else {"x": x, "mask": mask}
                    got = fused1.run(None, feed)[0]
                    np.testing.assert_array_equal(fused2.run(None, feed)[0], got, err_msg=f"{where}: 2 threads")
                    check(got, reference(name, x, mask, attrs), mask, where)
                    if kind in ("normal", "ties") and n <= 17:  # the bodies are slow (sort-based: TopK over rows)
                        np.testing.assert_allclose(got, body.run(None, feed)[0], atol=2e-6, err_msg=f"{where}: body")
        assert ort_ops.run_counts()[0] > runs_before, f"{op}{suffix}: the fused kernel did not run"


def test_sparse_functions_are_sparse_and_topk_keeps_ties(lib: ort_ops.Library) -> None:
    """Closed forms on small rows: SparseMax([1, 0.5, -1]) = [0.75, 0.25, 0]; top-2 of [3, 1, 3, 3] keeps the
    three tied 3s; Ev-SoftMax drops the entries below the mean."""
    run = lambda op, x, **a: session(reweighting_model(op, a), True).run(None, {"x": np.float32([x])})[0][0]  # noqa: E731
    np.testing.assert_allclose(run("SparseMaxNoMask", [1.0, 0.5, -1.0]), [0.75, 0.25, 0.0], atol=1e-7)
    np.testing.assert_allclose(run("TopKSoftMaxNoMask", [3.0, 1.0, 3.0, 3.0], k=2), [1 / 3, 0, 1 / 3, 1 / 3], atol=1e-7)
    ev = run("EvSoftMaxNoMask", [2.0, 0.0, 1.0, -3.0])  # mean 0: 2, 0 and 1 kept
    assert ev[3] == 0 and ev[1] > 0
    ent = run("EntMax15NoMask", [0.0, 0.0])
    np.testing.assert_allclose(ent, [0.5, 0.5], atol=1e-7)


def test_per_head_parameters_follow_axis_1(lib: ort_ops.Library) -> None:
    """Head h of x (B, 3, T, S) uses offset[h] / scale[h]: the same scores in every head give different rows."""
    attrs = ATTRS["gaussian"]
    x = np.repeat(np.random.default_rng(0).standard_normal((1, 1, 4, 9)).astype(np.float32), HEADS, 1)
    got = session(reweighting_model("GaussianAttentionNoMask", attrs), True).run(None, {"x": x})[0]
    for h in range(HEADS):
        one = {"offset": [attrs["offset"][h]], "scale": [attrs["scale"][h]]}
        want = session(reweighting_model("GaussianAttentionNoMask", one), True).run(None, {"x": x[:, h : h + 1]})[0]
        np.testing.assert_allclose(got[:, h : h + 1], want, atol=1e-7)
    assert np.abs(got[:, 0] - got[:, 2]).max() > 1e-3


BAD_ATTRS = [
    ("TopKSoftMaxNoMask", {"k": 0}, "attribute 'k' must be >= 1, got 0"),
    ("TopKSoftMaxNoMask", {}, "attribute 'k' (int) is missing"),
    ("GaussianAttentionNoMask", {"offset": [0.0], "scale": [1.0, 0.0]}, "attribute 'scale' must be > 0"),
    ("LaplacianAttentionNoMask", {"offset": [0.0, 1.0], "scale": [1.0, 2.0, 3.0]},
     "attributes 'offset' and 'scale' must hold 1 value or one per head, the same number; got 2 and 3"),
    ("LaplacianAttention", {"offset": [float("nan")], "scale": [1.0]}, "attribute 'offset' must be finite, got nan"),
    ("LengthScaledSoftMaxNoMask", {"eps": 1.0, "m": 0.0}, "attribute 'eps' must be in (0, 1), got 1"),
    ("LengthScaledSoftMax", {"eps": 0.1, "m": -2.0}, "attribute 'm' must be >= 0 (0: the square root"),
    ("LengthScaledSoftMaxNoMask", {"m": 0.0}, "attribute 'eps' (float) is missing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("op", "attrs", "message"), BAD_ATTRS, ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(BAD_ATTRS)]
)
def test_bad_attributes_fail_session_creation(lib: ort_ops.Library, op: str, attrs: dict, message: str) -> None:
    with pytest.raises(Exception, match=re.escape("multimax: " + message)):
        session(reweighting_model(op, attrs), True)


def test_head_count_mismatch_fails_at_creation_or_run_and_the_session_survives(lib: ort_ops.Library) -> None:
    attrs = ATTRS["gaussian"]  # 3 heads
    with pytest.raises(
        Exception, match=r"multimax: attributes 'offset'/'scale' hold 3 per-head values.*\(2, 4, 5, 6\)"
    ):
        session(reweighting_model("GaussianAttentionNoMask", attrs, shape=[2, 4, 5, 6]), True)  # static: at creation
    fused = session(reweighting_model("GaussianAttention", attrs), True)  # dynamic shapes: at run time
    mask = np.zeros((1, 1, 5, 6), np.float32)
    for bad, bad_mask in (((2, 4, 5, 6), mask.shape), ((3, 5, 6), (5, 6))):  # 4 heads; rank 3 (x and mask)
        with pytest.raises(Exception, match="hold 3 per-head values: the input must be rank 4"):
            fused.run(None, {"x": np.zeros(bad, np.float32), "mask": np.zeros(bad_mask, np.float32)})
    ok = fused.run(None, {"x": np.zeros((2, 3, 5, 6), np.float32), "mask": mask})[0]
    np.testing.assert_allclose(ok, 1 / 6, atol=1e-7)


@pytest.mark.parametrize("op", sorted(FUSED_OPS))
def test_output_takes_the_input_buffer(lib: ort_ops.Library, op: str) -> None:
    """scores -> Mul -> op -> Mul: the op's output is planned into x's buffer and the result equals the body's."""
    name = next(n for n, o in REWEIGHTING_OPS.items() if op.removesuffix("NoMask") == o)
    model = reweighting_scores_model(op, ATTRS.get(name, {}), heads=HEADS)
    fused, body = session(model, True, 2), session(model, False)
    rng = np.random.default_rng(4)
    feed = {"scores": (rng.standard_normal((2, HEADS, 21, 21)) * 20).astype(np.float32)}
    if not op.endswith("NoMask"):
        feed["mask"] = np.triu(np.full((21, 21), MIN, np.float32), 1)[None, None].repeat(2, 0)
    runs, in_place = ort_ops.run_counts()
    got = fused.run(None, feed)[0]
    assert (ort_ops.run_counts()[0] - runs, ort_ops.run_counts()[1] - in_place) == (1, 1), op
    np.testing.assert_allclose(got, body.run(None, feed)[0], atol=2e-6, err_msg=op)


def test_every_contract_op_is_fused(lib: ort_ops.Library) -> None:
    """The library registers every op type of the contract (so no model falls back to a body unannounced)."""
    options = ort.SessionOptions()
    ort_ops.register(options)
    for op in sorted(FUSED_OPS):
        name = next(n for n, o in REWEIGHTING_OPS.items() if op.removesuffix("NoMask") == o)
        model = reweighting_model(op, ATTRS.get(name, {}))
        runs = ort_ops.run_counts()[0]
        feed = {"x": np.zeros((1, HEADS, 2, 4), np.float32)} | (
            {} if op.endswith("NoMask") else {"mask": np.zeros(4, np.float32)}
        )
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, feed)
        assert ort_ops.run_counts()[0] == runs + 1, op


def sort_based(z: np.ndarray, ent: bool) -> np.ndarray:
    """The contract's sort-based SparseMax / EntMax-1.5 in float64 (z = y or y/2), rows of the last axis."""
    z = z.astype(np.float64) * (0.5 if ent else 1.0)
    srt = -np.sort(-z, -1)
    k = np.arange(1, z.shape[-1] + 1)
    mean = np.cumsum(srt, -1) / k
    if ent:
        delta = (1 - k * (np.cumsum(srt**2, -1) / k - mean**2)) / k
        tau_k = mean - np.sqrt(np.maximum(delta, 0))
        support = (tau_k <= srt).sum(-1, keepdims=True)
    else:
        tau_k = (np.cumsum(srt, -1) - 1) / k
        support = (tau_k < srt).sum(-1, keepdims=True)
    tau = np.take_along_axis(tau_k, support - 1, -1)
    p = np.maximum(z - tau, 0)
    return p * p if ent else p


@pytest.mark.parametrize("op", ["SparseMaxNoMask", "EntMax15NoMask"])
def test_sparse_ops_match_the_sort_based_definition_at_every_spread(lib: ort_ops.Library, op: str) -> None:
    """Rows from near-uniform (every entry a candidate, many Newton steps) to peaked, against float64 sorting."""
    rng = np.random.default_rng(11)
    fused = session(reweighting_model(op, {}), True)
    for spread in (1e-3, 0.05, 0.3, 1.0, 3.0, 30.0):
        x = (rng.standard_normal((64, 197)) * spread).astype(np.float32)
        got = fused.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, sort_based(x, op.startswith("EntMax")), atol=2e-6, err_msg=f"{op} {spread}")
        assert ((got > 0).sum(-1) >= 1).all()


def rows_at_their_mean(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows with one entry set to the float32 nearest the row's own (exact) mean, the case where float32 sums
    in different orders put the mean on either side of it."""
    x = (rng.standard_normal((rows, n)) * 2).astype(np.float32)
    for _ in range(4):  # the entry moves the mean: iterate to the fixed point
        x[:, 0] = x.astype(np.float64).mean(-1).astype(np.float32)
    return x


def test_evsoftmax_keeps_the_same_entries_in_reference_body_and_fused_ops(lib: ort_ops.Library) -> None:
    """Ev-SoftMax's cut at the row mean is a discontinuity: an entry at the mean is kept with a whole weight or
    dropped. Every implementation takes the mean in float64 (exact here), so all three agree entry by entry."""
    x = rows_at_their_mean(np.random.default_rng(0), 400, 197)
    mask = np.zeros((1, 197), np.float32)
    mask[0, -3:] = MIN  # the masked path too
    want_nomask, want = reference("evsoftmax", x, None, {}), reference("evsoftmax", x, mask, {})
    for fused in (True, False):
        for op, feed, w in (("EvSoftMaxNoMask", {"x": x}, want_nomask), ("EvSoftMax", {"x": x, "mask": mask}, want)):
            got = session(reweighting_model(op, {}), fused).run(None, feed)[0]
            np.testing.assert_array_equal(got > 0, w > 0, err_msg=f"{op} fused={fused}: another support")
            np.testing.assert_allclose(got, w, atol=2e-6, rtol=0, err_msg=f"{op} fused={fused}")


def test_fused_check_holds_cut_functions_to_the_logits_limit(lib: ort_ops.Library, tmp_path: Path) -> None:
    """Models with Ev-SoftMax or top-k nodes get the logits' limit (upstream rounding can move an entry across the
    cut in a whole model); the others keep the fused check's own 1e-5, and the summary says which applied."""
    x = {"x": np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32)}
    for op, cut in (("EvSoftMaxNoMask", True), ("TopKSoftMaxNoMask", True), ("SparseMaxNoMask", False)):
        path = tmp_path / f"{op}.onnx"
        path.write_bytes(reweighting_model(op, {"k": 3} if op.startswith("TopK") else {}))
        report = compare_fused(path, [x], loose_atol=1e-4)
        assert report["in_use"] and not report["failures"] and report["max_abs_vs_function_bodies"] <= 2e-6
        assert report["atol"] == (1e-4 if cut else FUSED_ATOL)
        assert report["discontinuous_ops"] == ([op] if cut else [])
        assert ("cut rows" in fused_summary(report)) == cut
