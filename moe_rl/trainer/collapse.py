"""Collapse events: detected from each step's metrics, logged with their step and kind.

| kind | fires when |
|---|---|
| `nonfinite` | in some mini-batches of the step, the loss or gradient norm was NaN/inf (those updates are skipped); one event per step, its `detail` maps each non-finite quantity (`train/loss`, `train/grad_norm`) to the number of mini-batches where it was, `value` is the first non-finite value |
| `reward_collapse` | after `warmup_steps`, the `reward_window`-step moving average of `rollout/reward/mean` falls below `reward_frac` x its best value so far (and the best is > 0); the best is taken over full windows only |
| `entropy_collapse` | after `warmup_steps`, `rollout/entropy/mean` < `entropy_min` |
| `ratio_blowup` | `ratio/<r>/max` > `ratio_max` or `ratio/<r>/min` < 1 / `ratio_max` in any mini-batch, where r is the ratio the objective weights its gradient by (`SPECS[name].ratio`: `token` for grpo and cispo, `seq` for gspo, gspo_token and gmpo); a token extreme that a sequence objective averages away is not a blow-up of that objective. One event per step; `value` is the high extreme if it crossed, else the low one; `detail` says which side crossed and with which advantage sign (below) |

A `ratio_blowup` event's `detail` maps `high` (the step's max ratio, if above `ratio_max`) and `low` (its
min, if below 1 / `ratio_max`) to the extreme, and each side-and-sign cell that crossed too,
`high/pos_adv`, `high/neg_adv`, `low/pos_adv`, `low/neg_adv`, to the extreme over the entries with
Â > 0 or Â < 0 (`ratio/<r>/{pos,neg}_adv/{max,min}`). A side without a cell crossed only on Â = 0
entries, which carry no gradient. Which cells carry gradient, with ρ the clipped ratio and Â the
advantage (a PPO clip −min(ρÂ, clip(ρ)Â) zeroes the gradient where the clip is active in the min):

| cell | grpo, gspo, gspo_token, gmpo (PPO-style clip) | cispo |
|---|---|---|
| `high/neg_adv` | **unclipped, weight ρ·\\|Â\\| > ratio_max·\\|Â\\|: the harmful case**, pushing down a token the policy now makes far likelier, with a gradient as large as the ratio (dual-clip, `objective.clip_ratio_c`, zeroes it beyond c) | weight truncated at 1 + clip_high |
| `low/pos_adv` | unclipped, but weight ρ·\\|Â\\| < \\|Â\\| / ratio_max: a negligible gradient; the harm is the lost signal of a good token the policy has all but dropped, not a large step | weight max(ρ, 1 − clip_low) |
| `high/pos_adv` | clipped: zero gradient | weight truncated at 1 + clip_high |
| `low/neg_adv` | clipped: zero gradient | as `low/pos_adv` |

(For gmpo the clip acts per token in log space and ρ_i is the geometric mean of the clipped token ratios:
a sequence with s_i > ratio_max and Â_i < 0 keeps the gradient of its tokens above the clip, so
`high/neg_adv` is harmful there too.) `collapse/ratio_blowup/<side>_<sign>_adv` counts the events so far
in which each cell crossed; `collapse/ratio_blowup/high_neg_adv` is the one that can move the policy far.

How often `reward_collapse` fires on noise alone: `reward_collapse_false_positive_rate` simulates a
policy whose true reward never moves, at the default batch (8 prompts x 8 completions, so each step's
mean reward is over 64 rewards) and the default thresholds (warm-up 5, window 5, fraction 0.5), and
counts the seeds on which it fires at least once (2000 seeds, seed 0; `python
experiments/reward_collapse_fp.py`; ± one binomial standard error). icc = 0: every reward an
independent Bernoulli(p). icc = 0.3: prompts differ in difficulty, each prompt's success probability
drawn from a Beta of mean p so its group's rewards correlate at 0.3, which makes the step mean as
noisy as ~21 independent rewards rather than 64 (design effect 1 + 7 x 0.3; 0.3 is an assumption, not
a measurement). "Before" is the detector that took its best from partial windows too (the mean of a
run's first 1-4 steps, noisier, so a lucky first step set a best the policy never matched again).

| icc | p | steps | before | after (full windows) |
|---|---|---|---|---|
| 0 | 0.2 | 30 | 0.020 ± 0.003 | 0.001 ± 0.001 |
| 0 | 0.2 | 150 | 0.074 ± 0.006 | 0.032 ± 0.004 |
| 0 | 0.5 | 30, 150 | 0 | 0 |
| 0.3 | 0.2 | 30 | 0.40 ± 0.01 | 0.26 ± 0.01 |
| 0.3 | 0.2 | 150 | 0.989 ± 0.002 | 0.985 ± 0.003 |
| 0.3 | 0.5 | 30 | 0.004 ± 0.001 | 0 |
| 0.3 | 0.5 | 150 | 0.015 ± 0.003 | 0.002 ± 0.001 |

So at reward ~0.2 and this batch size, a `reward_collapse` is evidence only with independent rewards
and short runs. With prompts of differing difficulty, as real tasks have, it still fires on a quarter of
30-step runs and on nearly every 150-step run: the best of 26-146 overlapping 5-step means of a noisy
series sits far above the series' mean, and half of it is within reach of a low stretch. Read it
against these rates (or a larger batch), not as a collapse by itself.

Reward and entropy collapse fire once when entered and again only after recovery, so a long
collapse is one event, not one per step. `collapse/kind/<kind>` counts each kind's events so far.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from moe_rl.config import CollapseConfig

KINDS = ("nonfinite", "reward_collapse", "entropy_collapse", "ratio_blowup")


BLOWUP_CELLS = ("high/neg_adv", "low/pos_adv", "high/pos_adv", "low/neg_adv")
"""The side-and-sign cells of a `ratio_blowup` event's detail (see the table above)."""


def counts_by_kind(events: list[CollapseEvent]) -> dict[str, float]:
    """`collapse/kind/<kind>`: how many events of each kind so far (0 for a kind that has not fired)."""
    return {f"collapse/kind/{kind}": float(sum(e.kind == kind for e in events)) for kind in KINDS}


def blowup_counts(events: list[CollapseEvent]) -> dict[str, float]:
    """`collapse/ratio_blowup/<side>_<sign>_adv`: how many `ratio_blowup` events so far had that cell cross."""
    blowups = [e for e in events if e.kind == "ratio_blowup"]
    return {
        f"collapse/ratio_blowup/{cell.replace('/', '_')}": float(sum(cell in (e.detail or {}) for e in blowups))
        for cell in BLOWUP_CELLS
    }


@dataclass
class CollapseEvent:
    """One event: the RL step it happened at, its kind, the value seen and the threshold crossed."""

    step: int
    kind: str
    value: float
    threshold: float
    detail: dict[str, float] | None = None
    """nonfinite: each non-finite quantity and in how many of the step's mini-batches; ratio_blowup: the
    sides and side-and-sign cells that crossed, with their extremes (module docstring); else None."""


@dataclass
class CollapseDetector:
    """Stateful detector; its state is part of every checkpoint."""

    cfg: CollapseConfig
    ratio: str = "token"
    """Which ratio's extremes `ratio_blowup` watches: `token` or `seq` (the objective's, SPECS[name].ratio)."""
    rewards: list[float] = field(default_factory=list)
    best_avg: float = -math.inf
    in_reward_collapse: bool = False
    in_entropy_collapse: bool = False
    events: list[CollapseEvent] = field(default_factory=list)
    nonfinite_counts: dict[str, int] = field(default_factory=dict)
    """This step's skipped updates so far, by quantity; `observe` turns them into one event."""
    nonfinite_first: float = math.nan

    def nonfinite(self, step: int, value: float, quantity: str = "train/loss") -> None:
        """Note a skipped update whose `quantity` (train/loss or train/grad_norm) was `value`, not finite.
        The step's notes become one `nonfinite` event when `observe` sees the step's metrics."""
        if not self.nonfinite_counts:
            self.nonfinite_first = value
        self.nonfinite_counts[quantity] = self.nonfinite_counts.get(quantity, 0) + 1

    def observe(self, step: int, metrics: dict[str, float]) -> list[CollapseEvent]:
        """Check one step's metrics (`ratio/<ratio>/max` and `/min` taken over all its mini-batches); return
        new events."""
        c, new = self.cfg, []
        if self.nonfinite_counts:
            detail, self.nonfinite_counts = dict(self.nonfinite_counts), {}
            new.append(CollapseEvent(step, "nonfinite", self.nonfinite_first, math.inf, detail))
        blowup = self._blowup(metrics)
        if "high" in blowup:
            new.append(CollapseEvent(step, "ratio_blowup", blowup["high"], c.ratio_max, blowup))
        elif "low" in blowup:
            new.append(CollapseEvent(step, "ratio_blowup", blowup["low"], 1 / c.ratio_max, blowup))
        self.rewards = (self.rewards + [metrics["rollout/reward/mean"]])[-c.reward_window :]
        avg = sum(self.rewards) / len(self.rewards)
        if len(self.rewards) == c.reward_window:  # a partial window's noisier mean would inflate the best
            self.best_avg = max(self.best_avg, avg)
        if step >= c.warmup_steps:
            low = self.best_avg > 0 and avg < c.reward_frac * self.best_avg
            if low and not self.in_reward_collapse:
                new.append(CollapseEvent(step, "reward_collapse", avg, c.reward_frac * self.best_avg))
            self.in_reward_collapse = low
            entropy = metrics["rollout/entropy/mean"]
            low = entropy < c.entropy_min
            if low and not self.in_entropy_collapse:
                new.append(CollapseEvent(step, "entropy_collapse", entropy, c.entropy_min))
            self.in_entropy_collapse = low
        return [self._add(e) for e in new]

    def _blowup(self, metrics: dict[str, float]) -> dict[str, float]:
        """The `ratio_blowup` detail of one step's extremes: each side and side-and-sign cell beyond the
        thresholds, with its extreme ({} when nothing crossed; NaN, a sign without entries, never does)."""
        r, hi, lo = f"ratio/{self.ratio}", self.cfg.ratio_max, 1 / self.cfg.ratio_max
        crossed = {"high": metrics[f"{r}/max"] > hi, "low": metrics[f"{r}/min"] < lo}
        out = {}
        for side, ext in (("high", "max"), ("low", "min")):
            if not crossed[side]:
                continue
            out[side] = metrics[f"{r}/{ext}"]
            for sign in ("pos", "neg"):
                x = metrics[f"{r}/{sign}_adv/{ext}"]
                if (x > hi) if side == "high" else (x < lo):
                    out[f"{side}/{sign}_adv"] = x
        return out

    def _add(self, event: CollapseEvent) -> CollapseEvent:
        self.events.append(event)
        return event

    def state_dict(self) -> dict:
        """Everything needed to resume detection exactly."""
        state = asdict(self)
        state.pop("cfg")
        state.pop("ratio")  # a property of the objective, which a resume cannot change
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`."""
        for key, value in state.items():
            setattr(self, key, value)
        self.events = [CollapseEvent(**e) for e in state["events"]]


def reward_collapse_false_positive_rate(
    cfg: CollapseConfig,
    p: float,
    steps: int,
    prompts: int = 8,
    group_size: int = 8,
    icc: float = 0.0,
    seeds: int = 2000,
    seed: int = 0,
) -> float:
    """Fraction of `seeds` simulated runs on which `reward_collapse` fires at least once, for a policy whose
    true reward never moves, fed to a `CollapseDetector` with `cfg` for `steps` steps (ratios 1, entropy 1,
    so nothing else fires). Every firing is a false positive.

    Each step's `rollout/reward/mean` is the mean of prompts x group_size Bernoulli rewards. icc = 0: all
    independent with probability p. icc > 0: prompts differ in difficulty, each prompt's success
    probability drawn fresh every step from Beta(p (1/icc − 1), (1 − p)(1/icc − 1)) (mean p), so its group's
    rewards share it and icc is their intra-group correlation; icc = 1 makes every group all-0 or all-1."""
    if not (0 < p < 1 and 0 <= icc <= 1):
        raise ValueError(f"need 0 < p < 1 and 0 <= icc <= 1, got {p=}, {icc=}")
    g = torch.Generator().manual_seed(seed)
    shape = (seeds, steps, prompts, 1)
    if icc == 0:
        p_SNP1 = torch.full(shape, p, dtype=torch.float64)
    elif icc == 1:
        p_SNP1 = (torch.rand(shape, generator=g, dtype=torch.float64) < p).double()
    else:
        kappa = 1 / icc - 1
        torch.manual_seed(seed)  # torch.distributions draws from the global generator
        p_SNP1 = torch.distributions.Beta(p * kappa, (1 - p) * kappa).sample(shape).double()
    hits = torch.rand(seeds, steps, prompts, group_size, generator=g, dtype=torch.float64) < p_SNP1
    fired = 0
    for rewards in hits.double().mean((-1, -2)).tolist():
        det = CollapseDetector(cfg)
        for step, reward in enumerate(rewards):
            metrics = {"rollout/reward/mean": reward, "rollout/entropy/mean": 1.0,
                       "ratio/token/max": 1.0, "ratio/token/min": 1.0}
            if any(e.kind == "reward_collapse" for e in det.observe(step, metrics)):
                fired += 1
                break
    return fired / seeds
