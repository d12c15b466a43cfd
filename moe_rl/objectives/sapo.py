r"""SAPO: soft adaptive policy optimisation, a smooth gate in place of PPO's hard clip (Qwen, arXiv 2511.20347).

Shape legend: B = sequences, T = padded token positions.

    f_τ(ρ) = σ(τ (ρ − 1)) · 4 / τ,      τ = tau_pos where Â > 0, tau_neg where Â ≤ 0      (the gate)
    ℓ      = −f_τ(ρ) Â
    ∇ℓ     = −4 σ(1 − σ) · ρ Â ∇log ρ    (σ = σ(τ(ρ − 1))), so at ρ = 1 the gradient is the unclipped
             policy gradient's, and it fades smoothly as ρ leaves 1 instead of being cut at a clip bound.

`sapo` gates the token ratio w_it and aggregates as loss_agg says (seq-mean-token-mean by default, TRL's
and verl's aggregation for SAPO); `sapo_seq` gates GSPO's sequence ratio s_i (TRL's
importance_sampling_level="sequence"): the sequence-level variant, which the paper shows token SAPO
reduces to when a sequence's token ratios agree. tau_neg > tau_pos (1.05 vs 1.0, TRL's defaults) makes
negative-advantage updates fade faster, the paper's asymmetry. τ must be > 0; there is no dual-clip.

Matches TRL 1.16 `loss_type="sapo"` and verl `compute_policy_loss_sapo`, except that, as everywhere in
moe-rl, the log-ratio is clamped to ±LOG_RATIO_BOUND before exp (TRL does not clamp). Metrics: no clip/*
keys (there is no hard clip, and zeros would be placeholders); `policy/gate_weight/mean` is the mean over
valid tokens of the gate's gradient factor 4σ(1 − σ) ∈ (0, 1] (1 on-policy); `policy/*grad_weight/sum`
use g = 4σ(1 − σ)·ρ, the weight on Â ∇logp.
"""

from __future__ import annotations

import torch

from moe_rl import reduction as S
from moe_rl.objectives.surrogate import (
    Prepared,
    Ratio,
    Surrogate,
    broadcast,
    declared,
    seq_ratio,
    token_ratio,
)


def soft_gate(ratio: Ratio, p: Prepared) -> Surrogate:
    """ℓ = −σ(τ(ρ − 1)) · 4/τ · Â with τ by Â's sign; no token's gradient is zeroed (but by the clamp)."""
    c = p.x.cfg
    rho, adv = ratio.value, (p.adv if ratio.value.dim() == 1 else p.adv_BT)
    tau = torch.where(adv > 0, rho.new_tensor(c.tau_pos), rho.new_tensor(c.tau_neg))  # in ρ's dtype
    gate = torch.sigmoid(tau * (rho - 1.0))
    loss = -(gate * 4.0 / tau) * adv
    with torch.no_grad():
        factor = 4.0 * gate * (1.0 - gate)  # d f / d ρ, in (0, 1]
        factor_BT = broadcast(factor, p.logp_BT)
    stats = {"policy/gate_weight/mean": S.mean(factor_BT[p.mask_BT])}
    keep_BT = p.mask_BT & ratio.in_bound_BT
    return Surrogate(loss, None, None, keep_BT, (factor * rho).detach(), stats)


SAPO = declared("sapo", build_ratio=token_ratio, surrogate=soft_gate)
SAPO_SEQ = declared("sapo_seq", build_ratio=seq_ratio, surrogate=soft_gate)
