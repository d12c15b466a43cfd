"""What each objective gives a meaning to, declared without torch: the names config validation reads.

`CAPABILITIES` has one row per registry name. The objective modules build their `Objective` from their row
(`surrogate.declared`), so the registry and config validation read one declaration, and `import
moe_rl.config` (which validates against these rows) never loads torch. The option names (aggregations, KL
estimators, rollout IS modes) live here for the same reason; `common.py` implements each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
AGGREGATION_NAMES = (SEQ_MEAN_TOKEN_MEAN, "token-mean", "seq-mean-token-sum-norm")
"""objective.loss_agg values (implemented by `common.AGGREGATIONS`)."""
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "low_var_kl", "k3_unbiased")
"""objective.kl_estimator values (`common.KL_ESTIMATORS`, then `common.IS_WEIGHTED_KL`)."""
ROLLOUT_IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                    "geo_sequence_truncate", "geo_sequence_mask", "icepop")
"""Rollout importance-sampling correction modes: TRL's `vllm_importance_sampling_mode` names, the
geometric-mean sequence modes of "When Speed Kills Stability" (verl rollout_rs=geometric), and IcePop."""
FOLDABLE_ROLLOUT_IS = ("none", "token_truncate", "token_mask")
"""The modes an objective that folds the correction into its own weight takes (VESPO; TRL refuses the others)."""


@dataclass(frozen=True)
class Capabilities:
    """Which options an objective gives a meaning to (config validation reads these; `Objective` adds the math)."""

    name: str
    ratio: str
    """The ratio whose extremes collapse detection watches: `token` (r_it) or `seq` (s_i)."""
    loss_aggs: tuple[str, ...]
    """The loss_agg values it defines (a per-sequence loss has only seq-mean-token-mean)."""
    default_loss_agg: str = SEQ_MEAN_TOKEN_MEAN
    dual_clip: bool = False
    """Whether clip_ratio_c applies (PPO's min is there to cap)."""
    seq_advantages_only: bool = False
    """Whether advantages must be [B] (the trainer's are)."""
    clip_low_may_be_one: bool = False
    """Whether clip_low = 1 (no lower bound) is allowed."""
    folds_rollout_is: bool = False
    """Whether the ratio takes the rollout IS correction inside it (VESPO: into log w), so that `compute`
    does not multiply the loss by ω again."""
    anchored: bool = False
    """Whether it reads objective.anchor (the DPPO family): anchor=sampler builds its ratio on μ."""
    needs_topk: bool = False
    """Whether it reads the sampler's top-k distribution (`ObjectiveInputs.topk`; the sampler records it)."""


def _dppo(name: str) -> Capabilities:
    """A DPPO-family row: every aggregation (token-mean by default), anchored, top-k for the top-k divergences."""
    return Capabilities(name, ratio="token", loss_aggs=AGGREGATION_NAMES, default_loss_agg="token-mean",
                        anchored=True, needs_topk=name.startswith("dppo_topk"))


SEQ_ONLY = (SEQ_MEAN_TOKEN_MEAN,)
CAPABILITIES: dict[str, Capabilities] = {
    c.name: c
    for c in (
        Capabilities("grpo", ratio="token", loss_aggs=AGGREGATION_NAMES, dual_clip=True),
        Capabilities("gspo", ratio="seq", loss_aggs=SEQ_ONLY, dual_clip=True, seq_advantages_only=True),
        Capabilities("gspo_token", ratio="seq", loss_aggs=SEQ_ONLY, dual_clip=True),
        Capabilities("cispo", ratio="token", loss_aggs=AGGREGATION_NAMES, default_loss_agg="token-mean",
                     clip_low_may_be_one=True),
        Capabilities("gmpo", ratio="seq", loss_aggs=SEQ_ONLY, seq_advantages_only=True),
        Capabilities("sapo", ratio="token", loss_aggs=AGGREGATION_NAMES),
        Capabilities("sapo_seq", ratio="seq", loss_aggs=SEQ_ONLY, seq_advantages_only=True),
        Capabilities("vespo", ratio="seq", loss_aggs=AGGREGATION_NAMES, default_loss_agg="token-mean",
                     seq_advantages_only=True, folds_rollout_is=True),
        Capabilities("luspo", ratio="seq", loss_aggs=SEQ_ONLY, dual_clip=True, seq_advantages_only=True),
        _dppo("dppo_tv"),
        _dppo("dppo_kl"),
        _dppo("dppo_topk_tv"),
        _dppo("dppo_topk_kl"),
    )
}
"""Every objective's row, keyed by its registry name (`moe_rl.objectives.OBJECTIVES` has the same keys)."""
