"""Router-logit noise, router weight noise and router margins: the faithful volatility instrument."""

import math

import pytest
import torch

from moe_rl.routing import (
    LogitNoise,
    RoutingController,
    hash_normal,
    logit_noise,
    noise_scale,
    predicted_change,
    replay_gates,
    router_margins,
)
from moe_rl.trainer import batch as batch_module
from tests.integration.test_train_loop import compose_config, first_step
from tests.unit.routing.test_routing_record_replay import routing_model, routing_tokens

SKIP = ("time/", "throughput/")


def same_rows(a: dict, b: dict) -> bool:
    keys = [k for k in a if not k.startswith(SKIP)]
    return bool(keys) and set(a) == set(b) and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys
    )


def test_hash_normal_is_standard_normal_and_deterministic():
    """hash_normal's values over 400k keys have mean 0, variance 1 and normal tails within sampling error,
    neighbouring keys are uncorrelated, and the same keys give the same values."""
    x = hash_normal(7, 3, torch.arange(400_000))
    se = 1 / math.sqrt(len(x))
    assert abs(float(x.mean())) < 5 * se and abs(float(x.var()) - 1) < 5 * math.sqrt(2) * se
    assert abs(float((x < -1.959964).double().mean()) - 0.025) < 5 * math.sqrt(0.025 * 0.975) * se
    assert abs(float(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1])) < 5 * se
    assert torch.equal(x, hash_normal(7, 3, torch.arange(400_000)))
    assert abs(float(torch.corrcoef(torch.stack([x, hash_normal(7, 4, torch.arange(400_000))]))[0, 1])) < 5 * se


def test_logit_noise_is_keyed_by_row_and_position_not_layout():
    """A token's ε depends on (seed, step, row, position, layer, expert) only: the same row in another batch
    order, or shifted by left padding, gets the same ε at the same position; another step gets another."""
    pos = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]])  # row 9 is left-padded by two
    eps = logit_noise(0, 5, torch.tensor([4, 9]), pos, 3, 8)
    swapped = logit_noise(0, 5, torch.tensor([9, 4]), pos.flip(0), 3, 8)
    assert eps.shape == (2, 4, 3, 8) and eps.dtype == torch.float32
    assert torch.equal(eps, swapped.flip(0))
    unpadded = logit_noise(0, 5, torch.tensor([9]), torch.tensor([[0, 1]]), 3, 8)
    assert torch.equal(eps[1, 2:], unpadded[0])
    assert not torch.equal(eps, logit_noise(0, 6, torch.tensor([4, 9]), pos, 3, 8))


def test_noise_scale_grows_with_staleness():
    """Growth sqrt leaves the on-policy mini-batch exact and gives mini-batch j σ·sqrt(j-1); constant gives σ."""
    assert [noise_scale(0.2, "sqrt", j) for j in range(4)] == pytest.approx([0, 0.2, 0.2 * 2**0.5, 0.2 * 3**0.5])
    assert noise_scale(0.2, "constant", 0) == 0.2
    with pytest.raises(ValueError, match="growth"):
        noise_scale(0.2, "linear", 1)


def test_logit_noise_reroutes_near_ties_to_the_runner_up_with_live_gates(tokenizer):
    """Under noise the top-k is that of logits + σε (a swapped-in expert is the one the noisy order puts
    in), the gates are replay_gates of the live logits at those ids, small σ flips only tokens whose margin it can close,
    scale 0 leaves the forward bitwise as it is, and router gradients flow."""
    model = routing_model(tokenizer, "qwen3_moe", num_experts=8, top_k=2)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=6, T=30)
    with torch.no_grad(), ctl.record(with_logits=True) as free:
        ref = model(x).logits
    eps = logit_noise(0, 0, torch.arange(6), torch.arange(30).expand(6, 30), ctl.num_layers, 8)
    sigma = 0.05
    with torch.no_grad(), ctl.record(with_logits=True) as rec, ctl.noise(LogitNoise(eps, sigma)):
        out = model(x).logits
    assert not torch.equal(out, ref)
    # Layer 0 sees the same hidden states: its noisy choice is exactly the top-k of logits + σε there.
    z0 = free.trace.router_logits_BTLE[:, :, 0]
    want = (z0 + sigma * eps[:, :, 0]).topk(2, dim=-1).indices
    assert torch.equal(rec.trace.expert_ids_BTLK[:, :, 0].long(), want)
    changed = (free.trace.expert_ids_BTLK[:, :, 0].sort(-1).values != want.sort(-1).values).any(-1)
    margins = router_margins(z0, 2)
    assert changed.any() and (~changed).any()
    # A flip needs the noise to close the gap: margin <= σ·(max ε - min ε) for every moved token.
    spread = sigma * (eps[:, :, 0].max(-1).values - eps[:, :, 0].min(-1).values)
    assert bool((margins[changed] <= spread[changed]).all())
    assert float(margins[changed].mean()) < 0.5 * float(margins[~changed].mean())  # near ties move
    assert torch.allclose(replay_gates(ctl.routers[0], z0.reshape(-1, 8), want.reshape(-1, 2)).sum(-1), torch.ones(1))
    with torch.no_grad(), ctl.noise(LogitNoise(eps, 0.0)):
        assert torch.equal(model(x).logits, ref)
    with ctl.noise(LogitNoise(eps, sigma)):
        model(x).logits.square().mean().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in ctl.routers)


def test_noise_that_does_not_fit_the_forward_raises(tokenizer):
    """Noise shaped for another [B, T] raises at the first router instead of being dropped; replay wins."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=2, T=9)
    eps = torch.randn(2, 8, ctl.num_layers, ctl.num_experts)
    with pytest.raises(ValueError, match="does not fit"), torch.no_grad(), ctl.noise(LogitNoise(eps, 1.0)):
        model(x)
    with torch.no_grad(), ctl.record() as rec:
        ref = model(x).logits
    eps = torch.randn(2, 9, ctl.num_layers, ctl.num_experts)
    with torch.no_grad(), ctl.replay(rec.trace), ctl.noise(LogitNoise(eps, 5.0)):
        assert torch.equal(model(x).logits, ref)


def test_router_margins_and_predicted_change_match_references():
    """router_margins is the k-th minus (k+1)-th sorted logit (float64 reference); predicted_change agrees
    with a Monte-Carlo of iid logit noise on logits whose only near tie is at the k / k+1 boundary."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 7, 3, 16, generator=g, dtype=torch.float64)
    ref = z.sort(-1, descending=True).values
    torch.testing.assert_close(router_margins(z, 4).double(), ref[..., 3] - ref[..., 4], rtol=0, atol=1e-6)
    # 2000 tokens, K = 2 of E = 4: experts 0, 1 far ahead of 3; 2 sits margin m below expert 1.
    m = torch.rand(2000, generator=g, dtype=torch.float64) * 0.5
    logits = torch.stack([torch.full_like(m, 10.0), torch.full_like(m, 5.0), 5.0 - m, torch.zeros_like(m)], -1)
    s = 0.3
    noisy = logits.unsqueeze(0) + s * torch.randn(200, *logits.shape, generator=g, dtype=torch.float64)
    top = noisy.topk(2, dim=-1).indices
    measured = 1 - float((top.unsqueeze(-1) == torch.tensor([0, 1]).view(1, 1, 1, 2)).any(-1).sum(-1).double().mean()) / 2
    assert predicted_change(router_margins(logits, 2), s, 2) == pytest.approx(measured, rel=0.05)
    assert predicted_change(m, 0.0, 2) == 0.0 and math.isnan(predicted_change(m[:0], s, 2))


@pytest.mark.parametrize("replay, scope", [("old", "update"), ("rollout", "update"), ("rollout", "trainer")])
def test_replay_wins_over_logit_noise_bitwise(replay, scope):
    """R2 under scope update, and R3 under either scope, give bitwise-identical metrics with σ 0 and 0.5."""
    growth = "constant" if scope == "trainer" else "sqrt"
    common = [f"routing.replay={replay}", f"routing.noise_scope={scope}", f"routing.noise_growth={growth}"]
    a, _ = first_step([*common, "routing.logit_noise=0.0"])
    b, _ = first_step([*common, "routing.logit_noise=0.5"])
    assert same_rows(a, b)


def test_logit_noise_changes_routing_as_its_scope_says():
    """Without replay, scope update leaves the on-policy mini-batch exact and moves later ones' experts
    beyond the natural change (and the margins predict more change); scope trainer perturbs the old-policy
    forward against a clean sampler (sampler/old routing and log-probs differ); R2 does not undo that."""
    clean, _ = first_step(["routing.logit_noise=0.0"])
    noisy, _ = first_step(["routing.logit_noise=0.5"])
    assert noisy["routing/expert_change/first_minibatch"] == 0.0 == clean["routing/expert_change/first_minibatch"]
    assert noisy["routing/expert_change/after_one_update"] > clean["routing/expert_change/after_one_update"] + 0.02
    assert noisy["routing/margin/predicted_change"] > clean["routing/margin/predicted_change"]
    assert noisy["rollout/reward/mean"] == clean["rollout/reward/mean"]  # the sampler is never perturbed
    trainer = ["routing.noise_scope=trainer", "routing.noise_growth=constant", "routing.logit_noise=0.5"]
    for replay in ("off", "old"):
        mism, _ = first_step([f"routing.replay={replay}", *trainer])
        base, _ = first_step([f"routing.replay={replay}"])
        assert mism["routing/rollout_vs_old/frac"] > base["routing/rollout_vs_old/frac"] + 0.02, replay
        assert mism["mismatch/logp_abs_diff/mean"] > base["mismatch/logp_abs_diff/mean"], replay
        assert mism["routing/expert_change/first_minibatch"] == 0.0  # one ε for the old and update forwards


def test_router_margins_and_logit_shift_are_logged(monkeypatch):
    """routing/margin/* (median, p10, fraction below 0.1, one median per layer) are logged in order
    (p10 <= median) and in range; an update shifts the
    router logits, and the margins predict some change from that shift."""
    g = torch.Generator().manual_seed(0)  # the untrained policy scores 0 everywhere: random advantages move it
    monkeypatch.setattr(batch_module, "group_advantages", lambda r, *_, **__: torch.randn(r.shape, generator=g))
    m, ctx = first_step([])
    assert 0 < m["routing/margin/p10"] <= m["routing/margin/median"]
    assert 0 <= m["routing/margin/frac_below_0.1"] <= 1
    assert all(f"routing/margin/layer_{i}" in m for i in range(ctx.controller.num_layers))
    assert m["routing/logit_shift/after_one_update"] > 0 and 0 < m["routing/margin/predicted_change"] < 1


def test_weight_noise_moves_router_weights_only_and_the_sampler_sees_it():
    """routing.weight_noise adds seeded noise to router weights after each update (the master copy under
    bf16 master weights too): router weights differ from the σ_w = 0 run by about σ_w·sqrt(updates), other
    weights do not differ at all, and the next step's rollout differs."""
    base = ["trainer.mini_batches=2", "trainer.lr=1e-9"]
    _, a = first_step(base)
    _, b = first_step([*base, "routing.weight_noise=0.05"])
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        if name.endswith("mlp.gate.weight"):
            assert float((pa - pb).std()) == pytest.approx(0.05 * 2**0.5, rel=0.15), name
        else:
            assert torch.equal(pa, pb), name
    from moe_rl.trainer.step import rl_step

    assert rl_step(a, 1)["routing/entropy/mean"] != rl_step(b, 1)["routing/entropy/mean"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["routing.logit_noise=-0.1"], "routing.logit_noise"),
        (["routing.noise_growth=linear"], "routing.noise_growth"),
        (["routing.noise_scope=sampler"], "routing.noise_scope"),
        (["routing.logit_noise=0.1", "routing.drift=0.1"], "routing.drift"),
        (["routing.logit_noise=0.1", "routing.noise_scope=trainer"], "routing.noise_growth=constant"),
        (["routing.logit_noise=0.1", "routing.noise_scope=trainer", "routing.noise_growth=constant",
          "trainer.reuse_sampler_logp=true"], "trainer.reuse_sampler_logp"),
        (["routing.weight_noise=0.1", "trainer.parallel=fsdp"], "routing.weight_noise"),
    ],
)
def test_noise_config_is_validated(overrides, match):
    """Bad routing-noise settings stop at start-up with a ValueError naming the field."""
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        compose_config(overrides)
