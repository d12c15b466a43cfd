"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, §3.1).

Shape legend: B = sequences, T = padded token positions. `mask_BT` is True at valid response tokens.
Where GRPO clips the ratio inside a min, which zeroes a clipped token's gradient, CISPO clips only the
ratio's *weight* on a REINFORCE term, so every token keeps a gradient. Same keywords as `grpo`.

Conventions against the other systems (same loss, different parametrisation):
- The weight is clip(r, 1 − clip_low, 1 + clip_high), as in verl `loss_mode=cispo`. TRL
  `loss_type="cispo"` caps r at `epsilon_high` itself (an absolute ε_max, ScaleRL), with no lower bound:
  TRL epsilon_high = E is moe-rl clip_high = E − 1 with clip_low = 1.
- clip_low = 1 means "no lower bound" (the paper: "we did not impose a lower bound").
- `clip/*` counts a token whose weight is truncated, whatever the advantage's sign, as verl does (its
  gradient is scaled, not zeroed); TRL's `cispo_clip_ratio` counts only r > ε_max with Â > 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.objectives.common import (
    DEFAULT_EXTREME_BAND,
    DEFAULT_EXTREME_WEIGHT_BAND,
    LOG_RATIO_BOUND,
    aggregation,
    check_corrections,
    check_options,
    clip_fracs,
    kl_penalty,
    prepare,
    ratio_metrics,
    rollout_is_weight,
    weight_sums,
)


def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str = "token-mean",
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
    """CISPO loss: a stop-gradient clipped token ratio weights log π_θ.

        r_it = exp(clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND))
        r̂_it = clip(r_it, 1 − clip_low, 1 + clip_high)
        ℓ_it = −sg(r̂_it) Â_it logp_it
        loss = agg(ω_it ℓ_it) + beta · agg(kl(logp, ref_logp))

    ∇ℓ_it = −r̂_it Â_it ∇logp_it: equal to GRPO's gradient wherever GRPO's clip is inactive, and still
    nonzero where it is. The loss's value is not a surrogate of the return (only its gradient matters).
    The paper normalises by the batch's token count, i.e. loss_agg="token-mean" (the default here).

    Args:
        logp, old_logp, advantages, mask, loss_agg, max_len, beta, ref_logp, extreme_band, kl_estimator,
            sampler_logp, rollout_is, rollout_is_cap: as in `grpo`.
        clip_low, clip_high: the weight's clip range [1 − clip_low, 1 + clip_high]; clip_low may be 1.
        clip_ratio_c: must be None: the loss has no min for a dual clip to cap.
        extreme_weight_band: `policy/extreme_weight_share` counts tokens whose r_it (before truncation)
            lies outside it as extreme. No token's gradient is dropped, so the share is over all valid
            tokens, each weighted by its truncated weight: Σ r̂_it |Â_it| [r_it extreme] / Σ r̂_it |Â_it|.

    Returns:
        (loss, metrics): the `moe_rl.objectives` diagnostics; clip/* count truncated weights (see above).
    """
    check_options(clip_low, clip_high, beta, ref_logp, extreme_band, extreme_weight_band,
                  allow_no_lower_clip=True)
    check_corrections(mask, kl_estimator, clip_ratio_c, sampler_logp, rollout_is, rollout_is_cap)
    if clip_ratio_c is not None:
        raise ValueError(f"cispo has no min for dual-clip to cap: clip_ratio_c must be None, "
                         f"got {clip_ratio_c}")
    aggregate = aggregation(loss_agg, max_len)
    logp_BT, old_logp_BT, adv, mask_BT, ref_logp_BT = prepare(logp, old_logp, advantages, mask, ref_logp)
    adv_BT = adv if adv.dim() == 2 else torch.where(mask_BT, adv[:, None], 0.0)

    r_BT = torch.exp((logp_BT - old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).detach()
    r_hat_BT = r_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    is_BT, is_metrics = rollout_is_weight(old_logp_BT, sampler_logp, mask_BT, rollout_is, rollout_is_cap)
    loss_BT = torch.where(mask_BT, -r_hat_BT * adv_BT * logp_BT * is_BT, 0.0)
    kl, kl_metrics = kl_penalty(logp_BT, ref_logp_BT, mask_BT, beta, aggregate, kl_estimator)
    loss = aggregate(loss_BT, mask_BT) + kl

    metrics = {
        **clip_fracs(mask_BT & (r_BT < 1.0 - clip_low), mask_BT & (r_BT > 1.0 + clip_high), mask_BT),
        **weight_sums(r_BT, r_hat_BT, adv_BT.abs(), mask_BT, extreme_weight_band),
        **ratio_metrics(logp_BT, old_logp_BT, adv_BT, mask_BT, extreme_band),
        **kl_metrics,
        **is_metrics,
    }
    return loss, metrics
