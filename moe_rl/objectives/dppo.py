r"""DPPO: the trust region on the divergence between the anchor and the current policy, not on the sampled
ratio (arXiv 2602.04879). As sail-sg/Stable-RL's `compute_policy_loss_with_mask` (binary and top-k, TV
and KL) and verl's `dppo_tv` / `dppo_kl`; `dppo_prime` is prime-rl's default loss.

Shape legend: B sequences, T padded token positions. d_t = logp_t − log π_a(y_t), π_a the anchor:
π_old (objective.anchor=old, verl's default) or the sampler μ (anchor=sampler: verl's "bypass", Stable-RL's
default variants, prime-rl's only anchor). p = e^{logp}, p_a = e^{log π_a} of the sampled token.

    drop_t  = up_t    where Â_t > 0      (the direction Â > 0 pushes)
            = down_t  where Â_t ≤ 0      (Â = 0 takes this branch, as every reference)
      binary TV:  up = p − p_a > δ_high,                 down = p − p_a < −δ_low
      binary KL:  up = KL_t > δ_high ∧ p > p_a,           down = KL_t > δ_low ∧ p < p_a
                  KL_t = p_a (log p_a − log p) + (1 − p_a) log((1 − p_a + 1e-8) / (1 − p + 1e-8))
      top-k TV/KL: as binary KL with KL_t the top-k divergence (moe_rl.objectives.topk) between the
                  sampler's top-k distribution and π_θ's on the same tokens
    ℓ_t     = −Â_t · sg[min(r_t, C)] · [¬drop_t] · logp_t + kl_tau · d_t²,   r_t = e^{clamp(d_t, ±20)}
    loss    = token-mean(ℓ) by default (masked tokens stay in the denominator, as the references)

The gradient of a kept token is −Â min(r, C) ∇logp: the importance-weighted policy gradient, truncated at
C; a dropped token has none. Defaults as verl's example: δ 0.15 (TV) and 0.05 (KL), C = 20 (verl's code;
its scripts set 1e4, Stable-RL's config 3). The divergence, p and p_a carry no gradient.

Where it departs from the references: the log-ratio clamp is two-sided (verl; Stable-RL clamps above only);
rollout IS weights multiply ℓ as verl does (Stable-RL ignores them); the top-k variants are anchored on
the sampler (the only top-k distribution there is, as Stable-RL) and refuse anchor=old. `dppo_prime`
(prime-rl `default_loss_fn`: binary TV 0.2 / 0.2 on the sampler, + 1e-3·d², global token-mean) takes C
above e^20, so its gradient is prime-rl's −Â r ∇logp + 2τ d ∇logp exactly (up to the ±20 clamp); its
loss *value* is −Â sg[r] logp where prime-rl's is −Â r (equal gradients, different numbers).

Metrics: `clip/low_frac` and `clip/high_frac` count the dropped tokens with Â < 0 and Â > 0 (prime-rl's
is_masked_low / is_masked_high), `clip/token_frac` both, `clip/seq_frac` sequences with a dropped token;
`policy/dppo_truncated_frac` the kept tokens whose ratio C truncates (verl's pg_clipfrac_lower);
`policy/dppo_divergence/mean` the mean divergence over valid tokens (p − p_a for TV: its mean signed shift).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moe_rl import reduction as S
from moe_rl.objectives.surrogate import Prepared, Ratio, Surrogate, declared, token_ratio
from moe_rl.objectives.topk import topk_divergence

BERNOULLI_EPS = 1e-8


def bernoulli_kl(p_a: Tensor, p: Tensor, log_p_a: Tensor, log_p: Tensor) -> Tensor:
    """KL(Bern(p_a) ‖ Bern(p)) of the sampled token, Stable-RL's form (ε only in the 1 − · terms)."""
    return p_a * (log_p_a - log_p) + (1 - p_a) * torch.log((1.0 - p_a + BERNOULLI_EPS) / (1.0 - p + BERNOULLI_EPS))


def dropped(p: Prepared, divergence: str) -> tuple[Tensor, Tensor]:
    """([B, T] bool tokens the trust region drops, [B, T] the divergence it judged), no gradient."""
    c = p.x.cfg
    with torch.no_grad():
        log_q, log_a = p.logp_BT.detach().double(), p.old_logp_BT.double()
        q, a = log_q.exp(), log_a.exp()
        if divergence == "tv":
            div = q - a
            up, down = div > c.delta_high, div < -c.delta_low
        else:
            div = bernoulli_kl(a, q, log_a, log_q) if divergence == "kl" else topk_divergence(p.x.topk, divergence[5:])
            up, down = (div > c.delta_high) & (q > a), (div > c.delta_low) & (q < a)
        drop = torch.where(p.adv_BT > 0, up, down) & p.mask_BT
    return drop, div


def trust_region(divergence: str) -> Callable[[Ratio, Prepared], Surrogate]:
    """The DPPO surrogate with the given divergence: tv, kl, topk_tv or topk_kl."""

    def surrogate(ratio: Ratio, p: Prepared) -> Surrogate:
        c = p.x.cfg
        drop_BT, div_BT = dropped(p, divergence)
        keep_BT = p.mask_BT & ~drop_BT
        weight_BT = ratio.value.detach().clamp(max=c.ratio_cap)
        loss_BT = -p.adv_BT * weight_BT * keep_BT * p.logp_BT
        if c.kl_tau:  # prime-rl's τ·(log π_θ − log π_a)² on every valid token
            loss_BT = loss_BT + c.kl_tau * (p.logp_BT - p.old_logp_BT).square()
        stats = {
            "policy/dppo_truncated_frac": S.mean((ratio.value.detach() > c.ratio_cap)[keep_BT]),
            "policy/dppo_divergence/mean": S.mean(div_BT[p.mask_BT]),
        }
        low_BT, high_BT = drop_BT & (p.adv_BT < 0), drop_BT & (p.adv_BT > 0)
        return Surrogate(loss_BT, low_BT, high_BT, keep_BT, weight_BT, stats)  # the clamp stops no ∇logp

    surrogate.__name__ = f"trust_region_{divergence}"
    return surrogate


DPPO_TV = declared("dppo_tv", build_ratio=token_ratio, surrogate=trust_region("tv"))
DPPO_KL = declared("dppo_kl", build_ratio=token_ratio, surrogate=trust_region("kl"))
DPPO_TOPK_TV = declared("dppo_topk_tv", build_ratio=token_ratio, surrogate=trust_region("topk_tv"))
DPPO_TOPK_KL = declared("dppo_topk_kl", build_ratio=token_ratio, surrogate=trust_region("topk_kl"))
