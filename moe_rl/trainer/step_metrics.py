"""Metrics of one RL step that are pure functions of its batch, traces and per-mini-batch results (the
metric table is in moe_rl/trainer/__init__.py). Shape legend as in moe_rl/trainer/step.py."""

from __future__ import annotations

import math

import torch

from moe_rl import reduction as S
from moe_rl.routing import (
    RoutingTrace,
    centred_shift_sq,
    expert_change_by_layer,
    expert_change_fraction,
    expert_load,
    margin_summary,
    predicted_change,
    router_entropy,
    router_margins,
)
from moe_rl.trainer.batch import Batch


def finite_mean(values: list[float]) -> float:
    """Mean of the non-NaN values; NaN when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def rollout_metrics(rows: list[list[float]], group_size: int, reward_can_fail: bool = False) -> dict[str, float]:
    """Rollout metrics over all ranks' rows in prompt-major order (each prompt's `group_size` completions
    next to each other), each row (reward, response tokens, summed token entropy, reward failed 0/1);
    `rollout/reward_errors` only for a task whose reward can fail (`Task.reward_can_fail`).

    `rollout/reward/se`, the standard error of the step's mean reward, is sd(group means) / sqrt(P) over
    the P groups (sample sd): the group means are independent draws, and their spread carries both the
    sampling noise and the prompts' differing difficulty (the intra-group correlation). NaN for P < 2."""
    reward_B, length_B, entropy_B, failed_B = torch.tensor(rows, dtype=torch.float64).T
    group_means_P = reward_B.view(-1, group_size).mean(1)
    P = len(group_means_P)
    out = {
        "rollout/reward/mean": reward_B.mean().item(),
        "rollout/reward/std": reward_B.std().item(),
        "rollout/reward/se": (group_means_P.std() / math.sqrt(P)).item() if P > 1 else math.nan,
        "rollout/accuracy": (reward_B == 1).double().mean().item(),
        "rollout/response_len/mean": length_B.mean().item(),
        "rollout/entropy/mean": (entropy_B.sum() / length_B.sum()).item(),
    }
    if reward_can_fail:
        out["rollout/reward_errors"] = failed_B.sum().item()
    return out


def minibatch_overlap(batch: Batch, group_B: torch.Tensor, slices: list[slice]) -> S.Stats:
    """How much of mini-batches 2..M was already seen, in part, by an earlier update of the same step:
    `minibatch/sibling_frac`, rows whose group (prompt) had a row in an earlier mini-batch;
    `minibatch/duplicate_frac`, rows whose whole sequence (prompt and response) equals a row of an
    earlier mini-batch. NaN with one mini-batch. `group_B` is each row's group index. Pooled over ranks
    weighted by their rows."""
    seen_groups: set[int] = set()
    seen_seqs: set[tuple[int, ...]] = set()
    sibling = duplicate = later = 0
    for j, sl in enumerate(slices):
        groups = group_B[sl].tolist()
        ids_bS, keep_bS = batch.input_ids_BS[sl], batch.attention_mask_BS[sl].bool()
        seqs = [tuple(ids[keep].tolist()) for ids, keep in zip(ids_bS, keep_bS, strict=True)]
        if j > 0:
            later += len(groups)
            sibling += sum(g in seen_groups for g in groups)
            duplicate += sum(q in seen_seqs for q in seqs)
        seen_groups.update(groups)
        seen_seqs.update(seqs)
    rows = float(len(group_B))
    return {
        "minibatch/sibling_frac": S.weighted(sibling / later if later else math.nan, rows),
        "minibatch/duplicate_frac": S.weighted(duplicate / later if later else math.nan, rows),
    }


def routing_metrics(
    batch: Batch, old_trace: RoutingTrace, old_logp_BR: torch.Tensor, cache_bytes: float
) -> S.Stats:
    """The old policy's routing statistics and the sampler mismatch of this rank's rows, each pooled over
    ranks weighted by what it averages over (rows, valid positions or response tokens); `cache_bytes`, the
    expert ids a replay holds for the step (RoutingPlan.replay_cache_bytes), adds up."""
    valid = batch.valid_BS1
    rows, tokens, positions = float(valid.shape[0]), float(batch.response_mask_BR.sum()), float(valid.sum())
    out = {
        # The weighted mean of the ranks' per-layer CVs, not the global statistic.
        "routing/load_cv/mean": S.weighted(float(expert_load(old_trace, valid)["cv"].mean()), rows),
        "routing/entropy/mean": S.weighted(float(router_entropy(old_trace, valid).mean()), positions),
        "routing/replay_cache_bytes": S.Stat("sum", (cache_bytes,)),
        "mismatch/logp_abs_diff/mean": S.weighted(
            float((batch.sampler_logp_BR - old_logp_BR)[batch.response_mask_BR].abs().mean()), tokens
        ),
    }
    if batch.sampler_trace is not None:
        out["routing/rollout_vs_old/frac"] = S.weighted(
            expert_change_fraction(batch.sampler_trace, old_trace, valid), positions
        )
    return out


@torch.no_grad()
def mismatch_metrics(
    trainer_logp_BR: torch.Tensor, sampler_logp_BR: torch.Tensor, entropy_BR: torch.Tensor, mask_BR: torch.Tensor
) -> S.Stats:
    r"""The field's trainer-sampler health metrics on the sampled tokens, float64, each a sum and a count so
    they pool exactly over ranks. Δ = log π_train − log π_sampler, π_train the old-policy forward's
    log-probs (the trainer at the sampling step's weights, or the proximal policy under staleness):

    | key | per token | reference |
    |---|---|---|
    | `mismatch/k3_kl` | e^Δ − Δ − 1 (KL(μ ‖ π_train) on samples from μ) | prime-rl mismatch_kl |
    | `mismatch/kl_ent_ratio` | Σ k3 / Σ H, H the sampled position's entropy | prime-rl kl_ent_ratio |
    | `mismatch/extreme_frac` | [\|Δ\| > ln 2] (the ratio outside [1/2, 2]) | AReaL-style extreme tokens |
    | `mismatch/token_mult_prob_error` | e^{\|Δ\|} (1 = no mismatch) | NeMo-RL, its R3 gate |
    | `mismatch/js_divergence` | ½(e^a − a − 1) + ½(e^b − b − 1), a = log π_train − log m, b = log μ − log m, m = ½(π_train + μ) | NeMo-RL js_divergence_error |

    H is the sampler's entropy of softmax(logits / T) at each sampled position (Rollout.entropy_BR):
    prime-rl divides by the trainer's entropy at the same position, which differs from it by the same
    mismatch the numerator measures."""
    m = mask_BR.bool()
    a_N, b_N = trainer_logp_BR[m].double(), sampler_logp_BR[m].double()
    d_N = a_N - b_N
    k3_N = d_N.exp() - d_N - 1
    log_mix_N = torch.logaddexp(a_N, b_N) - math.log(2)
    x_N, y_N = a_N - log_mix_N, b_N - log_mix_N
    js_N = 0.5 * (x_N.exp() - x_N - 1) + 0.5 * (y_N.exp() - y_N - 1)
    return {
        "mismatch/k3_kl": S.mean(k3_N),
        "mismatch/kl_ent_ratio": S.ratio(k3_N.sum(), entropy_BR[m].double().sum()),
        "mismatch/extreme_frac": S.mean(d_N.abs() > math.log(2)),
        "mismatch/token_mult_prob_error": S.mean(d_N.abs().exp()),
        "mismatch/js_divergence": S.mean(js_N),
    }


def replace_rate(replaced_BTL: torch.Tensor, valid_BT: torch.Tensor, top_k: int) -> S.Stats:
    """`routing/replay_replace_rate` (pooled over layers) and `.../layer_{i}`: replayed slots the partial
    replay replaced over the replayed slots (valid positions x K), each a sum and a count (prime-rl's
    router_replay_replace_rate, which averages its per-layer rates)."""
    at_NL = replaced_BTL[valid_BT].double()
    slots = float(at_NL.shape[0] * top_k)
    out = {"routing/replay_replace_rate": S.ratio(at_NL.sum(), at_NL.new_tensor(slots * at_NL.shape[1]))}
    out.update({f"routing/replay_replace_rate/layer_{i}": S.ratio(at_NL[:, i].sum(), at_NL.new_tensor(slots))
                for i in range(at_NL.shape[1])})
    return out


def staleness_metrics(
    batch: Batch, old_trace: RoutingTrace, response_BS1: torch.Tensor, staleness: int
) -> tuple[S.Stats, tuple[float, float] | None]:
    """A stale rollout's metrics (rollout.staleness; every row shares the sampler's version): `staleness/*`
    in versions, and the expert change from the stale sampler's routing to the proximal (old-policy)
    forward's on the response positions, pooled and per layer, each pooled over ranks weighted by response
    tokens; with both traces' logits, also [Σ centred logit shift², elements] there (for the margin
    prediction of that change, `reduce_step`)."""
    tokens = float(batch.response_mask_BR.sum())
    out = {"staleness/mean": S.weighted(float(staleness), float(len(batch.adv_B))),
           "staleness/max": S.Stat("max", (float(staleness),))}
    trace, shift = batch.sampler_trace, None
    if trace is None:
        return out, shift
    at = response_BS1.to(trace.expert_ids_BTLK.device)
    layers_L = expert_change_by_layer(trace, old_trace, at)
    out["routing/expert_change/vs_sampler"] = S.weighted(float(layers_L.mean()), tokens)
    out.update({f"routing/expert_change/vs_sampler/layer_{i}": S.weighted(float(v), tokens) for i, v in enumerate(layers_L)})
    if trace.router_logits_BTLE is not None and old_trace.router_logits_BTLE is not None:
        prox = old_trace.router_logits_BTLE[at.to(old_trace.router_logits_BTLE.device)]
        shift = (centred_shift_sq(prox, trace.router_logits_BTLE[at].to(prox)), float(prox.numel()))
    return out, shift


def change_metrics(changes: list[torch.Tensor], response: list[float]) -> dict[str, float]:
    """Expert-change metrics from each mini-batch's per-layer change `[L]` and its change over response
    positions (metric table in __init__.py)."""
    out = {"routing/expert_change/first_minibatch": float(changes[0].mean())}
    if len(changes) > 1:
        later_L = torch.stack(changes[1:]).mean(0)
        out["routing/expert_change/frac"] = float(later_L.mean())
        out["routing/expert_change/response_frac"] = finite_mean(response[1:])
        out["routing/expert_change/after_one_update"] = float(changes[1].mean())
        out.update({f"routing/expert_change/layer_{i}": float(v) for i, v in enumerate(later_L)})
    return out


def response_margins(old_trace: RoutingTrace, response_BS1: torch.Tensor, top_k: int) -> list[list[float]] | None:
    """The old policy's router margins (`router_margins`) at the response positions, `[N][L]`, or None
    when the model has no (k+1)-th expert or the trace no logits."""
    logits = old_trace.router_logits_BTLE
    if logits is None or old_trace.num_experts <= top_k:
        return None
    return router_margins(logits[response_BS1.to(logits.device)], top_k).cpu().tolist()


def margin_metrics(
    margins: list[list[float]], shift: list[tuple[float, float]], sigma: float, top_k: int,
    sampler_shift: list[tuple[float, float]] | None = None,
) -> dict[str, float]:
    """`routing/margin/*` over every rank's margins `[N][L]` (pooled, so the order statistics are exact),
    `routing/logit_shift/after_one_update` from each rank's [Σ centred shift², elements] on mini-batch 2,
    and the expert change those predict after one update with injected logit noise σ on top
    (plan.noise_sigma(routing, 1); metric table in __init__.py). With `sampler_shift` (each rank's [Σ centred
    shift², elements] from a stale sampler's logits to the proximal forward's), the change those margins
    predict at that shift: `routing/margin/predicted_change_vs_sampler`."""
    m_NL = torch.tensor(margins, dtype=torch.float64).reshape(-1, len(margins[0]) if margins else 1)
    out: dict[str, float] = {}
    if m_NL.numel():
        summary = margin_summary(m_NL)
        out["routing/margin/median"] = summary["median"]
        out["routing/margin/p10"] = summary["p10"]
        out["routing/margin/frac_below_0.1"] = summary["frac_below"]
        out.update({f"routing/margin/layer_{i}": float(v) for i, v in enumerate(m_NL.quantile(0.5, dim=0))})
    if shift:
        count = sum(n for _, n in shift)
        delta = math.sqrt(sum(q for q, _ in shift) / count) if count else math.nan
        out["routing/logit_shift/after_one_update"] = delta
        out["routing/margin/predicted_change"] = (
            predicted_change(m_NL.flatten(), math.sqrt(sigma**2 + delta**2), top_k)
            if math.isfinite(delta) and m_NL.numel()
            else math.nan
        )
    if sampler_shift and m_NL.numel():
        count = sum(n for _, n in sampler_shift)
        delta = math.sqrt(sum(q for q, _ in sampler_shift) / count) if count else math.nan
        out["routing/logit_shift/vs_sampler"] = delta
        out["routing/margin/predicted_change_vs_sampler"] = (
            predicted_change(m_NL.flatten(), delta, top_k) if math.isfinite(delta) else math.nan
        )
    return out

