"""The Triton kernels of the reweighting functions (plugins.reweight_kernel) under Triton's interpreter, against the
PyTorch references (models.reweighting): every function, row lengths across the tile widths, the contract's masking
edge rows (fully masked, one left, soft biases), ties, large magnitudes, per-head parameters, fp16.

Like tests/test_plugins.py, the kernels run in one child process with TRITON_INTERPRET=1 (a process either compiles
or interprets `@triton.jit` functions)."""

from __future__ import annotations

import json

import pytest

from plugins.reweight_kernel_cases import CASES
from tests.test_plugins import _child, needs_triton

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
        const = {"FN": fn, "HAS_MASK": has_mask, "BLOCK_R": 4, "BLOCK_L": 256}
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
