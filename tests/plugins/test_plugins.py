"""Fused MultiMax kernel, its ahead-of-time compile, the PyTorch op, the TensorRT plugin and engine builder.

Triton decides when `triton` is first imported whether `@triton.jit` compiles or interprets (its own
tl.max / tl.sum are decorated then), so a process is one or the other. The CPU checks of the kernel
therefore run in one child process with TRITON_INTERPRET=1 and the sm_80 / sm_90 compile in one child
without it; this pytest process never imports triton in interpreter mode, which keeps the compiled
kernel usable for the GPU tests and for the rest of the suite.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from models.multimax import paper_params
from plugins.reference import reference_multimax, reference_sigma
from tests.paths import ROOT

LENGTHS = (1, 7, 197, 1024, 4099)
TOL = {"fp32": 1e-6, "fp16": 1e-3}
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (Linux wheels only)")
try:
    import tensorrt  # noqa: F401

    HAS_TRT = True
except ImportError:
    HAS_TRT = False

NO_GPU = "needs a CUDA GPU"
NO_TRT = "needs TensorRT (pip install 'multimax-serve[tensorrt]' on a GPU machine)"


def _child(code: str, interpret: bool, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# --- the kernel under Triton's interpreter, against the reference -------------------------------------

KINDS = ("plain", "masked", "one_left", "sigma")
INTERPRETER_CASES = (
    [
        f"{kind}-{params}-{dtype}-L{n}"
        for kind in KINDS
        for params in ("paper", "random")
        for dtype in TOL
        for n in LENGTHS
    ]
    + [f"tiled-{kind}-paper-fp32-L{n}" for kind in ("masked", "one_left") for n in (197, 1024, 4099)]
    + [f"order1-{kind}-random-{dtype}-L{n}" for kind in ("masked", "sigma") for dtype in TOL for n in (7, 197)]
    + [f"trtmask-{i}" for i in range(6)]
)

# Runs in the interpreter child; prints {case: {"diff", "tol", "finite"}} as JSON.
INTERPRETER_SCRIPT = r"""
import json, math, sys, zlib, torch
from models.multimax import paper_params
from plugins.kernel import choose_config, fused_multimax, fused_sigma, interpreting, multimax_kernel
from plugins.reference import reference_multimax, reference_sigma
from plugins.trt_plugin import mask_row_args
assert interpreting(), "TRITON_INTERPRET=1 did not reach triton"
DT = {"fp32": torch.float32, "fp16": torch.float16}
TOL = {"fp32": 1e-6, "fp16": 1e-3}

def params(kind, seed):
    if kind == "paper":
        return paper_params(seed % 12)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(4, generator=g) * 4 - 2).tolist(), (torch.rand(4, generator=g) * 2 - 1).tolist()

def masks(kind, x, g):
    b, h, t, n = x.shape
    if kind == "masked":  # 0 / finfo.min / -inf mix in x's dtype, column 0 always open, broadcast over heads
        r = torch.rand(b, 1, t, n, generator=g)
        m = torch.zeros(b, 1, t, n).masked_fill(r < 0.3, torch.finfo(x.dtype).min).masked_fill(r > 0.8, -math.inf)
        m[..., 0] = 0
        return m.to(x.dtype)
    # every column closed but one: half the rows with -inf, half with finfo.min (fp32 mask)
    m = torch.full((b, 1, t, n), -math.inf)
    m[:, :, t // 2:] = torch.finfo(torch.float32).min
    keep = torch.randint(0, n, (b, 1, t, 1), generator=g)
    return m.scatter(-1, keep, 0.0)

out = {}
for case in sys.argv[1:]:
    seed = zlib.crc32(case.encode()) % 1000
    g = torch.Generator().manual_seed(seed)
    if case.startswith("trtmask-"):
        # The TensorRT launch arguments (plugins.trt_plugin.mask_row_args) with a contiguous, un-expanded mask.
        xs, ms = [((2, 3, 4, 9), (2, 1, 4, 9)), ((2, 3, 4, 9), (1, 1, 4, 9)), ((2, 3, 4, 9), (4, 9)),
                  ((3, 4, 9), (3, 1, 9)), ((2, 3, 4, 9), (2, 3, 4, 9)), ((6, 9), (1, 9))][int(case[8:])]
        x = torch.randn(xs, generator=g) * 3
        mask = torch.randn(ms, generator=g) * 4
        a = mask_row_args(list(xs), list(ms))
        r, t = paper_params(3)
        y = torch.empty_like(x)
        multimax_kernel[(x.numel() // xs[-1],)](
            x, mask, None, x.numel() // xs[-1], xs[-1], a["n1"], a["n2"], a["ms0"], a["ms1"], a["ms2"],
            *r, *t, y, ORDER=2, HAS_MASK=True, SOFTMAX=True, PARAMS_IN_MEMORY=False, BLOCK_R=1, BLOCK_L=16)
        ref = reference_multimax(x, r, t, 2, mask)
        out[case] = {"diff": float((y - ref).abs().max()), "tol": 1e-6, "finite": bool(y.isfinite().all())}
        continue
    parts = case.split("-")
    tiled = parts[0] == "tiled"
    order = 1 if parts[0] == "order1" else 2
    if tiled or order == 1:
        parts = parts[1:]
    kind, pkind, dtype, n = parts[0], parts[1], parts[2], int(parts[3][1:])
    ranges, ts = params(pkind, seed)
    x = (torch.randn(2, 3, 2, n, generator=g) * 3).to(DT[dtype])
    cfg = choose_config(n, block_l=64) if tiled else None
    if kind == "sigma":
        y = fused_sigma(x, ranges, ts, order, config=cfg)
        ref = reference_sigma(x, ranges, ts, order)
        diff = ((y.float() - ref.float()).abs() / ref.float().abs().clamp(min=1)).max()  # relative: sigma is unbounded
    else:
        mask = None if kind == "plain" else masks(kind, x, g)
        # Tensor parameters: the in-memory path the torch op uses; lists: the scalar / constant path.
        p = (torch.tensor(ranges), torch.tensor(ts)) if pkind == "paper" else (ranges, ts)
        y = fused_multimax(x, *p, order, mask, config=cfg)
        ref = reference_multimax(x, ranges, ts, order, mask)
        diff = (y.float() - ref.float()).abs().max()
        if kind == "one_left":
            diff = max(diff, (y.float().sum(-1) - 1).abs().max(), (1 - y.float().amax(-1)).abs().max())
    out[case] = {"diff": float(diff), "tol": TOL[dtype], "finite": bool(y.isfinite().all())}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    proc = _child(INTERPRETER_SCRIPT.replace("sys.argv[1:]", repr(INTERPRETER_CASES)), interpret=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_interpreter_kernel_matches_reference(interpreter_results: dict[str, dict], case: str) -> None:
    """Random rows of every length, paper and random parameters, masked (0 / finfo.min / -inf, broadcast
    over heads), unmasked, all-but-one masked, sigma alone, order 1, forced multi-tile rows, and the
    TensorRT mask arguments: within 1e-6 (fp32) / 1e-3 (fp16) of the fp32 PyTorch reference, no NaN."""
    r = interpreter_results[case]
    assert r["finite"], f"{case}: non-finite output"
    assert r["diff"] <= r["tol"], f"{case}: max |diff| {r['diff']:.3e} > {r['tol']:.0e}"


# --- ahead-of-time compile for sm_80 / sm_90 without a GPU --------------------------------------------

AOT_SCRIPT = r"""
import json
from plugins.aot import CI_ARCHS, ci_specs, compile_kernel
rows = []
for arch in CI_ARCHS:
    for spec in ci_specs(quick=True):
        k = compile_kernel(spec, arch)
        rows.append({"arch": arch, "op": spec.op, "name": k.name, "params": k.param_types(),
                     "scalars": list(spec.scalar_args), "cubin": len(k.cubin), "threads": k.block_threads,
                     "target": [l.split()[1] for l in k.ptx.splitlines() if l.startswith(".target")][0],
                     "version": [l.split()[1] for l in k.ptx.splitlines() if l.startswith(".version")][0],
                     "entry": f".entry {k.name}(" in k.ptx})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def aot_results() -> list[dict]:
    return json.loads(_child(AOT_SCRIPT, interpret=False).stdout.strip().splitlines()[-1])


@needs_triton
def test_aot_compiles_for_sm80_and_sm90(aot_results: list[dict]) -> None:
    """PTX and cubin for sm_80 and sm_90 through triton.compile + ptxas: each op, the kernel named in
    the PTX, an old enough PTX ISA for CUDA 12 drivers, and exactly the parameters TensorRT passes
    (inputs, int32 scalars, output; Triton's scratch pointers removed)."""
    assert {(r["arch"], r["op"]) for r in aot_results} == {
        (a, op) for a in (80, 90) for op in ("MultiMax", "MultiMaxNoMask", "MultiMaxSigma")
    }
    for r in aot_results:
        assert r["entry"] and r["name"] == "multimax_kernel"
        assert r["target"] == ("sm_80" if r["arch"] == 80 else "sm_90a")
        assert float(r["version"]) <= 8.0
        assert r["cubin"] > 1000 and r["threads"] % 32 == 0
        inputs = 2 if r["op"] == "MultiMax" else 1
        types = r["params"]
        assert len(types) == inputs + len(r["scalars"]) + 1
        assert all(".ptr" in t for t in types[:inputs]) and ".ptr" in types[-1]
        assert all(t == ".u32" for t in types[inputs:-1])


@needs_triton
def test_strip_scratch_params_keeps_declared_and_rejects_used() -> None:
    from plugins.aot import _strip_scratch_params, entry_params

    decl = ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
    decl += "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3\n)\n"
    ptx = decl + "{\n\tld.param.b64 %rd1, [k_param_0];\n\tld.param.b32 %r1, [k_param_1];\n}\n"
    stripped = _strip_scratch_params(ptx, "k", 2)
    assert entry_params(stripped, "k") == [".u64 .ptr .global .align 1", ".u32"]
    assert _strip_scratch_params(ptx, "k", 4) == ptx
    with pytest.raises(RuntimeError, match="unused scratch"):
        _strip_scratch_params(ptx, "k", 1)  # k_param_1 is read: not something to drop


@needs_triton
def test_kernel_spec_validates_and_canonicalises() -> None:
    from plugins.aot import KernelSpec

    ranges, ts = paper_params(0)
    a = KernelSpec("MultiMax", "fp16", ranges=tuple(ranges), ts=tuple(ts), n_cols=None)
    assert a.scalar_args == ("n_rows", "n_cols", "n1", "n2", "ms0", "ms1", "ms2")
    assert KernelSpec("MultiMaxSigma", n_cols=197).scalar_args == ("n_rows",)
    assert hash(KernelSpec("MultiMaxSigma", ranges=(1, 2, 3, 4))) == hash(
        KernelSpec("MultiMaxSigma", ranges=(1.0, 2.0, 3.0, 4.0))
    )
    with pytest.raises(ValueError, match="unknown MultiMax op"):
        KernelSpec("Softmax")
    with pytest.raises(ValueError, match="order"):
        KernelSpec("MultiMax", order=3)


# --- the PyTorch custom op ---------------------------------------------------------------------------


def _causal(t: int, s: int) -> torch.Tensor:
    allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    return torch.zeros(t, s).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def test_torch_op_on_cpu_is_the_reference_and_compiles() -> None:
    """CPU runs the reference; torch.compile(fullgraph=True) traces through the fake implementation
    (no graph break) and returns the same numbers; opcheck validates the registration."""
    from plugins.torch_op import multimax, reweight_op, sigma

    ranges, ts = (torch.tensor(v) for v in paper_params(4))
    x = torch.randn(2, 3, 5, 8) * 3
    mask = _causal(5, 8)
    expected = reference_multimax(x, ranges, ts, 2, mask)
    assert torch.equal(multimax(x, ranges, ts, 2, mask), expected)
    assert torch.equal(sigma(x, ranges.tolist(), ts.tolist(), 1), reference_sigma(x, ranges, ts, 1))

    def f(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return multimax(a * 0.5, ranges, ts, 2, m) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask), f(x, mask), rtol=0, atol=1e-6)
    torch.library.opcheck(reweight_op, (x, torch.cat([ranges, ts]), "multimax", 8, 0.1, 0.0, mask, 2, True))
    torch.library.opcheck(reweight_op, (x.half(), torch.cat([ranges, ts]), "multimax", 8, 0.1, 0.0, None, 1, False))


# --- TensorRT plugin and engine builder (without TensorRT) -------------------------------------------


def _plugin_model(with_functions: bool = True, nested: bool = False) -> onnx.ModelProto:
    ranges, ts = paper_params(1)
    attrs = {"ranges": ranges, "ts": ts, "order": 2, "plugin_version": "1", "plugin_namespace": "multimax"}
    nodes = [
        helper.make_node("MultiMax", ["x", "mask"], ["p"], domain="multimax", plugin_name="MultiMax", **attrs),
        helper.make_node("MultiMaxSigma", ["p"], ["y"], domain="multimax", plugin_name="MultiMaxSigma", **attrs),
    ]
    if nested:  # a MultiMax node inside a control-flow subgraph counts too
        inner = helper.make_node(
            "MultiMaxNoMask", ["y"], ["z"], domain="multimax", plugin_name="MultiMaxNoMask", **attrs
        )
        z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
        branch = helper.make_graph([inner], "then", [], [z])
        plain = helper.make_graph([helper.make_node("Identity", ["y"], ["z"])], "else", [], [z])
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        nodes.append(helper.make_node("If", ["c"], ["w"], then_branch=branch, else_branch=plain))
    functions = []
    if with_functions:
        body = [helper.make_node("Softmax", ["x"], ["out"], axis=-1)]
        functions = [
            helper.make_function("multimax", op, ["x"], ["out"], body, [helper.make_opsetid("", 18)], ["ranges"])
            for op in ("MultiMax", "MultiMaxSigma", "MultiMaxNoMask")
        ]
        functions.append(helper.make_function("other", "Keep", ["x"], ["out"], body, [helper.make_opsetid("", 18)]))
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 4]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 4, 4]),
    ] + ([cond] if nested else [])
    output = helper.make_tensor_value_info("w" if nested else "y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs, [output])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("multimax", 1), helper.make_opsetid("other", 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


def test_plugin_modules_import_without_tensorrt() -> None:
    """The TensorRT modules import everywhere; TensorRT itself (and triton) only load when used."""
    code = (
        "import sys; import plugins.trt_plugin as t, plugins.build_engine, plugins.torch_op, plugins.selftest; "
        "assert 'tensorrt' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules); "
        "assert t.PLUGIN_OPS == ('MultiMax', 'MultiMaxNoMask', 'MultiMaxSigma'); "
        "assert t.PLUGIN_NAMESPACE == 'multimax'; print(t.tensorrt_unavailable())"
    )
    out = _child(code, interpret=False).stdout.strip()
    if HAS_TRT and HAS_CUDA:
        assert out == "None"
    else:  # the one TensorRT check says why not
        assert ("TensorRT is not installed" if not HAS_TRT else "needs a CUDA GPU") in out, out


@pytest.mark.skipif(HAS_TRT, reason="checks the behaviour without TensorRT")
def test_register_without_tensorrt_names_the_missing_module() -> None:
    from plugins.trt_plugin import register

    with pytest.raises(ModuleNotFoundError, match="tensorrt"):
        register()


def test_mask_row_args_broadcast_rules() -> None:
    from plugins.trt_plugin import mask_row_args

    assert mask_row_args([2, 6, 5, 9], [2, 1, 5, 9]) == {"n1": 6, "n2": 5, "ms0": 45, "ms1": 0, "ms2": 9}
    assert mask_row_args([2, 6, 5, 9], [5, 9]) == {"n1": 6, "n2": 5, "ms0": 0, "ms1": 0, "ms2": 9}
    with pytest.raises(ValueError, match="softmax axis"):
        mask_row_args([2, 6, 5, 9], [2, 1, 5, 1])
    with pytest.raises(ValueError, match="rank"):
        mask_row_args([1, 2, 6, 5, 9], [5, 9])


def test_multimax_nodes_and_function_stripping() -> None:
    from plugins.build_engine import _without_plugin_functions, multimax_nodes

    model = _plugin_model(nested=True)
    assert [n.op_type for n in multimax_nodes(model)] == ["MultiMax", "MultiMaxSigma", "MultiMaxNoMask"]
    stripped = _without_plugin_functions(model)
    assert [f.name for f in stripped.functions] == ["Keep"]  # other domains keep their bodies
    assert len(model.functions) == 4
    node = stripped.graph.node[0]
    assert {a.name for a in node.attribute} >= {"plugin_namespace", "plugin_version", "plugin_name"}


def test_profiles_cover_batch_and_sequence_axes() -> None:
    from plugins.build_engine import BuildError, Profile, _dims_profile, build_parser, profile_from_args

    vision = _dims_profile([-1, 3, 224, 224], Profile((1, 8, 64)), 1024)
    assert vision == ((1, 3, 224, 224), (8, 3, 224, 224), (64, 3, 224, 224))
    text = _dims_profile([-1, -1], Profile((1, 2, 4), (1, 64, 256)), 1024)
    assert text == ((1, 1), (2, 64), (4, 256))
    assert _dims_profile([-1, -1], Profile((1, 2, 4)), 512)[2] == (4, 512)
    args = build_parser().parse_args(["m.onnx", "--max-batch", "16", "--max-seq", "512"])
    assert profile_from_args(args) == Profile((1, 8, 16), (1, 128, 512))
    with pytest.raises(BuildError, match="min <= opt <= max"):
        Profile((4, 2, 1))


def test_build_engine_cli_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or broken file, or (on this machine) no TensorRT / GPU: exit 2 and one clear line."""
    from plugins.build_engine import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a model")
    assert main([str(tmp_path / "missing.onnx")]) == 2
    assert main([str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: {tmp_path / 'missing.onnx'}: no such file",
        f"error: {bad}: not an ONNX model (DecodeError)",
    ]
    if HAS_TRT and HAS_CUDA:
        return  # a valid model would build here: test_engine_uses_plugins_and_matches_reference covers it
    good = tmp_path / "model.onnx"
    onnx.save(_plugin_model(), str(good))
    assert main([str(good)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("TensorRT is not installed" in err[0] or "needs a CUDA GPU" in err[0])


def test_build_engine_module_entry_point() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "plugins.build_engine", "nowhere.onnx"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nowhere.onnx: no such file" in proc.stderr


@needs_triton
def test_selftest_without_gpu_runs_cpu_checks_and_says_what_it_skipped() -> None:
    if HAS_CUDA:
        pytest.skip("this machine has a GPU: the GPU self-test is test_selftest_on_gpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "plugins.selftest", "--no-aot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "CPU (Triton interpreter)" in out and "FAIL" not in out
    assert sum(line.startswith("| kernel ") for line in out.splitlines()) == 2 * len(LENGTHS)
    assert "skipped: ahead-of-time compile: --no-aot" in out
    assert "skipped: TensorRT engine: no CUDA GPU" in out
    assert "skipped: timings: no CUDA GPU" in out


# --- GPU / TensorRT (skipped here; run on GPU machines) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_kernel_matches_reference(n: int, dtype: torch.dtype, masked: bool) -> None:
    from plugins.kernel import fused_multimax

    ranges, ts = (torch.tensor(v, device="cuda") for v in paper_params(n % 12))
    x = (torch.randn(4, 6, 3, n, device="cuda") * 3).to(dtype)
    mask = _causal(3, n).cuda() if masked else None
    y = fused_multimax(x, ranges, ts, 2, mask)
    ref = reference_multimax(x, ranges, ts, 2, mask)
    assert (y.float() - ref.float()).abs().max().item() <= TOL["fp32" if dtype == torch.float32 else "fp16"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)
def test_cuda_torch_op_under_inductor() -> None:
    from plugins.torch_op import multimax

    ranges, ts = (torch.tensor(v, device="cuda") for v in paper_params(7))
    x = torch.randn(2, 6, 197, 197, device="cuda", dtype=torch.float16) * 3
    compiled = torch.compile(lambda a: multimax(a, ranges, ts, 2), fullgraph=True)
    torch.testing.assert_close(compiled(x), reference_multimax(x, ranges, ts, 2), rtol=0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)
def test_selftest_on_gpu() -> None:
    from plugins.selftest import main

    assert main(["--no-bench"]) == 0


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TRT, reason=NO_TRT)
def test_register_puts_three_creators_in_the_registry() -> None:
    import tensorrt as trt

    from plugins.trt_plugin import register

    register()
    registry = trt.get_plugin_registry()
    for op in ("MultiMax", "MultiMaxNoMask", "MultiMaxSigma"):
        assert registry.get_creator(op, "1", "multimax") is not None


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.skipif(not (HAS_TRT and HAS_CUDA), reason=f"{NO_TRT}; {NO_GPU}")
def test_engine_uses_plugins_and_matches_reference(tmp_path: Path) -> None:
    from plugins.selftest import tensorrt_rows

    rows = tensorrt_rows(tmp_path)
    assert rows and all(r.ok is not False for r in rows), [r for r in rows if r.ok is False]
    assert sum(r.ok is True for r in rows) >= 3  # at least the fp32 engine's three outputs


@needs_triton
def test_choose_config_tiles() -> None:
    from plugins.kernel import MAX_BLOCK_L, choose_config

    deit = choose_config(197)
    assert deit.block_l == 256 and deit.block_r * deit.block_l >= 1024
    assert choose_config(1).block_l == 16
    assert choose_config(100_000).block_l == MAX_BLOCK_L and choose_config(100_000).block_r == 1
    assert math.log2(choose_config(None).block_l).is_integer()
