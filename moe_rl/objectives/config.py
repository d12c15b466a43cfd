"""The objective's typed config: every option of every objective, handed to the objective whole.

The trainer builds `ObjectiveInputs(tensors..., cfg=cfg.objective)` and the objective reads the fields it
gives a meaning to, so a new option is a field here, its use in the objective, and its YAML: no copy list
between them (verl hands its policy loss the config the same way). `validate` checks each field's own
range; the checks that need the objective's capabilities (which loss_agg it defines, whether it has a min
for dual-clip, ...) are `validate_config`, which reads the objective's row of `capabilities.CAPABILITIES`
(the rows the registry's objectives are built from), so validation never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.objectives.capabilities import (
    AGGREGATION_NAMES,
    CAPABILITIES,
    FOLDABLE_ROLLOUT_IS,
    KL_ESTIMATOR_NAMES,
    ROLLOUT_IS_MODES,
)

ANCHORS = ("old", "sampler")
"""objective.anchor values: the policy a DPPO divergence is measured from."""


@dataclass
class ObjectiveConfig:
    """The policy objective and its clip range (GSPO paper's settings in conf/objective/)."""

    name: str = "gspo"
    """Registry key in moe_rl.objectives.OBJECTIVES: grpo, gspo, gspo_token, cispo, gmpo, sapo, sapo_seq,
    vespo, luspo, dppo_tv, dppo_kl, dppo_topk_tv, dppo_topk_kl."""
    preset: str = "gspo"
    """Label of the preset (grpo, grpo_rr, grpo_r3, gspo, gspo_token, cispo, gmpo, grpo_dualclip,
    grpo_tis, ...; see conf/objective/) used in tables and W&B."""
    clip_low: float = 3e-4
    """Lower clip: ratios below 1 - clip_low are clipped for negative advantages. cispo: the weight's lower
    bound 1 - clip_low (1 = none, its paper); gmpo: a log-space bound, log-ratios below -clip_low."""
    clip_high: float = 4e-4
    """Upper clip: ratios above 1 + clip_high are clipped for positive advantages. cispo: the weight's upper
    bound 1 + clip_high; gmpo: a log-space bound, log-ratios above clip_high."""
    loss_agg: str = "seq-mean-token-mean"
    """Aggregation (grpo and cispo; the others define seq-mean-token-mean only): seq-mean-token-mean,
    token-mean, seq-mean-token-sum-norm."""
    beta: float = 0.0
    """KL penalty to the initial (reference) policy, estimated by kl_estimator; 0 as in the paper."""
    kl_estimator: str = "k3"
    """KL estimator of the beta penalty, δ = ref_logp - logp: k1 (-δ), k2 (δ²/2), k3 (exp δ - δ - 1),
    low_var_kl (k3 capped at 10, verl's low_var_kl) or k3_unbiased (k3 times π_θ / π_old, DeepSeek-V3.2's
    unbiased KL; TRL use_bias_correction_kl). Read only when beta > 0."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 (grpo, gspo, gspo_token): a negative advantage's loss is capped at c·|Â|
    (Ye et al. 2020; verl clip_ratio_c, default 3). null = off."""
    rollout_is: str = "none"
    """Rollout importance-sampling correction by ρ = π_old / π_sampler: none, token_truncate (TIS),
    sequence_truncate, token_mask (MIS), sequence_mask (TRL's vllm_importance_sampling_mode names; sequence
    ρ is the product of token ratios), geo_sequence_truncate, geo_sequence_mask (ρ the geometric mean,
    length-normalised: Geo-MIS), icepop (two-sided token mask [α, β] = rollout_is_band). Useful when the
    sampler differs from the trained model (trainer.sampler_dtype)."""
    rollout_is_cap: float = 2.0
    """C > 1 of rollout_is: truncate modes cap ρ at C; mask modes drop tokens or sequences with ρ outside
    [1/C, C]. Read only when rollout_is is not none or icepop."""
    rollout_is_band: list[float] = field(default_factory=lambda: [0.5, 5.0])
    """[α, β] of rollout_is=icepop, 0 <= α < 1 < β (Ring-1T's 0.5, 5): tokens with ρ outside it are masked."""
    opsm_delta: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): a sequence's Â < 0 tokens leave the loss when its mean
    log(π_sampler / π_θ) exceeds δ >= 0 (slime --opsm-delta, default 1e-4; TRL off_policy_mask_threshold).
    Any objective; null = off."""
    tau_pos: float = 1.0
    """SAPO's gate temperature for Â > 0 (sapo, sapo_seq; TRL sapo_temperature_pos, verl tau_pos)."""
    tau_neg: float = 1.05
    """SAPO's gate temperature for Â <= 0 (TRL sapo_temperature_neg, verl tau_neg)."""
    router_shift: bool = False
    """RSPO (arXiv 2510.23027): rescale the objective's importance ratio, before its clip, by the per-token
    router-shift ratio γ̃ = max(sg[exp(−mean over layers and the old policy's activated experts of
    |log p_θ(e) − log p_old(e)|)], router_shift_floor), p the router's softmax over experts, read from the
    update forward's recorded router logits (moe_rl.objectives.router_shift). Any objective; RSPO itself is
    gmpo with it (preset rspo)."""
    router_shift_floor: float = 0.8
    """γ_min in (0, 1]: the floor of the router-shift ratio (1 = rescaling off). No value could be read
    from the paper's stored text; 0.8 is the threshold the public verl port counts as clipped."""
    anchor: str = "old"
    """The DPPO family's anchor, the policy its divergence trust region is measured from: old (π_old, the
    proximal policy's log-probs; Stable-RL and verl's dppo_tv/dppo_kl by default) or sampler (the
    sampler's log-probs μ, verl's "bypass" mode and prime-rl's only anchor). The ratio r = π_θ / anchor."""
    delta_low: float = 0.15
    """DPPO's lower divergence bound δ_low: a token whose advantage is ≤ 0 leaves the loss when the
    divergence moved it down by more (TV: p − p_a < −δ_low; KL: KL > δ_low with p < p_a)."""
    delta_high: float = 0.15
    """DPPO's upper bound δ_high: a token with Â > 0 leaves the loss when p − p_a > δ_high (TV) or
    KL > δ_high with p > p_a (KL). verl's example: 0.15 for TV, 0.05 for KL."""
    ratio_cap: float = 20.0
    """DPPO's C > 0: the detached weight on −Â·log π is min(r, C) (verl 20, Stable-RL 10)."""
    topk: int = 20
    """k of dppo_topk_tv / dppo_topk_kl: the divergence is over the sampler's k most likely tokens at each
    position plus one bin for the rest of the vocabulary (the sampler must return them)."""
    kl_tau: float = 0.0
    """Coefficient of the squared log-ratio penalty τ·(log π_θ − log π_anchor)², token-mean (prime-rl's
    kl_tau, 1e-3 in dppo_prime; Kimi-K2.5). DPPO family only; 0 = none."""
    vespo_k_pos: float = 2.0
    """VESPO's gamma-kernel shape k for Â ≥ 0 (TRL vespo_k_pos)."""
    vespo_lambda_pos: float = 3.0
    """VESPO's rate λ for Â ≥ 0 (TRL vespo_lambda_pos)."""
    vespo_k_neg: float = 3.0
    """VESPO's k for Â < 0 (TRL vespo_k_neg)."""
    vespo_lambda_neg: float = 2.0
    """VESPO's λ for Â < 0 (TRL vespo_lambda_neg)."""
    normalize_std: bool = True
    """Divide group advantages by the group std (False = Dr. GRPO)."""
    extreme_band: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """Token ratios outside [lo, hi] count in ratio/token/extreme_frac."""
    extreme_weight_band: list[float] = field(default_factory=lambda: [0.1, 10.0])
    """Ratios (the objective's own: r_it, or s_i for gspo, gspo_token and gmpo) outside [lo, hi] count as
    extreme in policy/extreme_weight_share, the share of gradient weight Σ|ρ·Â| such entries carry."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the checks that read objective.* alone)."""
        if self.loss_agg not in AGGREGATION_NAMES:
            raise ValueError(f"objective.loss_agg={self.loss_agg!r}: expected one of {sorted(AGGREGATION_NAMES)}")
        if not 0 <= self.clip_low <= 1:
            raise ValueError(f"objective.clip_low={self.clip_low}: must be in [0, 1)")
        if self.kl_estimator not in KL_ESTIMATOR_NAMES:
            raise ValueError(
                f"objective.kl_estimator={self.kl_estimator!r}: expected one of {list(KL_ESTIMATOR_NAMES)}"
            )
        band = self.rollout_is_band
        if len(band) != 2 or not 0 <= band[0] < 1 < band[1]:
            raise ValueError(f"objective.rollout_is_band={band}: expected [α, β] with 0 <= α < 1 < β")
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"objective.opsm_delta={self.opsm_delta}: must be >= 0 (or null)")
        if not 0 < self.router_shift_floor <= 1:
            raise ValueError(f"objective.router_shift_floor={self.router_shift_floor}: must be in (0, 1]")
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"objective.{name}={getattr(self, name)}: SAPO's temperature must be > 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"objective.clip_ratio_c={self.clip_ratio_c}: must be > 1 (or null)")
        if self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"objective.rollout_is={self.rollout_is!r}: expected one of {ROLLOUT_IS_MODES}")
        if not self.rollout_is_cap > 1:
            raise ValueError(f"objective.rollout_is_cap={self.rollout_is_cap}: must be > 1")
        if self.clip_high < 0:
            raise ValueError(f"objective.clip_high={self.clip_high}: must be >= 0")
        if self.beta < 0:
            raise ValueError(f"objective.beta={self.beta}: must be >= 0")
        if len(self.extreme_band) != 2 or not 0 <= self.extreme_band[0] < 1 < self.extreme_band[1]:
            raise ValueError(
                f"objective.extreme_band={self.extreme_band}: expected [lo, hi] with 0 <= lo < 1 < hi"
            )
        if self.anchor not in ANCHORS:
            raise ValueError(f"objective.anchor={self.anchor!r}: expected one of {ANCHORS}")
        for name in ("delta_low", "delta_high", "kl_tau"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"objective.{name}={getattr(self, name)}: must be >= 0")
        if not self.ratio_cap > 0:
            raise ValueError(f"objective.ratio_cap={self.ratio_cap}: DPPO's weight cap C must be > 0")
        if self.topk < 1:
            raise ValueError(f"objective.topk={self.topk}: the top-k divergence needs k >= 1")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"objective.{name}={getattr(self, name)}: VESPO's kernel needs k, λ >= 0")
        band = self.extreme_weight_band
        if len(band) != 2 or not 0 <= band[0] < 1 < band[1]:
            raise ValueError(f"objective.extreme_weight_band={band}: expected [lo, hi] with 0 <= lo < 1 < hi")


def validate_config(cfg: ObjectiveConfig) -> None:
    """Raise ValueError naming the first bad objective.* field: its own range checks (`cfg.validate`),
    then those that read what the objective gives a meaning to (its `Capabilities` row)."""
    if cfg.name not in CAPABILITIES:
        raise ValueError(f"objective.name={cfg.name!r}: expected one of {sorted(CAPABILITIES)}")
    cfg.validate()
    spec = CAPABILITIES[cfg.name]
    if cfg.loss_agg not in spec.loss_aggs:
        raise ValueError(f"objective.loss_agg={cfg.loss_agg!r}: {cfg.name} defines {', '.join(spec.loss_aggs)} only")
    if not (cfg.clip_low <= 1 if spec.clip_low_may_be_one else cfg.clip_low < 1):
        interval = "[0, 1]" if spec.clip_low_may_be_one else "[0, 1)"
        raise ValueError(f"objective.clip_low={cfg.clip_low}: must be in {interval} for {cfg.name}")
    if cfg.clip_ratio_c is not None and not spec.dual_clip:
        raise ValueError(f"objective.clip_ratio_c={cfg.clip_ratio_c}: dual-clip caps PPO's min, which {cfg.name} "
                         "does not have; set it to null")
    if not spec.anchored and (cfg.anchor != "old" or cfg.kl_tau):
        raise ValueError(f"objective.anchor={cfg.anchor!r}, objective.kl_tau={cfg.kl_tau}: only the DPPO family "
                         f"reads them, not {cfg.name}; leave them at old and 0")
    if spec.needs_topk and cfg.anchor != "sampler":
        raise ValueError(f"objective.anchor={cfg.anchor!r}: {cfg.name} measures its divergence against the "
                         "sampler's top-k distribution; set objective.anchor=sampler")
    if spec.folds_rollout_is and cfg.rollout_is not in FOLDABLE_ROLLOUT_IS:
        raise ValueError(f"objective.rollout_is={cfg.rollout_is!r}: {cfg.name} folds a token-level correction "
                         f"into its weight, one of {FOLDABLE_ROLLOUT_IS} (as TRL)")
