"""GMPO: geometric-mean policy optimisation (Zhao et al., arXiv 2507.20673).

Shape legend: B = sequences, T = padded token positions. `mask_BT` is True at valid response tokens.
GSPO clips the geometric mean of a sequence's token ratios; GMPO clips each token's ratio in log space
*before* taking the geometric mean, so one outlier token is clipped alone instead of dragging its whole
sequence out of the trust region. Same keywords as `grpo`; like GSPO its loss is one term per sequence,
so only loss_agg="seq-mean-token-mean" means anything and other values raise.

Conventions against verl `loss_mode=geo_mean` (the reference implementation's port): same loss and clip
(clip_low, clip_high are log-space bounds, so clip 0.4 / 0.4 is the paper's (e^−0.4, e^0.4)). Two
differences: the log-ratio is clamped to ±LOG_RATIO_BOUND as everywhere in moe-rl (verl's clamp is
commented out), and a token-level rollout IS weight enters as its arithmetic mean over the sequence, as
in `gspo`, where verl takes the geometric mean (which a single masked token would zero for the sequence).
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
    clip_fracs,
    kl_penalty,
    prepare,
    ratio_metrics,
    rollout_is_weight,
    seq_kept_adv,
    seq_log_ratio,
    seq_mean,
    seq_mean_token_mean,
    weight_sums,
)


def gmpo(
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
    """GMPO loss: the geometric mean of token ratios, each clipped in log space, one term per sequence.

        d_it = clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND),   σ_i = sign(Â_i)
        d̂_it = σ_i · min(σ_i d_it, σ_i clip(d_it, −clip_low, clip_high))             (token clip)
        ρ_i  = exp(1/|y_i| Σ_t d̂_it) = (Π_t r̂_it)^(1/|y_i|)                          (geometric mean)
        ℓ_i  = −ρ_i Â_i
        loss = 1/B' Σ_i ℓ_i · (1/|y_i| Σ_t ω_it) + beta · seq-mean-token-mean(kl(logp, ref_logp))

    A token whose clip is active in the min (Â > 0 and d > clip_high, or Â < 0 and d < −clip_low) gets
    zero gradient; the others get −ρ_i Â_i / |y_i| ∇logp_it.

    Args:
        logp, old_logp, mask, beta, ref_logp, extreme_band, kl_estimator, sampler_logp, rollout_is,
            rollout_is_cap: as in `grpo`.
        advantages: [B], one Â_i per sequence; [B, T] raises ValueError.
        clip_low, clip_high: log-space clip [−clip_low, clip_high] of each d_it (paper: 0.4, 0.4).
        loss_agg: must be "seq-mean-token-mean". max_len: unused (accepted for a shared signature).
        clip_ratio_c: must be None (dual-clip is defined for PPO's min, not for GMPO).
        extreme_weight_band: `policy/extreme_weight_share` counts a sequence as extreme when its unclipped
            geometric mean s_i lies outside it; its weight is ρ_i · 1/|y_i| Σ_t |Â_i| over its
            gradient-carrying tokens (the coefficient of its ∇logp_it terms).

    Returns:
        (loss, metrics): the `moe_rl.objectives` diagnostics; clip/* count tokens whose clip is active.
    """
    check_options(clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band)
    check_corrections(mask, kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap)
    if loss_agg != SEQ_MEAN_TOKEN_MEAN:
        raise ValueError(f"gmpo has one loss term per sequence: loss_agg must be {SEQ_MEAN_TOKEN_MEAN!r}, "
                         f"got {loss_agg!r}")
    if clip_ratio_c is not None:
        raise ValueError(f"gmpo has no dual-clip; clip_ratio_c must be None, got {clip_ratio_c}")
    if advantages.dim() != 1:
        raise ValueError(f"gmpo needs per-sequence advantages [B], got {list(advantages.shape)}")
    logp_BT, old_logp_BT, adv_B, mask_BT, ref_logp_BT = prepare(logp, old_logp, advantages, mask, ref_logp)

    d_BT = (logp_BT - old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sign_BT = torch.sign(adv_B)[:, None].expand_as(d_BT)
    d_hat_BT = sign_BT * torch.minimum(sign_BT * d_BT, sign_BT * d_BT.clamp(-clip_low, clip_high))
    rho_B = torch.exp(torch.where(mask_BT, d_hat_BT, 0.0).sum(-1) / mask_BT.sum(-1).clamp(min=1))
    is_BT, is_metrics = rollout_is_weight(old_logp_BT, sampler_logp, mask_BT, rollout_is, rollout_is_cap)
    is_B = is_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)  # exactly 1 when rollout_is="none"
    kl, kl_metrics = kl_penalty(logp_BT, ref_logp_BT, mask_BT, beta, seq_mean_token_mean, kl_estimator)
    loss = seq_mean(-rho_B * adv_B * is_B, mask_BT) + kl

    with torch.no_grad():
        low_BT = mask_BT & (sign_BT < 0) & (d_BT < -clip_low)
        high_BT = mask_BT & (sign_BT > 0) & (d_BT > clip_high)
        keep_BT = mask_BT & ~low_BT & ~high_BT & ((logp_BT - old_logp_BT).abs() <= LOG_RATIO_BOUND)
        s_B = seq_log_ratio(logp_BT, old_logp_BT, mask_BT).exp()
        adv_BT = adv_B[:, None].expand_as(d_BT)
    metrics = {
        **clip_fracs(low_BT, high_BT, mask_BT),
        **weight_sums(s_B, rho_B, seq_kept_adv(adv_BT, keep_BT, mask_BT), mask_BT.any(-1), extreme_weight_band),
        **ratio_metrics(logp_BT, old_logp_BT, adv_BT, mask_BT, extreme_band),
        **kl_metrics,
        **is_metrics,
    }
    return loss, metrics
