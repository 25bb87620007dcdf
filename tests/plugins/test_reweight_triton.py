"""The Triton kernels of the reweighting functions (plugins.reweight_kernel) under Triton's interpreter, against the
PyTorch references (models.reweighting): every function, row lengths across the tile widths, the contract's masking
edge rows (fully masked, one left, soft biases), ties, large magnitudes, per-head parameters, fp16.

Like tests/plugins/test_plugins.py, the kernels run in one child process with TRITON_INTERPRET=1 (a process either
compiles or interprets `@triton.jit` functions)."""

from __future__ import annotations

import json

import pytest

from plugins.reweight_kernel_cases import CASES
from tests.plugins.test_plugins import _child, needs_triton

SCRIPT = r"""
import json
from plugins.reweight_kernel_cases import run_cases
print(json.dumps(run_cases()))
"""


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return json.loads(_child(SCRIPT, interpret=True).stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_interpreter_kernel_matches_reference(results: dict[str, dict], case: str) -> None:
    r = results[case]
    assert r["finite"], f"{case}: non-finite output"
    assert r["diff"] <= r["tol"], f"{case}: max |diff| {r['diff']:.3e} > {r['tol']:.0e}"


@needs_triton
def test_launcher_refuses_bad_arguments() -> None:
    import torch

    from plugins.reweight_kernel import fused_reweight

    x = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="unknown reweighting function 'nosuchmax'"):
        fused_reweight("nosuchmax", x)
    with pytest.raises(ValueError, match="need k >= 1"):
        fused_reweight("topk_softmax", x, k=0)
    with pytest.raises(ValueError, match="per-head values must be 1 or 3"):
        fused_reweight("gaussian", x, offset=[0.0, 1.0], scale=1.0)
    with pytest.raises(ValueError, match="rank-4 x"):
        fused_reweight("laplacian", torch.zeros(3, 4, 5), offset=[0.0, 1.0, 2.0], scale=1.0)
    with pytest.raises(ValueError, match="do not fit one program"):
        fused_reweight("sparsemax", torch.zeros(1, 5000))
    with pytest.raises(TypeError, match="supports"):
        fused_reweight("sparsemax", torch.zeros(2, 3, dtype=torch.int32))


COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from plugins.reweight_kernel import FNS, reweight_kernel
sig = {n: "*fp32" for n in ("x_ptr", "mask_ptr", "off_ptr", "scale_ptr", "out_ptr")}
sig.update({n: "i32" for n in ("n_rows", "n_cols", "n1", "n2", "ms0", "ms1", "ms2", "rows_per_head", "heads", "k")})
sig.update({"eps": "fp32", "m_attr": "fp32"})
done = []
for fn in range(len(FNS)):
    for has_mask in (False, True):
        const = {"FN": fn, "HAS_MASK": has_mask, "BLOCK_R": 4, "BLOCK_L": 256, "PARAMS_IN_MEMORY": True,
                 "OFFSETS": (0.0,), "SCALES": (1.0,)}
        src = ASTSource(fn=reweight_kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32))
        done.append([FNS[fn], has_mask, "reweight_kernel" in compiled.asm["ptx"]])
print(json.dumps(done))
"""


@needs_triton
def test_every_function_compiles_for_a_gpu() -> None:
    """The interpreter runs any Python; the compiler does not (e.g. a plain float global inside the kernel is a
    NameError there), so each function, masked and not, is compiled to PTX for sm_80 too (no GPU needed)."""
    done = json.loads(_child(COMPILE, interpret=False).stdout.strip().splitlines()[-1])
    assert len(done) == 14 and all(ptx for _, _, ptx in done), done


# --- the PyTorch custom op (plugins.torch_op) -------------------------------------------------------


@pytest.mark.parametrize("fn", ["sparsemax", "entmax15", "evsoftmax", "topk_softmax", "gaussian", "laplacian",
                                "length_scaled"])
def test_custom_op_on_cpu_is_the_reference_and_compiles_whole(fn: str) -> None:
    """CPU runs the reference; torch.compile(fullgraph=True) keeps the op as one node (no graph break), with the
    same numbers; opcheck validates the registration (fake, schema, dispatch)."""
    import torch

    from models import reweighting as rw
    from plugins.reweight_kernel_cases import ATTRS
    from plugins.torch_op import reweight, reweight_op

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=g) * 3
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 5, 7).masked_fill(torch.rand(1, 1, 5, 7, generator=g) < 0.3, low)
    attrs = ATTRS.get(fn, {})
    kw = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in attrs.items()}
    reference = rw.FUNCTIONS[fn].fn
    assert reference is not None
    for m in (None, mask):
        assert torch.equal(reweight(fn, x, m, **attrs), reference(x, m, -1, **kw))
    half = reweight(fn, x.half(), mask, **attrs)
    assert half.dtype == torch.float16 and torch.allclose(half.float(), reference(x.half().float(), mask, -1, **kw),
                                                          atol=1e-3)

    def f(a: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        return reweight(fn, a * 0.5, mm, **attrs) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask), f(x, mask), rtol=0, atol=1e-6)
    params = torch.tensor([*attrs.get("offset", []), *attrs.get("scale", [])])
    torch.library.opcheck(reweight_op, (x, params, fn, int(attrs.get("k", 8)), 0.1, 0.0, mask))


def test_attention_function_runs_the_op_only_on_cuda_at_inference() -> None:
    """use_fused_kernels sets every AttentionFunction; on the CPU (and in training) the reference still runs."""
    import torch

    from models.gpt import GPT, GPTConfig
    from plugins.torch_op import use_fused_kernels

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("gpt-nano", attention_function="gaussian")).eval()
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():
        before, _ = model(ids)
    calls: list[str] = []

    def recording(name: str, *args: object, **kw: object) -> torch.Tensor:
        calls.append(name)
        raise AssertionError("the fused kernel must not run on the CPU")

    assert use_fused_kernels(model) == 2
    for module in model.modules():
        if getattr(module, "fused", None) is not None:
            module.fused = recording
    with torch.no_grad():
        after, _ = model(ids)
    assert torch.equal(before, after) and not calls


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_custom_op_matches_the_reference_per_function() -> None:
    import torch

    from models import reweighting as rw
    from plugins.reweight_kernel_cases import ATTRS
    from plugins.torch_op import reweight

    x = torch.randn(2, 3, 64, 64, device="cuda") * 3
    mask = torch.zeros(1, 1, 64, 64, device="cuda").masked_fill(
        torch.ones(64, 64, device="cuda", dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    for fn in rw.OTHER_FUNCTIONS:
        attrs = ATTRS.get(fn, {})
        kw = {k: torch.tensor(v, device="cuda") if isinstance(v, list) else v for k, v in attrs.items()}
        reference = rw.FUNCTIONS[fn].fn
        assert reference is not None
        torch.testing.assert_close(reweight(fn, x, mask, **attrs), reference(x, mask, -1, **kw), atol=1e-5, rtol=0)


# --- the TensorRT plugins' glue, against a stand-in for tensorrt.plugin ---------------------------------

FAKE_TRT = r"""
import inspect, json, sys, types

class Expr:  # a symbolic extent: TensorRT's ShapeExpr entries, constant or not
    def __init__(self, text, value=None):
        self.text, self.value = text, value
        self.is_constant = value is not None
    def constant_value(self):
        return self.value
    def _op(self, other, sym, fn):
        o = other if isinstance(other, Expr) else Expr(str(other), other)
        if self.is_constant and o.is_constant:
            return Expr(str(fn(self.value, o.value)), fn(self.value, o.value))
        return Expr(f"({self.text}{sym}{o.text})")
    def __mul__(self, o): return self._op(o, "*", lambda a, b: a * b)
    def __floordiv__(self, o): return self._op(o, "//", lambda a, b: a // b)
    def __eq__(self, o): return self._op(o, "==", lambda a, b: int(a == b))
    __hash__ = object.__hash__

class Shape:
    def __init__(self, dims):
        self.dims = [d if isinstance(d, Expr) else Expr(str(d), d) for d in dims]
    def __getitem__(self, i): return self.dims[i]
    def numel(self):
        out = self.dims[0]
        for d in self.dims[1:]:
            out = out * d
        return out

trt = types.ModuleType("tensorrt"); trt.__version__ = "10.15-fake"
trt.float32, trt.float16, trt.bfloat16 = "F32", "F16", "BF16"
trtp = types.ModuleType("tensorrt.plugin")
registry = {"register": {}, "autotune": {}, "aot_impl": {}}
for kind in registry:
    setattr(trtp, kind, (lambda kind: lambda name: lambda f: registry[kind].setdefault(name, f))(kind))
class TensorDesc:
    def __init__(self, dims, dtype="F32"):
        self.shape_expr, self.ndim, self.dtype = Shape(dims), len(dims), dtype
    def like(self): return self
class KernelLaunchParams: pass
class SymInt32:
    def __init__(self, v): self.v = v
class SymIntExprs(list):
    @classmethod
    def from_tuple(cls, t): return cls(t)
trtp.TensorDesc, trtp.KernelLaunchParams = TensorDesc, KernelLaunchParams
trtp.SymInt32, trtp.SymIntExprs = SymInt32, SymIntExprs
trtp.AutoTuneCombination = lambda spec: spec
trtp.cdiv = lambda a, b: a // b + (a % b > 0) if isinstance(a, int) else Expr(f"cdiv({a.text},{b})")
trt.plugin = trtp
sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp

import numpy as np
from plugins import trt_plugin
from plugins.aot import entry_params
trt_plugin.device_arch = lambda: 80  # no GPU here: compile for sm_80
trt_plugin.register()
out = {"registered": sorted(registry["aot_impl"])}
attrs = {"TopKSoftMax": {"k": np.int32([3])}, "GaussianAttention": {"offset": np.float32([0.1, -0.2, 0.3]),
         "scale": np.float32([0.5, 1.0, 2.0])}, "LaplacianAttention": {"offset": np.float32([0.2]),
         "scale": np.float32([0.7])}, "LengthScaledSoftMax": {"eps": np.float32([0.05]), "m": np.float32([4.0])}}
rows = {}
shown = lambda v: (v.value if v.is_constant else v.text) if isinstance(v, Expr) else v
for op in trt_plugin.REWEIGHTING_PLUGIN_OPS:
    base = op.removesuffix("NoMask")
    a = attrs.get(base, {})
    for label, dims in (("static", [2, 3, 16, 197]), ("dynamic", [Expr("B"), 3, Expr("T"), Expr("S")])):
        x = TensorDesc(dims, "F16" if label == "static" else "F32")
        inputs = [x] if op.endswith("NoMask") else [x, TensorDesc([1, 1, dims[2], dims[3]], "F32")]
        params = list(inspect.signature(registry["register"][f"multimax::{op}"]).parameters)
        registry["register"][f"multimax::{op}"](*inputs, *a.values())
        name, ptx, launch, extra = registry["aot_impl"][f"multimax::{op}"](*inputs, *a.values(), (x,), 0)
        rows[f"{op} {label}"] = {"params": params, "name": name, "entry": len(entry_params(ptx, name)),
                                 "inputs": len(inputs), "scalars": len(extra), "block": launch.block_x,
                                 "grid": getattr(launch.grid_x, "text", launch.grid_x),
                                 "values": [shown(s.v) for s in extra]}
out["rows"] = rows
try:
    registry["register"]["multimax::GaussianAttention"](TensorDesc([2, 4, 16, 16]), TensorDesc([1, 1, 16, 16]),
                                                          *attrs["GaussianAttention"].values())
    out["bad"] = "accepted"
except ValueError as exc:
    out["bad"] = str(exc)
print(json.dumps(out))
"""


@needs_triton
def test_tensorrt_plugins_register_and_compile_every_reweighting_op_against_a_stand_in() -> None:
    """TensorRT cannot be installed here: a stand-in for `tensorrt.plugin` records what register() declares and
    calls each op's description and ahead-of-time implementation, which compiles the real kernel for sm_80. The
    PTX must take exactly the inputs, the int32 scalars the launch passes and the output."""
    from models.onnx_contract import REWEIGHTING_ATTRIBUTES

    out = json.loads(_child(FAKE_TRT, interpret=False).stdout.strip().splitlines()[-1])
    names = {f"multimax::{op}{s}" for op in REWEIGHTING_ATTRIBUTES for s in ("", "NoMask")}
    assert names | {"multimax::MultiMax", "multimax::MultiMaxNoMask", "multimax::MultiMaxSigma"} == set(
        out["registered"])
    for case, r in out["rows"].items():
        op = case.split()[0]
        inputs = ["x"] if op.endswith("NoMask") else ["x", "mask"]
        assert r["params"] == [*inputs, *REWEIGHTING_ATTRIBUTES[op.removesuffix("NoMask")]], case
        assert r["name"] == "reweight_kernel" and r["entry"] == r["inputs"] + r["scalars"] + 1, case
        assert r["block"] % 32 == 0, case
    static, dynamic = out["rows"]["GaussianAttention static"], out["rows"]["GaussianAttention dynamic"]
    assert static["values"][0] == 2 * 3 * 16 and static["values"][-2:] == [16, 3]  # rows, rows per head, heads
    assert "S" in str(dynamic["values"][1]) and isinstance(dynamic["grid"], str)  # n_cols and rows symbolic
    assert out["rows"]["SparseMaxNoMask static"]["scalars"] == 1  # n_rows only: n_cols is a constant
    assert "3 per-head values for 4 heads" in out["bad"]


def test_the_selftests_tensorrt_model_runs_as_function_bodies_and_matches_the_references() -> None:
    """The graph the GPU self-test hands the engine builder (14 reweighting nodes), checked here through
    onnxruntime's function bodies, so that on a GPU only TensorRT itself is new."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from plugins.selftest import _causal_mask, reweight_selftest_diffs, reweight_selftest_model

    model, names = reweight_selftest_model(2, 16)
    onnx.checker.check_model(model, full_check=True)
    x = torch.randn(3, 2, 16, 16) * 3
    mask = _causal_mask(16, 16, torch.device("cpu"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run(names, {"x": x.numpy(), "mask": mask.numpy()})
    out = {n: torch.from_numpy(np.asarray(v)) for n, v in zip(names, values, strict=True)}
    diffs = reweight_selftest_diffs(out, x, mask)
    assert len(diffs) == 7 and max(diffs.values()) <= 2e-6, diffs
