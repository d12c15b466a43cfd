r"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, §3.1).

Shape legend: B = sequences, T = padded token positions.

    r_it = exp(clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND))          (`surrogate.token_ratio`, detached)
    r̂_it = clip(r_it, 1 − clip_low, 1 + clip_high)
    ℓ_it = −sg(r̂_it) Â_it logp_it
    loss = agg(ω_it ℓ_it) + beta · agg(kl(logp, ref_logp))

Where GRPO clips the ratio inside a min, which zeroes a clipped token's gradient, CISPO clips only the
ratio's *weight* on a REINFORCE term, so every token keeps a gradient: ∇ℓ_it = −r̂_it Â_it ∇logp_it, equal
to GRPO's wherever GRPO's clip is inactive. The loss's value is not a surrogate of the return (only its
gradient matters). The paper normalises by the batch's token count: loss_agg="token-mean" by default.
No dual-clip (there is no min to cap).

Conventions against the other systems (same loss, different parametrisation):
- The weight is clip(r, 1 − clip_low, 1 + clip_high), as in verl `loss_mode=cispo`. TRL
  `loss_type="cispo"` caps r at `epsilon_high` itself (an absolute ε_max, ScaleRL), with no lower bound:
  TRL epsilon_high = E is moe-rl clip_high = E − 1 with clip_low = 1.
- clip_low = 1 means "no lower bound" (the paper: "we did not impose a lower bound").
- `clip/*` counts a token whose weight is truncated, whatever the advantage's sign, as verl does (its
  gradient is scaled, not zeroed); TRL's `cispo_clip_ratio` counts only r > ε_max with Â > 0.
- `policy/extreme_weight_share` is over every valid token, each weighted by its truncated weight:
  Σ r̂ |Â| [r extreme] / Σ r̂ |Â|, r judged before truncation.
"""

from __future__ import annotations

from moe_rl.objectives.surrogate import Prepared, Ratio, Surrogate, declared, token_ratio


def truncated_weight_reinforce(ratio: Ratio, p: Prepared) -> Surrogate:
    """ℓ_it = −sg(clip(r_it, 1 − clip_low, 1 + clip_high)) Â_it logp_it; no token's gradient is dropped."""
    c = p.x.cfg
    r_BT = ratio.value.detach()
    r_hat_BT = r_BT.clamp(1.0 - c.clip_low, 1.0 + c.clip_high)
    loss_BT = -r_hat_BT * p.adv_BT * p.logp_BT
    low_BT, high_BT = p.mask_BT & (r_BT < 1.0 - c.clip_low), p.mask_BT & (r_BT > 1.0 + c.clip_high)
    return Surrogate(loss_BT, low_BT, high_BT, p.mask_BT, r_hat_BT)


CISPO = declared("cispo", build_ratio=token_ratio, surrogate=truncated_weight_reinforce)
cispo = CISPO
