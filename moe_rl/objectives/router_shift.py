r"""RSPO's router-shift ratio (Router-Shift Policy Optimization, Zhang et al., arXiv 2510.23027, §3).

Shape legend: B = sequences, T = response tokens, L = MoE layers, K = experts per token, E = experts.

For token t of sequence i, with E^old_{l,t} the K experts the old policy *activated* at layer l (under R3 the
replayed sampler's, otherwise its own top-k) and p^l(e) = softmax(z^l)_e the router's probability of expert e
over all E experts:

    δ_it = 1/(L·K) Σ_l Σ_{e ∈ E^old_{l,t}} | log p^l_θ(e) − log p^l_old(e) |
    γ_it = exp(−δ_it) ∈ (0, 1]                                           (the router-shift ratio)
    γ̃_it = max(sg[γ_it], γ_min)                                          (stop-gradient, floored)

and the objective's importance ratio is rescaled before the clip, ρ̃_it = ρ_it · γ̃_it (RSPO is GMPO + this
rescaling; here any objective takes it: moe_rl.objectives.surrogate.compute shifts old_logp by −log γ̃, so
token ratios become r_it·γ̃_it, sequence ratios s_i·(Π_t γ̃_it)^(1/|y_i|), GMPO's log-clip acts on
d_it + log γ̃_it). A token whose routing moved since the old policy weighs less; γ = 1 where it did not.

The paper's equation numbers could not be read from the stored copy of the paper; the formula above is the
one its abstract states (a per-token ratio on the old activated experts, stop-gradient, a lower-bound floor,
rescaling before clipping and aggregation) written as the public verl port computes it (mean absolute
log-probability difference over layers and the old top-k, then exp(−·)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl import reduction as S


@torch.no_grad()
def router_shift_ratio(
    logits_BTLE: Tensor, old_logits_BTLE: Tensor, old_ids_BTLK: Tensor, mask_BT: Tensor, floor: float
) -> tuple[Tensor, S.Stats]:
    """γ̃ `[B, T]` (float32, detached, 1 at padding) and its stats.

    logits_BTLE: the current forward's router logits at the response positions; old_logits_BTLE the old
    policy's; old_ids_BTLK the experts the old policy activated. Stats: `router_shift/gamma/mean` (of γ̃
    over valid tokens), `router_shift/gamma/min` (of γ before the floor), `router_shift/floored_frac`
    (tokens with γ < γ_min)."""
    ids = old_ids_BTLK.long().to(logits_BTLE.device)
    new_BTLK = torch.log_softmax(logits_BTLE.double(), -1).gather(-1, ids)
    old_BTLK = torch.log_softmax(old_logits_BTLE.to(logits_BTLE.device).double(), -1).gather(-1, ids)
    delta_BT = (new_BTLK - old_BTLK).abs().mean(dim=(-2, -1))
    gamma_BT = torch.exp(-delta_BT)
    floored_BT = gamma_BT.clamp(min=floor)
    stats = {
        "router_shift/gamma/mean": S.mean(floored_BT[mask_BT]),
        "router_shift/gamma/min": S.minimum(gamma_BT[mask_BT]),
        "router_shift/floored_frac": S.mean((gamma_BT < floor)[mask_BT]),
    }
    return torch.where(mask_BT, floored_BT, 1.0).float(), stats
