"""Tests for CISPO, GMPO, dual-clip, rollout IS correction and the KL estimators (issue 16).

Shape legend: B = sequences, T = padded token positions. Each reference is written from its paper's
equations as a loop over valid tokens with scalar torch ops (float64) and calls no library helper, so a
bug shared with moe_rl.objectives.common cannot hide. Batches are ragged (an empty row, a one-token row,
a full row) and hold NaN/inf at padding; "small" and "large" gaps are the spread of the log-ratios.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.testing import assert_close

from moe_rl.objectives import OBJECTIVES
from moe_rl.objectives.common import KL_ESTIMATORS, ROLLOUT_IS_MODES

NAMES = sorted(n for n in OBJECTIVES if n not in ("dppo_kl", "dppo_topk_tv", "dppo_topk_kl"))
"""dppo_kl reads probabilities (log-probs above 0 here are outside its domain) and the top-k variants need
the sampler's top-k: test_rival_objectives.py tests them on inputs they are defined on."""
DELTA, CAP_C = (0.15, 0.15), 20.0  # DPPO's defaults (δ_low, δ_high, C), which `call` leaves as they are
CLIP = {
    "luspo": (0.03, 0.04),
    "vespo": (0.2, 0.28),  # not read: VESPO has no hard clip
    "dppo_tv": (0.2, 0.28),  # not read: DPPO's trust region is δ on the divergence
    "grpo": (0.2, 0.28),
    "gspo": (0.03, 0.04),
    "gspo_token": (0.03, 0.04),
    "cispo": (0.2, 0.28),
    "gmpo": (0.1, 0.15),
    "sapo": (0.2, 0.28),  # not read: SAPO has no hard clip
    "sapo_seq": (0.2, 0.28),
}  # asymmetric on purpose; gmpo's are log-space bounds
TAU = (1.0, 1.05)  # SAPO's default temperatures (TRL, verl)
BAND = (0.5, 5.0)  # IcePop's default [α, β]
GAPS = {"small": 0.05, "large": 1.5}
IS_MODES = [m for m in ROLLOUT_IS_MODES if m != "none"]
BOUND = 20.0


def make_batch(seed: int = 0, gap: float = 0.3, sampler_gap: float = 0.1, B: int = 12, T: int = 9):
    """Ragged float64 batch: logp (with grad), old, adv [B], mask, ref, sampler; NaN/inf at padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0], mask[1], mask[2] = False, False, True
    mask[1, 4] = True
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + gap * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler = old + sampler_gap * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    for x, garbage in (
        (logp, float("nan")),
        (old, -float("inf")),
        (ref, float("inf")),
        (sampler, float("nan")),
    ):
        x[~mask] = garbage
    return logp.requires_grad_(), old, adv, mask, ref, sampler


def rows(mask):
    return [i for i in range(mask.shape[0]) if mask[i].any()]


def toks(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def clamp(x: float) -> float:
    return max(-BOUND, min(BOUND, x))


def ref_is(old, sampler, mask, mode, cap, band=BAND):
    """{(i, t): (ρ, ω)} from the TIS/MIS definitions: ρ = π_old/π_sampler per token, per sequence (the
    product), or the sequence's geometric mean (Geo-IS, verl rollout_rs=geometric); IcePop masks tokens
    outside [α, β]."""
    out = {}
    for i in rows(mask):
        seq_diff = sum(old[i, t].item() - sampler[i, t].item() for t in toks(mask, i))
        for t in toks(mask, i):
            if mode == "none":
                out[i, t] = (1.0, 1.0)
                continue
            diff = {"sequence": seq_diff, "geo_sequence": seq_diff / len(toks(mask, i))}.get(
                mode.rsplit("_", 1)[0], old[i, t].item() - sampler[i, t].item())
            rho = math.exp(clamp(diff))
            lo, hi = band if mode == "icepop" else (1 / cap, cap)
            omega = min(rho, cap) if mode.endswith("truncate") else (rho if lo <= rho <= hi else 0.0)
            out[i, t] = (rho, omega)
    return out


def agg(per_row, loss_agg, max_len=None):
    """per_row: list of lists of per-token terms of non-empty rows."""
    if loss_agg == "token-mean":
        return sum(sum(r) for r in per_row) / sum(len(r) for r in per_row)
    if loss_agg == "seq-mean-token-sum-norm":
        return sum(sum(r) / max_len for r in per_row) / len(per_row)
    return sum(sum(r) / len(r) for r in per_row) / len(per_row)


def ppo_term(ratio, a, lo, hi, c):
    """PPO's clipped term, and dual-clip's cap min(ℓ, −c·a) for a < 0 (Ye et al. 2020, Eq. 6)."""
    term = -torch.min(ratio * a, torch.clamp(ratio, 1 - lo, 1 + hi) * a)
    return torch.min(term, -c * a) if (c is not None and a < 0) else term


def ref_loss(
    name, logp, old, adv, mask, lo, hi, *, loss_agg="seq-mean-token-mean", c=None, weights=None, max_len=None
):
    """Each objective's loss from its paper, times the rollout IS weights ω (default 1)."""
    w = weights or {(i, t): (1.0, 1.0) for i in rows(mask) for t in toks(mask, i)}
    per_row, per_seq = [], []
    for i in rows(mask):
        ts, a = toks(mask, i), adv[i]
        mean_w = sum(w[i, t][1] for t in ts) / len(ts)
        d = [logp[i, t] - old[i, t] for t in ts]
        if name == "grpo":
            per_row.append(
                [ppo_term(torch.exp(dt), a, lo, hi, c) * w[i, t][1] for dt, t in zip(d, ts, strict=True)]
            )
        elif name == "gspo_token":
            s = torch.exp(sum(d).detach() / len(ts))
            per_row.append(
                [
                    ppo_term(s * torch.exp(logp[i, t] - logp[i, t].detach()), a, lo, hi, c) * w[i, t][1]
                    for t in ts
                ]
            )
        elif name == "cispo":  # MiniMax-M1: −sg(clip(r, 1 − ε_low, 1 + ε_high)) Â log π
            per_row.append(
                [
                    -torch.clamp(torch.exp(dt).detach(), 1 - lo, 1 + hi) * a * logp[i, t] * w[i, t][1]
                    for dt, t in zip(d, ts, strict=True)
                ]
            )
        elif name == "gspo":
            per_seq.append(ppo_term(torch.exp(sum(d) / len(ts)), a, lo, hi, c) * mean_w)
        elif name == "sapo":  # SAPO: −σ(τ(r − 1))·4/τ·Â, τ by Â's sign (arXiv 2511.20347)
            tau = TAU[0] if a > 0 else TAU[1]
            per_row.append([-torch.sigmoid(tau * (torch.exp(dt) - 1)) * 4 / tau * a * w[i, t][1]
                            for dt, t in zip(d, ts, strict=True)])
        elif name == "sapo_seq":  # the same gate on GSPO's s_i
            tau = TAU[0] if a > 0 else TAU[1]
            per_seq.append(-torch.sigmoid(tau * (torch.exp(sum(d) / len(ts)) - 1)) * 4 / tau * a * mean_w)
        elif name == "gmpo":  # GMPO: Π_t min(r^σ, clip(r, e^−lo, e^hi)^σ)^(σ/|y|), σ = sign(Â)
            sg = float(torch.sign(a))
            logs = [sg * torch.min(sg * dt, sg * torch.clamp(dt, -lo, hi)) for dt in d]
            per_seq.append(-torch.exp(sum(logs) / len(ts)) * a * mean_w)
        elif name == "luspo":  # LUSPO: GSPO's term times |y_i|
            per_seq.append(ppo_term(torch.exp(sum(d) / len(ts)), a, lo, hi, c) * len(ts) * mean_w)
        elif name == "vespo":  # VESPO: φ(w) = w^k e^{λ(1−w)}, w the product ratio with ω folded in (log space)
            floor = math.log(1e-8)
            log_w = sum(clamp(dt.item()) for dt in d)
            log_w += sum(max(floor, min(BOUND, math.log(w[i, t][1]) if w[i, t][1] > 0 else -math.inf)) for t in ts)
            log_w = max(floor, min(BOUND, log_w))
            k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
            phi = math.exp(k * log_w) * math.exp(lam * (1 - math.exp(log_w)))
            per_row.append([-phi * a * logp[i, t] for t in ts])  # ω is inside φ, not multiplied again
        elif name == "dppo_tv":  # DPPO binary TV: drop where p − p_old leaves δ in Â's direction
            terms = []
            for dt, t in zip(d, ts, strict=True):
                shift = math.exp(logp[i, t].item()) - math.exp(old[i, t].item())
                drop = shift > DELTA[1] if a > 0 else shift < -DELTA[0]
                weight = min(math.exp(clamp(dt.item())), CAP_C)
                terms.append(-a * weight * (not drop) * logp[i, t] * w[i, t][1])
            per_row.append(terms)
    if per_seq:
        return sum(per_seq) / len(per_seq)
    return agg(per_row, loss_agg, max_len)


def grad_of(loss, logp):
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


def call(name, logp, old, adv, mask, **kw):
    lo, hi = CLIP[name]
    kw.setdefault("loss_agg", "seq-mean-token-mean")
    return OBJECTIVES[name](logp, old, adv, mask, clip_low=lo, clip_high=hi, **kw)


# --- CISPO -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gap", sorted(GAPS))
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_cispo_matches_reference(loss_agg, gap):
    """CISPO's value and gradient match the paper's −sg(clip(r)) Â log π for every loss_agg and gap."""
    logp, old, adv, mask, _, _ = make_batch(seed=1, gap=GAPS[gap])
    loss, metrics = call("cispo", logp, old, adv, mask, loss_agg=loss_agg, max_len=11)
    expected = ref_loss("cispo", logp, old, adv, mask, *CLIP["cispo"], loss_agg=loss_agg, max_len=11)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    if gap == "large":
        assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0


def test_cispo_gradient_is_clipped_weight_times_advantage():
    """∇ℓ_it = −clip(r_it) Â_i / N per token under token-mean: truncated weights keep their gradient."""
    logp, old, adv, mask, _, _ = make_batch(seed=2, gap=1.0)
    loss, _ = call("cispo", logp, old, adv, mask, loss_agg="token-mean")
    lo, hi = CLIP["cispo"]
    r = torch.exp(logp.detach() - old).clamp(1 - lo, 1 + hi)
    expected = torch.where(mask, -r * adv[:, None] / mask.sum(), 0.0)
    assert_close(grad_of(loss, logp), expected)
    grpo_loss, _ = call("grpo", logp, old, adv, mask, loss_agg="token-mean")
    zero_in_grpo = mask & (grad_of(grpo_loss, logp) == 0)
    assert zero_in_grpo.any() and (grad_of(loss, logp)[zero_in_grpo] != 0).all()  # GRPO drops, CISPO keeps


def test_cispo_clip_low_one_means_no_lower_bound():
    """clip_low = 1 (the paper's no lower bound) leaves a tiny ratio unclipped and counts no low clip."""
    logp, old, adv, mask, _, _ = make_batch(seed=3, gap=2.0)
    loss, metrics = OBJECTIVES["cispo"](
        logp, old, adv, mask, clip_low=1.0, clip_high=4.0, loss_agg="token-mean"
    )
    r = torch.exp(logp.detach() - old).clamp(max=5.0)
    assert (r[mask] < 0.2).any()
    assert_close(grad_of(loss, logp), torch.where(mask, -r * adv[:, None] / mask.sum(), 0.0))
    assert metrics["clip/low_frac"] == 0.0 and metrics["clip/high_frac"] > 0


# --- GMPO --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gap", sorted(GAPS))
def test_gmpo_matches_reference(gap):
    """GMPO's value and gradient match the paper's clipped geometric mean at small and large gaps."""
    logp, old, adv, mask, _, _ = make_batch(seed=4, gap=GAPS[gap])
    loss, metrics = call("gmpo", logp, old, adv, mask)
    expected = ref_loss("gmpo", logp, old, adv, mask, *CLIP["gmpo"])
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    if gap == "large":
        assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0


def test_gmpo_gradient_zero_exactly_at_clipped_tokens():
    """A token whose log-space clip is active gets zero gradient; the others −ρ_i Â_i / |y_i| / B'."""
    logp, old, adv, mask, _, _ = make_batch(seed=5, gap=0.4)
    lo, hi = CLIP["gmpo"]
    loss, metrics = call("gmpo", logp, old, adv, mask)
    d = logp.detach() - old
    sign = torch.sign(adv)[:, None]
    clipped = mask & (((sign > 0) & (d > hi)) | ((sign < 0) & (d < -lo)))
    d_hat = torch.where(mask, sign * torch.minimum(sign * d, sign * d.clamp(-lo, hi)), 0.0)
    n = mask.sum(-1).clamp(min=1)
    rho = torch.exp(d_hat.sum(-1) / n)
    expected = torch.where(mask & ~clipped, (-rho * adv / n / len(rows(mask)))[:, None], 0.0)
    assert clipped.any() and (mask & ~clipped).any()
    assert_close(grad_of(loss, logp), expected)
    assert metrics["clip/token_frac"] == pytest.approx(clipped.sum().item() / mask.sum().item())


def test_gmpo_equals_gspo_when_nothing_is_clipped():
    """With clips too wide to bind, GMPO's geometric mean is GSPO's s_i: same loss and gradient."""
    logp, old, adv, mask, _, _ = make_batch(seed=6, gap=0.25)
    gmpo, _ = OBJECTIVES["gmpo"](logp, old, adv, mask, clip_low=0.999, clip_high=50.0)
    gspo, _ = OBJECTIVES["gspo"](logp, old, adv, mask, clip_low=0.99, clip_high=50.0)
    # gmpo's log-space bound −0.999 (ratio 0.368) and gspo's ratio bound 0.01 bind nothing here
    assert torch.exp(logp.detach() - old)[mask].min() > 0.37
    assert_close(gmpo, gspo)
    assert_close(grad_of(gmpo, logp), grad_of(gspo, logp))


# --- dual-clip ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in NAMES if OBJECTIVES[n].dual_clip])
def test_dual_clip_matches_reference(name):
    """With clip_ratio_c, a negative advantage's loss is min(ℓ, −c·Â): value, gradient and clip/dual_frac."""
    logp, old, adv, mask, _, _ = make_batch(seed=7, gap=1.5)
    if name != "grpo":  # give whole sequences ratios far from 1 so s_i > c happens
        old = torch.where(
            mask,
            old
            - 2.0
            * torch.sign(
                torch.randn(mask.shape[0], 1, dtype=old.dtype, generator=torch.Generator().manual_seed(0))
            ),
            old,
        )
    c = 1.5
    loss, metrics = call(name, logp, old, adv, mask, clip_ratio_c=c)
    expected = ref_loss(name, logp, old, adv, mask, *CLIP[name], c=c)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    ratio = (
        torch.exp(logp.detach() - old)
        if name == "grpo"
        else torch.exp(
            torch.where(mask, logp.detach() - old, 0.0).sum(-1, keepdim=True)
            / mask.sum(-1, keepdim=True).clamp(min=1)
        )
    )
    capped = mask & (adv[:, None] < 0) & (ratio > c)
    assert capped.any()
    assert metrics["clip/dual_frac"] == pytest.approx(capped.sum().item() / mask.sum().item())
    assert (grad_of(loss, logp)[capped] == 0).all()


@pytest.mark.parametrize("name", [n for n in NAMES if OBJECTIVES[n].dual_clip])
def test_dual_clip_changes_nothing_when_no_ratio_exceeds_c(name):
    """Dual-clip with c above every ratio gives bitwise the same loss as without, and dual_frac 0."""
    logp, old, adv, mask, _, _ = make_batch(seed=8, gap=0.05)
    plain, plain_metrics = call(name, logp, old, adv, mask)
    dual, metrics = call(name, logp, old, adv, mask, clip_ratio_c=3.0)
    assert torch.equal(plain, dual) and metrics["clip/dual_frac"] == 0.0
    assert "clip/dual_frac" not in plain_metrics


# --- rollout importance-sampling correction ----------------------------------------------------------


def is_cases(modes=IS_MODES):
    """(name, mode) pairs: VESPO folds token-level corrections only (as TRL)."""
    return [(n, m) for n in NAMES for m in modes if n != "vespo" or m in ("token_truncate", "token_mask")]


@pytest.mark.parametrize("gap", sorted(GAPS))
@pytest.mark.parametrize(("name", "mode"), is_cases())
def test_rollout_is_matches_reference(name, mode, gap):
    """Every objective times the TIS/MIS weight matches the reference in value, gradient and rollout_is/*."""
    sampler_gap = GAPS[gap] if mode.startswith("token") else GAPS[gap] / 3  # sequences sum their gaps
    logp, old, adv, mask, _, sampler = make_batch(seed=9, sampler_gap=sampler_gap)
    cap = 1.3
    loss, metrics = call(
        name, logp, old, adv, mask, sampler_logp=sampler, rollout_is=mode, rollout_is_cap=cap
    )
    w = ref_is(old, sampler, mask, mode, cap)
    expected = ref_loss(name, logp, old, adv, mask, *CLIP[name], weights=w)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    rhos = [rho for rho, _ in w.values()]
    lo, hi = BAND if mode == "icepop" else (1 / cap, cap)
    outside = [rho > cap if mode.endswith("truncate") else not lo <= rho <= hi for rho in rhos]
    frac_key = "rollout_is/clipped_frac" if mode.endswith("truncate") else "rollout_is/masked_frac"
    assert {k for k in metrics if k.startswith("rollout_is/")} == {
        "rollout_is/mean",
        "rollout_is/max",
        frac_key,
        "rollout_is/ess",  # issue 25: with any correction on
        "rollout_is/chi2",
    }
    assert metrics["rollout_is/mean"] == pytest.approx(sum(rhos) / len(rhos), rel=1e-12)
    assert metrics["rollout_is/max"] == pytest.approx(max(rhos), rel=1e-12)
    assert metrics[frac_key] == pytest.approx(sum(outside) / len(outside), rel=1e-12)
    if gap == "large":
        assert 0 < metrics[frac_key] < 1  # the truncation or mask is exercised, not everywhere


@pytest.mark.parametrize(("name", "mode"), is_cases())
def test_rollout_is_with_sampler_equal_to_old_changes_nothing(name, mode):
    """When the sampler's log-probs are the old policy's, every weight is 1: loss as with rollout_is=none."""
    logp, old, adv, mask, _, _ = make_batch(seed=10)
    plain, plain_metrics = call(name, logp, old, adv, mask)
    loss, metrics = call(name, logp, old, adv, mask, sampler_logp=old.clone(), rollout_is=mode)
    assert_close(loss, plain, rtol=1e-15, atol=1e-15)
    assert metrics["rollout_is/mean"] == 1.0 and metrics["rollout_is/max"] == 1.0
    assert not any(k.startswith("rollout_is/") for k in plain_metrics)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("mode", IS_MODES)
def test_rollout_is_extreme_sampler_gap_stays_finite(mode, sign):
    """A sampler 1e4 nats off on a whole sequence and on single tokens gives finite loss, gradient, metrics."""
    logp, old, adv, mask, _, sampler = make_batch(seed=11)
    sampler = torch.where(mask, sampler, 0.0)
    sampler[2, :] += sign * 1e4
    sampler[4:, 3] += sign * 1e4
    for name in (n for n, m in is_cases([mode])):
        loss, metrics = call(name, logp, old, adv, mask, sampler_logp=sampler, rollout_is=mode)
        assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()
        assert all(math.isfinite(v) for v in metrics.values())
        if mode.endswith("mask"):
            assert metrics["rollout_is/masked_frac"] > 0


def test_sequence_mask_drops_whole_sequences():
    """sequence_mask zeroes the gradient of every token of a sequence whose ρ_i leaves [1/C, C], and only those."""
    logp, old, adv, mask, _, sampler = make_batch(seed=12, sampler_gap=0.3)
    cap = 1.5
    loss, _ = call(
        "grpo", logp, old, adv, mask, sampler_logp=sampler, rollout_is="sequence_mask", rollout_is_cap=cap
    )
    rho = torch.exp(torch.where(mask, old - sampler, 0.0).sum(-1))
    dropped = torch.tensor([bool(mask[i].any()) and not 1 / cap <= rho[i] <= cap for i in range(len(rho))])
    grad = grad_of(loss, logp)
    assert dropped.any() and (~dropped & mask.any(-1)).any()
    assert (grad[dropped] == 0).all() and (grad[~dropped][mask[~dropped]] != 0).any()


# --- KL estimators -----------------------------------------------------------------------------------


def ref_kl(estimator, lp, rf):
    """Schulman's estimators of KL(π_θ ‖ π_ref) from δ = ref − logp; low_var_kl caps k3 at 10 (verl)."""
    delta = torch.clamp(rf - lp, -BOUND, BOUND)
    k3 = torch.exp(delta) - delta - 1
    return {"k1": lp - rf, "k2": 0.5 * (lp - rf) ** 2, "k3": k3, "low_var_kl": torch.clamp(k3, max=10.0)}[
        estimator
    ]


@pytest.mark.parametrize("gap", [0.5, 4.0])
@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
@pytest.mark.parametrize("name", NAMES)
def test_kl_estimator_matches_reference(name, estimator, gap):
    """loss(beta) − loss(0) = beta · agg(kl), value and gradient, and policy/ref_kl is agg(kl)."""
    logp, old, adv, mask, _, _ = make_batch(seed=13)
    ref = torch.where(
        mask,
        old + gap * torch.randn(old.shape, dtype=old.dtype, generator=torch.Generator().manual_seed(1)),
        old,
    )
    loss_agg = "token-mean" if name == "cispo" else "seq-mean-token-mean"
    base, _ = call(name, logp, old, adv, mask, loss_agg=loss_agg)
    loss, metrics = call(
        name, logp, old, adv, mask, loss_agg=loss_agg, beta=0.1, ref_logp=ref, kl_estimator=estimator
    )
    kl = agg(
        [[ref_kl(estimator, logp[i, t], ref[i, t]) for t in toks(mask, i)] for i in rows(mask)], loss_agg
    )
    assert_close(loss - base, 0.1 * kl)
    assert_close(grad_of(loss, logp) - grad_of(base, logp), 0.1 * grad_of(kl, logp))
    assert metrics["policy/ref_kl"] == pytest.approx(kl.item(), rel=1e-12)
    if estimator == "low_var_kl" and gap == 4.0:  # the cap binds: those tokens' KL gradient is zero
        capped = mask & (ref_kl("k3", logp.detach(), ref) > 10)
        assert capped.any()


# --- option checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("cispo", {"clip_ratio_c": 3.0}),
        ("gmpo", {"clip_ratio_c": 3.0}),
        ("grpo", {"clip_ratio_c": 1.0}),
        *[(n, {"kl_estimator": "k4"}) for n in NAMES],
        *[(n, {"rollout_is": "token_truncate"}) for n in NAMES],  # without sampler_logp
        *[(n, {"rollout_is": "token"}) for n in NAMES],
        ("grpo", {"rollout_is": "token_mask", "rollout_is_cap": 1.0, "sampler": True}),
        ("gspo", {"rollout_is": "sequence_mask", "sampler": "short"}),
    ],
)
def test_meaningless_options_raise_value_error(name, options):
    """A correction the objective cannot apply, or one without its inputs, raises ValueError."""
    logp, old, adv, mask, _, sampler = make_batch()
    which = options.pop("sampler", None)
    if which:
        options["sampler_logp"] = sampler if which is True else sampler[:, :-1]
    with pytest.raises(ValueError):
        call(name, logp, old, adv, mask, **options)


# --- configuration -----------------------------------------------------------------------------------


def compose_config(overrides: list[str]):
    from moe_rl.train import CONF_DIR, to_config

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["objective=gmpo", "objective.loss_agg=token-mean"], "objective.loss_agg"),
        (["objective=gspo", "objective.loss_agg=token-mean"], "objective.loss_agg"),
        (["objective=cispo", "objective.clip_ratio_c=3"], "objective.clip_ratio_c"),
        (["objective=gmpo", "objective.clip_ratio_c=3"], "objective.clip_ratio_c"),
        (["objective=grpo_dualclip", "objective.clip_ratio_c=0.5"], "objective.clip_ratio_c"),
        (["objective=grpo", "objective.clip_low=1.0"], "objective.clip_low"),
        (["objective=grpo_tis", "objective.rollout_is=truncate"], "objective.rollout_is"),
        (["objective=grpo_tis", "objective.rollout_is_cap=1"], "objective.rollout_is_cap"),
        (["objective=grpo_tis", "trainer.reuse_sampler_logp=true"], "objective.rollout_is"),
        (["objective=grpo", "objective.kl_estimator=k4"], "objective.kl_estimator"),
    ],
)
def test_meaningless_config_fails_at_start_up_naming_the_field(overrides, field):
    """A config combining options meaninglessly raises one ValueError line that starts with the field."""
    with pytest.raises(ValueError) as err:
        compose_config(overrides)
    message = str(err.value)
    assert message.startswith(field + "=") and "\n" not in message


def test_presets_carry_their_papers_defaults():
    """cispo, gmpo, dual-clip and TIS/MIS presets carry the defaults their sources name."""
    o = {
        n: compose_config([f"objective={n}"]).objective
        for n in ("cispo", "gmpo", "grpo_dualclip", "gspo_dualclip", "grpo_tis", "grpo_mis", "gspo_seq_mis")
    }
    assert (o["cispo"].name, o["cispo"].clip_low, o["cispo"].clip_high, o["cispo"].loss_agg) == (
        "cispo",
        1.0,
        4.0,
        "token-mean",
    )
    assert (o["gmpo"].name, o["gmpo"].clip_low, o["gmpo"].clip_high) == ("gmpo", 0.4, 0.4)
    assert o["grpo_dualclip"].clip_ratio_c == 3.0 and o["grpo_dualclip"].clip_low == 0.2
    assert o["gspo_dualclip"].clip_ratio_c == 3.0 and o["gspo_dualclip"].clip_low == 3e-4
    assert (o["grpo_tis"].rollout_is, o["grpo_tis"].rollout_is_cap) == ("token_truncate", 2.0)
    assert o["grpo_mis"].rollout_is == "token_mask" and o["gspo_seq_mis"].rollout_is == "sequence_mask"
    assert all(cfg.preset == name for name, cfg in o.items())


TINY = [
    "trainer.steps=1",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "trainer.mini_batches=2",
    "sampler.max_new_tokens=6",
    "model.num_layers=2",
    "logger.progress=false",
    "logger.wandb=false",
    "warmstart.enabled=false",
]


@pytest.mark.slow
def test_trainer_weights_by_the_samplers_own_log_probs(tmp_path):
    """In a real step with a bf16 sampler, rollout_is weighs by the sampler's log-probs: ρ ≠ 1 (old's would give 1)."""
    from moe_rl.trainer.run import train

    cfg = compose_config([*TINY, "objective=grpo_tis", "trainer.sampler_dtype=bfloat16"])
    final = train(cfg, tmp_path)["final"]
    assert final["rollout_is/max"] > 1 + 1e-3 and 0.9 < final["rollout_is/mean"] < 1.1
    assert math.isfinite(final["rollout_is/clipped_frac"]) and math.isfinite(final["train/loss"])
