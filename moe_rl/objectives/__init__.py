"""Policy objectives for RL of (MoE) language models: GRPO, GSPO and GSPO-token (arXiv 2507.18071).

Every objective is a pure function with one signature, so the trainer picks it by name and calls it
the same way whichever it is:

    loss, metrics = OBJECTIVES[name](logp_BT, old_logp_BT, adv_B_or_BT, mask_BT,
                                     clip_low=..., clip_high=..., loss_agg=..., max_len=...,
                                     beta=..., ref_logp=..., extreme_band=...)

GRPO and GSPO differ only in the importance ratio they clip: w_it per token (GRPO) or s_i per sequence
(GSPO). Unknown keywords raise TypeError; values that cannot apply (loss_agg other than
seq-mean-token-mean for gspo, beta > 0 without ref_logp) raise ValueError.

## Metrics

Python floats, computed under `no_grad` in float64 over valid tokens only. Notation: d_it = logp_it −
old_logp_it; r_it = exp(clamp(d_it, ±20)) the token ratio; s_i = exp(clamp(mean_t d_it, ±20)) the
sequence ratio; ρ_it the ratio the objective clips (w_it = r_it for grpo, s_i for gspo and gspo_token);
N = valid tokens; B' = sequences with at least one valid token; [·] = 1 if true else 0;
low_it = [Â_it < 0 ∧ ρ_it < 1 − clip_low], high_it = [Â_it > 0 ∧ ρ_it > 1 + clip_high] (the clip is
active in the min, so the token's gradient is zero). A metric whose denominator is empty (no valid
token, no sequence with two tokens) is NaN, never a placeholder 0.

| key | formula |
|---|---|
| `clip/token_frac` | 1/N Σ (low_it ∨ high_it); under gspo every token of a clipped sequence counts (Fig. 2) |
| `clip/low_frac` | 1/N Σ low_it |
| `clip/high_frac` | 1/N Σ high_it |
| `clip/seq_frac` | 1/B' Σ_i [∃t: low_it ∨ high_it]: grpo, sequences with a clipped token; gspo, clipped |
| `ratio/token/mean` | 1/N Σ r_it (for every objective, so runs compare) |
| `ratio/token/var` | 1/N Σ (r_it − mean r)² (population variance over all valid tokens) |
| `ratio/token/within_seq_var` | mean over sequences with n_i ≥ 2 tokens of 1/n_i Σ_t (r_it − mean_t r_it)² |
| `ratio/token/max`, `ratio/token/min` | max_it r_it, min_it r_it |
| `ratio/token/extreme_frac` | 1/N Σ [r_it < lo ∨ r_it > hi], (lo, hi) = extreme_band, default (0.5, 2) |
| `ratio/seq/mean` | 1/B' Σ_i s_i |
| `ratio/seq/var` | 1/B' Σ_i (s_i − mean s)² |
| `policy/approx_kl` | 1/N Σ exp(−d_it) + d_it − 1 (k3 of old vs new, d clamped to ±20) |
| `policy/logp_diff/abs_mean` | 1/N Σ abs(d_it) (not clamped) |
| `policy/ref_kl` | beta > 0 only: agg(exp(δ_it) − δ_it − 1), δ = ref_logp − logp; the penalty before beta |
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from moe_rl.objectives.common import group_advantages
from moe_rl.objectives.grpo import grpo
from moe_rl.objectives.gspo import gspo, gspo_token


class Objective(Protocol):
    """The signature every entry of OBJECTIVES has; see `grpo` for the meaning of each argument."""

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip_low: float,
        clip_high: float,
        loss_agg: str = ...,
        max_len: int | None = ...,
        beta: float = ...,
        ref_logp: Tensor | None = ...,
        extreme_band: tuple[float, float] = ...,
    ) -> tuple[Tensor, dict[str, float]]: ...


OBJECTIVES: dict[str, Objective] = {"grpo": grpo, "gspo": gspo, "gspo_token": gspo_token}

__all__ = ["OBJECTIVES", "Objective", "group_advantages", "grpo", "gspo", "gspo_token"]
