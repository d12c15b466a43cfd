r"""Policy objectives for RL of (MoE) language models: GRPO, GSPO and GSPO-token (arXiv 2507.18071),
CISPO (arXiv 2506.13585) and GMPO (arXiv 2507.20673), with dual-clip, rollout importance-sampling
correction and a choice of KL estimator as options.

Every objective is a pure function with one signature, so the trainer picks it by name and calls it
the same way whichever it is:

    loss, metrics = OBJECTIVES[name](logp_BT, old_logp_BT, adv_B_or_BT, mask_BT,
                                     clip_low=..., clip_high=..., loss_agg=..., max_len=...,
                                     beta=..., ref_logp=..., extreme_band=..., kl_estimator=...,
                                     clip_ratio_c=..., sampler_logp=..., rollout_is=..., rollout_is_cap=...,
                                     extreme_weight_band=...)

GRPO and GSPO differ only in the importance ratio they clip: w_it per token (GRPO) or s_i per sequence
(GSPO). GMPO clips each token's log-ratio and then takes the sequence's geometric mean; CISPO clips the
ratio's weight on a REINFORCE term instead of the surrogate. Unknown keywords raise TypeError; values that
cannot apply (loss_agg other than seq-mean-token-mean for gspo or gmpo, beta > 0 without ref_logp, a
dual-clip constant for cispo or gmpo, rollout_is without sampler_logp) raise ValueError. `SPECS` states
per objective which options apply, for start-up validation of the config.

Options every objective takes (see common.py): `kl_estimator` ∈ {k1, k2, k3, low_var_kl} picks the
penalty kl(logp, ref) in `beta · agg(kl)`, with δ = ref_logp − logp: k1 = −δ, k2 = δ²/2,
k3 = exp(δ) − δ − 1, low_var_kl = min(k3, 10). `rollout_is` ∈ {none, token_truncate, token_mask,
sequence_truncate, sequence_mask} multiplies each token's loss by ω = a function of
ρ = π_old / π_sampler (see `common.rollout_is_weight`), capped at `rollout_is_cap` (truncate) or zero
outside [1/cap, cap] (mask). `clip_ratio_c` (grpo, gspo, gspo_token) is dual-clip's c.

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
| `ratio/seq/max`, `ratio/seq/min` | max_i s_i, min_i s_i |
| `ratio/token/pos_adv/max`, `ratio/token/pos_adv/min`, `ratio/token/neg_adv/max`, `ratio/token/neg_adv/min` | max and min of r_it over valid tokens with Â_it > 0 (`pos_adv`) or Â_it < 0 (`neg_adv`); Â = 0 counts in neither; NaN when there is no such token. They say which side of a blow-up can carry gradient (moe_rl.trainer.collapse) |
| `ratio/seq/pos_adv/max`, ..., `ratio/seq/neg_adv/min` | the same for s_i, over the tokens of each sign (s_i at each of its sequence's tokens) |
| `policy/grad_weight/sum` | Σ_k g_k \|Â_k\| over gradient-carrying entries k (defined below): the total weight on the ∇logp terms before aggregation; a sum, so mini-batches and ranks add it |
| `policy/extreme_grad_weight/sum` | the same sum over the entries whose ratio ρ_k is extreme: ρ_k < lo or ρ_k > hi, (lo, hi) = extreme_weight_band, default (0.1, 10). The trainer logs their quotient as `policy/extreme_weight_share` (`common.extreme_weight_share`) |
| `policy/approx_kl` | 1/N Σ exp(d_it) − d_it − 1 = (r − 1) − log r, r = π_θ/π_old: the unbiased k3 estimate of KL(π_old ‖ π_θ) on samples from π_old (cleanrl, TRL); d clamped to ±20 |
| `policy/logp_diff/abs_mean` | 1/N Σ abs(d_it) (not clamped) |
| `policy/ref_kl` | beta > 0 only: agg(kl_it) with the chosen `kl_estimator` (default k3 = exp(δ_it) − δ_it − 1), δ = ref_logp − logp; the penalty before beta |
| `clip/dual_frac` | clip_ratio_c set only: 1/N Σ [Â_it < 0 ∧ ρ_it > c], tokens whose loss dual-clip caps at c·\|Â_it\| (zero gradient); not counted in `clip/token_frac` |
| `rollout_is/mean`, `rollout_is/max` | rollout_is ≠ none only: 1/N Σ q_it and max q_it of the sampler correction q_it = exp(clamp(old_logp_it − sampler_logp_it, ±20)) before truncation or masking; sequence modes use q_i = exp(clamp(Σ_t (old_logp_it − sampler_logp_it), ±20)) at each of the sequence's tokens |
| `rollout_is/clipped_frac` | *_truncate only: 1/N Σ [q_it > cap] |
| `rollout_is/masked_frac` | *_mask only: 1/N Σ [q_it ∉ [1/cap, cap]] (tokens, or every token of a masked sequence) |

Gradient-carrying entries k of the two `*grad_weight/sum` rows, their weight g_k on Â ∇logp and the ratio
ρ_k judged extreme (the issue's Σ|w_it·Â_i| over unclipped tokens, and its sequence analogue):
- grpo: tokens; g = ρ = r_it; excluded: low_it, high_it, dual-clipped tokens (Â_it < 0 ∧ r_it > c) and
  |d_it| > 20, where the clamp passes no gradient.
- gspo: sequences; g = ρ = s_i; excluded: clipped or dual-clipped sequences and |mean_t d_it| > 20.
- gspo_token: sequences; g = ρ = s_i, with |Â_i| read as 1/n_i Σ_t |Â_it| over the sequence's unclipped
  tokens (for per-sequence advantages exactly gspo's).
- gmpo: sequences; ρ = s_i (before the clip), g = the clipped geometric mean ρ_i, with |Â_i| scaled by the
  fraction of the sequence's tokens that keep a gradient (not clipped, |d_it| ≤ 20).
- cispo: drops no token's gradient, so every valid token counts; ρ = r_it, g = its truncated weight r̂_it.
Neither the rollout IS weight ω nor the aggregation's 1/|y_i| or 1/N enters g.

For cispo, low_it = [r_it < 1 − clip_low] and high_it = [r_it > 1 + clip_high] whatever Â's sign: the
weight is truncated (its gradient scaled, not zeroed). For gmpo, low_it = [Â_i < 0 ∧ d_it < −clip_low]
and high_it = [Â_i > 0 ∧ d_it > clip_high]: the token's log-space clip is active and its gradient zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from moe_rl.objectives.cispo import cispo
from moe_rl.objectives.common import AGGREGATIONS, SEQ_MEAN_TOKEN_MEAN, group_advantages
from moe_rl.objectives.gmpo import gmpo
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
        kl_estimator: str = ...,
        clip_ratio_c: float | None = ...,
        sampler_logp: Tensor | None = ...,
        rollout_is: str = ...,
        rollout_is_cap: float = ...,
        extreme_weight_band: tuple[float, float] = ...,
    ) -> tuple[Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class ObjectiveSpec:
    """Which options an objective gives a meaning to (the functions raise on the rest; config reads it)."""

    loss_aggs: tuple[str, ...]
    """The loss_agg values it defines (a per-sequence loss has only seq-mean-token-mean)."""
    dual_clip: bool
    """Whether clip_ratio_c applies (PPO's min is there to cap)."""
    seq_advantages_only: bool
    """Whether advantages must be [B] (the trainer's are)."""
    clip_low_may_be_one: bool
    """Whether clip_low = 1 (no lower bound) is allowed."""
    ratio: str
    """The importance ratio the objective weights its gradient by, `token` (r_it) or `seq` (s_i; gmpo's
    geometric mean of token ratios is s_i before its clip): collapse detection watches `ratio/<ratio>/*`."""


_ALL_AGGS = tuple(AGGREGATIONS)
_SEQ = (SEQ_MEAN_TOKEN_MEAN,)
SPECS: dict[str, ObjectiveSpec] = {
    "grpo": ObjectiveSpec(loss_aggs=_ALL_AGGS, dual_clip=True, seq_advantages_only=False,
                          clip_low_may_be_one=False, ratio="token"),
    "gspo": ObjectiveSpec(loss_aggs=_SEQ, dual_clip=True, seq_advantages_only=True,
                          clip_low_may_be_one=False, ratio="seq"),
    "gspo_token": ObjectiveSpec(loss_aggs=_SEQ, dual_clip=True, seq_advantages_only=False,
                                clip_low_may_be_one=False, ratio="seq"),
    "cispo": ObjectiveSpec(loss_aggs=_ALL_AGGS, dual_clip=False, seq_advantages_only=False,
                           clip_low_may_be_one=True, ratio="token"),
    "gmpo": ObjectiveSpec(loss_aggs=_SEQ, dual_clip=False, seq_advantages_only=True,
                          clip_low_may_be_one=False, ratio="seq"),
}

OBJECTIVES: dict[str, Objective] = {
    "grpo": grpo, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo, "gmpo": gmpo,
}

__all__ = ["OBJECTIVES", "SPECS", "Objective", "ObjectiveSpec", "cispo", "gmpo", "group_advantages", "grpo",
           "gspo", "gspo_token"]
