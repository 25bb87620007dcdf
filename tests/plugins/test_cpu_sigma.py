"""The fused SegLU on CPU tensors (plugins.cpu_sigma): every kernel path against models.multimax.sigma, the
Llama hook, and the server's PyTorch backend using it."""

from __future__ import annotations

import pytest
import torch

from models.llama import Llama, LlamaConfig
from models.multimax import paper_params, sigma
from plugins import cpu_sigma, ort_ops

SHAPE = dict(flavor="llama", vocab_size=4099, block_size=64, n_layer=1, n_head=2, n_local_heads=1, dim=16,
             intermediate_size=24, multimax_output=True)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_every_kernel_path_equals_the_reference(lib: ort_ops.Library, isa: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if isa not in lib.kernel_paths:
        pytest.skip(f"this CPU has no {isa} (paths here: {', '.join(lib.kernel_paths)})")
    monkeypatch.setenv("MULTIMAX_ORT_ISA", isa)
    torch.manual_seed(0)
    for ranges, ts in (paper_params(0), paper_params(2), ([-1.0, 0.5, -2.0, 3.0], [0.4, -0.3, 0.2, -0.1])):
        r, t = torch.tensor(ranges), torch.tensor(ts)
        for n in (1, 7, 17, 4096, 4099):  # below, across and at multiples of the vector widths
            x = torch.randn(3, n) * 8
            want = sigma(x, r, t)
            got = cpu_sigma.sigma_cpu(x.clone(), r, t)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-5), (isa, n)


def test_writes_in_place_and_copies_a_strided_input(lib: ort_ops.Library) -> None:
    r, t = (torch.tensor(v) for v in paper_params(1))
    x = torch.randn(4, 100)
    out = cpu_sigma.sigma_cpu(x, r, t)
    assert out.data_ptr() == x.data_ptr()  # a forward's fresh logits are modulated where they are
    base = torch.randn(100, 4)
    view = base.t()  # not contiguous: modulated into a new tensor, the input untouched
    before = base.clone()
    got = cpu_sigma.sigma_cpu(view, r, t)
    assert torch.equal(base, before)
    assert torch.allclose(got, sigma(view, r, t), rtol=1e-6, atol=1e-5)


def test_unknown_or_missing_path_is_a_clear_error(lib: ort_ops.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTIMAX_ORT_ISA", "sse9")
    with pytest.raises(RuntimeError, match="sse9"):
        cpu_sigma.sigma_cpu(torch.randn(5), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="float32"):
        cpu_sigma.sigma_cpu(torch.randn(5, dtype=torch.float64), torch.zeros(4), torch.zeros(4))


def test_llama_hook_is_inference_only(lib: ort_ops.Library) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_dict(SHAPE)).eval()
    assert model.output_multimax is not None
    with torch.no_grad():
        model.output_multimax.set_params(*paper_params(3))
    ids = torch.randint(0, 4099, (2, 9))
    with torch.no_grad():
        want, _ = model(ids)
    assert cpu_sigma.use_cpu_sigma(model)
    calls = []
    fused = model.fused_sigma
    assert fused is not None
    model.fused_sigma = lambda *a: calls.append(1) or fused(*a)  # type: ignore[assignment, func-returns-value]
    with torch.no_grad():
        got, _ = model(ids)
    assert calls and torch.allclose(got, want, rtol=1e-6, atol=1e-5)
    calls.clear()
    logits, _ = model(ids)  # autograd on: the reference, whose gradient the SegLU's training needs
    logits.sum().backward()
    assert not calls and model.output_multimax.ts.grad is not None
    # a first-order or absent head gets no fused SegLU
    first = Llama(LlamaConfig.from_dict(SHAPE | {"variant": "first"}))
    plain = Llama(LlamaConfig.from_dict(SHAPE | {"multimax_output": False}))
    assert not cpu_sigma.use_cpu_sigma(first) and not cpu_sigma.use_cpu_sigma(plain)
    assert Llama.fused_sigma is None  # set on the instance only
