"""Tests for moe_rl.objectives: GRPO, GSPO, GSPO-token against plainly written float64 references.

Tests parametrized over every objective also cover CISPO and GMPO; their own references, dual-clip,
rollout IS correction and the KL estimators are in test_cispo_gmpo_rollout_is_kl.py.

Shape legend: B = sequences, T = padded token positions. References loop over valid tokens with scalar
torch ops and call no library helper, so a shared bug cannot hide.
"""

from __future__ import annotations

import inspect
import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from moe_rl.objectives import OBJECTIVES, group_advantages

TOPK = {n for n in OBJECTIVES if n.startswith("dppo_topk")}
NAMES = sorted(set(OBJECTIVES) - TOPK)
"""The top-k DPPO variants need the sampler's top-k distribution as an input: test_rival_objectives.py."""
LOGP_ONLY = [n for n in NAMES if n != "dppo_kl"]
"""Objectives that read log-ratios alone. dppo_kl reads probabilities (its Bernoulli KL of 1 − p), so the
random log-probs above 0 of `make_batch` are outside its domain: test_rival_objectives.py tests it on
log-probs that are."""
CLIP = {"clip_low": 0.1, "clip_high": 0.15}  # asymmetric on purpose


def make_batch(seed: int = 0, B: int = 16, T: int = 10, per_token: bool = False, dtype=torch.float64):
    """Random batch with an empty row, a one-token row, a full row, and NaN/inf garbage at padding."""
    g = torch.Generator().manual_seed(seed)
    mask_BT = torch.rand(B, T, generator=g) < 0.7
    mask_BT[0] = False
    mask_BT[1] = False
    mask_BT[1, 3] = True
    mask_BT[2] = True
    old_BT = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp_BT = old_BT + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_BT = old_BT + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn((B, T) if per_token else (B,), generator=g, dtype=torch.float64)
    logp_BT[~mask_BT], old_BT[~mask_BT], ref_BT[~mask_BT] = float("nan"), -float("inf"), float("inf")
    if per_token:
        adv[~mask_BT] = float("nan")
    return logp_BT.to(dtype).requires_grad_(), old_BT.to(dtype), adv.to(dtype), mask_BT, ref_BT.to(dtype)


def valid(mask_BT, i):
    return [t for t in range(mask_BT.shape[1]) if mask_BT[i, t]]


def adv_at(adv, i, t):
    return adv[i] if adv.dim() == 1 else adv[i, t]


def surrogate(ratio, a, clip_low, clip_high):
    return -torch.min(ratio * a, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * a)


def k3_ref(logp, ref):
    return torch.exp(ref - logp) - (ref - logp) - 1


def ref_grpo(logp, old, adv, mask, clip_low, clip_high, loss_agg="seq-mean-token-mean", max_len=None):
    seqs = []
    for i in range(mask.shape[0]):
        terms = [surrogate(torch.exp(logp[i, t] - old[i, t]), adv_at(adv, i, t), clip_low, clip_high)
                 for t in valid(mask, i)]
        if terms:
            seqs.append(terms)
    if loss_agg == "token-mean":
        return sum(sum(ts) for ts in seqs) / sum(len(ts) for ts in seqs)
    norm = {"seq-mean-token-mean": None, "seq-mean-token-sum-norm": max_len}[loss_agg]
    return sum(sum(ts) / (norm or len(ts)) for ts in seqs) / len(seqs)


def ref_seq_ratio(logp, old, mask, i):
    toks = valid(mask, i)
    return torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))


def ref_gspo(logp, old, adv, mask, clip_low, clip_high):
    rows = [i for i in range(mask.shape[0]) if valid(mask, i)]
    losses = [surrogate(ref_seq_ratio(logp, old, mask, i), adv[i], clip_low, clip_high) for i in rows]
    return sum(losses) / len(losses)


def is_clipped(ratio, a, clip_low, clip_high):
    return bool((a > 0 and ratio > 1 + clip_high) or (a < 0 and ratio < 1 - clip_low))


def ref_gspo_token_value_and_grad(logp, old, adv, mask, clip_low, clip_high):
    """Value from Eq. 13 and the analytic gradient s_i Â_it / |y_i| per unclipped token (Eq. 15-16)."""
    rows = [i for i in range(mask.shape[0]) if valid(mask, i)]
    value, grad = 0.0, torch.zeros_like(logp)
    for i in rows:
        toks = valid(mask, i)
        s = ref_seq_ratio(logp.detach(), old, mask, i)
        for t in toks:
            a = adv_at(adv, i, t)
            value = value + surrogate(s, a, clip_low, clip_high) / len(toks) / len(rows)
            if not is_clipped(s, a, clip_low, clip_high):
                grad[i, t] = -s * a / len(toks) / len(rows)
    return value, grad


def grad_of(loss, logp):
    return torch.autograd.grad(loss, logp)[0]


def test_registry_shares_one_signature():
    """Every registered objective takes the same parameters, so the trainer calls any of them identically."""
    assert {"grpo", "gspo", "gspo_token"} <= set(OBJECTIVES)
    params = [list(inspect.signature(fn.inputs).parameters) for fn in OBJECTIVES.values()]
    assert all(p == params[0] for p in params)
    assert params[0][:4] == ["logp", "old_logp", "advantages", "mask"]


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_grpo_matches_float64_reference(loss_agg, per_token):
    """GRPO's loss and gradient match a loop reference for every loss_agg and advantage shape."""
    logp, old, adv, mask, _ = make_batch(per_token=per_token)
    loss, metrics = OBJECTIVES["grpo"](logp, old, adv, mask, **CLIP, loss_agg=loss_agg, max_len=12)
    expected = ref_grpo(logp, old, adv, mask, **CLIP, loss_agg=loss_agg, max_len=12)
    assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0  # both clip sides exercised
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))


def test_gspo_matches_float64_reference():
    """GSPO's loss and gradient match a loop reference of Eq. 5-7."""
    logp, old, adv, mask, _ = make_batch(seed=1)
    clip = {"clip_low": 0.03, "clip_high": 0.04}
    loss, metrics = OBJECTIVES["gspo"](logp, old, adv, mask, **clip)
    expected = ref_gspo(logp, old, adv, mask, **clip)
    assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))


def test_gspo_token_matches_float64_reference():
    """GSPO-token with per-token advantages matches Eq. 13's value and its analytic gradient."""
    logp, old, adv, mask, _ = make_batch(seed=2, per_token=True)
    clip = {"clip_low": 0.03, "clip_high": 0.04}
    loss, metrics = OBJECTIVES["gspo_token"](logp, old, adv, mask, **clip)
    value, grad = ref_gspo_token_value_and_grad(logp, old, adv, mask, **clip)
    assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0
    assert_close(loss, value)
    assert_close(grad_of(loss, logp), grad)


@pytest.mark.parametrize(
    ("name", "loss_agg"), [(n, "seq-mean-token-mean") for n in NAMES] + [("grpo", "token-mean")]
)
def test_kl_penalty_matches_reference(name, loss_agg):
    """beta > 0 adds beta · agg(k3(logp, ref)) in value and gradient and reports agg(k3) as policy/ref_kl."""
    logp, old, adv, mask, ref = make_batch(seed=3)
    fn, beta = OBJECTIVES[name], 0.3
    loss0, _ = fn(logp, old, adv, mask, **CLIP, loss_agg=loss_agg)
    loss1, metrics = fn(logp, old, adv, mask, **CLIP, loss_agg=loss_agg, beta=beta, ref_logp=ref)
    seqs = [[k3_ref(logp[i, t], ref[i, t]) for t in valid(mask, i)] for i in range(mask.shape[0])]
    seqs = [ts for ts in seqs if ts]
    if loss_agg == "token-mean":
        kl = sum(sum(ts) for ts in seqs) / sum(len(ts) for ts in seqs)
    else:
        kl = sum(sum(ts) / len(ts) for ts in seqs) / len(seqs)
    assert_close(loss1 - loss0, beta * kl)
    assert_close(grad_of(loss1, logp) - grad_of(loss0, logp), beta * grad_of(kl, logp))
    assert metrics["policy/ref_kl"] == pytest.approx(kl.item(), rel=1e-12)


def ref_weight_sums(d, s, adv, mask, name, clip_low, clip_high, band):
    """(Σ g·|Â|, the same over extreme ratios) over gradient-carrying tokens or sequences, by loops."""
    total, extreme = 0.0, 0.0
    for i in d:
        toks, n = valid(mask, i), len(d[i])
        a_t = [adv_at(adv, i, t).item() for t in toks]
        if name in ("sapo", "sapo_seq"):  # soft gate: g = 4σ(1 − σ)·ρ on every token within the clamp
            for x, a in zip(d[i], a_t, strict=True):
                rho = math.exp(x) if name == "sapo" else s[i]
                tau = 1.0 if a > 0 else 1.05
                sig = 1 / (1 + math.exp(-tau * (rho - 1)))
                g = 4 * sig * (1 - sig) * rho
                mag = g * abs(a) / (1 if name == "sapo" else n)
                judged = rho
                total, extreme = total + mag, extreme + mag * (not band[0] <= judged <= band[1])
            continue
        if name in ("grpo", "cispo"):  # per token; cispo keeps every token with its truncated weight
            for x, a in zip(d[i], a_t, strict=True):
                r = math.exp(x)
                g = min(max(r, 1 - clip_low), 1 + clip_high) if name == "cispo" else r
                if name == "cispo" or (not is_clipped(r, a, clip_low, clip_high) and abs(x) <= 20):
                    total, extreme = total + g * abs(a), extreme + g * abs(a) * (not band[0] <= r <= band[1])
            continue
        if name == "gmpo":  # log-space clip per token on the side Â's sign makes active
            kept = [not ((a > 0 and x > clip_high) or (a < 0 and x < -clip_low)) for x, a in zip(d[i], a_t, strict=True)]
            hat = [0.0 if a == 0 else (min(x, clip_high) if a > 0 else max(x, -clip_low)) for x, a in zip(d[i], a_t, strict=True)]
            g = math.exp(sum(hat) / n)
        else:  # gspo, gspo_token: the sequence ratio against each token's advantage
            kept = [not is_clipped(s[i], a, clip_low, clip_high) for a in a_t]
            g = s[i]
        mag = g * sum(abs(a) for a, k in zip(a_t, kept, strict=True) if k) / n
        total, extreme = total + mag, extreme + mag * (not band[0] <= s[i] <= band[1])
    return total, extreme


def ref_metrics(logp, old, adv, mask, name, clip_low, clip_high, band=(0.5, 2.0), weight_band=(0.1, 10.0)):
    """Every documented metric, from Python floats and the statistics module."""
    rows = [i for i in range(mask.shape[0]) if valid(mask, i)]
    d = {i: [(logp[i, t] - old[i, t]).item() for t in valid(mask, i)] for i in rows}
    r = {i: [math.exp(x) for x in d[i]] for i in rows}
    s = {i: math.exp(sum(d[i]) / len(d[i])) for i in rows}
    flat_d, flat_r = [x for i in rows for x in d[i]], [x for i in rows for x in r[i]]
    low, high, seq_clipped = 0, 0, 0
    by_sign = {(level, sign): [] for level in ("token", "seq") for sign in ("pos", "neg")}
    for i in rows:
        flags = []
        for k, t in enumerate(valid(mask, i)):
            rho, a = (r[i][k] if name in ("grpo", "cispo") else s[i]), adv_at(adv, i, t).item()
            if name == "cispo":  # the weight is truncated whatever Â's sign
                lo, hi = rho < 1 - clip_low, rho > 1 + clip_high
            elif name == "gmpo":  # each token's log-ratio against the log-space bounds
                lo, hi = a < 0 and d[i][k] < -clip_low, a > 0 and d[i][k] > clip_high
            else:
                lo, hi = a < 0 and rho < 1 - clip_low, a > 0 and rho > 1 + clip_high
            low, high = low + lo, high + hi
            flags.append(lo or hi)
            if a != 0:
                by_sign["token", "pos" if a > 0 else "neg"].append(r[i][k])
                by_sign["seq", "pos" if a > 0 else "neg"].append(s[i])
        seq_clipped += any(flags)
    n = len(flat_r)
    within_var = [statistics.pvariance(r[i]) for i in rows if len(r[i]) >= 2]
    total, extreme = ref_weight_sums(d, s, adv, mask, name, clip_low, clip_high, weight_band)
    clip = {
        "clip/token_frac": (low + high) / n, "clip/low_frac": low / n, "clip/high_frac": high / n,
        "clip/seq_frac": seq_clipped / len(rows),
    }
    if name in ("sapo", "sapo_seq"):  # no hard clip, no clip/* keys; the gate's mean gradient factor instead
        factors = []
        for i in rows:
            for k, t in enumerate(valid(mask, i)):
                a = adv_at(adv, i, t).item()
                tau = 1.0 if a > 0 else 1.05
                sig = 1 / (1 + math.exp(-tau * ((r[i][k] if name == "sapo" else s[i]) - 1)))
                factors.append(4 * sig * (1 - sig))
        clip = {"policy/gate_weight/mean": statistics.fmean(factors)}
    return {
        **clip,
        "ratio/token/mean": statistics.fmean(flat_r), "ratio/token/var": statistics.pvariance(flat_r),
        "ratio/token/within_seq_var": statistics.fmean(within_var),
        "ratio/token/max": max(flat_r), "ratio/token/min": min(flat_r),
        "ratio/token/extreme_frac": sum(not band[0] <= x <= band[1] for x in flat_r) / n,
        "ratio/seq/mean": statistics.fmean(s.values()), "ratio/seq/var": statistics.pvariance(s.values()),
        "ratio/seq/max": max(s.values()), "ratio/seq/min": min(s.values()),
        **{f"ratio/{level}/{sign}_adv/{ext}": fn(xs) for (level, sign), xs in by_sign.items()
           for ext, fn in (("max", max), ("min", min))},
        "policy/approx_kl": statistics.fmean(math.exp(x) - x - 1 for x in flat_d),  # (r - 1) - log r
        "policy/logp_diff/abs_mean": statistics.fmean(abs(x) for x in flat_d),
        "policy/grad_weight/sum": total,
        "policy/extreme_grad_weight/sum": extreme,
        "policy/extreme_weight_share": extreme / total if total > 0 else math.nan,
    }


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("vespo", "dppo_tv", "dppo_kl")])
def test_metrics_match_reference(name, per_token):
    """Every documented metric is a Python float equal to its formula, with no gradient attached; the
    gradient-weight sums hold both extreme and ordinary entries under a narrow band."""
    if per_token and OBJECTIVES[name].seq_advantages_only:
        pytest.skip(f"{name} takes per-sequence advantages only")
    logp, old, adv, mask, _ = make_batch(seed=4, per_token=per_token)
    old = torch.where(mask, old - 0.4 * torch.rand_like(old), old)  # push some ratios outside (0.5, 2)
    clip = CLIP if name == "grpo" else {"clip_low": 0.03, "clip_high": 0.04}
    weight_band = (0.8, 1.25)
    _, metrics = OBJECTIVES[name](logp, old, adv, mask, **clip, extreme_weight_band=weight_band)
    expected = ref_metrics(logp, old, adv, mask, name, **clip, weight_band=weight_band)
    assert set(metrics) == set(expected)
    assert all(type(v) is float for v in metrics.values())
    assert metrics["ratio/token/extreme_frac"] > 0 and metrics.get("clip/token_frac", 1.0) > 0
    assert 0 < metrics["policy/extreme_grad_weight/sum"] < metrics["policy/grad_weight/sum"]
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_has_ratio_one_and_no_clipping(name):
    """With old == new: ratios are 1, loss = −mean_i Â_i over non-empty sequences, nothing is clipped."""
    logp, _, adv, mask, _ = make_batch(seed=5)
    loss, metrics = OBJECTIVES[name](logp, logp.detach(), adv, mask, **CLIP)
    if name == "cispo":  # a REINFORCE loss: its value is −agg(Â logp); its gradient is on-policy GRPO's
        grpo_loss, _ = OBJECTIVES["grpo"](logp, logp.detach(), adv, mask, **CLIP, loss_agg="token-mean")
        assert_close(grad_of(loss, logp), grad_of(grpo_loss, logp))
    elif name in ("vespo", "dppo_tv", "dppo_kl"):  # φ(1) = 1, nothing dropped: on-policy token-mean REINFORCE
        grpo_loss, _ = OBJECTIVES["grpo"](logp, logp.detach(), adv, mask, **CLIP, loss_agg="token-mean")
        assert_close(grad_of(loss, logp), grad_of(grpo_loss, logp))
        assert_close(loss, -(adv[:, None] * logp)[mask].mean())
    elif name == "luspo":  # GSPO's on-policy term −Â_i, times n_i
        assert_close(loss, -(adv * mask.sum(-1))[mask.any(-1)].mean())
    elif name in ("sapo", "sapo_seq"):  # the gate is σ(0)·4/τ = 2/τ on-policy, its slope 1: GRPO's gradient
        tau = torch.where(adv > 0, 1.0, 1.05).to(adv.dtype)
        assert_close(loss, -(2 / tau * adv)[mask.any(-1)].mean())
        grpo_loss, _ = OBJECTIVES["grpo"](logp, logp.detach(), adv, mask, **CLIP)
        assert_close(grad_of(loss, logp), grad_of(grpo_loss, logp))
        assert metrics["policy/gate_weight/mean"] == 1.0 and not any(k.startswith("clip/") for k in metrics)
    else:
        assert_close(loss, -adv[mask.any(-1)].mean())
    for key in ("clip/token_frac", "clip/low_frac", "clip/high_frac", "clip/seq_frac", "ratio/token/var",
                "ratio/seq/var", "policy/approx_kl", "policy/logp_diff/abs_mean"):
        if name not in ("sapo", "sapo_seq", "vespo") or not key.startswith("clip/"):
            assert metrics[key] == 0.0, key
    for key in ("ratio/token/mean", "ratio/token/max", "ratio/token/min", "ratio/seq/mean", "ratio/seq/max",
                "ratio/seq/min"):
        assert metrics[key] == 1.0, key


def test_gspo_equals_grpo_when_token_log_ratios_are_equal():
    """With one log-ratio per sequence, GSPO equals GRPO in value, gradient and clipping."""
    logp, _, adv, mask, _ = make_batch(seed=6)
    c_B = torch.linspace(-0.4, 0.4, mask.shape[0], dtype=torch.float64)
    old = logp.detach() - c_B[:, None]
    grpo_loss, grpo_m = OBJECTIVES["grpo"](logp, old, adv, mask, **CLIP)
    gspo_loss, gspo_m = OBJECTIVES["gspo"](logp, old, adv, mask, **CLIP)
    assert grpo_m["clip/low_frac"] > 0 and grpo_m["clip/high_frac"] > 0
    assert_close(gspo_loss, grpo_loss)
    assert_close(grad_of(gspo_loss, logp), grad_of(grpo_loss, logp))
    for key in ("clip/token_frac", "clip/low_frac", "clip/high_frac", "clip/seq_frac"):
        assert gspo_m[key] == grpo_m[key], key


def test_gspo_token_equals_gspo_for_sequence_advantages():
    """With per-sequence advantages GSPO-token equals GSPO in value, gradient and every metric."""
    logp, old, adv, mask, _ = make_batch(seed=7)
    clip = {"clip_low": 0.03, "clip_high": 0.04}
    tok_loss, tok_m = OBJECTIVES["gspo_token"](logp, old, adv, mask, **clip)
    seq_loss, seq_m = OBJECTIVES["gspo"](logp, old, adv, mask, **clip)
    assert seq_m["clip/seq_frac"] > 0
    assert_close(tok_loss, seq_loss)
    assert_close(grad_of(tok_loss, logp), grad_of(seq_loss, logp))
    assert tok_m == pytest.approx(seq_m, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", LOGP_ONLY)
def test_masked_tokens_get_exactly_zero_gradient(name):
    """Padded tokens holding NaN/inf get exactly zero gradient, and loss and gradient stay finite."""
    logp, old, adv, mask, ref = make_batch(seed=8, per_token=not OBJECTIVES[name].seq_advantages_only)
    loss, metrics = OBJECTIVES[name](logp, old, adv, mask, **CLIP, beta=0.1, ref_logp=ref)
    grad = grad_of(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("name", LOGP_ONLY)
def test_extreme_log_prob_differences_stay_finite(name, sign, dtype):
    """Log-prob differences of ±1e4 on tokens or whole sequences give finite loss, gradients and metrics."""
    if name.startswith("dppo") and sign < 0:
        pytest.skip("old log-probs of +1e4 are no probabilities, which DPPO's divergence reads")
    logp, old, adv, mask, ref = make_batch(seed=9, dtype=dtype)
    old = torch.where(mask, old, 0.0)
    old[3, :] -= sign * 1e4  # a whole sequence
    old[4:, 2] -= sign * 1e4  # single tokens of many sequences, advantages of both signs
    for beta in (0.0, 0.1):
        loss, metrics = OBJECTIVES[name](logp, old, adv, mask, **CLIP, beta=beta, ref_logp=old)
        assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()
        assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", LOGP_ONLY)
def test_empty_sequences_count_as_nothing(name):
    """An added empty sequence changes neither loss nor metrics; an all-empty batch gives loss 0, no NaN."""
    logp, old, adv, mask, _ = make_batch(seed=10)
    loss, metrics = OBJECTIVES[name](logp, old, adv, mask, **CLIP)
    pad = torch.full((1, mask.shape[1]), float("nan"), dtype=logp.dtype)
    more_loss, more_metrics = OBJECTIVES[name](
        torch.cat([logp, pad]), torch.cat([old, pad]), torch.cat([adv, adv.new_tensor([5.0])]),
        torch.cat([mask, torch.zeros_like(mask[:1])]), **CLIP)
    assert_close(more_loss, loss)
    assert more_metrics == pytest.approx(metrics, rel=1e-12)
    empty_loss, empty_metrics = OBJECTIVES[name](logp, old, adv, torch.zeros_like(mask), **CLIP)
    assert empty_loss.item() == 0.0 and (grad_of(empty_loss, logp) == 0).all()
    assert math.isnan(empty_metrics["ratio/token/mean"])  # undefined, not a placeholder 0


@pytest.mark.parametrize("name", LOGP_ONLY)
def test_float32_inputs_compute_in_float32_and_match_float64(name):
    """float32 inputs give a float32 loss close to the float64 one; float64 stays float64."""
    logp, old, adv, mask, _ = make_batch(seed=11)
    loss64, _ = OBJECTIVES[name](logp, old, adv, mask, **CLIP)
    loss32, _ = OBJECTIVES[name](logp.detach().float(), old.float(), adv.float(), mask, **CLIP)
    assert loss64.dtype == torch.float64 and loss32.dtype == torch.float32
    assert_close(loss32.double(), loss64.detach(), rtol=1e-5, atol=1e-6)


def test_group_advantages_hand_computed():
    """group_advantages is (r − group mean) / (unbiased group std + eps), or r − mean without std."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0])
    std1, std3 = math.sqrt(1.0 / 3), math.sqrt(0.75 / 3)  # sqrt(Σ(r − mean)² / (G − 1))
    a1, a3p, a3n = 0.5 / (std1 + 1e-6), 0.75 / (std3 + 1e-6), -0.25 / (std3 + 1e-6)
    expected = [a1, -a1, -a1, a1, 0, 0, 0, 0, a3p, a3n, a3n, a3n]
    assert_close(group_advantages(rewards, 4), torch.tensor(expected))
    expected_raw = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.75, -0.25, -0.25, -0.25]
    assert_close(group_advantages(rewards, 4, normalize_std=False), torch.tensor(expected_raw))


@pytest.mark.parametrize("group_size", [1, 5])
def test_group_advantages_rejects_bad_group_size(group_size):
    """A group size that does not divide B (or a group of one) raises ValueError."""
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(12), group_size)


def clip_case(log_ratios_BT, adv_B):
    logp = torch.zeros(len(log_ratios_BT), 3, dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp.detach())
    mask = torch.zeros_like(old, dtype=torch.bool)
    for i, row in enumerate(log_ratios_BT):
        old[i, : len(row)] = -torch.tensor(row, dtype=torch.float64)
        mask[i, : len(row)] = True
    return logp, old, torch.tensor(adv_B, dtype=torch.float64), mask


def test_grpo_clip_diagnostics_hand_constructed():
    """A token above 1+clip_high counts as clipped with A>0, not A<0 (and mirrored); its gradient is 0."""
    up, down = math.log(1.5), math.log(0.5)
    rows, adv_B = [[up, down, 0.0], [up, down], [0.0, 0.0, 0.0], [up, down]], [1.0, -1.0, 1.0, 0.0]
    logp, old, adv, mask = clip_case(rows, adv_B)  # the last row: A = 0 never counts as clipped
    loss, m = OBJECTIVES["grpo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert (m["clip/token_frac"], m["clip/low_frac"], m["clip/high_frac"]) == (2 / 10, 1 / 10, 1 / 10)
    assert m["clip/seq_frac"] == 2 / 4
    clipped = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)
    grad = grad_of(loss, logp)
    assert (grad[clipped] == 0).all() and (grad[:3][mask[:3] & ~clipped[:3]] != 0).all()


def test_extreme_weight_sums_hand_constructed():
    """grpo weighs only tokens with a gradient (no clip, dual-clip cap or ±20 clamp zeroes it) by w·|Â|;
    cispo weighs every token by its truncated weight; the share is their quotient, NaN when nothing is left."""
    hi, lo = math.log(20.0), math.log(0.05)
    logp, old, adv, mask = clip_case([[0.0, hi, lo], [hi, 25.0, lo], [hi]], [1.0, -1.0, 0.0])
    keys = ("policy/grad_weight/sum", "policy/extreme_grad_weight/sum")
    for c, total, extreme, grads in ((None, 21.05, 20.05, [[1, 0, 1], [1, 0, 0]]), (3.0, 1.05, 0.05, [[1, 0, 1], [0, 0, 0]])):
        loss, m = OBJECTIVES["grpo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=c)
        assert [m[k] for k in keys] == pytest.approx([total, extreme], rel=1e-12), c
        assert (grad_of(loss, logp)[:2] != 0).tolist() == [[bool(g) for g in row] for row in grads], c
        assert m["policy/extreme_weight_share"] == pytest.approx(extreme / total)
    _, m = OBJECTIVES["cispo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert [m[k] for k in keys] == pytest.approx([1 + 3 * 1.28 + 2 * 0.8, 3 * 1.28 + 2 * 0.8], rel=1e-12)
    _, m = OBJECTIVES["grpo"](logp, logp, torch.zeros(3, dtype=logp.dtype), mask, clip_low=0.2, clip_high=0.28)
    assert m[keys[0]] == 0.0 and math.isnan(m["policy/extreme_weight_share"])


def test_gspo_clip_diagnostics_count_every_token_of_a_clipped_sequence():
    """GSPO clips whole sequences: every token of a clipped sequence counts, and gets zero gradient."""
    up, down = math.log(1.5), math.log(0.5)
    logp, old, adv, mask = clip_case([[up, up, up], [up, up], [down]], [1.0, -1.0, -1.0])
    loss, m = OBJECTIVES["gspo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert m["clip/token_frac"] == pytest.approx(4 / 6) and m["clip/seq_frac"] == pytest.approx(2 / 3)
    assert m["clip/high_frac"] == pytest.approx(3 / 6) and m["clip/low_frac"] == pytest.approx(1 / 6)
    grad = grad_of(loss, logp)
    assert (grad[[0, 2]] == 0).all() and (grad[1, :2] != 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_raises_type_error(name):
    """An option the objective does not define raises TypeError instead of being swallowed."""
    logp, old, adv, mask, _ = make_batch()
    with pytest.raises(TypeError):
        OBJECTIVES[name](logp, old, adv, mask, **CLIP, epsilon=0.2)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        *[(n, {"beta": 0.1}) for n in NAMES],  # beta > 0 without ref_logp
        *[(n, {"loss_agg": "seq-mean-token-sum"}) for n in NAMES],
        ("grpo", {"loss_agg": "seq-mean-token-sum-norm"}),  # without max_len
        ("gspo", {"loss_agg": "token-mean"}),
        ("gspo_token", {"loss_agg": "token-mean"}),
        ("gspo", {"advantages": "per-token"}),
        *[(n, {"clip_low": 1.0}) for n in NAMES if not OBJECTIVES[n].clip_low_may_be_one],
        ("cispo", {"clip_low": 1.01}),
        ("gmpo", {"loss_agg": "token-mean"}),
        ("gmpo", {"advantages": "per-token"}),
    ],
)
def test_invalid_option_values_raise_value_error(name, options):
    """Options that cannot mean what the caller intends raise ValueError with a message."""
    logp, old, adv, mask, _ = make_batch()
    if options.pop("advantages", None):
        adv = adv[:, None].expand_as(old)
    with pytest.raises(ValueError):
        OBJECTIVES[name](logp, old, adv, mask, **{**CLIP, **options})


# --- ratio statistics by response length (logged by the trainer over mini-batches 2..M) ---------------


def _length_reference(rows: list[list[float]], bins: list[tuple[int, int]]) -> dict[str, float]:
    """`length/*` by hand: rows are each sequence's token log-ratios d_it (empty: no valid token)."""
    out = {}
    for lo, hi in bins:
        seqs = [[math.exp(max(-20.0, min(20.0, d))) for d in row] for row in rows if lo <= len(row) <= hi]
        s = [math.exp(max(-20.0, min(20.0, sum(row) / len(row)))) for row in rows if lo <= len(row) <= hi]
        tokens = [r for seq in seqs for r in seq]
        key = f"length/{lo}-{hi}"
        out[f"{key}/token_var"] = statistics.pvariance(tokens) if tokens else math.nan
        within = [statistics.pvariance(seq) for seq in seqs if len(seq) >= 2]
        out[f"{key}/within_seq_var"] = statistics.fmean(within) if within else math.nan
        out[f"{key}/seq_var"] = statistics.pvariance(s) if s else math.nan
        out[f"{key}/seqs"], out[f"{key}/tokens"] = float(len(seqs)), float(len(tokens))
    return out


def _length_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[float]]]:
    """Hand-made [B, T] log-probs: lengths 3, 1, 0 (empty), 6, 7, 4 and 5 (one log-ratio past the clamp);
    padding holds NaN and inf garbage."""
    rows = [[0.1, -0.2, 0.3], [0.5], [], [0.05, -0.1, 0.2, 0.0, -0.3, 0.15], [-0.4, 0.1, 0.1, 0.2, -0.05, 0.3, 0.0],
            [0.2, 0.2, 0.2, 0.2], [25.0, -0.1, 0.0, 0.1, 0.2]]  # fmt: skip
    T = 8
    mask_BT = torch.zeros(len(rows), T, dtype=torch.bool)
    old_BT = -2.0 * torch.rand(len(rows), T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp_BT = old_BT.clone()
    for i, row in enumerate(rows):
        mask_BT[i, : len(row)] = True
        logp_BT[i, : len(row)] += torch.tensor(row, dtype=torch.float64)
    logp_BT[~mask_BT], old_BT[~mask_BT] = float("nan"), -float("inf")
    return logp_BT, old_BT, mask_BT, rows


def test_length_bins_are_fixed_powers_of_two():
    """Bins are [1, 4], [5, 8], [9, 16], ... up to the one holding max_len, whatever else the config says."""
    from moe_rl.objectives.common import length_bins

    assert length_bins(1) == length_bins(4) == [(1, 4)]
    assert length_bins(32) == [(1, 4), (5, 8), (9, 16), (17, 32)]
    assert length_bins(33)[-1] == (33, 64)
    with pytest.raises(ValueError, match="max_len"):
        length_bins(0)


def test_length_metrics_match_float64_reference():
    """Per length bin: token-ratio variance, mean within-sequence variance, sequence-ratio variance and the
    counts equal a hand computation; an empty bin is NaN (counts 0); sums of two halves of the batch give
    the statistics of the whole (what the trainer does over mini-batches and ranks)."""
    from moe_rl.objectives.common import length_bins, length_metrics, length_sums

    logp_BT, old_BT, mask_BT, rows = _length_batch()
    bins = length_bins(16)  # 9-16 holds no sequence
    got = length_metrics(length_sums(logp_BT, old_BT, mask_BT, bins), bins)
    want = _length_reference(rows, bins)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    assert math.isnan(got["length/9-16/token_var"]) and got["length/9-16/seqs"] == 0.0
    assert got["length/1-4/seqs"] == 3.0 and got["length/5-8/tokens"] == 18.0
    assert got["length/1-4/token_var"] > 0 and got["length/5-8/seq_var"] > 0  # not vacuous
    halves = length_sums(logp_BT[:3], old_BT[:3], mask_BT[:3], bins) + length_sums(
        logp_BT[3:], old_BT[3:], mask_BT[3:], bins
    )
    pooled = length_metrics(halves, bins)
    assert all(pooled[k] == pytest.approx(got[k], rel=1e-12) or math.isnan(got[k]) for k in got)


def test_length_metrics_float32_inputs_and_too_long_responses():
    """float32 log-probs give the float64 statistics to float32 rounding; a response longer than the last
    bin raises instead of being dropped."""
    from moe_rl.objectives.common import length_bins, length_metrics, length_sums

    logp_BT, old_BT, mask_BT, rows = _length_batch()
    bins = length_bins(8)
    f32 = length_metrics(length_sums(logp_BT.float(), old_BT.float(), mask_BT, bins), bins)
    f64 = length_metrics(length_sums(logp_BT, old_BT, mask_BT, bins), bins)
    assert all(f32[k] == pytest.approx(f64[k], rel=1e-4) for k in f64)
    with pytest.raises(ValueError, match="longer than the last bin"):
        length_sums(logp_BT, old_BT, mask_BT, length_bins(4))
