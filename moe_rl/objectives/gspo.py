"""GSPO and GSPO-token: one clipped importance ratio per sequence (arXiv 2507.18071, Eq. 5-7 and 13-14).

Shape legend: B = sequences, T = padded token positions. `mask_BT` is True at valid response tokens.
Both take the same keywords as `grpo`; the paper aggregates only as seq-mean-token-mean, so any other
`loss_agg` raises rather than being ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.objectives.common import (
    DEFAULT_EXTREME_BAND,
    DEFAULT_EXTREME_WEIGHT_BAND,
    LOG_RATIO_BOUND,
    SEQ_MEAN_TOKEN_MEAN,
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
    seq_kept_adv,
    seq_log_ratio,
    seq_mean,
    seq_mean_token_mean,
    weight_sums,
)


def _check_loss_agg(name: str, loss_agg: str) -> None:
    if loss_agg != SEQ_MEAN_TOKEN_MEAN:
        raise ValueError(f"{name} is defined with loss_agg={SEQ_MEAN_TOKEN_MEAN!r} only, got {loss_agg!r}")


def gspo(
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
    """GSPO loss with the sequence-level importance ratio s_i.

        s_i = exp(clamp(1/|y_i| Σ_t (logp_it − old_logp_it), ±LOG_RATIO_BOUND))    (Eq. 7)
        ℓ_i = −min(s_i Â_i, clip(s_i, 1 − clip_low, 1 + clip_high) Â_i)              (Eq. 5)
        ℓ_i ← min(ℓ_i, −c Â_i) where Â_i < 0, if clip_ratio_c = c is set             (dual-clip)
        loss = 1/B' Σ_i ℓ_i · (1/|y_i| Σ_t ω_it) + beta · seq-mean-token-mean(kl(logp, ref_logp))

    ω_it is the rollout IS weight (1 when rollout_is="none"): as in TRL, it multiplies the sequence's loss
    broadcast to its tokens, so a token-level weight enters as its mean over the sequence.

    B' counts sequences with at least one valid token; empty ones count as nothing. The mean log-ratio is
    computed in float32 at least and clamped before exp (see LOG_RATIO_BOUND): clipping removes whole
    sequences, and every token of a clipped sequence counts in `clip/token_frac` (the paper's Fig. 2).

    Args:
        logp, old_logp: [B, T] log π_θ (carries the gradient) and log π_old of the sampled tokens.
        advantages: [B], one Â_i per sequence; [B, T] raises ValueError (use gspo_token).
        mask: [B, T] bool, True at valid tokens; padded entries may hold anything, even NaN.
        clip_low, clip_high: the clip range [1 − clip_low, 1 + clip_high] of s_i (paper: 3e-4, 4e-4).
        loss_agg: must be "seq-mean-token-mean". max_len: unused (accepted for a shared signature).
        beta, ref_logp: k3 KL penalty to π_ref ([B, T]), required when beta > 0; 0 in the paper.
        extreme_band: `ratio/token/extreme_frac` counts token ratios outside this interval.
        kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap: as in `grpo`.
        extreme_weight_band: `policy/extreme_weight_share` counts s_i outside this interval as extreme.

    Returns:
        (loss, metrics): a scalar to minimise and the diagnostics documented in `moe_rl.objectives`.
    """
    check_options(clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band)
    check_corrections(mask, kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap)
    _check_loss_agg("gspo", loss_agg)
    if advantages.dim() != 1:
        raise ValueError(f"gspo needs per-sequence advantages [B], got {list(advantages.shape)}; "
                         "use gspo_token for per-token advantages")
    logp_BT, old_logp_BT, adv_B, mask_BT, ref_logp_BT = prepare(logp, old_logp, advantages, mask, ref_logp)

    s_B = torch.exp(seq_log_ratio(logp_BT, old_logp_BT, mask_BT))
    is_BT, is_metrics = rollout_is_weight(old_logp_BT, sampler_logp, mask_BT, rollout_is, rollout_is_cap)
    is_B = is_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)  # exactly 1 when rollout_is="none"
    loss_B = clipped_surrogate(s_B, adv_B, clip_low, clip_high, clip_ratio_c)
    kl, kl_metrics = kl_penalty(logp_BT, ref_logp_BT, mask_BT, beta, seq_mean_token_mean, kl_estimator)
    loss = seq_mean(loss_B * is_B, mask_BT) + kl

    s_BT, adv_BT = s_B[:, None].expand_as(logp_BT), adv_B[:, None].expand_as(logp_BT)
    # A sequence carries gradient s_i Â_i ∇log s_i unless its clip, cap or log-ratio clamp zeroes it.
    mean_d_BT = ((logp_BT - old_logp_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1))[:, None].expand_as(logp_BT)
    keep_BT = ppo_keep(s_BT, adv_BT, mask_BT, clip_low, clip_high, clip_ratio_c,
                       mean_d_BT.abs() <= LOG_RATIO_BOUND)
    metrics = {
        **clip_metrics(s_BT, adv_BT, mask_BT, clip_low, clip_high),
        **weight_sums(s_B, s_B, seq_kept_adv(adv_BT, keep_BT, mask_BT), mask_BT.any(-1), extreme_weight_band),
        **dual_clip_metrics(s_BT, adv_BT, mask_BT, clip_ratio_c),
        **ratio_metrics(logp_BT, old_logp_BT, adv_BT, mask_BT, extreme_band),
        **kl_metrics,
        **is_metrics,
    }
    return loss, metrics


def gspo_token(
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
    """GSPO-token loss: GRPO's shape with the ratio s_it, for per-token advantages (multi-turn RL).

        s_it = sg[s_i] · exp(logp_it − sg[logp_it])          (Eq. 14; sg = detach, s_i as in gspo)
        ℓ_it = −min(s_it Â_it, clip(s_it, 1 − clip_low, 1 + clip_high) Â_it)         (Eq. 13)
        ℓ_it ← min(ℓ_it, −c Â_it) where Â_it < 0, if clip_ratio_c = c is set        (dual-clip)
        loss = seq-mean-token-mean(ω ℓ) + beta · seq-mean-token-mean(kl(logp, ref_logp))

    Numerically s_it = s_i, and ∇s_it = s_i ∇logp_it, so with Â_it = Â_i the loss equals gspo's in value,
    clipping and gradient. One exception: where |mean log-ratio| exceeds LOG_RATIO_BOUND, gspo's clamp
    passes no gradient while here the token term still does (scaled by the clamped s_i).

    Args:
        logp, old_logp, mask, clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band:
            as in `gspo`.
        advantages: [B] per sequence (broadcast over its tokens) or [B, T] per token.
        loss_agg: must be "seq-mean-token-mean". max_len: unused (accepted for a shared signature).
        kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap: as in `grpo`.

    Returns:
        (loss, metrics): a scalar to minimise and the diagnostics documented in `moe_rl.objectives`;
        a token counts as clipped when its (s_it, Â_it) pair is.
    """
    check_options(clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band)
    check_corrections(mask, kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap)
    _check_loss_agg("gspo_token", loss_agg)
    logp_BT, old_logp_BT, adv, mask_BT, ref_logp_BT = prepare(logp, old_logp, advantages, mask, ref_logp)
    adv_BT = adv if adv.dim() == 2 else torch.where(mask_BT, adv[:, None], 0.0)

    s_B = torch.exp(seq_log_ratio(logp_BT, old_logp_BT, mask_BT)).detach()
    s_BT = s_B[:, None] * torch.exp(logp_BT - logp_BT.detach())
    is_BT, is_metrics = rollout_is_weight(old_logp_BT, sampler_logp, mask_BT, rollout_is, rollout_is_cap)
    loss_BT = clipped_surrogate(s_BT, adv_BT, clip_low, clip_high, clip_ratio_c)
    loss_BT = torch.where(mask_BT, loss_BT * is_BT, 0.0)
    kl, kl_metrics = kl_penalty(logp_BT, ref_logp_BT, mask_BT, beta, seq_mean_token_mean, kl_estimator)
    loss = seq_mean_token_mean(loss_BT, mask_BT) + kl

    # Each token carries s_i Â_it ∇logp_it unless its clip or cap zeroes it (no clamp acts on the gradient).
    keep_BT = ppo_keep(s_BT, adv_BT, mask_BT, clip_low, clip_high, clip_ratio_c, mask_BT)
    metrics = {
        **clip_metrics(s_BT, adv_BT, mask_BT, clip_low, clip_high),
        **weight_sums(s_B, s_B, seq_kept_adv(adv_BT, keep_BT, mask_BT), mask_BT.any(-1), extreme_weight_band),
        **dual_clip_metrics(s_BT, adv_BT, mask_BT, clip_ratio_c),
        **ratio_metrics(logp_BT, old_logp_BT, adv_BT, mask_BT, extreme_band),
        **kl_metrics,
        **is_metrics,
    }
    return loss, metrics
