"""Properties of the reweighting references (models.reweighting) against the issue-15 contract."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import reweighting as rw
from models.onnx_contract import REWEIGHTING_ATTRIBUTES, REWEIGHTING_OPS, reweighting_op_types

MIN = torch.finfo(torch.float32).min
NAMES = [n for n, s in rw.FUNCTIONS.items() if s.fn is not None]
PARAMS = {"gaussian": {"offset": 0.3, "scale": 0.7}, "laplacian": {"offset": -0.2, "scale": 1.5}}

rows = st.lists(st.floats(-8, 8, width=32), min_size=1, max_size=12)
# multiples of 1/8: a shift keeps them exact, so it cannot create or break ties (top-k, Ev-SoftMax supports)
grid_rows = st.lists(st.integers(-64, 64).map(lambda i: i / 8), min_size=1, max_size=12)


def apply(name: str, x: torch.Tensor, mask: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
    fn = rw.FUNCTIONS[name].fn
    assert fn is not None
    return fn(x, mask, -1, **{**PARAMS.get(name, {}), **kw})


def test_table_matches_the_contract() -> None:
    assert {s.op for s in rw.FUNCTIONS.values() if s.name in rw.OTHER_FUNCTIONS} == set(REWEIGHTING_OPS.values())
    for name in rw.OTHER_FUNCTIONS:
        s = rw.spec(name)
        assert s.op == REWEIGHTING_OPS[name]
        assert set(REWEIGHTING_ATTRIBUTES[s.op]) == set(s.options) | set(s.params)
    assert len(reweighting_op_types()) == 14
    with pytest.raises(ValueError, match="unknown attention function 'nope'"):
        rw.spec("nope")


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(row=rows, masked=st.lists(st.booleans(), min_size=12, max_size=12))
def test_distribution_and_masking(name: str, row: list[float], masked: list[bool]) -> None:
    x = torch.tensor([row])
    m = torch.tensor([[MIN if b else 0.0 for b in masked[: len(row)]]])
    p = apply(name, x, m)
    keep = m > rw.MASKED_BELOW
    assert not torch.isnan(p).any() and (p >= 0).all()
    assert torch.allclose(p.sum(-1), torch.ones(1), atol=1e-5)
    n = int(keep.sum())
    if n == 0:
        assert torch.equal(p, torch.full_like(p, 1 / len(row)))  # uniform, as softmax on a finfo.min mask
    else:
        assert (p[~keep] == 0).all()  # exactly 0
    if n == 1:
        assert p[keep].item() == 1.0  # exactly 1


@pytest.mark.parametrize("name", ["softmax", "sparsemax", "entmax15", "evsoftmax", "topk_softmax", "length_scaled"])
@settings(max_examples=30, deadline=None)
@given(row=grid_rows, shift=st.integers(-160, 160).map(lambda i: i / 8))
def test_shift_invariance(name: str, row: list[float], shift: float) -> None:
    x = torch.tensor([row], dtype=torch.float64)
    torch.testing.assert_close(apply(name, x + shift), apply(name, x), atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", ["gaussian", "laplacian"])
@settings(max_examples=30, deadline=None)
@given(row=grid_rows, shift=st.integers(-160, 160).map(lambda i: i / 8))
def test_adaptive_functions_are_shift_invariant_too(name: str, row: list[float], shift: float) -> None:
    # mu = mean + offset moves with the scores, so only distances to it matter
    x = torch.tensor([row], dtype=torch.float64)
    torch.testing.assert_close(apply(name, x + shift), apply(name, x), atol=1e-9, rtol=0)


def test_sparsemax_closed_forms() -> None:
    p = rw.sparsemax(torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 0.5]]))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.75, 0.25]]))
    # three entries within 1 of each other: tau = (0.6 - 1)/3, p = x - tau
    x = torch.tensor([[0.3, 0.2, 0.1]])
    torch.testing.assert_close(rw.sparsemax(x), x + 0.4 / 3)
    assert rw.sparsemax(torch.tensor([[3.0, 1.0, 0.0, -5.0]])).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_entmax15_closed_forms() -> None:
    # two entries: p1 - p2 = (x1 - x2)/2 * (sqrt p1 + sqrt p2)... solved by tau: ([1, 0]: z = [.5, 0])
    # (0.5 - tau)^2 + (0 - tau)^2 = 1 -> tau = (0.5 - sqrt(1.75))/2
    tau = (0.5 - math.sqrt(1.75)) / 2
    expected = torch.tensor([[(0.5 - tau) ** 2, tau**2]])
    torch.testing.assert_close(rw.entmax15(torch.tensor([[1.0, 0.0]])), expected)
    torch.testing.assert_close(rw.entmax15(torch.tensor([[0.0, 0.0]])), torch.tensor([[0.5, 0.5]]))
    assert rw.entmax15(torch.tensor([[2.0, 0.0]])).tolist() == [[1.0, 0.0]]  # z gap 1: the boundary


@settings(max_examples=40, deadline=None)
@given(row=st.lists(st.floats(-3, 3, width=32), min_size=2, max_size=12))
def test_entmax15_matches_its_definition_by_bisection(row: list[float]) -> None:
    z = torch.tensor(row, dtype=torch.float64) / 2
    lo, hi = float(z.max()) - 1, float(z.max())
    for _ in range(200):
        tau = (lo + hi) / 2
        lo, hi = (tau, hi) if float((z - tau).clamp(min=0).pow(2).sum()) > 1 else (lo, tau)
    expected = (z - lo).clamp(min=0).pow(2)
    torch.testing.assert_close(rw.entmax15(torch.tensor([row], dtype=torch.float64))[0], expected, atol=1e-9, rtol=0)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp(min=1e-30).log()).sum(-1)


@settings(max_examples=40, deadline=None)
@given(row=st.lists(st.floats(-4, 4, width=32), min_size=2, max_size=12))
def test_entmax15_lies_between_softmax_and_sparsemax(row: list[float]) -> None:
    x = torch.tensor([row], dtype=torch.float64)
    soft, ent, sparse = rw.softmax(x), rw.entmax15(x), rw.sparsemax(x)
    support = [int((p > 0).sum()) for p in (soft, ent, sparse)]
    assert support[0] >= support[1] >= support[2]
    h = [float(_entropy(p)) for p in (soft, ent, sparse)]
    assert h[0] + 1e-9 >= h[1] >= h[2] - 1e-9


def test_evsoftmax_zeros_below_the_mean() -> None:
    x = torch.tensor([[3.0, 1.0, 0.0, 2.0]])  # mean 1.5
    p = rw.evsoftmax(x)
    assert p[0, 1] == 0 and p[0, 2] == 0
    torch.testing.assert_close(p[0, [0, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    # the mean is over the unmasked entries only: masking the 3 moves it to 1, so the 1 is kept
    q = rw.evsoftmax(x, torch.tensor([[MIN, 0.0, 0.0, 0.0]]))
    expected = torch.zeros(4)
    expected[[1, 3]] = torch.softmax(torch.tensor([1.0, 2.0]), -1)
    torch.testing.assert_close(q[0], expected)
    assert torch.equal(rw.evsoftmax(torch.full((1, 5), 0.1)), torch.full((1, 5), 0.2))  # equal entries: all kept


def test_topk_keeps_k_and_all_ties() -> None:
    x = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0]])
    p = rw.topk_softmax(x, k=2)
    assert (p > 0).tolist() == [[True, False, True, False, False]]
    torch.testing.assert_close(p[0, [0, 2]], torch.softmax(torch.tensor([5.0, 4.0]), -1))
    ties = rw.topk_softmax(torch.tensor([[5.0, 4.0, 4.0, 1.0]]), k=2)
    assert (ties > 0).tolist() == [[True, True, True, False]]  # ties at the k-th value are all kept
    # k counts unmasked entries: the masked 5 does not take a place
    m = torch.tensor([[MIN, 0.0, 0.0, 0.0, 0.0]])
    assert (rw.topk_softmax(x, m, k=2) > 0).tolist() == [[False, False, True, True, False]]
    torch.testing.assert_close(rw.topk_softmax(x, k=9), torch.softmax(x, -1))  # k >= n: plain softmax
    with pytest.raises(ValueError, match="k >= 1"):
        rw.topk_softmax(x, k=0)


@pytest.mark.parametrize("length", [2, 5, 10, 50, 197])
@pytest.mark.parametrize(("eps", "m"), [(0.1, 0.0), (0.01, 3.0), (0.5, 1.0)])
def test_length_scale_against_the_formula(length: int, eps: float, m: float) -> None:
    mm = math.sqrt(length) if m == 0 else m
    ratio = (1 - eps) * (length - mm) / (eps * mm)
    k = 0.5 * math.log(ratio) if ratio > 1 else 0.0
    got = rw.length_scale(torch.tensor([float(length)], dtype=torch.float64), eps, m)
    assert got.item() == pytest.approx(k, rel=1e-12, abs=1e-12)
    x = torch.linspace(-1, 1, length, dtype=torch.float64)[None]
    torch.testing.assert_close(rw.length_scaled(x, eps=eps, m=m), torch.softmax(k * x, -1))


@settings(max_examples=30, deadline=None)
@given(row=rows, pad=st.integers(1, 9))
@pytest.mark.parametrize("name", NAMES)
def test_padding_changes_nothing(name: str, row: list[float], pad: int) -> None:
    """The same row with extra masked entries (right padding) gets the same weights: l is the unmasked length."""
    x = torch.tensor([row])
    padded = torch.cat([x, torch.randn(1, pad) * 5], -1)
    mask = torch.cat([torch.zeros(1, len(row)), torch.full((1, pad), MIN)], -1)
    p = apply(name, padded, mask)
    torch.testing.assert_close(p[:, : len(row)], apply(name, x), atol=1e-6, rtol=0)
    assert (p[:, len(row) :] == 0).all()


def test_gaussian_and_laplacian_normalise_the_kernel_over_the_row() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, 4.0]])
    mu = x.mean() + 0.5
    g = torch.exp(-((x - mu) ** 2) / (2 * 0.8**2))
    torch.testing.assert_close(rw.gaussian(x, offset=0.5, scale=0.8), g / g.sum())
    lap = torch.exp(-(x - mu).abs() / 0.8)
    torch.testing.assert_close(rw.laplacian(x, offset=0.5, scale=0.8), lap / lap.sum())


def test_per_head_parameters_apply_along_axis_1() -> None:
    x = torch.randn(2, 3, 4, 5)
    offset, scale = torch.tensor([0.0, 1.0, -1.0]), torch.tensor([0.5, 1.0, 2.0])
    p = rw.gaussian(x, offset=offset, scale=scale)
    for h in range(3):
        torch.testing.assert_close(p[:, h], rw.gaussian(x[:, h], offset=float(offset[h]), scale=float(scale[h])))
    with pytest.raises(ValueError, match="length 2"):
        rw.laplacian(x, offset=[0.0, 1.0])


@pytest.mark.parametrize("name", NAMES)
def test_gradients_are_finite_with_finfo_min_masks(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.float64)
    mask[..., 0, 1:] = torch.finfo(torch.float64).min  # one entry left
    mask[..., 1, :] = torch.finfo(torch.float64).min  # none left
    mask[..., 2, 3:] = torch.finfo(torch.float64).min
    kw = {"offset": torch.zeros(3, dtype=torch.float64, requires_grad=True)} if name in PARAMS else {}
    p = apply(name, x, mask, **kw)
    (p * torch.randn_like(p)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[..., 2, 3:] == 0).all()  # masked scores do not move the weights


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "gaussian", "laplacian", "length_scaled"])
def test_gradients_match_finite_differences(name: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply(name, t), (x,))


def test_options_are_checked() -> None:
    assert rw.spec("topk_softmax").check_options({"k": 3}) == {"k": 3}
    assert rw.spec("length_scaled").check_options(None) == {"eps": 0.1, "m": 0.0}
    for name, opts, match in [
        ("topk_softmax", {"k": 0}, "k >= 1"),
        ("topk_softmax", {"k": 2.5}, "must be an integer"),
        ("length_scaled", {"eps": 1.0}, r"eps in \(0, 1\)"),
        ("length_scaled", {"m": -1}, "m >= 0"),
        ("sparsemax", {"k": 2}, "unknown option"),
        ("topk_softmax", {"k": "3"}, "must be a number"),
    ]:
        with pytest.raises(ValueError, match=match):
            rw.spec(name).check_options(opts)
