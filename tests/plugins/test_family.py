"""The reweighting family (plugins.family): MultiMax and the seven others through one path in every layer.

Each layer is checked to cover exactly the registry's members and op types, on the CPU: the contract and the models'
table, the references, the ONNX function bodies (inlined by onnxruntime), the onnxruntime custom ops (forcing each
ISA path), the PyTorch custom op, the ahead-of-time kernel specs and the TensorRT plugin registration (against the
stand-in for `tensorrt.plugin` of tests/plugins/test_reweight_triton.py, compiling the real kernels for sm_80).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from models import onnx_contract as contract
from models import reweighting
from models.multimax import paper_params
from plugins import family, ort_ops
from plugins.family import MEMBERS
from plugins.onnx_functions import function_protos
from plugins.ort_ops.graphs import op_model, reweighting_model
from plugins.reference import reference
from plugins.reweight_kernel_cases import ATTRS
from tests.plugins.test_plugins import _child, needs_triton
from tests.plugins.test_reweight_triton import FAKE_TRT

RANGES, TS = paper_params(3)
OPS = family.op_types()


def attributes(op: str) -> dict[str, Any]:
    """Node attributes of a test node of `op` (the paper's learned MultiMax parameters; per-head Gaussian)."""
    member = family.member_of(op)
    if member.name == "multimax":
        return {"ranges": RANGES, "ts": TS, "order": 2}
    return dict(ATTRS.get(member.name, {}))


def inputs(op: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (2, 3, 5, 9) and, for a masked op, a causal mask with finfo.min as the models write it."""
    x = torch.randn(2, 3, 5, 9, generator=torch.Generator().manual_seed(len(op))) * 3
    if not family.member_of(op).takes_mask(op):
        return x, None
    allowed = torch.ones(5, 9, dtype=torch.bool).tril(4)
    return x, torch.zeros(1, 1, 5, 9).masked_fill(~allowed, torch.finfo(torch.float32).min)


def model_bytes(op: str) -> bytes:
    attrs = attributes(op)
    if family.member_of(op).name == "multimax":
        return op_model(op, attrs["ranges"], attrs["ts"], attrs["order"])
    return reweighting_model(op, attrs)


def test_the_registry_is_the_contract_and_the_models_table() -> None:
    assert list(MEMBERS) == list(contract.FAMILY_OPS)
    assert set(MEMBERS) == set(reweighting.FUNCTIONS) - {"softmax"}
    assert family.REWEIGHT_FNS == reweighting.OTHER_FUNCTIONS  # the reweighting kernel's FN order
    assert sorted(OPS) == sorted((*contract.multimax_op_types(), *contract.reweighting_op_types()))
    assert tuple(ort_ops.OPS) == OPS
    for name, m in MEMBERS.items():
        spec = reweighting.FUNCTIONS[name]
        assert m.op == spec.op and m.op_types[:2] == spec.op_types
        assert m.attributes == contract.FAMILY_ATTRIBUTES[m.op]
        assert set(m.attributes) == ({*spec.options, *spec.params} if name != "multimax" else {*spec.params, "order"})
        assert all(family.member_of(op) is m for op in m.op_types)
    assert MEMBERS["multimax"].op_types == contract.multimax_op_types()
    with pytest.raises(ValueError, match="unknown reweighting op 'Softmax'"):
        family.member_of("Softmax")
    with pytest.raises(ValueError, match="unknown reweighting function 'nosuchmax'"):
        family.member("nosuchmax")


def test_function_protos_are_one_per_op_type_with_the_members_attributes() -> None:
    protos = function_protos(18)
    assert [p.name for p in protos] == list(OPS) and {p.domain for p in protos} == {contract.ONNX_DOMAIN}
    for p in protos:
        m = family.member_of(p.name)
        assert list(p.attribute) == [*m.attributes, *contract.PLUGIN_ATTRIBUTES]
        assert list(p.input) == (["x", "mask"] if m.takes_mask(p.name) else ["x"])
    assert [p.name for p in function_protos(18, {"MultiMaxSigma", "EntMax15NoMask", "Other"})] == [
        "MultiMaxSigma", "EntMax15NoMask"]


@pytest.mark.parametrize("op", OPS)
def test_every_op_body_inlined_by_onnxruntime_is_the_reference(op: str) -> None:
    """No custom-op library: onnxruntime inlines the family's body, which must give the member's reference."""
    x, mask = inputs(op)
    session = ort.InferenceSession(model_bytes(op), providers=["CPUExecutionProvider"])
    feeds = {"x": x.numpy()} | ({} if mask is None else {"mask": mask.numpy()})
    got = torch.from_numpy(session.run(None, feeds)[0])
    torch.testing.assert_close(got, reference(op, x, mask, **attributes(op)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_the_library_registers_and_fuses_every_op_of_the_family(
    lib: ort_ops.Library, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every op type of the registry runs as the library's fused kernel (its run counter moves), on each ISA path
    this CPU has, and agrees with the reference."""
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)
    for op in OPS:
        options = ort.SessionOptions()
        assert ort_ops.register(options)
        session = ort.InferenceSession(model_bytes(op), options, providers=["CPUExecutionProvider"])
        x, mask = inputs(op)
        runs = ort_ops.run_counts()[0]
        got = session.run(None, {"x": x.numpy()} | ({} if mask is None else {"mask": mask.numpy()}))[0]
        assert ort_ops.run_counts()[0] == runs + 1, f"{op} did not run the fused kernel"
        torch.testing.assert_close(torch.from_numpy(got), reference(op, x, mask, **attributes(op)), rtol=1e-5,
                                   atol=2e-6, msg=lambda m, op=op: f"{op}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", list(MEMBERS))
def test_the_torch_op_runs_every_member_as_its_reference_on_the_cpu(name: str) -> None:
    from plugins.torch_op import reweight, sigma

    m = MEMBERS[name]
    for op in m.op_types:
        x, mask = inputs(op)
        attrs = attributes(op)
        want = reference(op, x, mask, **attrs)
        got = sigma(x, RANGES, TS, 2) if op == contract.MULTIMAX_SIGMA_OP else reweight(name, x, mask, **attrs)
        assert torch.equal(got, want), op


def test_the_torch_op_refuses_the_modulation_alone_for_the_other_members() -> None:
    from plugins.torch_op import reweight_op

    with pytest.raises(ValueError, match="MultiMax's only"):
        reweight_op(torch.zeros(2, 3), torch.empty(0), "sparsemax", softmax=False)


def test_use_fused_kernels_routes_multimax_attention_and_nothing_on_the_cpu() -> None:
    """MultiMax attention layers get the fused op (the output layer's modulation does not: it is not attention);
    on the CPU the model's numbers do not change and the op is never called."""
    from models.gpt import GPT, GPTConfig
    from plugins.torch_op import attention_owners, use_fused_kernels

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("gpt-nano")).eval()
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():
        before, _ = model(ids)
    owners = attention_owners(model)
    assert [type(o).__name__ for o in owners] == ["Modulation"] * model.config.n_layer
    assert all(o is not model.multimax for o in owners)
    assert use_fused_kernels(model) == model.config.n_layer
    called: list[int] = []
    for owner in owners:
        vars(owner)["fused"] = lambda *a, **k: called.append(1)
    with torch.no_grad():
        after, _ = model(ids)
    assert torch.equal(before, after) and not called


def test_attention_probs_calls_the_fused_op_for_cuda_scores_at_inference_only() -> None:
    """models.multimax.attention_probs hands CUDA scores (here: a stand-in whose is_cuda is True) to the owner's
    fused implementation, with the owner's parameters and order and the mask; with grad enabled it does not."""
    from models.multimax import Modulation, attention_probs

    class CudaScores(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    owner = Modulation("second")
    seen: list[tuple[Any, ...]] = []
    vars(owner)["fused"] = lambda x, ranges, ts, order, mask: seen.append((ranges, ts, order, mask)) or x
    scores = torch.randn(1, 2, 3, 3).as_subclass(CudaScores)
    mask = torch.zeros(1, 1, 3, 3)
    with torch.no_grad():
        assert attention_probs(scores, owner, mask) is scores
    assert len(seen) == 1 and seen[0][0] is owner.ranges and seen[0][2] == 2 and seen[0][3] is mask
    attention_probs(scores, owner, mask)  # grad enabled (training): the reference
    assert len(seen) == 1


@needs_triton
def test_kernel_specs_cover_every_op_of_the_family() -> None:
    from plugins.aot import KernelSpec

    for op in OPS:
        m = family.member_of(op)
        spec = KernelSpec(op, n_cols=None, **{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in attributes(op).items()})  # fmt: skip
        assert spec.kernel == m.kernel and spec.function == m.name and spec.has_mask == m.takes_mask(op)
        assert spec.scalar_args[:2] == ("n_rows", "n_cols")
        assert ("n1" in spec.scalar_args) == m.takes_mask(op)
    with pytest.raises(ValueError, match="4 values"):
        KernelSpec("MultiMax", ranges=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="k >= 1"):
        KernelSpec("TopKSoftMax", k=0)


def test_tensorrt_spec_args_read_every_members_attributes() -> None:
    from plugins.trt_plugin import spec_args

    mm = {"ranges": np.float32(RANGES), "ts": np.float32(TS), "order": np.int32([1])}
    assert spec_args("MultiMaxSigma", mm, [2, 197]) == {"ranges": tuple(np.float32(RANGES).tolist()),
                                                        "ts": tuple(np.float32(TS).tolist()), "order": 1}
    with pytest.raises(ValueError, match="4 ranges and 4 ts"):
        spec_args("MultiMax", mm | {"ranges": np.float32([0, 1, 2])}, [2, 197])
    with pytest.raises(ValueError, match="order must be 1 or 2"):
        spec_args("MultiMax", mm | {"order": np.int32([3])}, [2, 197])
    assert spec_args("TopKSoftMax", {"k": np.int32([3])}, [2, 197]) == {"k": 3}


# The stand-in script of tests/plugins/test_reweight_triton.py, over MultiMax's three ops: the same registration loop.
MULTIMAX_TRT = (
    FAKE_TRT.replace("for op in trt_plugin.REWEIGHTING_PLUGIN_OPS:", "for op in trt_plugin.PLUGIN_OPS:")
    .replace('inputs = [x] if op.endswith("NoMask")', 'inputs = [x] if op != "MultiMax"')
    .replace('attrs = {"TopKSoftMax"',
             f'MM = {{"ranges": np.float32({RANGES}), "ts": np.float32({TS}), "order": np.int32([2])}}\n'
             'attrs = {"MultiMax": MM, "MultiMaxSigma": MM, "TopKSoftMax"')
)


@needs_triton
def test_tensorrt_registers_multimax_through_the_familys_path_against_a_stand_in() -> None:
    assert MULTIMAX_TRT != FAKE_TRT and "MM = {" in MULTIMAX_TRT
    out = json.loads(_child(MULTIMAX_TRT, interpret=False).stdout.strip().splitlines()[-1])
    assert set(out["registered"]) == {f"{contract.ONNX_DOMAIN}::{op}" for op in OPS}
    assert {case.split()[0] for case in out["rows"]} == set(contract.multimax_op_types())
    for case, r in out["rows"].items():
        op = case.split()[0]
        ins = ["x", "mask"] if op == contract.MULTIMAX_OP else ["x"]
        assert r["params"] == [*ins, *contract.MULTIMAX_ATTRIBUTES], case
        assert r["name"] == "multimax_kernel" and r["entry"] == r["inputs"] + r["scalars"] + 1, case
    assert out["rows"]["MultiMaxSigma static"]["scalars"] == 1  # n_rows: n_cols is a constant, no mask
    assert out["rows"]["MultiMax static"]["scalars"] == 6  # n_rows and the mask's row mapping
