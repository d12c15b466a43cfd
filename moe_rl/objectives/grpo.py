"""GRPO: a clipped importance ratio per token (GSPO paper, arXiv 2507.18071, Eq. 2-3).

Shape legend: B = sequences, T = padded token positions. `mask_BT` is True at valid response tokens.
DAPO is this objective with clip_high > clip_low and loss_agg="token-mean"; Dr. GRPO is
loss_agg="seq-mean-token-sum-norm" with `group_advantages(..., normalize_std=False)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.objectives.common import (
    DEFAULT_EXTREME_BAND,
    DEFAULT_EXTREME_WEIGHT_BAND,
    LOG_RATIO_BOUND,
    SEQ_MEAN_TOKEN_MEAN,
    aggregation,
    check_corrections,
    check_options,
    clip_metrics,
    clipped_surrogate,
    dual_clip_metrics,
    kl_penalty,
    ppo_keep,
    prepare,
    ratio_metrics,
    rollout_is_weight,
    weight_sums,
)


def grpo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str = SEQ_MEAN_TOKEN_MEAN,
    max_len: int | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    extreme_band: tuple[float, float] = DEFAULT_EXTREME_BAND,
    kl_estimator: str = "k3",
    clip_ratio_c: float | None = None,
    sampler_logp: Tensor | None = None,
    rollout_is: str = "none",
    rollout_is_cap: float = 2.0,
    extreme_weight_band: tuple[float, float] = DEFAULT_EXTREME_WEIGHT_BAND,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss with the token-level importance ratio w_it.

        w_it = exp(clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND))                     (Eq. 3)
        ℓ_it = −min(w_it Â_it, clip(w_it, 1 − clip_low, 1 + clip_high) Â_it)          (Eq. 2)
        ℓ_it ← min(ℓ_it, −c Â_it) where Â_it < 0, if clip_ratio_c = c is set          (dual-clip)
        loss = agg(ω_it ℓ_it) + beta · agg(kl(logp, ref_logp))

    `loss_agg` picks agg (B' = sequences with at least one valid token; empty ones count as nothing):
        seq-mean-token-mean      1/B' Σ_i 1/|y_i| Σ_t ℓ_it     the paper's Eq. 2 (default)
        token-mean               Σ_i Σ_t ℓ_it / Σ_i |y_i|        DAPO
        seq-mean-token-sum-norm  1/B' Σ_i Σ_t ℓ_it / max_len     Dr. GRPO

    Args:
        logp: [B, T] log π_θ of the sampled tokens; the gradient flows through it.
        old_logp: [B, T] log π_old of the same tokens, from the sampling policy.
        advantages: [B] per sequence (Â_i, shared by its tokens) or [B, T] per token (Â_it).
        mask: [B, T] bool, True at valid tokens; padded entries may hold anything, even NaN.
        clip_low, clip_high: the clip range [1 − clip_low, 1 + clip_high] of w_it.
        loss_agg: one of the three modes above. max_len: the constant of seq-mean-token-sum-norm,
            required by that mode and unused by the others.
        beta: coefficient of the k3 KL penalty to the reference policy (0 = none, as in the paper).
        ref_logp: [B, T] log π_ref; required when beta > 0, unused when beta == 0.
        extreme_band: `ratio/token/extreme_frac` counts token ratios outside this interval.
        extreme_weight_band: `policy/extreme_weight_share` counts w_it outside this interval as extreme.
        kl_estimator: kl above, one of common.KL_ESTIMATORS (k1, k2, k3, low_var_kl).
        clip_ratio_c: dual-clip constant c > 1 (verl `clip_ratio_c`, paper 3); None = off.
        sampler_logp, rollout_is, rollout_is_cap: the rollout IS weight ω_it (1 when rollout_is="none");
            see common.rollout_is_weight.

    Returns:
        (loss, metrics): a scalar to minimise, in float32 (float64 if logp is float64), and the
        diagnostics documented in `moe_rl.objectives`. A token counts as clipped when its w_it is.
    """
    check_options(clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band)
    check_corrections(mask, kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap)
    aggregate = aggregation(loss_agg, max_len)
    logp_BT, old_logp_BT, adv, mask_BT, ref_logp_BT = prepare(logp, old_logp, advantages, mask, ref_logp)
    adv_BT = adv if adv.dim() == 2 else torch.where(mask_BT, adv[:, None], 0.0)

    d_BT = logp_BT - old_logp_BT
    w_BT = torch.exp(d_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    is_BT, is_metrics = rollout_is_weight(old_logp_BT, sampler_logp, mask_BT, rollout_is, rollout_is_cap)
    loss_BT = clipped_surrogate(w_BT, adv_BT, clip_low, clip_high, clip_ratio_c)
    loss_BT = torch.where(mask_BT, loss_BT * is_BT, 0.0)
    kl, kl_metrics = kl_penalty(logp_BT, ref_logp_BT, mask_BT, beta, aggregate, kl_estimator)
    loss = aggregate(loss_BT, mask_BT) + kl

    # Gradient-carrying tokens: those whose w_it ∇logp_it term no clip, cap or clamp zeroes.
    keep_BT = ppo_keep(w_BT, adv_BT, mask_BT, clip_low, clip_high, clip_ratio_c, d_BT.abs() <= LOG_RATIO_BOUND)
    metrics = {
        **clip_metrics(w_BT, adv_BT, mask_BT, clip_low, clip_high),
        **weight_sums(w_BT, w_BT, adv_BT.abs(), keep_BT, extreme_weight_band),
        **dual_clip_metrics(w_BT, adv_BT, mask_BT, clip_ratio_c),
        **ratio_metrics(logp_BT, old_logp_BT, adv_BT, mask_BT, extreme_band),
        **kl_metrics,
        **is_metrics,
    }
    return loss, metrics
