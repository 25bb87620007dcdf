"""MultiMax function, its variants, the masking order, and the paper's metrics (with Prop. 4.2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from models.metrics import (
    multimax_l_fn,
    multimodality,
    softmax_fn,
    sparsemax_fn,
    sparsity,
)
from models.multimax import (
    PAPER_TABLE_7,
    PAPER_TABLE_8,
    Modulation,
    attention_probs,
    multimax,
    paper_params,
    paper_row_to_params,
    sigma,
)


def official_selu(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    # The official expression, written as the paper's eq. 6 with Pow.
    return (
        x
        + ts[0] * torch.relu(ranges[0] - x)
        + ts[1] * torch.relu(x - ranges[1])
        + ts[2] * torch.relu(ranges[2] - x) ** 2
        + ts[3] * torch.relu(x - ranges[3]) ** 2
    )


@pytest.mark.parametrize("layer", range(12))
def test_sigma_matches_official_expression_with_paper_params(layer: int) -> None:
    ranges, ts = (torch.tensor(v, dtype=torch.float64) for v in paper_params(layer))
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    torch.testing.assert_close(sigma(x, ranges, ts), official_selu(x, ranges, ts), rtol=0, atol=1e-12)


def test_paper_row_conversion() -> None:
    ranges, ts = paper_row_to_params(PAPER_TABLE_7[0])
    t_b1, t_d1, t_b2, t_d2, b1, d1, b2, d2 = PAPER_TABLE_7[0]
    assert ranges == [b1, d1, b2, d2]
    assert ts == pytest.approx([1 - t_b1, t_d1 - 1, 1 - t_b2, t_d2 - 1])
    assert paper_params(12) == paper_params(0)  # cyclic reuse beyond the table
    assert len(PAPER_TABLE_8) == 6


def test_first_order_is_piecewise_linear_from_the_paper() -> None:
    # eq. 5: t_b x + (1 - t_b) b below b, x between, t_d x + (1 - t_d) d above d.
    t_b, t_d, b, d = 2.5, 0.4, -1.0, 1.5
    ranges = torch.tensor([b, d, 0.0, 0.0])
    ts = torch.tensor([1 - t_b, t_d - 1, 0.7, 0.7])  # second-order terms must be ignored
    x = torch.linspace(-5, 5, 1001)
    expected = torch.where(x < b, t_b * x + (1 - t_b) * b, torch.where(x > d, t_d * x + (1 - t_d) * d, x))
    torch.testing.assert_close(sigma(x, ranges, ts, order=1), expected)


def test_variants_differ_and_v2_applies_affine_first() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 9)
    second, first, v2 = Modulation("second"), Modulation("first"), Modulation("v2")
    for m in (second, first, v2):
        m.set_params(*paper_params(5))
    assert not torch.allclose(second(x), first(x))
    with torch.no_grad():
        v2.t.fill_(1.7)
        v2.b.fill_(-0.3)
    torch.testing.assert_close(v2(x), first(1.7 * x - 0.3))
    assert set(dict(v2.named_parameters())) == {"ranges", "ts", "t", "b"}
    assert set(dict(second.named_parameters())) == {"ranges", "ts"}
    with pytest.raises(ValueError, match="unknown MultiMax variant"):
        Modulation("third")  # type: ignore[arg-type]


def test_multimax_is_softmax_of_sigma_and_a_distribution() -> None:
    ranges, ts = (torch.tensor(v) for v in paper_params(3))
    x = torch.randn(3, 5, 17) * 4
    p = multimax(x, ranges, ts)
    torch.testing.assert_close(p, torch.softmax(official_selu(x, ranges, ts), -1))
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 5))


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_mask_after_modulation_never_nan_and_the_other_order_does(fill: float) -> None:
    # Causal rows (the first fully masked but one) with the learned parameters of DeiT-small layer 1.
    ranges, ts = (torch.tensor(v) for v in paper_params(0))
    scores = torch.randn(6, 6) * 3
    mask = torch.full((6, 6), fill).triu(1)
    ours = multimax(scores, ranges, ts, mask=mask)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[0], torch.tensor([1.0, 0, 0, 0, 0, 0]))
    mod = Modulation("second")
    mod.set_params(*paper_params(0))
    torch.testing.assert_close(attention_probs(scores, mod, mask), ours)
    # Masking first and modulating after: the squared terms overflow (finfo.min) or hit inf*0 / inf-inf.
    wrong = torch.softmax(sigma(scores + mask, ranges, ts), -1)
    assert torch.isnan(wrong).any()


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_on_a_hand_computed_example() -> None:
    x = torch.tensor([2.0, 1.0, -1.0, -3.0])
    p = torch.softmax(x, -1)
    m = multimodality(x, softmax_fn(), eps=0.0)
    assert m.item() == pytest.approx(1 - (p[0] - p[1]).item())
    s_ref = p.min()
    expected_s = (torch.exp((s_ref - p[2]) / s_ref - 1) + torch.exp((s_ref - p[3]) / s_ref - 1)) / 2
    assert sparsity(x, softmax_fn(), eps=0.0).item() == pytest.approx(expected_s.item())


def test_metrics_nan_without_support_and_batched() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, -2.0, -5.0]])
    m = multimodality(x, softmax_fn(), eps=-10.0)
    assert not math.isnan(m[0].item()) and not math.isnan(m[1].item())
    assert math.isnan(multimodality(torch.tensor([3.0, -2.0]), softmax_fn(), eps=0.0).item())
    assert math.isnan(sparsity(torch.tensor([1.0, 2.0]), softmax_fn(), eps=0.0).item())


def test_softmax_temperature_trade_off_prop_3_5() -> None:
    # Lower temperature: less multi-modal, sparser (eps below the mean of x).
    x = torch.tensor([3.0, 2.5, 0.5, -1.0, -2.0], dtype=torch.float64)
    eps = 0.0
    s = torch.softmax(x, -1).min()
    ms = [multimodality(x, softmax_fn(t), eps).item() for t in (0.5, 1.0, 2.0)]
    ss = [sparsity(x, softmax_fn(t), eps, s).item() for t in (0.5, 1.0, 2.0)]
    assert ms[0] < ms[1] < ms[2]
    assert ss[0] > ss[1] > ss[2]


def test_sparsemax_is_sparse_and_a_distribution() -> None:
    x = torch.tensor([[2.0, 1.9, -1.0, -3.0], [0.1, 0.0, 0.05, -0.1]])
    p = sparsemax_fn()(x)
    torch.testing.assert_close(p.sum(-1), torch.ones(2))
    assert (p[0, 2:] == 0).all()
    assert (p >= 0).all()


scores_vectors = st.lists(
    st.floats(min_value=-6, max_value=6, allow_nan=False, allow_subnormal=False), min_size=3, max_size=16, unique=True
)


@settings(max_examples=300, deadline=None)
@given(
    values=scores_vectors,
    t_b=st.floats(min_value=1.05, max_value=5.0),
    b=st.floats(min_value=-4.0, max_value=4.0),
    eps_below_b=st.floats(min_value=0.0, max_value=4.0),
)
def test_prop_4_2_statement_1_multimax_l_is_sparser(values: list[float], t_b: float, b: float, eps_below_b: float):
    """t_b > 1, eps <= b: MultiMax-l is sparser than SoftMax at temperature 1 (same reference s)."""
    x = torch.tensor(values, dtype=torch.float64)
    eps = b - eps_below_b
    assume(bool((x < eps).any()))
    s = torch.softmax(x, -1).min()
    s_mm = sparsity(x, multimax_l_fn(t_b, b), eps, s).item()
    s_sm = sparsity(x, softmax_fn(1.0), eps, s).item()
    assert s_mm >= s_sm - 1e-12


def _softmax_temperature_matching_sparsity(x: torch.Tensor, target: float, eps: float, s: torch.Tensor) -> float:
    # Sparsity of softmax(x / T) rises as T falls (Prop. 3.5): bisect on T in (0, 1].
    lo, hi = 1e-3, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sparsity(x, softmax_fn(mid), eps, s).item() >= target:
            lo = mid
        else:
            hi = mid
    return lo


def test_prop_4_2_statement_2_does_not_hold_as_literally_stated() -> None:
    """With term (1) only, entries >= b keep their logits while the normaliser shrinks, so the gaps
    phi_max - phi_n grow and Definition 3.2 *decreases*. The proof in B.5 swaps an inequality; we
    pin this so nobody builds on the literal claim (the Pareto form is tested below)."""
    x = torch.tensor([3.0, 2.0, -1.0, -2.0], dtype=torch.float64)
    m_mm = multimodality(x, multimax_l_fn(3.0, 0.0), eps=0.0).item()
    m_sm = multimodality(x, softmax_fn(1.0), eps=0.0).item()
    assert m_mm < m_sm


@settings(max_examples=150, deadline=None)
@given(
    values=scores_vectors,
    t_b=st.floats(min_value=1.05, max_value=5.0),
    b=st.floats(min_value=-4.0, max_value=4.0),
    eps_below_b=st.floats(min_value=0.0, max_value=4.0),
)
def test_prop_4_2_pareto_form_multimax_l_beats_softmax_at_equal_sparsity(
    values: list[float], t_b: float, b: float, eps_below_b: float
):
    """The paper's conclusion from 4.2 (higher Pareto efficiency): a SoftMax temperature that is as
    sparse as MultiMax-l is no more multi-modal. Needs b below the top entry (otherwise
    MultiMax-l is itself a SoftMax at temperature 1/t_b)."""
    x = torch.tensor(values, dtype=torch.float64)
    eps = b - eps_below_b
    assume(bool((x < eps).any()) and bool(((x > eps) & (x < x.max())).any()) and b < x.max().item())
    s = torch.softmax(x, -1).min()
    phi_mm = multimax_l_fn(t_b, b)
    target = sparsity(x, phi_mm, eps, s).item()
    assume(sparsity(x, softmax_fn(1e-3), eps, s).item() >= target)
    temperature = _softmax_temperature_matching_sparsity(x, target, eps, s)
    m_sm = multimodality(x, softmax_fn(temperature), eps).item()
    assert multimodality(x, phi_mm, eps).item() >= m_sm - 1e-9
