"""The objectives' diagnostics as reducible `moe_rl.reduction.Stats`, computed under no_grad in float64.

Shape legend: B = sequences, T = padded token positions, N = valid tokens; `mask_BT` is True at valid
response tokens. Formulas: the metric table in moe_rl.objectives. Every mean is a (sum, count) pair, so
pooling ranks or mini-batches gives the statistic of the pooled tokens exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl import reduction as S
from moe_rl.objectives.common import LOG_RATIO_BOUND, k3, seq_log_ratio


@torch.no_grad()
def ppo_clipped(
    ratio_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """[B, T] bool masks of valid tokens whose PPO clip is active at the low and the high bound."""
    low_BT = mask_BT & (adv_BT < 0) & (ratio_BT < 1.0 - clip_low)
    high_BT = mask_BT & (adv_BT > 0) & (ratio_BT > 1.0 + clip_high)
    return low_BT, high_BT


@torch.no_grad()
def clip_stats(low_BT: Tensor, high_BT: Tensor, mask_BT: Tensor) -> S.Stats:
    """The four `clip/*` fractions from [B, T] bool masks of tokens clipped at the low and high bound."""
    clipped_BT = low_BT | high_BT
    return {
        "clip/token_frac": S.mean(clipped_BT[mask_BT]),
        "clip/low_frac": S.mean(low_BT[mask_BT]),
        "clip/high_frac": S.mean(high_BT[mask_BT]),
        "clip/seq_frac": S.mean(clipped_BT.any(-1)[mask_BT.any(-1)]),
    }


@torch.no_grad()
def dual_clip_stats(ratio_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip_ratio_c: float | None) -> S.Stats:
    """`clip/dual_frac`: fraction of valid tokens whose dual-clip cap is active (Â < 0, ρ > c); {} if off."""
    if clip_ratio_c is None:
        return {}
    return {"clip/dual_frac": S.mean((mask_BT & (adv_BT < 0) & (ratio_BT > clip_ratio_c))[mask_BT])}


@torch.no_grad()
def ppo_keep(
    ratio_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
    in_bound_BT: Tensor,
) -> Tensor:
    """[B, T] bool: valid tokens whose gradient under `ppo_clip` is not zeroed: neither clip of the min is
    active (Â < 0 ∧ ρ < 1 − clip_low, Â > 0 ∧ ρ > 1 + clip_high), nor dual-clip's cap (Â < 0 ∧ ρ > c),
    and the log-ratio lies within ±LOG_RATIO_BOUND (`in_bound_BT`; beyond it the clamp passes no
    gradient)."""
    clipped_BT = ((adv_BT < 0) & (ratio_BT < 1.0 - clip_low)) | ((adv_BT > 0) & (ratio_BT > 1.0 + clip_high))
    if clip_ratio_c is not None:
        clipped_BT = clipped_BT | ((adv_BT < 0) & (ratio_BT > clip_ratio_c))
    return mask_BT & ~clipped_BT & in_bound_BT


@torch.no_grad()
def seq_kept_adv(adv_BT: Tensor, keep_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """[B] 1/n_i Σ_t keep_it |Â_it|: a sequence's advantage magnitude over its gradient-carrying tokens
    (|Â_i| for a sequence clipped whole or not at all under per-sequence advantages; 0 if empty)."""
    return torch.where(keep_BT, adv_BT.abs(), 0.0).sum(-1) / mask_BT.sum(-1).clamp(min=1)


@torch.no_grad()
def weight_stats(
    ratio: Tensor, weight: Tensor, abs_adv: Tensor, keep: Tensor, band: tuple[float, float]
) -> S.Stats:
    """The gradient weight, the part of it extreme ratios carry, and its share (a `share` stat, so it is
    the quotient over all the step's entries, on every rank and mini-batch, not a mean of quotients):

        policy/grad_weight/sum          = Σ_k keep_k · weight_k · |Â_k|
        policy/extreme_grad_weight/sum  = Σ_k keep_k · weight_k · |Â_k| · [ratio_k < lo ∨ ratio_k > hi]
        policy/extreme_weight_share     = policy/extreme_grad_weight/sum / policy/grad_weight/sum (NaN at 0)

    k runs over tokens ([B, T], token-ratio objectives) or sequences ([B], sequence-ratio objectives);
    weight is what multiplies Â ∇logp in the objective's gradient, ratio what is judged extreme, keep the
    entries whose gradient is not zeroed."""
    mag = torch.where(keep, weight.double() * abs_adv.double(), 0.0)
    extreme_mag = torch.where((ratio < band[0]) | (ratio > band[1]), mag, 0.0)
    return {
        "policy/grad_weight/sum": S.total(mag),
        "policy/extreme_grad_weight/sum": S.total(extreme_mag),
        "policy/extreme_weight_share": S.share(extreme_mag, mag),
    }


def _sign_extremes(ratio_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, level: str) -> S.Stats:
    """`ratio/<level>/{pos,neg}_adv/{max,min}`: extremes of the ratio over valid entries with Â > 0 or
    Â < 0 (Â = 0 carries no gradient and counts in neither); NaN where there is none."""
    out = {}
    for sign, sel_BT in (("pos", mask_BT & (adv_BT > 0)), ("neg", mask_BT & (adv_BT < 0))):
        out[f"ratio/{level}/{sign}_adv/max"] = S.maximum(ratio_BT[sel_BT])
        out[f"ratio/{level}/{sign}_adv/min"] = S.minimum(ratio_BT[sel_BT])
    return out


@torch.no_grad()
def ratio_stats(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, extreme_band: tuple[float, float]
) -> S.Stats:
    """Token and sequence importance-ratio statistics and the policy's drift (see moe_rl.objectives)."""
    logp_BT, old_logp_BT, adv_BT = logp_BT.double(), old_logp_BT.double(), adv_BT.double()
    diff_BT = logp_BT - old_logp_BT
    ratio_BT = diff_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    len_B = mask_BT.sum(-1)
    ratio_N = ratio_BT[mask_BT]
    seq_ratio_mean_B = torch.where(mask_BT, ratio_BT, 0.0).sum(-1) / len_B.clamp(min=1)
    within_var_B = torch.where(mask_BT, ratio_BT - seq_ratio_mean_B[:, None], 0.0).square().sum(-1)
    within_var_B = within_var_B / len_B.clamp(min=1)
    s_all_B = seq_log_ratio(logp_BT, old_logp_BT, mask_BT).exp()
    s_B = s_all_B[len_B > 0]
    extreme_N = (ratio_N < extreme_band[0]) | (ratio_N > extreme_band[1])
    return {
        "ratio/token/mean": S.mean(ratio_N),
        "ratio/token/var": S.variance(ratio_N),
        "ratio/token/within_seq_var": S.mean(within_var_B[len_B >= 2]),
        "ratio/token/max": S.maximum(ratio_N),
        "ratio/token/min": S.minimum(ratio_N),
        "ratio/token/extreme_frac": S.mean(extreme_N),
        "ratio/seq/mean": S.mean(s_B),
        "ratio/seq/var": S.variance(s_B),
        "ratio/seq/max": S.maximum(s_B),
        "ratio/seq/min": S.minimum(s_B),
        **_sign_extremes(ratio_BT, adv_BT, mask_BT, "token"),
        **_sign_extremes(s_all_B[:, None].expand_as(ratio_BT), adv_BT, mask_BT, "seq"),
        # KL(π_old ‖ π_θ) on samples from π_old, unbiased: (r − 1) − log r with r = π_θ / π_old (as cleanrl
        # and TRL); k3(new, old) would estimate the other direction, agreeing only to second order.
        "policy/approx_kl": S.mean(k3(old_logp_BT, logp_BT)[mask_BT]),
        "policy/logp_diff/abs_mean": S.mean(diff_BT.abs()[mask_BT]),
    }
