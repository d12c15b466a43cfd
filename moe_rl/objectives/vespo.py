r"""VESPO: a gamma kernel on the whole sequence's importance weight (arXiv 2602.10693), and LUSPO: GSPO
without its length bias (arXiv 2602.05261). Both as TRL 1.16 (`loss_type="vespo"`, `"luspo"`).

Shape legend: B = sequences, T = padded token positions; n_i = valid tokens of sequence i.

VESPO (TRL `GRPOTrainer.get_gamma_weights` and `_compute_loss`; the authors' verl recipe agrees):

    log w_i = clamp(Σ_t clamp(logp_it − old_logp_it, ±20) + Σ_t clamp(log ω_it, log 1e-8, 20), log 1e-8, 20)
    φ_i     = sg[w_i^k · e^{λ(1 − w_i)}] = sg[exp(λ + k log w_i − λ w_i)],  (k, λ) = (k_pos, λ_pos) = (2, 3)
              where Â_i ≥ 0, (k_neg, λ_neg) = (3, 2) where Â_i < 0; φ(1) = 1
    ℓ_it    = −φ_i Â_i logp_it,       loss = token-mean(ℓ) (TRL's aggregation; any loss_agg is allowed)

The weight is the **sum** of token log-ratios (the product ratio), not GSPO's mean, and the kernel both
rewards w near 1 and fades it smoothly to 0 far from it, on either side: no hard clip, no token dropped.
A rollout IS correction (rollout_is = token_truncate or token_mask, ω = π_old / μ truncated or masked) is
folded into log w in log space, not multiplied onto the loss afterwards: a token the mask drops has
ω = 0, log ω clamps to log 1e-8, so its whole sequence's φ falls to ~e^λ·1e-8^k ≈ 0. φ is a weight only
(detached): the gradient is −φ_i Â_i ∇logp_it. Where this departs from TRL: none in value; TRL averages
φ over every row in `vespo/phi_seq_mean`, here `policy/vespo_phi/mean` is over non-empty sequences.

LUSPO (TRL `loss_type="luspo"` with importance_sampling_level="sequence"):

    ℓ_i  = −min(s_i Â_i, clip(s_i, 1 − clip_low, 1 + clip_high) Â_i) · n_i     (GSPO's term, times n_i)
    loss = 1/B' Σ_i ℓ_i · (1/n_i Σ_t ω_it)                                      (a plain mean over sequences)

so a sequence weighs in proportion to its length, as a token-sum loss would, but with GSPO's one ratio and
whole-sequence clip. Where this departs from TRL: s_i's mean log-ratio is clamped at ±LOG_RATIO_BOUND
(TRL does not clamp), and empty sequences do not count in the mean (TRL's .mean() counts every row),
as everywhere in moe-rl.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moe_rl import reduction as S
from moe_rl.objectives.common import LOG_RATIO_BOUND
from moe_rl.objectives.surrogate import Prepared, Ratio, Surrogate, declared, ppo_clip, seq_ratio

LOG_W_FLOOR = math.log(1e-8)
"""VESPO's lower clamp on log w (and on each log ω), TRL's and the recipe's."""


def summed_log_ratio(p: Prepared) -> Ratio:
    """w_i = exp(log w_i), [B] (see the module docstring): the product ratio with ω folded in, no gradient."""
    with torch.no_grad():
        d_BT = (p.logp_BT - p.old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        log_w_B = torch.where(p.mask_BT, d_BT, 0.0).sum(-1)
        if p.x.cfg.rollout_is != "none":  # ω folded in log space (TRL's get_gamma_weights)
            log_is_BT = p.is_weight_BT.log().clamp(LOG_W_FLOOR, LOG_RATIO_BOUND)
            log_w_B = log_w_B + torch.where(p.mask_BT, log_is_BT, 0.0).sum(-1)
        w_B = log_w_B.clamp(LOG_W_FLOOR, LOG_RATIO_BOUND).exp()
    return Ratio(w_B, w_B, p.mask_BT)


def gamma_weighted_reinforce(ratio: Ratio, p: Prepared) -> Surrogate:
    """ℓ_it = −φ_i Â_i logp_it with φ_i = w_i^k e^{λ(1 − w_i)}, (k, λ) by Â_i's sign; φ detached."""
    c, w_B = p.x.cfg, ratio.value
    with torch.no_grad():
        pos_B = p.adv >= 0
        k_B = torch.where(pos_B, c.vespo_k_pos, c.vespo_k_neg).to(w_B)
        lam_B = torch.where(pos_B, c.vespo_lambda_pos, c.vespo_lambda_neg).to(w_B).clamp(min=1e-4)  # as TRL
        phi_B = torch.exp(lam_B + k_B * w_B.log() - lam_B * w_B).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss_BT = -phi_B[:, None] * p.adv_BT * p.logp_BT
    stats = {"policy/vespo_phi/mean": S.mean(phi_B[p.mask_BT.any(-1)])}
    return Surrogate(loss_BT, None, None, p.mask_BT, phi_B, stats)


def length_weighted_clip(ratio: Ratio, p: Prepared) -> Surrogate:
    """GSPO's ℓ_i (`ppo_clip` on s_i) times n_i, the sequence's valid tokens."""
    sur = ppo_clip(ratio, p)
    return replace(sur, loss=sur.loss * p.mask_BT.sum(-1).to(sur.loss))


VESPO = declared("vespo", build_ratio=summed_log_ratio, surrogate=gamma_weighted_reinforce)
LUSPO = declared("luspo", build_ratio=seq_ratio, surrogate=length_weighted_clip)
