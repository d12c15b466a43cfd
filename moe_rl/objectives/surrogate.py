r"""One surrogate, many ratios: the clip-and-aggregate step every objective shares, written once.

Shape legend: B = sequences, T = padded token positions; `mask_BT` is True at valid response tokens.

An `Objective` names two things and nothing else:
- its *ratio* (`build_ratio`): the importance ratio it weights the gradient by. Token w_it (GRPO, CISPO,
  SAPO), sequence s_i (GSPO, Eq. 7), sequence-as-token s_it (GSPO-token, Eq. 14), or the geometric mean of
  log-clipped token ratios (GMPO);
- its *surrogate* (`surrogate`): what it makes of the ratio and the advantage. PPO's clipped min (with
  dual-clip), CISPO's truncated-weight REINFORCE, GMPO's plain −ρÂ, SAPO's soft gate.

Everything else happens in `compute`, once for all of them, in this order:

    ρ      = build_ratio(inputs)                                [B, T] per token, or [B] per sequence
             (with router_shift γ̃: built on old_logp − log γ̃, so ρ carries the factor γ̃ before any clip)
    ℓ      = surrogate(ρ, Â)                                    same shape as ρ
    ω_it   = rollout IS weight (common.rollout_is_weight) · off-policy sequence mask (opsm, if set)
    loss   = agg(ω ℓ)                  for a per-token ℓ_it (agg = loss_agg)
           = 1/B' Σ_i ℓ_i · mean_t ω_it  for a per-sequence ℓ_i
    loss  += beta · agg(kl(logp, ref_logp))

So "GRPO and GSPO differ only in the ratio" reads off the registry (moe_rl.objectives.OBJECTIVES): both
are `ppo_clip`, over `token_ratio` and `seq_ratio`. Metrics are `moe_rl.reduction.Stats` (sums and counts
that reduce exactly); `Objective.__call__` keeps the keyword form, with floats, for callers outside the
trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, fields, replace

import torch
from torch import Tensor

from moe_rl import reduction as S
from moe_rl.objectives import diagnostics as D
from moe_rl.objectives.capabilities import CAPABILITIES, FOLDABLE_ROLLOUT_IS, Capabilities
from moe_rl.objectives.common import (
    LOG_RATIO_BOUND,
    Aggregate,
    aggregation,
    check_corrections,
    check_options,
    clipped_surrogate,
    kl_penalty,
    rollout_is_weight,
    seq_log_ratio,
    seq_mean,
)
from moe_rl.objectives.config import ObjectiveConfig
from moe_rl.objectives.topk import TopK


@dataclass(frozen=True)
class ObjectiveInputs:
    """Everything an objective receives, in one value: the tensors of a mini-batch and its config whole.

    Tensors: logp [B, T] log π_θ of the sampled tokens (the gradient flows through it); old_logp [B, T]
    log π_old; advantages [B] per sequence (Â_i) or [B, T] per token (Â_it); mask [B, T] bool, True at
    valid tokens (padding may hold anything, even NaN); ref_logp, sampler_logp [B, T] or None.
    `cfg` is the run's `ObjectiveConfig` (moe_rl.objectives.config): each objective reads the options it
    gives a meaning to. The rest is what the trainer knows and the config does not.
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    _: KW_ONLY
    cfg: ObjectiveConfig
    max_len: int | None = None
    """The constant of seq-mean-token-sum-norm (read by that mode only): sampler.max_new_tokens."""
    ref_logp: Tensor | None = None
    """The reference policy's [B, T] log-probs, for the beta penalty."""
    sampler_logp: Tensor | None = None
    """The sampler's [B, T] log-probs μ: the rollout IS weight, OPSM, and the DPPO anchor=sampler."""
    mismatch_diagnostics: bool = False
    """Log `rollout_is/ess` and `rollout_is/chi2` even with rollout_is="none" (the sampler's log-probs differ
    from π_old's: another precision, engine or policy version)."""
    router_shift: Tensor | None = None
    """RSPO's floored router-shift ratio γ̃ [B, T] in (0, 1], no gradient (moe_rl.objectives.router_shift):
    the objective's ratio is rescaled by it before the clip; None = off."""
    topk: TopK | None = None
    """The top-k distributions the dppo_topk_* divergences read (moe_rl.objectives.dppo); None elsewhere."""


@dataclass(frozen=True)
class Prepared:
    """ObjectiveInputs after the shared preamble: float32 at least, zero at padding, Â also as [B, T]."""

    logp_BT: Tensor
    old_logp_BT: Tensor
    adv: Tensor
    """[B] or [B, T], as given."""
    adv_BT: Tensor
    """Â broadcast over each sequence's valid tokens (0 at padding)."""
    mask_BT: Tensor
    ref_logp_BT: Tensor | None
    aggregate: Aggregate
    x: ObjectiveInputs
    """The raw inputs, for the options (`x.cfg`)."""
    is_weight_BT: Tensor | None = None
    """The rollout IS weight ω (common.rollout_is_weight), for a ratio that folds it in (VESPO)."""


@dataclass(frozen=True)
class Ratio:
    """What a ratio builder returns. `value` is [B, T] (a per-token loss follows) or [B] (per sequence)."""

    value: Tensor
    judged: Tensor
    """What `policy/extreme_weight_share` judges extreme: [B, T] for a token-level objective, [B] else."""
    in_bound_BT: Tensor
    """[B, T] bool: where the log-ratio clamp at ±LOG_RATIO_BOUND still passes a gradient."""
    low_BT: Tensor | None = None
    high_BT: Tensor | None = None
    """Tokens a clip inside the ratio zeroes (gmpo's log-space clip); None when the ratio has none."""


@dataclass(frozen=True)
class Surrogate:
    """What a surrogate returns: ℓ (the shape of the ratio) and the masks its diagnostics need."""

    loss: Tensor
    low_BT: Tensor | None
    high_BT: Tensor | None
    """[B, T] bool: tokens counted in clip/low_frac and clip/high_frac; None for a surrogate without a
    hard clip (SAPO), which then logs no clip/* keys rather than zeros."""
    keep_BT: Tensor
    """[B, T] bool: valid tokens whose gradient no clip, cap or clamp zeroes."""
    weight: Tensor
    """g, the weight on Â ∇logp of each entry ([B, T] or [B], as Ratio.judged)."""
    stats: S.Stats = field(default_factory=dict)
    """The surrogate's own diagnostics (dual-clip's `clip/dual_frac`, SAPO's gate weight)."""


RatioFn = Callable[[Prepared], Ratio]
SurrogateFn = Callable[[Ratio, Prepared], Surrogate]


@dataclass(frozen=True)
class Objective(Capabilities):
    """An objective: a ratio, a surrogate, and which options give them a meaning (its `Capabilities` row,
    which config reads without importing torch)."""

    _: KW_ONLY
    build_ratio: RatioFn
    surrogate: SurrogateFn

    def compute(self, x: ObjectiveInputs) -> tuple[Tensor, S.Stats]:
        """(loss, stats): the scalar to minimise and its diagnostics as reducible `Stats`."""
        return compute(self, x)

    def inputs(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **kwargs) -> ObjectiveInputs:
        """ObjectiveInputs from keywords: ObjectiveInputs' own fields (ref_logp, sampler_logp, max_len, ...)
        and ObjectiveConfig's (clip_low, clip_high, ...; loss_agg defaults to the objective's own). An
        unknown keyword raises TypeError."""
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in INPUT_FIELDS}
        kwargs["loss_agg"] = kwargs.get("loss_agg") or self.default_loss_agg
        cfg = ObjectiveConfig(name=self.name, preset=self.name, **kwargs)
        return ObjectiveInputs(logp, old_logp, advantages, mask, cfg=cfg, **own)

    def __call__(self, *args, **kwargs) -> tuple[Tensor, dict[str, float]]:
        """Keyword form: `objective(logp, old_logp, advantages, mask, clip_low=..., ...)`, float metrics."""
        loss, stats = compute(self, self.inputs(*args, **kwargs))
        return loss, S.values(stats)


INPUT_FIELDS = {f.name for f in fields(ObjectiveInputs)} - {"logp", "old_logp", "advantages", "mask", "cfg"}
"""The keyword form's names that are ObjectiveInputs' own rather than the config's."""


def declared(name: str, build_ratio: RatioFn, surrogate: SurrogateFn) -> Objective:
    """The objective `name`: its row of `CAPABILITIES` with its ratio and surrogate."""
    row = CAPABILITIES[name]
    return Objective(**{f.name: getattr(row, f.name) for f in fields(row)}, build_ratio=build_ratio,
                     surrogate=surrogate)


def check(obj: Objective, x: ObjectiveInputs, loss_agg: str) -> None:
    """Raise ValueError on options the objective cannot give a meaning to."""
    check_options(x.cfg.clip_low, x.cfg.clip_high, x.cfg.beta, x.ref_logp, x.cfg.extreme_band, x.cfg.extreme_weight_band,
                  allow_no_lower_clip=obj.clip_low_may_be_one)
    check_corrections(x.mask, x.cfg.kl_estimator, x.cfg.clip_ratio_c, x.sampler_logp, x.cfg.rollout_is, x.cfg.rollout_is_cap,
                      x.cfg.rollout_is_band)
    if not (x.cfg.tau_pos > 0 and x.cfg.tau_neg > 0):
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={x.cfg.tau_pos}, tau_neg={x.cfg.tau_neg}")
    if x.cfg.opsm_delta is not None and not x.cfg.opsm_delta >= 0:
        raise ValueError(f"opsm_delta must be >= 0 or None, got {x.cfg.opsm_delta}")
    if x.router_shift is not None:
        if x.router_shift.shape != x.mask.shape or x.router_shift.requires_grad:
            raise ValueError(f"router_shift must be a [B, T] = {list(x.mask.shape)} tensor without gradient, got "
                             f"{list(x.router_shift.shape)} (requires_grad={x.router_shift.requires_grad})")
        gamma = x.router_shift[x.mask]
        if not ((gamma > 0) & (gamma <= 1)).all():
            raise ValueError("router_shift must lie in (0, 1] at valid tokens")
    if loss_agg not in obj.loss_aggs:
        raise ValueError(f"{obj.name} is defined with loss_agg in {obj.loss_aggs} only, got {loss_agg!r}")
    if x.cfg.clip_ratio_c is not None and not obj.dual_clip:
        raise ValueError(f"{obj.name} has no min for dual-clip to cap: clip_ratio_c must be None, "
                         f"got {x.cfg.clip_ratio_c}")
    if obj.folds_rollout_is and x.cfg.rollout_is not in FOLDABLE_ROLLOUT_IS:
        raise ValueError(f"{obj.name} folds a token-level rollout IS weight into its own (token_truncate or "
                         f"token_mask, as TRL), got rollout_is={x.cfg.rollout_is!r}")
    if obj.anchored and x.cfg.anchor == "sampler" and (x.sampler_logp is None or x.sampler_logp.shape != x.mask.shape):
        raise ValueError(f"{obj.name} with anchor='sampler' needs sampler_logp, the sampler's [B, T] log-probs")
    if obj.needs_topk and (x.topk is None or x.topk.sampler_logp_BTK.shape[:2] != x.mask.shape):
        raise ValueError(f"{obj.name} needs topk, the sampler's top-k log-probs [B, T, K] and the policy's on the "
                         "same tokens")
    if obj.seq_advantages_only and x.advantages.dim() != 1:
        raise ValueError(f"{obj.name} needs per-sequence advantages [B], got {list(x.advantages.shape)}")


def prepare(x: ObjectiveInputs, aggregate: Aggregate) -> Prepared:
    """Check shapes, cast to float32 at least (float64 stays float64) and zero every padded entry.

    Zeroing with `torch.where` keeps NaN/inf padding out of both the values and the gradients.
    """
    mask = x.mask
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}; pass mask.bool()")
    if mask.dim() != 2 or x.logp.shape != mask.shape or x.old_logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(x.logp.shape)}, old_logp {tuple(x.old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must share one [B, T] shape")
    if x.advantages.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"advantages must be [B] or [B, T] with [B, T] = {list(mask.shape)}, "
                         f"got {list(x.advantages.shape)}")
    if x.ref_logp is not None and x.ref_logp.shape != mask.shape:
        raise ValueError(f"ref_logp must be [B, T] = {list(mask.shape)}, got {list(x.ref_logp.shape)}")
    dtype = torch.promote_types(x.logp.dtype, torch.float32)

    def clean(t: Tensor) -> Tensor:
        return torch.where(mask, t.to(dtype), 0.0)

    adv = x.advantages.to(dtype) if x.advantages.dim() == 1 else clean(x.advantages)
    adv_BT = adv if adv.dim() == 2 else torch.where(mask, adv[:, None], 0.0)
    ref = None if x.ref_logp is None else clean(x.ref_logp)
    return Prepared(clean(x.logp), clean(x.old_logp), adv, adv_BT, mask, ref, aggregate, x)


def compute(obj: Objective, x: ObjectiveInputs) -> tuple[Tensor, S.Stats]:
    """The one surrogate (see the module docstring): ratio, surrogate, correction, aggregation, KL, stats."""
    loss_agg = x.cfg.loss_agg  # Objective.inputs fills in the objective's default
    check(obj, x, loss_agg)
    p = prepare(x, aggregation(loss_agg, x.max_len))
    mask_BT = p.mask_BT
    omega_BT, is_stats = rollout_is_weight(p.old_logp_BT, x.sampler_logp, mask_BT, x.cfg.rollout_is,
                                           x.cfg.rollout_is_cap, x.cfg.rollout_is_band, x.mismatch_diagnostics)
    p_rho = p if x.router_shift is None else router_shifted(p, x.router_shift)
    if obj.anchored and x.cfg.anchor == "sampler":  # DPPO's trust region around μ ("bypass")
        p_rho = replace(p_rho, old_logp_BT=torch.where(mask_BT, x.sampler_logp.to(p.logp_BT), 0.0))
    if obj.folds_rollout_is:  # the ratio takes ω in (VESPO's log w); the loss is not multiplied again
        p_rho, omega_BT = replace(p_rho, is_weight_BT=omega_BT), mask_BT.to(omega_BT)
    ratio = obj.build_ratio(p_rho)
    sur = obj.surrogate(ratio, p_rho)
    if x.cfg.opsm_delta is not None:  # DeepSeek-V3.2's off-policy sequence mask multiplies ω (as TRL)
        keep_BT, is_stats["policy/opsm_masked_frac"] = opsm_keep(p, x.cfg.opsm_delta)
        omega_BT = omega_BT * keep_BT
    if sur.loss.dim() == 1:  # one term per sequence: a token-level weight enters as its mean (as TRL)
        omega_B = omega_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)  # exactly 1 when rollout_is="none"
        loss = seq_mean(sur.loss * omega_B, mask_BT)
    else:
        loss = p.aggregate(torch.where(mask_BT, sur.loss * omega_BT, 0.0), mask_BT)
    kl, kl_stats = kl_penalty(p.logp_BT, p.ref_logp_BT, mask_BT, x.cfg.beta, p.aggregate, x.cfg.kl_estimator,
                              p.old_logp_BT)
    loss = loss + kl

    if obj.ratio == "token":  # g and the judged ratio per token
        weights = D.weight_stats(ratio.judged, sur.weight, p.adv_BT.abs(), sur.keep_BT, x.cfg.extreme_weight_band)
    else:  # per sequence, |Â_i| over the sequence's gradient-carrying tokens
        weights = D.weight_stats(ratio.judged, sur.weight, D.seq_kept_adv(p.adv_BT, sur.keep_BT, mask_BT),
                                 mask_BT.any(-1), x.cfg.extreme_weight_band)
    clip = {} if sur.low_BT is None else D.clip_stats(sur.low_BT, sur.high_BT, mask_BT)
    stats = {
        **clip,
        **weights,
        **sur.stats,
        **D.ratio_stats(p.logp_BT, p.old_logp_BT, p.adv_BT, mask_BT, x.cfg.extreme_band),
        **kl_stats,
        **is_stats,
    }
    return loss, stats


@torch.no_grad()
def opsm_keep(p: Prepared, delta: float) -> tuple[Tensor, S.Stat]:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, §3.1), as TRL's get_off_policy_mask.

        keep_it = [Â_it ≥ 0] ∨ [1/|y_i| Σ_t (log π_sampler(y_it) − log π_θ(y_it)) ≤ δ]

    π_sampler is the sampler's (sampler_logp; π_old when there is none, as TRL without vLLM); π_θ is
    detached. Returns the [B, T] float mask (1 = keep) and `policy/opsm_masked_frac`, the fraction of valid
    tokens dropped (for per-sequence advantages, the token share of the dropped sequences)."""
    x, mask_BT = p.x, p.mask_BT
    mu_BT = p.old_logp_BT if x.sampler_logp is None else torch.where(mask_BT, x.sampler_logp.to(p.logp_BT), 0.0)
    kl_B = torch.where(mask_BT, mu_BT - p.logp_BT.detach(), 0.0).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    keep_BT = (p.adv_BT >= 0) | (kl_B <= delta)[:, None]
    return keep_BT.to(p.logp_BT.dtype), S.mean(~keep_BT[mask_BT])


def router_shifted(p: Prepared, gamma_BT: Tensor) -> Prepared:
    """p with old_logp − log γ̃ (RSPO, moe_rl.objectives.router_shift): every ratio built on it carries γ̃
    before its clip (token: r·γ̃; sequence: s·(Π_t γ̃)^(1/|y|)). Only the ratio sees it: the rollout IS
    weight, the KL and the ratio/* diagnostics keep the true π_old."""
    log_gamma_BT = torch.where(p.mask_BT, gamma_BT.to(p.old_logp_BT).log(), 0.0)
    return replace(p, old_logp_BT=p.old_logp_BT - log_gamma_BT)


def broadcast(x: Tensor, like_BT: Tensor) -> Tensor:
    """A [B] per-sequence value at each of its tokens ([B, T] as given)."""
    return x[:, None].expand_as(like_BT) if x.dim() == 1 else x


# --- the ratios and the surrogate most objectives share ------------------------------------------------


def token_ratio(p: Prepared) -> Ratio:
    """w_it = exp(clamp(logp_it − old_logp_it, ±LOG_RATIO_BOUND)), [B, T] (GSPO paper Eq. 3)."""
    d_BT = p.logp_BT - p.old_logp_BT
    w_BT = torch.exp(d_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return Ratio(w_BT, w_BT, d_BT.abs() <= LOG_RATIO_BOUND)


def seq_ratio(p: Prepared) -> Ratio:
    """s_i = exp(clamp(1/|y_i| Σ_t (logp_it − old_logp_it), ±LOG_RATIO_BOUND)), [B] (GSPO Eq. 7)."""
    s_B = torch.exp(seq_log_ratio(p.logp_BT, p.old_logp_BT, p.mask_BT))
    with torch.no_grad():
        mean_d_B = (p.logp_BT - p.old_logp_BT).sum(-1) / p.mask_BT.sum(-1).clamp(min=1)
        in_bound_BT = broadcast(mean_d_B, p.logp_BT).abs() <= LOG_RATIO_BOUND
    return Ratio(s_B, s_B, in_bound_BT)


def ppo_clip(ratio: Ratio, p: Prepared) -> Surrogate:
    """ℓ = −min(ρÂ, clip(ρ, 1 − clip_low, 1 + clip_high)Â), capped at −cÂ where Â < 0 under dual-clip.

    PPO's pessimistic bound (GSPO paper Eq. 2 and 5; dual-clip: Ye et al. 2020, arXiv 1912.09729, Eq. 6).
    A token whose clip or cap is active gets zero gradient; under a per-sequence ρ every token of the
    sequence counts as clipped (the GSPO paper's Fig. 2). g = ρ."""
    x = p.x
    rho, adv = ratio.value, (p.adv if ratio.value.dim() == 1 else p.adv_BT)
    loss = clipped_surrogate(rho, adv, x.cfg.clip_low, x.cfg.clip_high, x.cfg.clip_ratio_c)
    rho_BT = broadcast(rho, p.logp_BT)
    low_BT, high_BT = D.ppo_clipped(rho_BT, p.adv_BT, p.mask_BT, x.cfg.clip_low, x.cfg.clip_high)
    keep_BT = D.ppo_keep(rho_BT, p.adv_BT, p.mask_BT, x.cfg.clip_low, x.cfg.clip_high, x.cfg.clip_ratio_c, ratio.in_bound_BT)
    dual = D.dual_clip_stats(rho_BT, p.adv_BT, p.mask_BT, x.cfg.clip_ratio_c)
    return Surrogate(loss, low_BT, high_BT, keep_BT, ratio.judged, dual)
