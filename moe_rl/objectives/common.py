"""Pieces shared by the objectives: option checks, loss aggregation, KL estimators, the rollout IS weight,
ratio statistics by length, advantages.

Shape legend: B = sequences in the batch, T = padded token positions, N = groups, G = group size (B = N·G).
`mask_BT` is True at valid response tokens; "B'" below is the number of sequences with at least one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from moe_rl import reduction as S
from moe_rl.objectives.capabilities import (
    AGGREGATION_NAMES,
    KL_ESTIMATOR_NAMES,
    ROLLOUT_IS_MODES,
    SEQ_MEAN_TOKEN_MEAN,
)
from moe_rl.reduction import Stats

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before exp, so ratios lie in [2.1e-9, 4.9e8] and stay finite in
float32, squares included. Beyond the bound the clamp passes no gradient: a token (GRPO) or a sequence
(GSPO) whose log-likelihood moved by more than 20 nats is far outside any trust region and is dropped."""

DEFAULT_EXTREME_BAND = (0.5, 2.0)
DEFAULT_EXTREME_WEIGHT_BAND = (0.1, 10.0)
"""Ratios outside it count as extreme in `policy/extreme_weight_share` (objective.extreme_weight_band)."""
DEFAULT_ICEPOP_BAND = (0.5, 5.0)
"""IcePop's [α, β] (Ring-1T, arXiv 2510.18855): tokens with π_train / π_infer outside it are masked."""

Aggregate = Callable[[Tensor, Tensor], Tensor]


def check_options(
    clip_low: float,
    clip_high: float,
    beta: float,
    ref_logp: Tensor | None,
    extreme_band: tuple[float, float],
    extreme_weight_band: tuple[float, float] = DEFAULT_EXTREME_WEIGHT_BAND,
    allow_no_lower_clip: bool = False,
) -> None:
    """Raise ValueError on options that cannot mean what the caller intends.

    clip_low must lie in [0, 1); with allow_no_lower_clip (CISPO), clip_low = 1 is also accepted and means
    "no lower bound", the CISPO paper's choice (a ratio is never below 0)."""
    top_ok = clip_low <= 1.0 if allow_no_lower_clip else clip_low < 1.0
    if not (0.0 <= clip_low and top_ok and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low {'<=' if allow_no_lower_clip else '<'} 1 and clip_high >= 0, "
                         f"got {clip_low=}, {clip_high=}")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp, the reference policy's [B, T] log-probs")
    if not 0.0 <= extreme_band[0] < extreme_band[1]:
        raise ValueError(f"extreme_band must be (lo, hi) with 0 <= lo < hi, got {extreme_band}")
    if not 0.0 <= extreme_weight_band[0] < extreme_weight_band[1]:
        raise ValueError(f"extreme_weight_band must be (lo, hi) with 0 <= lo < hi, got {extreme_weight_band}")


def check_corrections(
    mask: Tensor,
    kl_estimator: str,
    clip_ratio_c: float | None,
    sampler_logp: Tensor | None,
    rollout_is: str,
    rollout_is_cap: float,
    rollout_is_band: tuple[float, float] = DEFAULT_ICEPOP_BAND,
) -> None:
    """Raise ValueError on a KL estimator, dual-clip constant or rollout-IS setting that cannot apply."""
    if kl_estimator not in KL_ESTIMATOR_NAMES:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {KL_ESTIMATOR_NAMES}")
    if rollout_is == "icepop" and not 0.0 <= rollout_is_band[0] < 1.0 < rollout_is_band[1]:
        raise ValueError(f"rollout_is_band must be [α, β] with 0 <= α < 1 < β, got {rollout_is_band}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip caps at c·|A|), got {clip_ratio_c}")
    if rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; choose one of {ROLLOUT_IS_MODES}")
    if rollout_is not in ("none", "icepop") and not rollout_is_cap > 1.0:
        raise ValueError(f"rollout_is_cap must be > 1, got {rollout_is_cap}")
    if rollout_is != "none" and (sampler_logp is None or sampler_logp.shape != mask.shape):
        got = None if sampler_logp is None else list(sampler_logp.shape)
        raise ValueError(f"rollout_is={rollout_is!r} needs sampler_logp, the sampler's [B, T] = "
                         f"{list(mask.shape)} log-probs, got {got}")


def seq_mean(x_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of per-sequence values over the B' non-empty sequences; 0 when there are none."""
    nonempty_B = mask_BT.any(-1)
    return torch.where(nonempty_B, x_B, 0.0).sum() / nonempty_B.sum().clamp(min=1)


def seq_mean_token_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """1/B' Σ_i 1/|y_i| Σ_t x_it (the GRPO and GSPO papers' aggregation)."""
    return seq_mean(x_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1), mask_BT)


def token_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Σ_i Σ_t x_it / Σ_i |y_i| (DAPO)."""
    return x_BT.sum() / mask_BT.sum().clamp(min=1)


def seq_mean_token_sum_norm(x_BT: Tensor, mask_BT: Tensor, *, max_len: int) -> Tensor:
    """1/B' Σ_i Σ_t x_it / max_len (Dr. GRPO: a constant in place of 1/|y_i|)."""
    return seq_mean(x_BT.sum(-1) / max_len, mask_BT)


AGGREGATIONS = {
    SEQ_MEAN_TOKEN_MEAN: seq_mean_token_mean,
    "token-mean": token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}
assert tuple(AGGREGATIONS) == AGGREGATION_NAMES  # the names config validation reads (capabilities.py)


def aggregation(loss_agg: str, max_len: int | None) -> Aggregate:
    """Look up `loss_agg` (x_BT must be zero at padding); max_len is read only by seq-mean-token-sum-norm."""
    if loss_agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; choose one of {sorted(AGGREGATIONS)}")
    if loss_agg != "seq-mean-token-sum-norm":
        return AGGREGATIONS[loss_agg]
    if max_len is None or max_len <= 0:
        raise ValueError(f"loss_agg='seq-mean-token-sum-norm' needs a positive max_len, got {max_len}")
    return functools.partial(seq_mean_token_sum_norm, max_len=max_len)


def seq_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log s_i = clamp(1/|y_i| Σ_t (logp_it − old_logp_it), ±LOG_RATIO_BOUND), shape [B]; 0 if empty.

    Inputs must be zero at padding (as `prepare` leaves them)."""
    mean_B = (logp_BT - old_logp_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return mean_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, clip_ratio_c: float | None = None
) -> Tensor:
    """−min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A), elementwise (PPO's pessimistic bound).

    With dual-clip (Ye et al. 2020, arXiv 1912.09729, Eq. 6; verl `clip_ratio_c`), a negative advantage's
    loss is also capped at c·|A|: ℓ = min(ℓ, −c·A) where A < 0, so a ratio far above 1 on a bad token
    cannot produce an unbounded loss (its gradient is then zero)."""
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    if clip_ratio_c is None:
        return loss
    return torch.where(adv < 0, torch.minimum(loss, -clip_ratio_c * adv), loss)


def k3(logp_BT: Tensor, other_logp_BT: Tensor) -> Tensor:
    """k3 KL estimator exp(δ) − δ − 1 with δ = clamp(other − logp, ±LOG_RATIO_BOUND); ≥ 0, ≈ δ²/2."""
    delta_BT = (other_logp_BT - logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(delta_BT) - delta_BT - 1.0


LOW_VAR_KL_CAP = 10.0
"""low_var_kl caps k3 at 10 per token (verl's `low_var_kl`, which verl also calls `k3`)."""

KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # Schulman, "Approximating KL divergence" (2020); δ = ref_logp − logp, samples from π_θ.
    "k1": lambda logp, ref: logp - ref,  # −δ: unbiased, can be negative
    "k2": lambda logp, ref: 0.5 * (logp - ref).square(),  # δ²/2: biased, ≥ 0, gradient of KL's 2nd order
    "k3": k3,  # exp(δ) − δ − 1: unbiased, ≥ 0
    "low_var_kl": lambda logp, ref: k3(logp, ref).clamp(max=LOW_VAR_KL_CAP),
}
IS_WEIGHTED_KL = {"k3_unbiased": "k3"}
"""Estimators of KL(π_θ ‖ π_ref) on samples from π_old: the base estimator times r_it = π_θ / π_old
(DeepSeek-V3.2, arXiv 2512.02556, §3.1, "unbiased KL estimate"; TRL use_bias_correction_kl, slime
--use-unbiased-kl). As in TRL and slime r carries the gradient: ∇(r·k3) = r·(logp − ref_logp)·∇logp,
the unbiased gradient of the reverse KL, whereas sg(r)·∇k3 would not be (π_old is the constant)."""
assert (*KL_ESTIMATORS, *IS_WEIGHTED_KL) == KL_ESTIMATOR_NAMES  # the names config validation reads


def kl_penalty(
    logp_BT: Tensor,
    ref_logp_BT: Tensor | None,
    mask_BT: Tensor,
    beta: float,
    aggregate: Aggregate,
    estimator: str = "k3",
    old_logp_BT: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """beta · agg(kl(logp, ref_logp)) and its `policy/ref_kl` stat; nothing at all when beta == 0.

    `estimator` picks kl from KL_ESTIMATORS (k1, k2, k3, low_var_kl; the default k3 is the GRPO paper's),
    or IS_WEIGHTED_KL (k3_unbiased: exp(clamp(logp − old_logp, ±LOG_RATIO_BOUND)) · k3, needs old_logp).
    `policy/ref_kl` is agg(kl), kept as (agg(kl)·w, w) with w the aggregation's own denominator (tokens
    for token-mean, non-empty sequences otherwise), so pooling ranks weighs each as the loss does."""
    if beta == 0.0 or ref_logp_BT is None:
        return logp_BT.new_zeros(()), {}
    if estimator in IS_WEIGHTED_KL:
        assert old_logp_BT is not None
        r_BT = torch.exp((logp_BT - old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        kl_BT = r_BT * KL_ESTIMATORS[IS_WEIGHTED_KL[estimator]](logp_BT, ref_logp_BT)
    else:
        kl_BT = KL_ESTIMATORS[estimator](logp_BT, ref_logp_BT)
    kl = aggregate(torch.where(mask_BT, kl_BT, 0.0), mask_BT)
    w = (mask_BT.sum() if aggregate is token_mean else mask_BT.any(-1).sum()).double()
    return beta * kl, {"policy/ref_kl": S.ratio(kl.detach().double() * w, w)}




def sequence_weights(diff_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-sequence importance weights w_i = exp(clamp(Σ_t diff_it, ±LOG_RATIO_BOUND)) over the non-empty
    rows, from per-token log-ratios `diff_BT` that are 0 at masked tokens."""
    return diff_BT.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()[mask_BT.any(-1)]


def rollout_is_weight(
    old_logp_BT: Tensor,
    sampler_logp: Tensor | None,
    mask_BT: Tensor,
    mode: str,
    cap: float,
    band: tuple[float, float] = DEFAULT_ICEPOP_BAND,
    diagnostics: bool = False,
) -> tuple[Tensor, Stats]:
    """Weight ω on each token's loss correcting for sampler/trainer mismatch, and its `rollout_is/*` metrics.

        token modes, icepop:  ρ_it = exp(clamp(old_logp_it − sampler_logp_it, ±LOG_RATIO_BOUND))
        sequence modes:       ρ_i  = exp(clamp(Σ_t (old_logp_it − sampler_logp_it), ±LOG_RATIO_BOUND)), all t
        geo_sequence modes:   ρ_i  = exp(clamp(1/|y_i| Σ_t (old_logp_it − sampler_logp_it), ±B)), all t
        *_truncate (TIS, Yao et al. 2025):  ω = min(ρ, cap)
        *_mask     (MIS):                   ω = ρ · [1/cap ≤ ρ ≤ cap]   (tokens or sequences dropped)
        icepop (Ring-1T, arXiv 2510.18855): ω = ρ · [α ≤ ρ ≤ β], [α, β] = band (two-sided token mask)

    The geometric mean (Liu, Li et al. 2025, "When Speed Kills Stability": Geo-MIS) is length-normalised:
    a 32-token answer's product ratio leaves [1/C, C] far more easily than a 4-token one's, its geometric
    mean does not. As in TRL, the weight multiplies the objective's per-token loss after its clip, before
    aggregation, and a masked token still counts in the aggregation's denominator (verl's rejection
    sampling, rollout_rs=geometric, masks with weight 1 and removes it from the mask instead). ω carries no
    gradient. Mode "none" returns ω = 1 (0 at padding, as every mode). Metrics (float64, over valid
    tokens; sequence modes count each token of a sequence with that sequence's ρ_i): `rollout_is/mean` and
    `rollout_is/max` of ρ before truncation or masking, `rollout_is/clipped_frac` (truncate modes)
    1/N Σ [ρ > cap], `rollout_is/masked_frac` (mask modes, icepop) 1/N Σ [ρ outside its band]; with any
    mode but none, or `diagnostics`, `rollout_is/ess` and `rollout_is/chi2` of the per-sequence weights
    w_i = π_old(y_i) / π_sampler(y_i) = exp(clamp(Σ_t (old_logp_it − sampler_logp_it), ±LOG_RATIO_BOUND))
    over non-empty sequences: (Σ w)² / (B' Σ w²) and mean(w²) − 1 (VCPO, arXiv 2602.17616; verl's χ²).
    """
    ones_BT = mask_BT.to(old_logp_BT.dtype)
    if sampler_logp is None or (mode == "none" and not diagnostics):
        return ones_BT, {}
    diff_BT = torch.where(mask_BT, old_logp_BT - sampler_logp.to(old_logp_BT.dtype), 0.0).detach()
    seq_w_B = sequence_weights(diff_BT, mask_BT)
    out = {"rollout_is/ess": S.ess(seq_w_B), "rollout_is/chi2": S.chi2(seq_w_B)}
    if mode == "none":
        return ones_BT, out
    if mode.startswith("sequence"):
        diff_BT = diff_BT.sum(-1, keepdim=True).expand_as(diff_BT)
    elif mode.startswith("geo_sequence"):
        diff_BT = (diff_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1))[:, None].expand_as(diff_BT)
    rho_BT = diff_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    lo, hi = band if mode == "icepop" else (1.0 / cap, cap)
    outside_BT = (rho_BT > cap) if mode.endswith("truncate") else (rho_BT < lo) | (rho_BT > hi)
    weight_BT = rho_BT.clamp(max=cap) if mode.endswith("truncate") else torch.where(outside_BT, 0.0, rho_BT)
    rho_N = rho_BT[mask_BT]
    frac_key = "rollout_is/clipped_frac" if mode.endswith("truncate") else "rollout_is/masked_frac"
    return torch.where(mask_BT, weight_BT, 0.0), {
        "rollout_is/mean": S.mean(rho_N),
        "rollout_is/max": S.maximum(rho_N),
        frac_key: S.mean(outside_BT[mask_BT]),
        **out,
    }


LENGTH_SUMS = ("seqs", "tokens", "r1", "r1_sq", "within", "seqs_2plus", "s1", "s1_sq")
"""Columns of `length_sums`, per bin: sequences, tokens, Σ (r_it − 1), Σ (r_it − 1)², Σ within-sequence
variance over sequences of n_i ≥ 2 tokens, their count, Σ (s_i − 1), Σ (s_i − 1)². Shifting by 1 (near
every ratio's value) keeps the variances computed from sums exact to float64 rounding."""


def length_bins(max_len: int) -> list[tuple[int, int]]:
    """Response-length bins (lo, hi), inclusive, in tokens: [1, 4], then powers of two [5, 8], [9, 16],
    [17, 32], ..., up to the bin holding `max_len`. They depend on `max_len` only (sampler.max_new_tokens),
    so a run's metric keys are the same at every step, and any run's bins are a prefix of a longer one's."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    bins = [(1, 4)]
    while bins[-1][1] < max_len:
        bins.append((bins[-1][1] + 1, 2 * bins[-1][1]))
    return bins


@torch.no_grad()
def length_sums(logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor, bins: list[tuple[int, int]]) -> Tensor:
    """`[len(bins), len(LENGTH_SUMS)]` float64 sums of each response-length bin's ratio statistics.

    A sequence's length is n_i = Σ_t mask_it, its valid response tokens (EOS included), the 1/|y_i| of
    GSPO's s_i; r_it and s_i are clamped as `ratio_metrics` clamps them. Sums add over mini-batches and
    ranks, so `length_metrics` of a sum is the statistic of the pooled sequences. Sequences without a
    valid token count nowhere; one longer than the last bin raises.
    """
    mask_BT = mask_BT.bool()
    logp_BT = torch.where(mask_BT, logp_BT.double(), 0.0)
    old_logp_BT = torch.where(mask_BT, old_logp_BT.double(), 0.0)
    len_B = mask_BT.sum(-1)
    r1_BT = torch.where(mask_BT, (logp_BT - old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp() - 1, 0.0)
    n_B = len_B.clamp(min=1).double()
    within_B = torch.where(mask_BT, r1_BT - (r1_BT.sum(-1) / n_B)[:, None], 0.0).square().sum(-1) / n_B
    s1_B = seq_log_ratio(logp_BT, old_logp_BT, mask_BT).exp() - 1
    two_B = (len_B >= 2).double()
    cols_BC = torch.stack(
        [torch.ones_like(n_B), len_B.double(), r1_BT.sum(-1), r1_BT.square().sum(-1), within_B * two_B, two_B,
         s1_B, s1_B.square()], dim=-1,
    )  # fmt: skip
    keep_B = len_B > 0
    bin_B = torch.bucketize(len_B[keep_B], torch.tensor([hi for _, hi in bins], device=len_B.device))
    if keep_B.any() and int(bin_B.max()) >= len(bins):
        raise ValueError(f"a response of {int(len_B.max())} tokens is longer than the last bin {bins[-1]}")
    sums = torch.zeros(len(bins), len(LENGTH_SUMS), dtype=torch.float64, device=cols_BC.device)
    return sums.index_add_(0, bin_B, cols_BC[keep_B])


def length_metrics(sums: Tensor, bins: list[tuple[int, int]]) -> dict[str, float]:
    """`length/<lo>-<hi>/*` from `length_sums` (of one mini-batch, or summed over several and over ranks):
    token_var, within_seq_var, seq_var (population variances; NaN for a bin without the sequences they
    need), seqs and tokens (counts, 0 when empty). Formulas: the metric table in moe_rl/trainer."""
    out: dict[str, float] = {}
    for (lo, hi), row in zip(bins, sums.tolist(), strict=True):
        n, tokens, r1, r1_sq, within, n2, s1, s1_sq = row
        key = f"length/{lo}-{hi}"
        # max(0, ·): E[x²] − E[x]² can round a hair below zero when every value is equal.
        out[f"{key}/token_var"] = max(0.0, r1_sq / tokens - (r1 / tokens) ** 2) if tokens else math.nan
        out[f"{key}/within_seq_var"] = within / n2 if n2 else math.nan
        out[f"{key}/seq_var"] = max(0.0, s1_sq / n - (s1 / n) ** 2) if n else math.nan
        out[f"{key}/seqs"] = n
        out[f"{key}/tokens"] = tokens
    return out


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages Â_i = (r_i − mean_G r) / (std_G r + eps) (GSPO paper Eq. 6), shape [B].

    `rewards` is [B] with consecutive groups of `group_size` responses to one prompt. std is the unbiased
    (Bessel-corrected) sample std, as torch.std and TRL/verl use. normalize_std=False skips the division
    (Dr. GRPO). A group whose rewards are all equal gets advantage 0. Computed in float32 at least.
    """
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B] with B divisible by group_size >= 2, got "
                         f"shape {list(rewards.shape)} and group_size={group_size}")
    r_NG = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).reshape(-1, group_size)
    adv_NG = r_NG - r_NG.mean(-1, keepdim=True)
    if normalize_std:
        adv_NG = adv_NG / (r_NG.std(-1, keepdim=True) + eps)
    return adv_NG.reshape(-1)
