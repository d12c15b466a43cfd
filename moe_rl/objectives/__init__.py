r"""Policy objectives for RL of (MoE) language models: GRPO, GSPO and GSPO-token (arXiv 2507.18071),
CISPO (arXiv 2506.13585) and GMPO (arXiv 2507.20673), with dual-clip, rollout importance-sampling
correction and a choice of KL estimator as options.

One surrogate, many ratios (`surrogate.py`): an objective is a ratio and a surrogate, and `compute` does the
rest once for all of them (rollout correction, aggregation, KL penalty, diagnostics):

| name | ratio | surrogate |
|---|---|---|
| grpo | `token_ratio` w_it (Eq. 3) | `ppo_clip` (Eq. 2; dual-clip) |
| gspo | `seq_ratio` s_i (Eq. 7) | `ppo_clip` (Eq. 5; dual-clip) |
| gspo_token | `seq_token_ratio` s_it = sg[s_i]·π_θ/sg[π_θ] (Eq. 14) | `ppo_clip` (Eq. 13) |
| cispo | `token_ratio`, detached | `truncated_weight_reinforce` −sg(clip(r))·Â·log π |
| gmpo | `geo_mean_clipped_ratio` (each log d_it clipped, then the mean) | `policy_gradient` −ρÂ |
| sapo | `token_ratio` w_it | `soft_gate` −σ(τ(w − 1))·4/τ·Â (arXiv 2511.20347) |
| sapo_seq | `seq_ratio` s_i | `soft_gate` |
| vespo | `summed_log_ratio` w_i, ω folded into log w (arXiv 2602.10693) | `gamma_weighted_reinforce` −sg[w^k e^{λ(1−w)}]·Â·log π |
| luspo | `seq_ratio` s_i | `length_weighted_clip`: `ppo_clip` × \|y_i\| (arXiv 2602.05261) |
| dppo_tv, dppo_kl, dppo_topk_tv, dppo_topk_kl | `token_ratio` against objective.anchor | `trust_region`: drop a token whose divergence leaves δ in Â's direction, −Â·sg[min(r, C)]·log π (arXiv 2602.04879) |

The rivals' formulas, references and departures are in their modules' docstrings (vespo.py, dppo.py,
topk.py). An objective receives the run's `ObjectiveConfig` whole (`ObjectiveInputs.cfg`), so a new option
is a field of moe_rl/objectives/config.py and its use in the objective, with no copy list in the trainer.

Options every objective takes on top: `opsm_delta` (off-policy sequence masking, DeepSeek-V3.2) multiplies
ω by the mask `surrogate.opsm_keep`; `kl_estimator=k3_unbiased` weights k3 by π_θ / π_old.

So GRPO and GSPO differ only in the ratio. The trainer builds one `ObjectiveInputs` value (the tensors and
the options) and calls `OBJECTIVES[name].compute(inputs)`, which returns `(loss, Stats)`: metrics as sums
and counts (`moe_rl.reduction`) that reduce exactly over ranks and mini-batches, with no list of names.
Any other caller may use the keyword form, which builds the inputs and returns float metrics:

    loss, metrics = OBJECTIVES[name](logp_BT, old_logp_BT, adv_B_or_BT, mask_BT, clip_low=..., clip_high=...,
                                     loss_agg=..., max_len=..., beta=..., ref_logp=..., ...)

Unknown keywords raise TypeError; values that cannot apply (loss_agg other than seq-mean-token-mean for
gspo or gmpo, beta > 0 without ref_logp, a dual-clip constant for cispo or gmpo, rollout_is without
sampler_logp) raise ValueError. Each name's `Objective` states which options apply, in its row of
`capabilities.CAPABILITIES`, which start-up validation of the config reads without importing torch.

Options every objective takes (see common.py): `kl_estimator` ∈ {k1, k2, k3, low_var_kl} picks the
penalty kl(logp, ref) in `beta · agg(kl)`, with δ = ref_logp − logp: k1 = −δ, k2 = δ²/2,
k3 = exp(δ) − δ − 1, low_var_kl = min(k3, 10). `rollout_is` ∈ {none, token_truncate, token_mask,
sequence_truncate, sequence_mask, geo_sequence_truncate, geo_sequence_mask, icepop} multiplies each
token's loss by ω = a function of ρ = π_old / π_sampler (see `common.rollout_is_weight`), capped at
`rollout_is_cap` (truncate) or zero outside [1/cap, cap] (mask; icepop: outside `rollout_is_band`). `clip_ratio_c` (grpo, gspo, gspo_token) is dual-clip's c.

## Metrics

`Stats` from `compute` (floats from the keyword form), computed under `no_grad` in float64 over valid
tokens only; each is a (sum, count) pair, an extreme, or a sum (`moe_rl.reduction`). Notation: d_it = logp_it −
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
| `policy/extreme_grad_weight/sum` | the same sum over the entries whose ratio ρ_k is extreme: ρ_k < lo or ρ_k > hi, (lo, hi) = extreme_weight_band, default (0.1, 10). |
| `policy/extreme_weight_share` | `policy/extreme_grad_weight/sum` / `policy/grad_weight/sum`, a `share` stat (moe_rl.reduction), so the step's value is the quotient of the step's sums over every rank and mini-batch; NaN when no gradient-carrying weight is left |
| `policy/approx_kl` | 1/N Σ exp(d_it) − d_it − 1 = (r − 1) − log r, r = π_θ/π_old: the unbiased k3 estimate of KL(π_old ‖ π_θ) on samples from π_old (cleanrl, TRL); d clamped to ±20 |
| `policy/logp_diff/abs_mean` | 1/N Σ abs(d_it) (not clamped) |
| `policy/ref_kl` | beta > 0 only: agg(kl_it) with the chosen `kl_estimator` (default k3 = exp(δ_it) − δ_it − 1), δ = ref_logp − logp; the penalty before beta |
| `clip/dual_frac` | clip_ratio_c set only: 1/N Σ [Â_it < 0 ∧ ρ_it > c], tokens whose loss dual-clip caps at c·\|Â_it\| (zero gradient); not counted in `clip/token_frac` |
| `rollout_is/mean`, `rollout_is/max` | rollout_is ≠ none only: 1/N Σ q_it and max q_it of the sampler correction q_it = exp(clamp(old_logp_it − sampler_logp_it, ±20)) before truncation or masking; sequence modes use q_i = exp(clamp(Σ_t (old_logp_it − sampler_logp_it), ±20)) at each of the sequence's tokens |
| `rollout_is/clipped_frac` | *_truncate only: 1/N Σ [q_it > cap] |
| `rollout_is/masked_frac` | *_mask and icepop only: 1/N Σ [q_it ∉ [1/cap, cap]] (icepop: ∉ rollout_is_band; tokens, or every token of a masked sequence); geo_sequence_* use q_i = exp(clamp(1/n_i Σ_t (old_logp_it − sampler_logp_it), ±20)) |
| `rollout_is/ess`, `rollout_is/chi2` | rollout_is ≠ none, or mismatch_diagnostics (the trainer: a sampler that is not exact, moe_rl.trainer.samplers: trainer.sampler_dtype set, vLLM, staleness): over non-empty sequences, w_i = exp(clamp(Σ_t (old_logp_it − sampler_logp_it), ±20)) = π_old(y_i)/π_sampler(y_i); ESS = (Σ w)² / (B' Σ w²) ∈ (0, 1], χ² = 1/B' Σ w² − 1 |
| `policy/opsm_masked_frac` | opsm_delta set only: 1/N Σ [Â_it < 0 ∧ 1/n_i Σ_t (sampler_logp_it − logp_it) > δ], the tokens off-policy sequence masking drops |
| `policy/gate_weight/mean` | sapo, sapo_seq only (instead of `clip/*`): 1/N Σ 4σ_it(1 − σ_it), σ = σ(τ(ρ − 1)), the gate's gradient factor (1 on-policy) |
| `policy/vespo_phi/mean` | vespo only (no `clip/*`): 1/B' Σ_i φ_i |
| `policy/dppo_truncated_frac`, `policy/dppo_divergence/mean` | the DPPO family: kept tokens with r > C over kept tokens; the judged divergence over valid tokens. Its `clip/low_frac` and `clip/high_frac` count the tokens its trust region drops with Â < 0 and Â > 0 |

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
- sapo, sapo_seq: tokens (sequences) within the log-ratio clamp; g = 4σ(1 − σ)·ρ, ρ = r_it (s_i).
Neither the rollout IS weight ω nor the aggregation's 1/|y_i| or 1/N enters g.

For cispo, low_it = [r_it < 1 − clip_low] and high_it = [r_it > 1 + clip_high] whatever Â's sign: the
weight is truncated (its gradient scaled, not zeroed). For gmpo, low_it = [Â_i < 0 ∧ d_it < −clip_low]
and high_it = [Â_i > 0 ∧ d_it > clip_high]: the token's log-space clip is active and its gradient zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.lazy import lazy_attributes
from moe_rl.objectives.capabilities import CAPABILITIES, Capabilities
from moe_rl.objectives.config import ObjectiveConfig, validate_config

if TYPE_CHECKING:
    from moe_rl.objectives.cispo import cispo
    from moe_rl.objectives.common import group_advantages
    from moe_rl.objectives.gmpo import gmpo
    from moe_rl.objectives.grpo import grpo
    from moe_rl.objectives.gspo import gspo, gspo_token
    from moe_rl.objectives.registry import OBJECTIVES
    from moe_rl.objectives.surrogate import Objective, ObjectiveInputs
    from moe_rl.objectives.topk import TopK

_LAZY = {
    "OBJECTIVES": "moe_rl.objectives.registry", "Objective": "moe_rl.objectives.surrogate",
    "ObjectiveInputs": "moe_rl.objectives.surrogate", "TopK": "moe_rl.objectives.topk",
    "cispo": "moe_rl.objectives.cispo", "gmpo": "moe_rl.objectives.gmpo", "grpo": "moe_rl.objectives.grpo",
    "gspo": "moe_rl.objectives.gspo", "gspo_token": "moe_rl.objectives.gspo",
    "group_advantages": "moe_rl.objectives.common",
}
"""Imported on first use (PEP 562): the math needs torch, and the schema (`config`, `capabilities`, read by
`moe_rl.config`) needs none of it."""

__all__ = ["CAPABILITIES", "OBJECTIVES", "Capabilities", "Objective", "ObjectiveConfig", "ObjectiveInputs", "TopK",
           "cispo", "gmpo", "group_advantages", "grpo", "gspo", "gspo_token", "validate_config"]

__getattr__ = lazy_attributes(__name__, _LAZY)
