"""The fused MultiMax custom-op library for onnxruntime (plugins.ort_ops): each op against PyTorch and
against its ONNX function body, every kernel path and thread count; whole models with and without it;
errors as statuses; and everything still working when the library is unavailable.

Set MULTIMAX_REQUIRE_ORT_OPS=1 (CI does) to fail instead of skipping when the library cannot be built.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export import validate
from export.fused_check import compare_fused, cpu_session
from export.onnx_export import export_text, export_vision
from models.checkpoint import Checkpoint, load
from models.deit import DeiT, DeiTConfig, set_paper_params
from models.demo import DEMO_DIR, TEXT_MULTIMAX, VISION_MULTIMAX, VISION_SOFTMAX
from models.generate import generate
from models.multimax import multimax, paper_params, sigma
from models.onnx_contract import VISION_INPUT
from models.registry import describe_model
from plugins import ort_ops
from plugins.ort_ops.__main__ import main as ort_ops_main
from plugins.ort_ops.graphs import op_model, scores_model
from service.engine.backends.onnxruntime import OnnxRuntimeBackend

LENGTHS = (1, 7, 17, 197, 1024, 4099)  # below, across and at multiples of the 4/8/16-lane vector widths
MIN = float(np.finfo(np.float32).min)


@pytest.fixture
def fresh_library() -> Iterator[None]:
    """library() is cached per process: forget it around tests that change the environment."""
    ort_ops.library.cache_clear()
    yield
    ort_ops.library.cache_clear()


def session(model: bytes, fused: bool, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if fused:
        assert ort_ops.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def param_sets() -> list[tuple[str, list[float], list[float]]]:
    rng = np.random.default_rng(7)
    return [
        ("paper layer 1", *paper_params(0)),
        ("paper layer 3", *paper_params(2)),  # t_b1 < 0: a strongly reweighting row
        ("random", (rng.standard_normal(4) * 1.5).tolist(), (rng.standard_normal(4) * 0.7).tolist()),
    ]


def masks(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Masks broadcast like the decoder's (B, 1, T, S) against scores (B, H, T, S)."""
    random = np.where(rng.random((2, 1, 5, n)) < 0.3, MIN, 0.0).astype(np.float32)
    random[..., 0] = 0.0
    one_left = np.full((2, 1, 5, n), MIN, np.float32)
    one_left[..., rng.integers(0, n)] = 0.0  # all masked but one: that one gets all the weight
    fully = random.copy()
    fully[0, 0, 2] = MIN  # a fully masked row: finite (finfo.min), uniform, as the function body gives
    return {"masked": random, "all-masked-but-one": one_left, "fully-masked-row": fully}


def torch_ref(op: str, x: np.ndarray, ranges: list[float], ts: list[float], order: int, mask=None) -> np.ndarray:
    r, t = torch.tensor(ranges), torch.tensor(ts)
    xt = torch.from_numpy(x)
    if op == "MultiMaxSigma":
        return sigma(xt, r, t, order).numpy()
    return multimax(xt, r, t, order, None if mask is None else torch.from_numpy(mask)).numpy()


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("op", ["MultiMax", "MultiMaxNoMask", "MultiMaxSigma"])
def test_op_matches_pytorch_and_function_body(
    lib: ort_ops.Library, op: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa} (paths here: {', '.join(lib.kernel_paths)})")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)
    rng = np.random.default_rng(0)
    for label, ranges, ts in param_sets():
        for order in (1, 2):
            ts_o = ts if order == 2 else [*ts[:2], 0.0, 0.0]  # what the exporter writes for order 1
            model = op_model(op, ranges, ts_o, order)
            fused1, fused4, body = session(model, True, 1), session(model, True, 4), session(model, False)
            for n in LENGTHS:
                x = (rng.standard_normal((2, 3, 5, n)) * 4).astype(np.float32)
                cases = masks(rng, n) if op == "MultiMax" else {"unmasked": None}
                for kind, mask in cases.items():
                    feed = {"x": x} if mask is None else {"x": x, "mask": mask}
                    where = f"{op} {isa} {label} order {order} n={n} {kind}"
                    got = fused1.run(None, feed)[0]
                    np.testing.assert_array_equal(fused4.run(None, feed)[0], got, err_msg=f"{where}: 4 threads")
                    want, ref = body.run(None, feed)[0], torch_ref(op, x, ranges, ts_o, order, mask)
                    rtol = 1e-6 if op == "MultiMaxSigma" else 0.0  # sigma's values grow with x^2
                    np.testing.assert_allclose(got, want, atol=1e-5, rtol=rtol, err_msg=f"{where}: vs body")
                    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=rtol, err_msg=f"{where}: vs torch")
                    assert not np.isnan(got).any(), where
                    if mask is not None:  # masked entries get exactly 0 (unless the whole row is masked)
                        kept = (mask == 0).any(-1, keepdims=True)
                        assert (got[np.broadcast_to((mask == MIN) & kept, got.shape)] == 0).all(), where
                    if op != "MultiMaxSigma":
                        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5, err_msg=where)


def test_mask_broadcasting_of_every_kind(lib: ort_ops.Library) -> None:
    """Masks of lower rank, size-1 axes anywhere (the softmax axis too), and x broadcast by the mask."""
    ranges, ts = paper_params(4)
    model = op_model("MultiMax", ranges, ts, 2)
    fused, body = session(model, True, 2), session(model, False)
    rng = np.random.default_rng(1)
    for xs, ms in [((2, 3, 4, 9), (9,)), ((2, 3, 4, 9), (4, 1)), ((2, 3, 4, 9), (2, 1, 1, 9)),
                   ((1, 3, 1, 9), (2, 1, 4, 9)), ((2, 3, 4, 1), (2, 3, 4, 6)), ((3, 9), (2, 1, 1))]:  # fmt: skip
        feed = {"x": rng.standard_normal(xs).astype(np.float32),
                "mask": np.where(rng.random(ms) < 0.4, MIN, 0).astype(np.float32)}  # fmt: skip
        got, want = fused.run(None, feed)[0], body.run(None, feed)[0]
        assert got.shape == want.shape, (xs, ms)
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"x {xs} mask {ms}")


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_exp_accuracy_and_underflow_against_float64(
    lib: ort_ops.Library, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ts = 0 (sigma is the identity) the op is a softmax: every kept term within 1e-6 relative of a
    float64 softmax, and terms more than 88 below the row max exactly 0 (as exp underflows), odd lengths."""
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)
    fused = session(op_model("MultiMaxNoMask", [0.0] * 4, [0.0] * 4, 2), True)
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-87, 0, (64, 37)), rng.uniform(-300, -88.5, (64, 6))], -1).astype(np.float32)
    x[:, 0] = 0.0
    got = fused.run(None, {"x": x})[0].astype(np.float64)
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[:, :37], want[:, :37], rtol=1e-6, atol=1e-37, err_msg=isa)
    assert (got[:, 37:] == 0).all(), isa


@pytest.mark.parametrize("op", ["MultiMax", "MultiMaxNoMask", "MultiMaxSigma"])
def test_output_takes_the_input_buffer_and_results_do_not_change(lib: ort_ops.Library, op: str) -> None:
    """Inside a graph (scores -> Mul -> op -> Mul), onnxruntime plans the op's output into x's buffer
    (the ops' shape inference + MayInplace): the run counters see it, and the outputs equal the bodies'."""
    ranges, ts = paper_params(5)
    model = scores_model(op, ranges, ts, heads=3)
    fused, body = session(model, True, 2), session(model, False)
    rng = np.random.default_rng(4)
    feed = {"scores": (rng.standard_normal((2, 3, 33, 33)) * 20).astype(np.float32)}
    if op == "MultiMax":
        feed["mask"] = np.triu(np.full((33, 33), MIN, np.float32), 1)[None, None].repeat(2, 0)
    runs, in_place = ort_ops.run_counts()
    got = fused.run(None, feed)[0]
    runs_after, in_place_after = ort_ops.run_counts()
    assert (runs_after - runs, in_place_after - in_place) == (1, 1), op
    np.testing.assert_allclose(got, body.run(None, feed)[0], atol=1e-5, rtol=1e-6, err_msg=op)


def test_kernel_paths_follow_the_cpu_and_os(lib: ort_ops.Library) -> None:
    """Every path is compiled on x86-64; one runs only where CPUID and XGETBV (the OS saves the registers)
    say so, which is what Linux's /proc/cpuinfo flags report too."""
    if platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").is_file():
        pytest.skip("checks x86-64 paths against Linux's /proc/cpuinfo")
    assert lib.compiled_paths == ("avx512", "avx2", "portable")
    line = next(li for li in Path("/proc/cpuinfo").read_text().splitlines() if li.startswith("flags"))
    flags = set(line.split(":", 1)[1].split())
    want = [isa for isa, need in (("avx512", {"avx512f", "fma"}), ("avx2", {"avx2", "fma"})) if need <= flags]
    assert lib.kernel_paths == (*want, "portable")


def test_errors_are_statuses_and_the_session_survives(lib: ort_ops.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    ranges, ts = paper_params(0)
    with pytest.raises(Exception, match="multimax: attribute 'ranges' must hold 4 floats"):
        session(op_model("MultiMaxNoMask", ranges[:3], ts, 2), True)
    with pytest.raises(Exception, match="multimax: attribute 'order' must be 1 or 2"):
        session(op_model("MultiMaxNoMask", ranges, ts, 3), True)
    fused = session(op_model("MultiMax", ranges, ts, 2), True)
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(Exception, match="multimax: mask does not broadcast against x"):
        fused.run(None, {"x": x, "mask": np.zeros((5, 4), np.float32)})
    ok = fused.run(None, {"x": x, "mask": np.zeros((1, 4), np.float32)})[0]  # the session goes on
    np.testing.assert_allclose(ok, 0.25, atol=1e-7)
    with pytest.raises(Exception, match="softmax runs over the last"):
        fused.run(None, {"x": np.array(1.0, np.float32), "mask": np.array(0.0, np.float32)})
    np.testing.assert_array_equal(fused.run(None, {"x": np.zeros((0, 4), np.float32),
                                                   "mask": np.zeros((1, 4), np.float32)})[0].shape, (0, 4))  # fmt: skip
    monkeypatch.setenv("MULTIMAX_ORT_ISA", "sse9")
    with pytest.raises(Exception, match="MULTIMAX_ORT_ISA=sse9: unknown path"):
        session(op_model("MultiMaxNoMask", ranges, ts, 2), True)
    missing = next((p for p in ("avx512", "avx2") if p not in lib.kernel_paths), None)
    if missing:
        monkeypatch.setenv("MULTIMAX_ORT_ISA", missing)
        with pytest.raises(Exception, match=f"MULTIMAX_ORT_ISA={missing}: this CPU does not support it"):
            session(op_model("MultiMaxNoMask", ranges, ts, 2), True)


def fused_ops_ran(path: Path) -> set[str]:
    """The op types onnxruntime's profiler saw for a session with the library (custom kernels, not bodies)."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(path.with_suffix(""))
    ort_ops.register(options)
    s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    s.run(None, {VISION_INPUT: np.zeros((1, 3, 224, 224), np.float32)})
    events = json.loads(Path(s.end_profiling()).read_text())
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"} & set(ort_ops.OPS)


@pytest.mark.slow
def test_deit_small_shaped_model_same_outputs_with_and_without(lib: ort_ops.Library, tmp_path: Path) -> None:
    """DeiT-small's widths, heads and 196 tokens (2 of its 12 blocks), paper parameters, attention + output."""
    torch.manual_seed(0)
    config = DeiTConfig(depth=2)
    model = set_paper_params(DeiT(config)).eval()
    path = export_vision(model, Checkpoint("deit", config.to_dict(), model.state_dict()), tmp_path / "deit.onnx")
    assert fused_ops_ran(path) == {"MultiMaxNoMask", "MultiMaxSigma"}
    x = torch.randn(3, 3, 224, 224)
    fused, bodies = cpu_session(path), cpu_session(path, fused=False)
    got, want = fused.run(None, {VISION_INPUT: x.numpy()})[0], bodies.run(None, {VISION_INPUT: x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4)
    report = compare_fused(path, [{VISION_INPUT: x[:1].numpy()}])
    assert report["in_use"] and report["max_abs_vs_function_bodies"] <= 1e-5 and not report["failures"]


@pytest.mark.slow
def test_text_demo_same_logits_and_greedy_text_with_and_without(lib: ort_ops.Library, tmp_path: Path) -> None:
    model, ckpt, _ = load(DEMO_DIR / TEXT_MULTIMAX)
    path = export_text(model, ckpt, tmp_path / "text.onnx")
    rng = np.random.default_rng(0)
    spec = describe_model(model)
    feeds = [validate._text_case(model, spec, rng, past)[0] for past in (0, 5, 16)]  # prefill, decode, left padding
    report = compare_fused(path, feeds)
    assert report["in_use"] and report["max_abs_vs_function_bodies"] <= 1e-5 and not report["failures"]
    fused, bodies = cpu_session(path), cpu_session(path, fused=False)
    n_layer = model.config.n_layer
    for prompt in ([72, 101, 108, 108, 111], [84], list(range(40, 72))):
        text = validate.ort_greedy(fused, prompt, 24, n_layer)
        assert text == validate.ort_greedy(bodies, prompt, 24, n_layer) == generate(model, prompt, 24, temperature=0)[0]


def test_service_backend_says_whether_the_fused_op_is_in_use(lib: ort_ops.Library) -> None:
    backend = OnnxRuntimeBackend(DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx"))
    assert backend.describe()["fused_multimax"] == {
        "in_use": True, "source": lib.source, "kernel_path": lib.kernel_paths[0]
    }  # fmt: skip
    # a checkout has no prebuilt library (a wheel's: tests/project/test_wheel.py)
    assert lib.source == ("MULTIMAX_ORT_OPS_LIB" if os.environ.get("MULTIMAX_ORT_OPS_LIB") else "built on first use")
    twin = OnnxRuntimeBackend(DEMO_DIR / VISION_SOFTMAX.replace(".pt", ".onnx"))
    assert twin.describe()["fused_multimax"] == {"in_use": False, "reason": "the model has no multimax nodes"}


def test_cli_prints_the_library_and_its_ops(lib: ort_ops.Library, capsys: pytest.CaptureFixture[str]) -> None:
    assert ort_ops_main([]) == 0
    out = capsys.readouterr().out
    assert str(lib.path) in out and "multimax::MultiMaxSigma" in out and lib.kernel_paths[0] in out
    assert f"library ({lib.source}): {lib.path}" in out


def test_unavailable_library_falls_back_with_one_log_line(
    fresh_library: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MULTIMAX_ORT_OPS", "0")
    with caplog.at_level(logging.WARNING, logger="plugins.ort_ops"):
        assert not ort_ops.register(ort.SessionOptions())
        assert not ort_ops.register(ort.SessionOptions())
        backend = OnnxRuntimeBackend(DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx"))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("plugins.ort_ops")]
    assert lines == [
        "fused MultiMax ops unavailable (turned off by MULTIMAX_ORT_OPS); onnxruntime runs the function bodies instead"
    ]
    assert backend.describe()["fused_multimax"] == {
        "in_use": False, "source": "unavailable", "reason": "turned off by MULTIMAX_ORT_OPS"
    }  # fmt: skip
    x = np.random.default_rng(0).standard_normal((2, 1, 32, 32)).astype(np.float32)
    model, _, _ = load(DEMO_DIR / VISION_MULTIMAX)
    with torch.no_grad():
        np.testing.assert_allclose(backend.run_vision(x), model(torch.from_numpy(x)).numpy(), atol=1e-4)
    path = DEMO_DIR / VISION_MULTIMAX.replace(".pt", ".onnx")
    assert compare_fused(path, [{VISION_INPUT: x}]) == {
        "in_use": False, "reason": "turned off by MULTIMAX_ORT_OPS", "failures": []
    }  # fmt: skip


def test_unbuildable_library_says_why_and_cli_exits_2(tmp_path: Path, fresh_library: None) -> None:
    env = os.environ | {"MULTIMAX_CACHE_DIR": str(tmp_path / "cache"), "ORT_INCLUDE_DIR": str(tmp_path)}
    env.pop("MULTIMAX_ORT_OPS_LIB", None)
    done = subprocess.run([sys.executable, "-m", "plugins.ort_ops"], env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert f"cannot build it: ORT_INCLUDE_DIR={tmp_path} has no onnxruntime_c_api.h" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))
