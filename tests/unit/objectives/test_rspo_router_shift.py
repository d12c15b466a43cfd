"""RSPO's router-shift ratio (issue 25 item 7, arXiv 2510.23027): γ̃ from router logits against a float64
reference, and the objectives' ratios rescaled by it before the clip, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from moe_rl import reduction as S
from moe_rl.objectives.router_shift import router_shift_ratio
from tests.unit.objectives.test_cispo_gmpo_rollout_is_kl import (
    CLIP,
    call,
    grad_of,
    make_batch,
    ppo_term,
    rows,
    toks,
)


def _routing(B=4, T=5, L=3, E=6, K=2, seed=0, shift=0.5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, L, E, generator=g)
    new = old + shift * torch.randn(B, T, L, E, generator=g)
    ids = old.topk(K, -1).indices.to(torch.uint8)
    mask = torch.rand(B, T, generator=g) < 0.8
    return new, old, ids, mask


def ref_gamma(new, old, ids, floor):
    """γ̃_it = max(exp(−1/(L·K) Σ_l Σ_{e ∈ old top-k} |log p_new(e) − log p_old(e)|), floor), float64 loops."""
    B, T, L, K = ids.shape
    out = torch.ones(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            total = 0.0
            for layer in range(L):
                zn, zo = new[b, t, layer].double(), old[b, t, layer].double()
                ln, lo = zn - torch.logsumexp(zn, 0), zo - torch.logsumexp(zo, 0)
                total += sum(abs(float(ln[e] - lo[e])) for e in ids[b, t, layer].long())
            out[b, t] = max(math.exp(-total / (L * K)), floor)
    return out


def test_router_shift_ratio_matches_float64_reference():
    """γ̃ equals the float64 formula (floored, 1 at padding), with its mean, min and floored fraction."""
    new, old, ids, mask = _routing()
    floor = 0.8
    gamma, stats = router_shift_ratio(new, old, ids, mask, floor)
    ref = ref_gamma(new, old, ids, floor)
    assert_close(gamma.double()[mask], ref[mask], atol=1e-6, rtol=0)
    assert (gamma[~mask] == 1).all() and not gamma.requires_grad
    raw = ref_gamma(new, old, ids, 0.0)[mask]
    got = S.values(stats)
    assert math.isclose(got["router_shift/gamma/mean"], float(ref[mask].mean()), abs_tol=1e-6)
    assert math.isclose(got["router_shift/gamma/min"], float(raw.min()), abs_tol=1e-6)
    assert got["router_shift/floored_frac"] == float((raw < floor).double().mean()) > 0
    same, _ = router_shift_ratio(old, old, ids, mask, floor)
    assert (same == 1).all()  # no shift, no rescaling


def _gamma_BT(mask, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (0.6 + 0.4 * torch.rand(mask.shape, generator=g, dtype=torch.float64)).where(mask, 1.0)


def test_grpo_and_gmpo_ratios_are_rescaled_before_the_clip():
    """With router_shift γ̃, grpo clips r_it·γ̃_it and gmpo (RSPO) log-clips d_it + log γ̃_it before its
    geometric mean: values and gradients match float64 references; ratio/* and the rollout IS weight
    still see the true π_old."""
    logp, old, adv, mask, _, sampler = make_batch(seed=11, gap=0.2)
    gamma = _gamma_BT(mask)
    lo, hi = CLIP["grpo"]
    loss, metrics = call("grpo", logp, old, adv, mask, router_shift=gamma)
    per_row = [[ppo_term(torch.exp(logp[i, t] - old[i, t]) * gamma[i, t], adv[i], lo, hi, None) for t in toks(mask, i)]
               for i in rows(mask)]
    expected = sum(sum(r) / len(r) for r in per_row) / len(per_row)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    _, plain = call("grpo", logp, old, adv, mask)
    assert metrics["ratio/token/mean"] == plain["ratio/token/mean"]
    _, shifted_is = call("grpo", logp, old, adv, mask, router_shift=gamma, sampler_logp=sampler, rollout_is="token_truncate")
    _, plain_is = call("grpo", logp, old, adv, mask, sampler_logp=sampler, rollout_is="token_truncate")
    assert shifted_is["rollout_is/mean"] == plain_is["rollout_is/mean"]  # the IS weight keeps the true π_old

    lo, hi = CLIP["gmpo"]
    loss, _ = call("gmpo", logp, old, adv, mask, router_shift=gamma)
    per_seq = []
    for i in rows(mask):
        sg = float(torch.sign(adv[i]))
        d = [logp[i, t] - old[i, t] + torch.log(gamma[i, t]) for t in toks(mask, i)]
        logs = [sg * torch.min(sg * dt, sg * torch.clamp(dt, -lo, hi)) for dt in d]
        per_seq.append(-torch.exp(sum(logs) / len(d)) * adv[i])
    expected = sum(per_seq) / len(per_seq)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))


def test_router_shift_of_one_changes_nothing_bitwise():
    """γ̃ = 1 everywhere gives bitwise the loss, gradient and metrics without router_shift (every objective)."""
    logp, old, adv, mask, _, _ = make_batch(seed=12)
    for name in ("grpo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "sapo_seq"):
        a, ma = call(name, logp, old, adv, mask)
        b, mb = call(name, logp, old, adv, mask, router_shift=torch.ones_like(old))
        assert torch.equal(a, b) and torch.equal(grad_of(a, logp), grad_of(b, logp)), name
        assert ma.keys() == mb.keys() and all(ma[k] == mb[k] or (ma[k] != ma[k] and mb[k] != mb[k]) for k in ma)


@pytest.mark.slow
def test_first_minibatch_has_no_router_shift_and_the_second_does():
    """In the trainer (γ̃ read from the routing traces): the on-policy mini-batch has γ̃ exactly 1, the
    off-policy one below 1 after a large update."""
    from tests.integration.test_train_loop import step_parts, update_once


    ctx, batch, plan, old = step_parts("off", extra=("objective.router_shift=true",
                                                                          "objective.router_shift_floor=0.01"))
    m1, _ = update_once(ctx, batch, plan, old, 0)
    assert m1["router_shift/gamma/mean"] == 1.0 and m1["router_shift/floored_frac"] == 0.0
    m2, _ = update_once(ctx, batch, plan, old, 1)
    assert m2["router_shift/gamma/min"] < 1.0 and m2["router_shift/gamma/mean"] < 1.0
