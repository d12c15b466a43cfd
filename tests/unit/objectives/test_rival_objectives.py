"""The 2026 rivals (issue 53): VESPO, LUSPO and the DPPO family against float64 re-derivations written out
here, in loss and gradient, with the edge cases each reference defines (test_cispo_gmpo_rollout_is_kl.py
holds the same references inside its generic loops; TRL's own loss is test_trl_parity.py).

Shape legend: B sequences, T positions, K top-k, V vocabulary. Log-probs here are of real distributions
(≤ 0), since DPPO reads probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from moe_rl.objectives import OBJECTIVES, TopK, validate_config
from moe_rl.objectives.common import aggregation
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.dppo import dropped
from moe_rl.objectives.surrogate import prepare
from moe_rl.objectives.topk import topk_divergence

LOG_1E8 = math.log(1e-8)


def batch(seed=0, B=10, T=8, gap=0.3, V=12, K=3):
    """Ragged float64 batch of sampled tokens from real distributions: logp (grad), old, sampler [B, T],
    adv [B] with a zero, mask (an empty row, a one-token row), and each position's top-k of the sampler."""
    g = torch.Generator().manual_seed(seed)
    logits_old = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    logits_new = logits_old + gap * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    logits_mu = logits_old + 0.5 * gap * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lp_old, lp_new, lp_mu = (x.log_softmax(-1) for x in (logits_old, logits_new, logits_mu))
    tok = torch.multinomial(lp_mu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    pick = lambda lp: lp.gather(-1, tok[..., None]).squeeze(-1)  # noqa: E731
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[0], mask[1], mask[2] = False, False, True
    mask[1, 5] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[3] = 0.0
    ids = lp_mu.topk(K, dim=-1).indices  # the sampler's top-k, with the sampled token in the last slot if absent
    absent = ~(ids == tok[..., None]).any(-1)
    ids[..., -1] = torch.where(absent, tok, ids[..., -1])
    top = TopK(lp_mu.gather(-1, ids), lp_new.gather(-1, ids))
    return pick(lp_new).requires_grad_(), pick(lp_old), pick(lp_mu), adv, mask, top


def rows(mask):
    return [i for i in range(mask.shape[0]) if mask[i].any()]


def toks(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def grad(loss, logp):
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


def token_mean(terms):
    return sum(sum(r) for r in terms) / sum(len(r) for r in terms)


# --- VESPO -------------------------------------------------------------------------------------------


def ref_vespo(logp, old, adv, mask, log_is=None, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """TRL 1.16 get_gamma_weights restated: log w = clamp(Σ clamp(d, ±20) + Σ clamp(log ω), log 1e-8, 20)."""
    terms, phis = [], []
    for i in rows(mask):
        lw = sum(max(-20.0, min(20.0, (logp[i, t] - old[i, t]).item())) for t in toks(mask, i))
        if log_is is not None:
            lw += sum(max(LOG_1E8, min(20.0, log_is[i][t])) for t in toks(mask, i))
        lw = max(LOG_1E8, min(20.0, lw))
        kk, ll = (k[0], lam[0]) if adv[i] >= 0 else (k[1], lam[1])
        phi = math.exp(ll + kk * lw - ll * math.exp(lw))
        phis.append(phi)
        terms.append([-phi * adv[i] * logp[i, t] for t in toks(mask, i)])
    return token_mean(terms), phis


def test_vespo_matches_reference_and_reports_phi():
    """VESPO's loss, gradient and policy/vespo_phi/mean equal the gamma-kernel re-derivation."""
    logp, old, _, adv, mask, _ = batch(seed=1, gap=0.4)
    loss, m = OBJECTIVES["vespo"](logp, old, adv, mask)
    expected, phis = ref_vespo(logp, old, adv, mask)
    assert_close(loss, expected)
    assert_close(grad(loss, logp), grad(expected, logp))
    assert m["policy/vespo_phi/mean"] == pytest.approx(sum(phis) / len(phis), rel=1e-12)
    assert not any(k.startswith("clip/") for k in m)


def test_vespo_w_one_gives_phi_one_and_saturates_past_20():
    """w = 1 gives φ = 1 exactly (the on-policy REINFORCE gradient); a summed log-ratio past ±20 saturates
    at the clamp (φ the kernel's value at log w = 20 or log 1e-8), with no NaN."""
    logp, old, _, adv, mask, _ = batch(seed=2)
    _, m = OBJECTIVES["vespo"](logp, logp.detach(), adv, mask)
    assert m["policy/vespo_phi/mean"] == 1.0
    for shift in (30.0, -30.0):  # every sequence's summed log-ratio beyond the clamp
        far = torch.where(mask, old - shift, old)
        loss, m = OBJECTIVES["vespo"](logp, far, adv, mask)
        expected, phis = ref_vespo(logp, far, adv, mask)
        assert torch.isfinite(loss) and torch.isfinite(grad(loss, logp)).all()
        assert_close(loss, expected)
        assert m["policy/vespo_phi/mean"] == pytest.approx(sum(phis) / len(phis), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_folds_rollout_is_in_log_space_and_a_masked_token_drops_its_sequence(mode):
    """ω enters log w (not the loss); a token the mask zeroes sends its whole sequence's φ to ~0."""
    logp, old, mu, adv, mask, _ = batch(seed=3, gap=0.2)
    mu = torch.where(mask, mu, 0.0)
    mu[4, toks(mask, 4)[0]] = old[4, toks(mask, 4)[0]] - 3.0  # ρ = e^3 leaves [1/C, C]: masked or truncated
    cap = 2.0
    loss, m = OBJECTIVES["vespo"](logp, old, adv, mask, sampler_logp=mu, rollout_is=mode, rollout_is_cap=cap)
    rho = (old - mu).exp()
    omega = rho.clamp(max=cap) if mode == "token_truncate" else torch.where((rho >= 1 / cap) & (rho <= cap), rho, 0)
    log_is = torch.where(omega > 0, omega.log(), -math.inf).tolist()
    expected, _ = ref_vespo(logp, old, adv, mask, log_is)
    assert_close(loss, expected)
    assert_close(grad(loss, logp), grad(expected, logp))
    if mode == "token_mask":
        assert grad(loss, logp)[4].abs().max() < 1e-12 * grad(loss, logp).abs().max()


def test_vespo_refuses_a_sequence_level_correction():
    """TRL folds token_truncate or token_mask only; a sequence mode is refused, not silently folded."""
    logp, old, mu, adv, mask, _ = batch(seed=4)
    with pytest.raises(ValueError, match="token_truncate or token_mask"):
        OBJECTIVES["vespo"](logp, old, adv, mask, sampler_logp=mu, rollout_is="sequence_mask")


# --- LUSPO -------------------------------------------------------------------------------------------


def test_luspo_is_gspo_weighted_by_length_for_unequal_lengths():
    """LUSPO's per-sequence term is GSPO's times n_i: value and gradient against the re-derivation."""
    logp, old, _, adv, mask, _ = batch(seed=5, gap=0.1)
    lo, hi = 0.03, 0.04
    loss, m = OBJECTIVES["luspo"](logp, old, adv, mask, clip_low=lo, clip_high=hi)
    per = []
    for i in rows(mask):
        ts = toks(mask, i)
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts))
        per.append(-torch.min(s * adv[i], s.clamp(1 - lo, 1 + hi) * adv[i]) * len(ts))
    expected = sum(per) / len(per)
    assert len({len(toks(mask, i)) for i in rows(mask)}) > 2 and m["clip/seq_frac"] > 0
    assert_close(loss, expected)
    assert_close(grad(loss, logp), grad(expected, logp))
    _, gspo = OBJECTIVES["gspo"](logp, old, adv, mask, clip_low=lo, clip_high=hi)
    assert m == pytest.approx(gspo, rel=1e-12)  # the same ratio, clip and diagnostics


# --- DPPO --------------------------------------------------------------------------------------------


def ref_dppo(logp, anchor, adv, mask, kind, lo, hi, cap=20.0, kl_tau=0.0, top=None):
    """Stable-RL's compute_policy_loss_with_mask restated per token (A ≤ 0 takes the "down" test)."""
    terms = []
    for i in rows(mask):
        row = []
        for t in toks(mask, i):
            q, a = math.exp(logp[i, t].item()), math.exp(anchor[i, t].item())
            if kind == "tv":
                up, down = q - a > hi, q - a < -lo
            else:
                if kind == "kl":
                    div = a * (math.log(a) - math.log(q)) + (1 - a) * math.log((1 - a + 1e-8) / (1 - q + 1e-8))
                else:
                    div = ref_topk(top.sampler_logp_BTK[i, t].tolist(), top.policy_logp_BTK[i, t].tolist(), kind[5:])
                up, down = div > hi and q > a, div > lo and q < a
            drop = up if adv[i] > 0 else down
            r = min(math.exp(max(-20.0, min(20.0, (logp[i, t] - anchor[i, t]).item()))), cap)
            row.append(-adv[i] * r * (not drop) * logp[i, t] + kl_tau * (logp[i, t] - anchor[i, t]) ** 2)
        terms.append(row)
    return token_mean(terms)


def ref_topk(log_p, log_q, kind):
    """Stable-RL's compute_topk_kl restated for one position's lists."""
    p, q = [math.exp(x) for x in log_p], [math.exp(x) for x in log_q]
    rest_p, rest_q = max(1 - sum(p), 1e-12), max(1 - sum(q), 1e-12)
    if kind == "kl":
        return sum(pi * (lp - lq) for pi, lp, lq in zip(p, log_p, log_q, strict=True)) + rest_p * math.log(rest_p / rest_q)
    return 0.5 * (sum(abs(pi - qi) for pi, qi in zip(p, q, strict=True)) + abs(rest_p - rest_q))


@pytest.mark.parametrize("anchor", ["old", "sampler"])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_binary_matches_reference(kind, anchor):
    """dppo_tv / dppo_kl against the old policy or the sampler: loss, gradient, and tokens dropped."""
    logp, old, mu, adv, mask, _ = batch(seed=6, gap=1.2)
    lo, hi = (0.08, 0.1) if kind == "tv" else (0.03, 0.05)
    loss, m = OBJECTIVES[f"dppo_{kind}"](logp, old, adv, mask, delta_low=lo, delta_high=hi, anchor=anchor,
                                         sampler_logp=mu)
    expected = ref_dppo(logp, old if anchor == "old" else mu, adv, mask, kind, lo, hi)
    assert_close(loss, expected)
    assert_close(grad(loss, logp), grad(expected, logp))
    assert m["clip/low_frac"] > 0 and m["clip/high_frac"] > 0  # both directions exercised
    assert m["clip/token_frac"] == pytest.approx(m["clip/low_frac"] + m["clip/high_frac"])


def test_dppo_zero_advantage_takes_the_down_branch_and_keeps_only_its_kl_gradient():
    """Â = 0: the "down" test decides its mask (as every reference), its policy gradient is 0, and with
    kl_tau only the penalty's 2τ·d / N reaches it."""
    logp, old, _, adv, mask, _ = batch(seed=7, gap=1.5)
    cfg = ObjectiveConfig(name="dppo_tv", delta_low=0.05, delta_high=0.05, kl_tau=0.01, loss_agg="token-mean")
    x = OBJECTIVES["dppo_tv"].inputs(logp, old, adv, mask, **{f: getattr(cfg, f) for f in ("delta_low", "delta_high", "kl_tau")})
    drop, shift = dropped(prepare(x, aggregation("token-mean", None)), "tv")
    zero = mask & (adv == 0)[:, None]
    assert_close(drop[zero], (shift < -0.05)[zero])
    loss, _ = OBJECTIVES["dppo_tv"].compute(x)
    expected_zero = 2 * 0.01 * (logp.detach() - old) / mask.sum()
    assert_close(grad(loss, logp)[zero], expected_zero[zero])


def test_dppo_truncates_the_weight_at_c():
    """A kept token's gradient weight is min(r, C): with C = 1.1, every kept ratio above it weighs 1.1."""
    logp, old, _, adv, mask, _ = batch(seed=8, gap=0.8)
    loss, m = OBJECTIVES["dppo_tv"](logp, old, adv, mask, ratio_cap=1.1, delta_low=1.0, delta_high=1.0)
    expected = ref_dppo(logp, old, adv, mask, "tv", 1.0, 1.0, cap=1.1)
    assert_close(grad(loss, logp), grad(expected, logp))
    r = (logp.detach() - old).exp()[mask]
    kept = m["clip/token_frac"] == 0  # δ = 1 drops nothing, so every valid token is kept
    assert kept and m["policy/dppo_truncated_frac"] == pytest.approx((r > 1.1).double().mean().item())
    assert m["policy/dppo_truncated_frac"] > 0


def test_dppo_prime_gradient_is_prime_rls_default_loss():
    """dppo_prime's settings (binary TV 0.2 on μ, C above e^20, kl_tau 1e-3, token-mean) give prime-rl's
    ∇[Σ −keep·Â·e^{logp − log μ} + τ(logp − log μ)²] / N exactly."""
    logp, _, mu, adv, mask, _ = batch(seed=9, gap=1.5)
    loss, _ = OBJECTIVES["dppo_tv"](logp, mu, adv, mask, anchor="sampler", sampler_logp=mu, delta_low=0.2,
                                    delta_high=0.2, ratio_cap=1e9, kl_tau=1e-3)
    d = logp - mu
    diff = logp.exp() - mu.exp()
    keep = torch.where(adv[:, None] > 0, diff <= 0.2, diff >= -0.2)
    prime = torch.where(mask, -keep.double() * adv[:, None] * d.exp() + 1e-3 * d.square(), 0.0).sum() / mask.sum()
    assert (mask & ~keep).any()
    assert_close(grad(loss, logp), grad(prime, logp))


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_topk_divergence_and_dppo_topk_match_reference(kind):
    """The top-k divergence (sampler's top-k plus a rest bin) and dppo_topk_* against loops."""
    logp, old, mu, adv, mask, top = batch(seed=10, gap=1.0)
    div = topk_divergence(top, kind)
    for i, t in [(2, 0), (4, 3), (7, 5)]:
        assert div[i, t].item() == pytest.approx(
            ref_topk(top.sampler_logp_BTK[i, t].tolist(), top.policy_logp_BTK[i, t].tolist(), kind), rel=1e-12)
    lo, hi = (0.05, 0.08) if kind == "tv" else (0.02, 0.04)
    loss, m = OBJECTIVES[f"dppo_topk_{kind}"](logp, old, adv, mask, anchor="sampler", sampler_logp=mu, topk=top,
                                             delta_low=lo, delta_high=hi)
    expected = ref_dppo(logp, mu, adv, mask, f"topk_{kind}", lo, hi, top=top)
    assert_close(loss, expected)
    assert_close(grad(loss, logp), grad(expected, logp))
    assert m["clip/token_frac"] > 0


@pytest.mark.parametrize("name", ["vespo", "luspo", "dppo_tv", "dppo_kl"])
def test_rivals_ignore_empty_sequences_and_mask_padding(name):
    """An added empty row changes neither loss nor metrics; padding holding NaN gets zero gradient."""
    logp, old, mu, adv, mask, _ = batch(seed=11)
    kw = {"clip_low": 0.03, "clip_high": 0.04} if name == "luspo" else {}
    loss, m = OBJECTIVES[name](logp, old, adv, mask, **kw)
    pad = torch.full((1, mask.shape[1]), float("nan"), dtype=logp.dtype)
    more, more_m = OBJECTIVES[name](torch.cat([logp, pad]), torch.cat([old, pad]), torch.cat([adv, adv[:1] + 5]),
                                    torch.cat([mask, torch.zeros_like(mask[:1])]), **kw)
    assert_close(more, loss)
    assert more_m == pytest.approx(m, rel=1e-12, nan_ok=True)
    nan_logp = torch.where(mask, logp.detach(), float("nan")).requires_grad_()
    loss, _ = OBJECTIVES[name](nan_logp, old, adv, mask, **kw)
    g = grad(loss, nan_logp)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all() and (g[mask] != 0).any()


def test_sampler_anchor_without_sampler_logp_is_refused():
    """anchor=sampler with no sampler log-probs raises instead of anchoring on π_old."""
    logp, old, _, adv, mask, _ = batch(seed=12)
    with pytest.raises(ValueError, match="anchor='sampler' needs sampler_logp"):
        OBJECTIVES["dppo_tv"](logp, old, adv, mask, anchor="sampler")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "dppo_tv", "delta_low": -0.1}, "objective.delta_low"),
        ({"name": "dppo_kl", "delta_high": -1.0}, "objective.delta_high"),
        ({"name": "dppo_tv", "ratio_cap": 0.0}, "objective.ratio_cap"),
        ({"name": "dppo_topk_tv", "anchor": "sampler", "topk": 0}, "objective.topk"),
        ({"name": "dppo_topk_kl", "anchor": "old"}, "objective.anchor"),
        ({"name": "grpo", "anchor": "sampler"}, "objective.anchor"),
        ({"name": "gspo", "kl_tau": 1e-3}, "objective.kl_tau"),
        ({"name": "dppo_tv", "anchor": "behaviour"}, "objective.anchor"),
        ({"name": "vespo", "rollout_is": "sequence_mask"}, "objective.rollout_is"),
        ({"name": "vespo", "vespo_lambda_neg": -1.0}, "objective.vespo_lambda_neg"),
        ({"name": "luspo", "loss_agg": "token-mean"}, "objective.loss_agg"),
    ],
)
def test_bad_rival_settings_fail_naming_the_field(fields, field):
    """Each bad setting of the rivals is one ValueError naming its field."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate_config(ObjectiveConfig(**fields))
