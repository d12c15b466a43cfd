"""The typed results of an RL step's phases, and `reduce_step`: their one gather over ranks and the
step's metrics (the metric table is in moe_rl/trainer/__init__.py). Shape legend as in step.py.

Every value carries its reduction: the objective's and the step's own scalars are `moe_rl.reduction.Stats`
(sums and counts, extremes, pooled variances); a mini-batch's routing change is a `RoutingChange` (means
over its positions or tokens, pooled weighted by their counts; drift and logit-shift slots and the length
sums add); the router margins are a pooled sample (exact order statistics). No list of metric names
decides how anything is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl import reduction as S
from moe_rl.objectives.common import LENGTH_SUMS, length_bins, length_metrics
from moe_rl.rollout import Rollout
from moe_rl.routing import (
    Drift,
    RoutingTrace,
    centred_shift_sq,
    expert_change_by_layer,
    expert_change_fraction,
)
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.distributed import Dist
from moe_rl.trainer.samplers import Scores
from moe_rl.trainer.step_metrics import (
    change_metrics,
    finite_mean,
    margin_metrics,
    rollout_metrics,
)


@dataclass(frozen=True)
class Counts:
    """Response tokens and valid forward positions of a slice of the batch (what the pooled means weigh by)."""

    tokens: float
    positions: float

    @classmethod
    def of(cls, batch: Batch, sl: slice = slice(None)) -> Counts:
        return cls(float(batch.response_mask_BR[sl].sum()), float(batch.valid_BS1[sl].sum()))


@dataclass
class RoutingChange:
    """One mini-batch's routing change (this rank's rows): the routing its update forward used absent
    replay (free, or drifted) against the old policy's, before its update.

    A typed record rather than `reduction.Stats`, on purpose: its means pool in float32 tensor arithmetic
    (`_pooled`), `length` sums rank by rank, and a step without drift logs 0.0 where a Stat would give nan;
    as float64 Stats every one of these would change logged values (in their last bits), which the
    step-equivalence harness (experiments/step_equivalence.py) forbids of a restructuring."""

    layers: list[float]
    """Per layer, the expert change 1 - |A∩B|/K over valid positions."""
    response: float
    """The same over response positions (`response_positions`)."""
    rollout: float | None = None
    """The sampler's routing against this forward's, over valid positions (when the sampler was traced)."""
    drift: tuple[float, float] | None = None
    """[swapped slots, valid slots] when routing.drift > 0."""
    shift: tuple[float, float] | None = None
    """[Σ centred logit shift², elements] over response positions, when the forward recorded logits."""
    length: list[float] | None = None
    """The flattened `length_sums` of this forward's ratios (the off-policy mini-batches, j > 0)."""


@dataclass
class MinibatchResult:
    """What one update returns: its objective's and optimizer's stats (float parts), its routing change
    and its rows' counts."""

    stats: S.Stats
    change: RoutingChange
    counts: Counts

    @property
    def metrics(self) -> dict[str, float]:
        """This rank's finished values (a plain dict to read)."""
        return {key: S.value(s) for key, s in self.stats.items()}


@dataclass
class StepRecord:
    """What each rank knows beside its results, for `reduce_step` (gathered from every rank): its own
    scalars (`local`, with their reductions), the old policy's router margins (a sample, or None), and a
    stale rollout's logit shift."""

    local: S.Stats
    margins: list[list[float]] | None
    sampler_shift: tuple[float, float] | None = None
    """A stale rollout's [Σ centred logit shift², elements] from the sampler to the proximal forward."""


@dataclass(frozen=True)
class MetricSettings:
    """The run's settings that the step's metrics read: fixed for the run, built once (StepContext) and
    passed to `reduce_step` as they are, never gathered."""

    group_size: int
    reward_can_fail: bool
    """The task's reward can fail (`rollout/reward_errors`)."""
    max_new_tokens: int
    """sampler.max_new_tokens, which fixes the response-length bins."""
    top_k: int
    noise_sigma: float
    """The logit-noise scale that re-routes mini-batch 2 beyond the old forward (plan.noise_sigma(routing, 1))."""
    drift_minibatches: range | None
    """The mini-batches `routing/drift/applied_frac` pools over, or None when drift is off."""


def _pooled(values: list[list[float]], weights: list[float]) -> torch.Tensor:
    """The ranks' means pooled, weighted by their counts."""
    total = sum(torch.tensor(v) * w for v, w in zip(values, weights, strict=True))
    return total / max(sum(weights), 1.0)


def reduce_step(
    dist: Dist, roll: Rollout, scores: Scores, results: list[MinibatchResult], record: StepRecord,
    settings: MetricSettings, lr: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """The step's metrics over all ranks (one gather; identical on every rank), and the ratio extremes
    over all its mini-batches that the collapse detector reads beside them. `lr` is the step's learning
    rate, the same on every rank.

    Each mini-batch's objective stats are pooled over ranks exactly (moe_rl.reduction.combine: whatever the
    key), then over the step's mini-batches by their kind (moe_rl.reduction.over_updates and extremes)."""
    mask_BR = roll.response_mask_BR
    rows = [
        scores.rewards_B.double(),
        mask_BR.sum(1).double().cpu(),
        (roll.entropy_BR * mask_BR).sum(1).double().cpu(),
        scores.failed_B,
    ]
    ranks = dist.gather({"rows": torch.stack(rows, 1).tolist(), "results": results, "record": record})
    metrics = rollout_metrics([row for r in ranks for row in r["rows"]], settings.group_size, settings.reward_can_fail)
    M = len(results)
    per_rank = [r["results"] for r in ranks]
    per_mb = [S.combine([res[j].stats for res in per_rank]) for j in range(M)]
    metrics.update(S.values(S.over_updates(per_mb)))
    metrics["train/lr"] = lr
    # Each mini-batch's expert change over all ranks: per layer a mean over valid positions, over the
    # response a mean over response tokens.
    changes = [[res[j].change for res in per_rank] for j in range(M)]
    counts = [[res[j].counts for res in per_rank] for j in range(M)]
    layers = [_pooled([c.layers for c in changes[j]], [n.positions for n in counts[j]]) for j in range(M)]
    response = [float(_pooled([[c.response] for c in changes[j]], [n.tokens for n in counts[j]])) for j in range(M)]
    metrics.update(change_metrics(layers, response))
    if changes[0][0].rollout is not None:
        metrics["routing/rollout_vs_current/frac"] = finite_mean(
            [float(_pooled([[c.rollout] for c in changes[j]], [n.positions for n in counts[j]])) for j in range(M)]
        )
    if settings.drift_minibatches is not None:  # over the mini-batches that drift (all ranks): swapped / valid slots
        swapped_slots = [res[j].change.drift for res in per_rank for j in settings.drift_minibatches]
        slots = sum(n for _, n in swapped_slots)
        metrics["routing/drift/applied_frac"] = sum(k for k, _ in swapped_slots) / slots if slots else 0.0
    # Ratio statistics by response length, pooled over mini-batches 2..M of all ranks: sums, so exact.
    bins = length_bins(settings.max_new_tokens)
    sums = torch.zeros(len(bins) * len(LENGTH_SUMS), dtype=torch.float64)
    for result in (x for res in per_rank for x in res[1:]):
        sums += torch.tensor(result.change.length, dtype=torch.float64)
    metrics.update(length_metrics(sums.view(len(bins), -1), bins))
    if record.margins is not None:  # every rank's margins, pooled: exact order statistics
        shift = [res[1].change.shift for res in per_rank] if M > 1 else []
        margins = [m for r in ranks for m in r["record"].margins]
        sampler_shift = [r["record"].sampler_shift for r in ranks if r["record"].sampler_shift is not None]
        metrics.update(margin_metrics(margins, shift, settings.noise_sigma, settings.top_k, sampler_shift))
    metrics.update(S.values(S.combine([r["record"].local for r in ranks])))
    return metrics, S.values(S.extremes(per_mb))


def response_positions(batch: Batch, sl: slice) -> torch.Tensor:
    """`[b, S1]` bool: the forward positions whose next-token prediction is a response token (the R
    positions that produce the response log-probs), where the paper's expert change is meant."""
    mask_bR = batch.response_mask_BR[sl]
    b, S1 = batch.valid_BS1[sl].shape
    return torch.cat([mask_bR.new_zeros(b, S1 - mask_bR.shape[1]), mask_bR], dim=1)


def routing_change(
    batch: Batch,
    sl: slice,
    used: RoutingTrace,
    old_trace: RoutingTrace,
    drift: Drift | None,
    num_layers: int,
    measure_drift: bool,
) -> RoutingChange:
    """Mini-batch `sl`'s routing change: `used` is the routing its update forward used absent replay,
    `drift` the drift context it ran under (None when it did not drift)."""
    valid_bS1 = batch.valid_BS1[sl]
    change = RoutingChange(
        layers=expert_change_by_layer(used, old_trace, valid_bS1).tolist(),
        response=expert_change_fraction(used, old_trace, response_positions(batch, sl)),
    )
    if batch.sampler_trace is not None:
        change.rollout = expert_change_fraction(batch.sampler_trace.rows(sl), used, valid_bS1)
    if measure_drift:
        slots = float(valid_bS1.sum()) * num_layers
        swapped = 0.0 if drift is None else float(drift.applied_BTL[valid_bS1.cpu()].sum())
        change.drift = (swapped, slots)
    if used.router_logits_BTLE is not None:  # the live logits' shift since the old policy, response positions
        at = response_positions(batch, sl).to(used.router_logits_BTLE.device)
        new, old = used.router_logits_BTLE[at], old_trace.router_logits_BTLE[at].to(used.router_logits_BTLE)
        change.shift = (centred_shift_sq(new, old), float(new.numel()))
    return change
