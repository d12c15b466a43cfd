r"""GMPO: geometric-mean policy optimisation (Zhao et al., arXiv 2507.20673).

Shape legend: B = sequences, T = padded token positions. Advantages [B] only; loss_agg
seq-mean-token-mean only (one term per sequence); no dual-clip.

    d_it = clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND),   σ_i = sign(Â_i)
    d̂_it = σ_i · min(σ_i d_it, σ_i clip(d_it, −clip_low, clip_high))             (token clip)
    ρ_i  = exp(1/|y_i| Σ_t d̂_it) = (Π_t r̂_it)^(1/|y_i|)                          (geometric mean)
    ℓ_i  = −ρ_i Â_i
    loss = 1/B' Σ_i ℓ_i · (1/|y_i| Σ_t ω_it) + beta · seq-mean-token-mean(kl(logp, ref_logp))

GSPO clips the geometric mean of a sequence's token ratios; GMPO clips each token's ratio in log space
*before* taking the geometric mean, so one outlier token is clipped alone instead of dragging its whole
sequence out of the trust region. Here that is the ratio (`geo_mean_clipped_ratio`), and the surrogate
is the plain policy gradient −ρÂ (`policy_gradient`). A token whose clip is active in the min (Â > 0 and
d > clip_high, or Â < 0 and d < −clip_low) gets zero gradient; the others −ρ_i Â_i / |y_i| ∇logp_it.

Conventions against verl `loss_mode=geo_mean` (the reference implementation's port): same loss and clip
(clip_low, clip_high are log-space bounds, so clip 0.4 / 0.4 is the paper's (e^−0.4, e^0.4)). Two
differences: the log-ratio is clamped to ±LOG_RATIO_BOUND as everywhere in moe-rl (verl's clamp is
commented out), and a token-level rollout IS weight enters as its arithmetic mean over the sequence, as
in gspo, where verl takes the geometric mean (which a single masked token would zero for the sequence).
`policy/extreme_weight_share` judges the unclipped geometric mean s_i, weighted by ρ_i · 1/|y_i| Σ_t |Â_i|
over the sequence's gradient-carrying tokens.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import LOG_RATIO_BOUND, seq_log_ratio
from moe_rl.objectives.surrogate import Prepared, Ratio, Surrogate, declared


def geo_mean_clipped_ratio(p: Prepared) -> Ratio:
    """ρ_i, the geometric mean of the log-clipped token ratios, [B]; the clip's masks come with it."""
    c, mask_BT = p.x.cfg, p.mask_BT
    d_BT = (p.logp_BT - p.old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sign_BT = torch.sign(p.adv)[:, None].expand_as(d_BT)
    d_hat_BT = sign_BT * torch.minimum(sign_BT * d_BT, sign_BT * d_BT.clamp(-c.clip_low, c.clip_high))
    rho_B = torch.exp(torch.where(mask_BT, d_hat_BT, 0.0).sum(-1) / mask_BT.sum(-1).clamp(min=1))
    with torch.no_grad():
        low_BT = mask_BT & (sign_BT < 0) & (d_BT < -c.clip_low)
        high_BT = mask_BT & (sign_BT > 0) & (d_BT > c.clip_high)
        in_bound_BT = (p.logp_BT - p.old_logp_BT).abs() <= LOG_RATIO_BOUND
        s_B = seq_log_ratio(p.logp_BT, p.old_logp_BT, mask_BT).exp()
    return Ratio(rho_B, s_B, in_bound_BT, low_BT, high_BT)


def policy_gradient(ratio: Ratio, p: Prepared) -> Surrogate:
    """ℓ = −ρÂ: no clip of its own (a clip inside the ratio zeroes its tokens' gradient). g = ρ."""
    assert ratio.low_BT is not None and ratio.high_BT is not None  # the ratio brings its clip
    keep_BT = p.mask_BT & ~ratio.low_BT & ~ratio.high_BT & ratio.in_bound_BT
    return Surrogate(-ratio.value * p.adv, ratio.low_BT, ratio.high_BT, keep_BT, ratio.value)


GMPO = declared("gmpo", build_ratio=geo_mean_clipped_ratio, surrogate=policy_gradient)
gmpo = GMPO
