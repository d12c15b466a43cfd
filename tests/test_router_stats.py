"""Router statistics (margins, dead experts) and the aux-loss-free selection bias (moe_rl.routing.balance)."""

import pytest
import torch

from moe_rl.routing import dead_expert_fraction, margin_summary, router_margins


def _reference_margins(logits: torch.Tensor, k: int) -> torch.Tensor:
    """k-th minus (k+1)-th largest, from a full descending sort in float64, element by element."""
    flat = logits.double().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float64)
    for i, row in enumerate(flat):
        desc = sorted(row.tolist(), reverse=True)
        out[i] = desc[k - 1] - desc[k]
    return out.reshape(logits.shape[:-1])


@pytest.mark.parametrize("E, k", [(8, 2), (64, 8), (128, 8), (4, 3), (2, 1)])
def test_router_margins_match_a_float64_sorted_reference(E, k):
    """router_margins equals z_(k) - z_(k+1) from a float64 full sort, and its gradient is +1 at the k-th and -1 at the (k+1)-th expert."""
    g = torch.Generator().manual_seed(E * 10 + k)
    logits = torch.randn(3, 5, 2, E, generator=g, requires_grad=True)
    margins = router_margins(logits, k)
    assert margins.shape == (3, 5, 2) and margins.dtype == torch.float32
    torch.testing.assert_close(margins.double(), _reference_margins(logits.detach(), k), rtol=0, atol=1e-6)
    margins.sum().backward()
    order = logits.detach().argsort(dim=-1, descending=True)
    expected = torch.zeros_like(logits).scatter_(-1, order[..., k - 1 : k], 1.0).scatter_(-1, order[..., k : k + 1], -1.0)
    torch.testing.assert_close(logits.grad, expected)


def test_router_margins_are_zero_at_ties_and_reject_k_out_of_range():
    """A tie between the k-th and (k+1)-th logit gives margin 0; top_k = 0 or top_k = E raises ValueError."""
    logits = torch.tensor([[3.0, 1.0, 1.0, -2.0]])
    assert router_margins(logits, 2).tolist() == [0.0]
    assert router_margins(logits, 1).tolist() == [2.0]
    for k in (0, 4):
        with pytest.raises(ValueError, match=f"top_k={k}"):
            router_margins(logits, k)


def test_margin_summary_median_p10_and_small_fraction():
    """median, p10 (linear interpolation) and the share below 0.1 of 0.00, 0.05, ..., 0.95."""
    m = torch.arange(20) * 0.05
    s = margin_summary(m)
    assert s["median"] == pytest.approx(0.475)
    assert s["p10"] == pytest.approx(0.095)
    assert s["frac_below"] == pytest.approx(2 / 20)
    assert all(v != v for v in margin_summary(torch.tensor([])).values())  # NaN when empty


def test_dead_expert_fraction_counts_experts_below_a_share_of_uniform_load():
    """With loads [0, 1, 10, 29] (uniform 10): share 0 counts 1 expert, 0.2 counts 2, 1.0 counts 2, 1.01 counts 3."""
    load = torch.tensor([[0.0, 1.0, 10.0, 29.0], [10.0, 10.0, 10.0, 10.0]])
    assert dead_expert_fraction(load).tolist() == [0.25, 0.0]
    assert dead_expert_fraction(load, 0.2).tolist() == [0.5, 0.0]
    assert dead_expert_fraction(load, 1.0).tolist() == [0.5, 0.0]
    assert dead_expert_fraction(load, 1.01).tolist() == [0.75, 1.0]
    with pytest.raises(ValueError, match="min_share"):
        dead_expert_fraction(load, -0.1)
