r"""Divergences between two next-token distributions known on the sampler's top-k tokens plus one "rest" bin
(DPPO's top-k variants, arXiv 2602.04879; sail-sg/Stable-RL `verl/workers/actor/utils.py` `compute_topk_kl`).

Shape legend: B sequences, T positions, K the sampler's top-k at each position.

At each position P is the sampler's distribution μ restricted to its k most likely tokens, with the rest of
its mass in one bin, and Q the current policy's probabilities of the same k tokens, with its own rest:

    rest_P = max(1 − Σ_k p_k, 1e-12),   rest_Q = max(1 − Σ_k q_k, 1e-12)
    KL(P ‖ Q) = Σ_k p_k (log p_k − log q_k) + rest_P (log rest_P − log rest_Q)
    TV(P, Q)  = ½ (Σ_k |p_k − q_k| + |rest_P − rest_Q|)

as the reference, which also floors the top-k masses Σ_k p_k and Σ_k q_k at 1e-12 (they only enter
through the rest bins here). No gradient: the divergence decides a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MASS_FLOOR = 1e-12


@dataclass(frozen=True)
class TopK:
    """The sampler's top-k log-probs at each response position and the current policy's on the same ids."""

    sampler_logp_BTK: Tensor
    """log μ of the sampler's k most likely tokens (the sampled token among them: see the sampler)."""
    policy_logp_BTK: Tensor
    """log π_θ of the same token ids, from the update forward."""


@torch.no_grad()
def topk_divergence(top: TopK, kind: str) -> Tensor:
    """[B, T] KL(P ‖ Q) (kind="kl") or TV(P, Q) (kind="tv") over the top-k plus the rest bin, float64."""
    log_p, log_q = top.sampler_logp_BTK.double(), top.policy_logp_BTK.double()
    p, q = log_p.exp(), log_q.exp()
    rest_p = (1.0 - p.sum(-1)).clamp(min=MASS_FLOOR)
    rest_q = (1.0 - q.sum(-1)).clamp(min=MASS_FLOOR)
    if kind == "kl":  # a token outside a truncated sampler's nucleus (p = 0) adds 0, not 0·∞
        return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
    return 0.5 * ((p - q).abs().sum(-1) + (rest_p - rest_q).abs())
