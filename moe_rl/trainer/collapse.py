"""Collapse events: detected from each step's metrics (and each evaluation's), logged with their step and kind.

Four kinds say the run is failing (`FAILURE_KINDS`: W&B alerts go to these by default, `logger.alert_kinds`,
and `collapse.stop_on_collapse` stops on them, `collapse.stop_kinds`); one is a signal of the mechanism
the paper is about, not a failure by itself (`ratio_blowup`).

| kind | fires when | in runs that go on to learn |
|---|---|---|
| `reward_collapse` | the true mean reward has fallen: a one-sided CUSUM on `rollout/reward/mean` with its standard error `rollout/reward/se` (from the group structure), against the level of the `reward_window` steps before (moe_rl.trainer.changepoint), tuned to a fall to `reward_frac` x that level, its threshold set for `reward_arl0` steps between false alarms. After `warmup_steps` + `reward_window` steps | false alarms ≤ 0.035 per 500-step run for p 0.1-0.5 with 8 x 8 and 16 x 8 rollouts; **not** over the whole range: above 0.05 in 12 of 72 cells of p 0.05-0.95 x 4 x 4 to 16 x 8 x icc 0-0.6 (0.053-0.12 with 4 prompts at p ≤ 0.2 or 8 groups at p 0.05 and icc ≥ 0.3; 0.07 and 0.24 with 4 x 4 rollouts at p 0.8 and icc 0.3 and 0.6; docs/reliability.md lists them); a fall to 0.25x found within 20 steps in ≥ 0.93 of runs with 16 x 8 rollouts |
| `eval_regression` | the same test on `eval/expected_accuracy` with `eval/expected_accuracy/se` (over the eval prompts), one observation per evaluation: `eval_frac`, `eval_window` evaluations, `eval_arl0` evaluations between false alarms. Only where expected accuracy is logged (tasks with a canonical answer) | false alarms ≤ 0.001 over 51 simulated evaluations (docs/reliability.md) |
| `entropy_collapse` | after `warmup_steps`, `rollout/entropy/mean` < `entropy_min`: the sampler has become all but deterministic | once in the committed reports (natural_balanced, a run whose accuracy went to 0) |
| `nonfinite` | in some mini-batches of the step, the loss or gradient norm was NaN/inf (those updates are skipped); one event per step, its `detail` maps each non-finite quantity (`train/loss`, `train/grad_norm`) to the number of mini-batches where it was, `value` is the first non-finite value | never in the committed reports |
| `ratio_blowup` (a mechanism signal) | `ratio/<r>/max` > `ratio_max` or `ratio/<r>/min` < 1 / `ratio_max` in any mini-batch, where r is the ratio the objective weights its gradient by (`OBJECTIVES[name].ratio`: `token` for grpo and cispo, `seq` for gspo, gspo_token and gmpo); a token extreme that a sequence objective averages away is not a blow-up of that objective. One event per step; `value` is the high extreme if it crossed, else the low one; `detail` says which side crossed and with which advantage sign (below) | often: see "How often ratio_blowup fires" below. It says a token ratio left [1/1000, 1000], which under a PPO clip mostly carries no gradient; it is not a collapse |

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

How often `reward_collapse` fires, and how soon it finds a fall: experiments/reward_collapse_fp.py
simulates rewards whose true level never moves, or falls at step 50, and feeds them through this
detector; its full tables are in docs/reliability.md ("Collapse events"). False alarms per run (a true
reward that never moves) and detection of a fall to 0.25x at step 50, default CollapseConfig, 1000 runs per
cell, "old" the rule this test replaced:

| batch | icc | p | old, 150 steps | new, 150 steps | new, 500 steps | new: fall to 0.25x found within 20 steps |
|---|---|---|---|---|---|---|
| 8x8 | 0 | 0.1 | 0.789 | 0.001 | 0.006 | 1.00 |
| 8x8 | 0 | 0.2 | 0.029 | 0.000 | 0.001 | 1.00 |
| 8x8 | 0 | 0.5 | 0.000 | 0.000 | 0.000 | 1.00 |
| 8x8 | 0.3 | 0.1 | 1.000 | 0.001 | 0.016 | 0.60 |
| 8x8 | 0.3 | 0.2 | 0.978 | 0.000 | 0.003 | 1.00 |
| 8x8 | 0.3 | 0.5 | 0.004 | 0.002 | 0.008 | 1.00 |
| 8x8 | 0.5 | 0.1 | 1.000 | 0.003 | 0.035 | 0.19 |
| 8x8 | 0.5 | 0.2 | 0.999 | 0.003 | 0.011 | 0.96 |
| 8x8 | 0.5 | 0.5 | 0.100 | 0.006 | 0.016 | 1.00 |
| 16x8 | 0 | 0.1 | 0.069 | 0.003 | 0.008 | 1.00 |
| 16x8 | 0 | 0.2 | 0.000 | 0.000 | 0.001 | 1.00 |
| 16x8 | 0 | 0.5 | 0.000 | 0.000 | 0.000 | 1.00 |
| 16x8 | 0.3 | 0.1 | 0.989 | 0.001 | 0.005 | 1.00 |
| 16x8 | 0.3 | 0.2 | 0.323 | 0.001 | 0.001 | 1.00 |
| 16x8 | 0.3 | 0.5 | 0.000 | 0.000 | 0.001 | 1.00 |
| 16x8 | 0.5 | 0.1 | 1.000 | 0.002 | 0.008 | 0.93 |
| 16x8 | 0.5 | 0.2 | 0.824 | 0.001 | 0.006 | 1.00 |
| 16x8 | 0.5 | 0.5 | 0.000 | 0.003 | 0.010 | 1.00 |

The rule it replaced (a 5-step moving average below half its best so far) false-alarms there on up to
every run: the best of many overlapping windows of a noisy series sits far above its mean. The new test is
slow only where one step's standard error is as large as the fall itself (8 x 8 groups at p = 0.1 with
correlated groups); docs/reliability.md says why.

How often `ratio_blowup` fires in runs that go on to learn (the committed reports, counted from their
table.json): in `noise_dose` (126 runs of 150 steps, arithmetic, tiny model) 20 runs logged at least one,
198 events in all: every seed of GRPO, CISPO and SAPO at router-logit noise σ = 0.8 (40, 77 and 79
events) and one seed each of CISPO at σ = 0.15 and SAPO at σ = 0.3. None of those 20 runs had a sustained
regression of expected accuracy; all ended at 0.40-0.47 (GRPO at σ = 0.8: 0.41-0.44, against 0.42-0.49 at
σ = 0 with no event). In `stability_natural` (18 runs) GRPO logged 9 (its seeds also had the retired
reward rule's events, so which seeds is not recoverable from the table), GRPO + R2 and GSPO none. So a
blow-up says that routing or noise moved a token's probability over 1000x, the mechanism the paper
describes; by itself it does not say the run is failing.

Reward collapse, eval regression and entropy collapse fire once when entered and again only after
recovery, so a long collapse is one event, not one per step (for the two tests, recovery is the CUSUM
back at 0 and a new reference: moe_rl.trainer.changepoint). `collapse/kind/<kind>` counts each kind's
events so far. A test's event has `value` the observation that tripped it, `threshold` the reference's
midpoint (1 + frac)/2 x its level, and `detail` {reference, sigma, cusum, h}.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

from moe_rl.trainer.changepoint import MIN_H_PER_K, LevelDrop
from moe_rl.trainer.config import COLLAPSE_KINDS, FAILURE_KINDS, CollapseConfig

KINDS = COLLAPSE_KINDS
assert set(FAILURE_KINDS) <= set(KINDS)

BLOWUP_CELLS = ("high/neg_adv", "low/pos_adv", "high/pos_adv", "low/neg_adv")
"""The side-and-sign cells of a `ratio_blowup` event's detail (see the table above)."""


def collapse_metrics(events: list[CollapseEvent], step: int) -> dict[str, float]:
    """A step's `collapse/*` metrics (the table in moe_rl/trainer/__init__.py): the events so far and those
    of `step`, the counts by kind and the `ratio_blowup` cells. The one place these keys are written."""
    return {
        "collapse/events": float(len(events)),
        "collapse/new_events": float(sum(1 for e in events if e.step == step)),
        **counts_by_kind(events),
        **blowup_counts(events),
    }


def stop_event(events: list[CollapseEvent], step: int, kinds: set[str]) -> dict | None:
    """The first of `step`'s events whose kind is in `kinds` (the ones a run stops on), as a dict."""
    return next((asdict(e) for e in events if e.step == step and e.kind in kinds), None)


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
    sides and side-and-sign cells that crossed, with their extremes; reward_collapse and eval_regression:
    the test's reference level, sigma, CUSUM statistic and threshold h (module docstring); else None."""


@dataclass
class CollapseDetector:
    """Stateful detector; its state is part of every checkpoint."""

    cfg: CollapseConfig
    ratio: str = "token"
    """Which ratio's extremes `ratio_blowup` watches: `token` or `seq` (the objective's, OBJECTIVES[name].ratio)."""
    reward: LevelDrop | None = None
    """The reward-collapse test (built from cfg)."""
    eval: LevelDrop | None = None
    """The eval-regression test (built from cfg)."""
    in_entropy_collapse: bool = False
    events: list[CollapseEvent] = field(default_factory=list)
    nonfinite_counts: dict[str, int] = field(default_factory=dict)
    """This step's skipped updates so far, by quantity; `observe` turns them into one event."""
    nonfinite_first: float = math.nan
    nonfinite_said: bool = False
    """Whether the run's first skipped update was said on the console (once per run)."""

    def __post_init__(self) -> None:
        c = self.cfg
        if self.reward is None:
            self.reward = LevelDrop(c.reward_frac, c.reward_window, c.reward_arl0, c.reward_margin, MIN_H_PER_K)
        if self.eval is None:
            self.eval = LevelDrop(c.eval_frac, c.eval_window, c.eval_arl0, c.eval_margin)

    def nonfinite(self, step: int, value: float, quantity: str = "train/loss") -> None:
        """Note a skipped update whose `quantity` (train/loss or train/grad_norm) was `value`, not finite.
        The step's notes become one `nonfinite` event when `observe` sees the step's metrics."""
        if not self.nonfinite_counts:
            self.nonfinite_first = value
        if not self.nonfinite_said:  # once per run on the console; every one is an event in events.jsonl
            self.nonfinite_said = True
            warnings.warn(f"step {step}: {quantity} = {value}, not finite: the update is skipped and a nonfinite "
                          "event logged (later ones only in events.jsonl); a reward or advantage too large to "
                          "average (rollout/reward/mean) is one cause", RuntimeWarning, stacklevel=2)
        self.nonfinite_counts[quantity] = self.nonfinite_counts.get(quantity, 0) + 1

    def observe(self, step: int, metrics: dict[str, float]) -> list[CollapseEvent]:
        """Check one step's metrics (`ratio/<ratio>/max` and `/min` taken over all its mini-batches); return
        new events. A step without `rollout/reward/se` (or with NaN there: fewer than two groups) is not
        a reward-test observation."""
        c, new = self.cfg, []
        if self.nonfinite_counts:
            detail, self.nonfinite_counts = dict(self.nonfinite_counts), {}
            new.append(CollapseEvent(step, "nonfinite", self.nonfinite_first, math.inf, detail))
        blowup = self._blowup(metrics)
        if "high" in blowup:
            new.append(CollapseEvent(step, "ratio_blowup", blowup["high"], c.ratio_max, blowup))
        elif "low" in blowup:
            new.append(CollapseEvent(step, "ratio_blowup", blowup["low"], 1 / c.ratio_max, blowup))
        if step >= c.warmup_steps:
            x = metrics["rollout/reward/mean"]
            event = level_event(self.reward, step, "reward_collapse", x, metrics.get("rollout/reward/se", math.nan))
            new += [event] if event else []
            entropy = metrics["rollout/entropy/mean"]
            low = entropy < c.entropy_min
            if low and not self.in_entropy_collapse:
                new.append(CollapseEvent(step, "entropy_collapse", entropy, c.entropy_min))
            self.in_entropy_collapse = low
        return [self._add(e) for e in new]

    def observe_eval(self, step: int, metrics: dict[str, float], prefix: str = "eval/") -> list[CollapseEvent]:
        """Check one evaluation's `<prefix>expected_accuracy` and its `/se` (absent: no observation);
        return new events. `prefix` is `eval/initial/` for the evaluation before the first update."""
        x = metrics.get(f"{prefix}expected_accuracy", math.nan)
        event = level_event(self.eval, step, "eval_regression", x, metrics.get(f"{prefix}expected_accuracy/se", math.nan))
        return [self._add(event)] if event else []

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
        """Restore from `state_dict()`. A test's field the checkpoint predates (`min_h_per_k`) keeps the value
        this detector was built with from its config, not the dataclass default."""
        tests = [LevelDrop(**{**asdict(t), **state[n]}) for t, n in ((self.reward, "reward"), (self.eval, "eval"))]
        for key, value in state.items():
            setattr(self, key, value)
        self.reward, self.eval = tests
        self.events = [CollapseEvent(**e) for e in state["events"]]


def level_event(test: LevelDrop, step: int, kind: str, x: float, se: float) -> CollapseEvent | None:
    """Feed one observation x (standard error se) to a level test; the `kind` event at `step` if it fired
    (detail: the reference it fell from). CollapseDetector calls it for both tests; analysis.recount too."""
    if not test.update(x, se):
        return None
    mu, sigma, _, h = test.reference()  # the one it fired against: a drop keeps its reference frozen
    threshold = (1 + test.frac) / 2 * mu  # the level whose crossing the statistic accumulates
    return CollapseEvent(step, kind, x, threshold, {"reference": mu, "sigma": sigma, "cusum": test.s, "h": h})
