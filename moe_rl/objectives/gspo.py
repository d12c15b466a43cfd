r"""GSPO and GSPO-token: PPO's clipped surrogate over one ratio per sequence (arXiv 2507.18071, Eq. 5-7, 13-14).

Shape legend: B = sequences, T = padded token positions.

GSPO (advantages [B]; its ratio is `surrogate.seq_ratio`):

    s_i = exp(clamp(1/|y_i| Σ_t (logp_it − old_logp_it), ±LOG_RATIO_BOUND))    (Eq. 7)
    ℓ_i = −min(s_i Â_i, clip(s_i, 1 − clip_low, 1 + clip_high) Â_i)              (Eq. 5; dual-clip as grpo)
    loss = 1/B' Σ_i ℓ_i · (1/|y_i| Σ_t ω_it) + beta · seq-mean-token-mean(kl(logp, ref_logp))

ω_it is the rollout IS weight (1 when rollout_is="none"): as in TRL, it multiplies the sequence's loss
broadcast to its tokens, so a token-level weight enters as its mean over the sequence. Clipping removes
whole sequences, and every token of a clipped sequence counts in `clip/token_frac` (the paper's Fig. 2).

GSPO-token (advantages [B] or [B, T]; for per-token advantages, multi-turn RL):

    s_it = sg[s_i] · exp(logp_it − sg[logp_it])          (Eq. 14; sg = detach)
    ℓ_it = −min(s_it Â_it, clip(s_it, 1 − clip_low, 1 + clip_high) Â_it)         (Eq. 13)
    loss = seq-mean-token-mean(ω ℓ) + beta · seq-mean-token-mean(kl(logp, ref_logp))

Numerically s_it = s_i, and ∇s_it = s_i ∇logp_it, so with Â_it = Â_i GSPO-token equals GSPO in value,
clipping and gradient. One exception: where |mean log-ratio| exceeds LOG_RATIO_BOUND, GSPO's clamp passes
no gradient while GSPO-token's token term still does (scaled by the clamped s_i). The paper aggregates
only as seq-mean-token-mean, so any other `loss_agg` raises rather than being ignored.
"""

from __future__ import annotations

import torch

from moe_rl.objectives.common import seq_log_ratio
from moe_rl.objectives.surrogate import Prepared, Ratio, declared, ppo_clip, seq_ratio


def seq_token_ratio(p: Prepared) -> Ratio:
    """s_it = sg[s_i] · exp(logp_it − sg[logp_it]), [B, T] (Eq. 14); s_i is judged, per sequence."""
    s_B = torch.exp(seq_log_ratio(p.logp_BT, p.old_logp_BT, p.mask_BT)).detach()
    s_BT = s_B[:, None] * torch.exp(p.logp_BT - p.logp_BT.detach())
    return Ratio(s_BT, s_B, p.mask_BT)  # no clamp acts on the token term's gradient


GSPO = declared("gspo", build_ratio=seq_ratio, surrogate=ppo_clip)
GSPO_TOKEN = declared("gspo_token", build_ratio=seq_token_ratio, surrogate=ppo_clip)
gspo, gspo_token = GSPO, GSPO_TOKEN
