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


def test_select_topk_without_bias_is_the_routers_own_choice_and_gates(tokenizer):
    """On a Qwen3-MoE router, select_topk(logits, None or zero bias, k) gives the router's own ids, and
    replay_gates at them its own gates: the hook change of moe_rl.routing.balance is a no-op at bias 0."""
    from moe_rl.models import ModelConfig, build_model
    from moe_rl.routing import replay_gates
    from moe_rl.routing.balance import select_topk

    model = build_model(ModelConfig(num_experts=16, top_k=4), tokenizer)
    router = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter")
    hidden_NH = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits_NE, scores_NK, ids_NK = router(hidden_NH)
    for bias in (None, torch.zeros(16)):
        ids = select_topk(logits_NE, bias, 4)
        assert torch.equal(ids, ids_NK)
        torch.testing.assert_close(replay_gates(router, logits_NE, ids), scores_NK, rtol=0, atol=1e-6)


def test_select_topk_ranks_logits_plus_bias_like_a_float64_sort():
    """Ids are the k largest of logits + bias (per-expert [E] or per-token [N, E]), largest first, as a float64 argsort gives; bad k or bias shape raises."""
    from moe_rl.routing.balance import select_topk

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 32, generator=g)
    for bias in (torch.randn(32, generator=g), 0.3 * torch.randn(40, 32, generator=g)):
        expected = (logits.double() + bias.double()).argsort(dim=-1, descending=True)[:, :8]
        assert torch.equal(select_topk(logits, bias, 8), expected)
    big = torch.zeros(32)
    big[5] = 100.0
    assert (select_topk(logits, big, 1) == 5).all()  # a large enough bias wins every token
    with pytest.raises(ValueError, match="k=33"):
        select_topk(logits, None, 33)
    with pytest.raises(ValueError, match="bias shape"):
        select_topk(logits, torch.zeros(31), 2)


def test_update_bias_moves_each_expert_by_gamma_toward_the_mean_load():
    """Overloaded experts go down by γ, underloaded up by γ, ones at the mean stay (DeepSeek-V3 §2.1.2)."""
    from moe_rl.routing.balance import update_bias

    bias = torch.tensor([[0.0, 0.5, -0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    load = torch.tensor([[10.0, 0.0, 4.0, 6.0], [3.0, 3.0, 3.0, 3.0]])  # means 5 and 3
    new = update_bias(bias, load, 0.01)
    torch.testing.assert_close(new, torch.tensor([[-0.01, 0.51, -0.49, -0.01], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.equal(bias, torch.tensor([[0.0, 0.5, -0.5, 0.0], [1.0, 1.0, 1.0, 1.0]]))  # not in place
    with pytest.raises(ValueError, match="gamma"):
        update_bias(bias, load, -1.0)
