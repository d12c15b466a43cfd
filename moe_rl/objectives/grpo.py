r"""GRPO: PPO's clipped surrogate over the token-level importance ratio (GSPO paper, arXiv 2507.18071, Eq. 2-3).

Shape legend: B = sequences, T = padded token positions.

    w_it = exp(clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND))                     (Eq. 3)
    ℓ_it = −min(w_it Â_it, clip(w_it, 1 − clip_low, 1 + clip_high) Â_it)          (Eq. 2)
    ℓ_it ← min(ℓ_it, −c Â_it) where Â_it < 0, if clip_ratio_c = c is set          (dual-clip)
    loss = agg(ω_it ℓ_it) + beta · agg(kl(logp, ref_logp))

`loss_agg` picks agg (B' = sequences with at least one valid token; empty ones count as nothing):
    seq-mean-token-mean      1/B' Σ_i 1/|y_i| Σ_t ℓ_it     the paper's Eq. 2 (default)
    token-mean               Σ_i Σ_t ℓ_it / Σ_i |y_i|        DAPO
    seq-mean-token-sum-norm  1/B' Σ_i Σ_t ℓ_it / max_len     Dr. GRPO

DAPO is this objective with clip_high > clip_low and loss_agg="token-mean"; Dr. GRPO is
loss_agg="seq-mean-token-sum-norm" with `group_advantages(..., normalize_std=False)`. ω is the rollout IS
weight (1 when rollout_is="none"). A token counts as clipped when its w_it is; advantages may be [B] or
[B, T]. The ratio and the surrogate are `surrogate.token_ratio` and `surrogate.ppo_clip`.
"""

from __future__ import annotations

from moe_rl.objectives.surrogate import declared, ppo_clip, token_ratio

GRPO = declared("grpo", build_ratio=token_ratio, surrogate=ppo_clip)
grpo = GRPO
