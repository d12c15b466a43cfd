"""A sequential test for a fall of a noisy level: a one-sided CUSUM against a trailing reference, with the
noise scale each observation brings and a threshold set by the in-control average run length.

The reward-collapse and eval-regression events (moe_rl.trainer.collapse) are this test, fed respectively
each step's mean reward with its standard error from the group structure, and each evaluation's expected
accuracy with its standard error over the eval prompts.

Notation: x_t is an observation and s_t its standard error (so s_t² is its sampling variance). The
reference is the last W observations before the current excursion: level μ = mean x, noise scale
σ = sqrt(mean s² · (1 + 1/W)) (the per-observation error, inflated by the error of μ itself, since
x_t − μ has variance s² + s²/W). The test is tuned to a fall to f·μ (`frac`): the allowance is half of it,
k = (1 − f) μ / (2σ) in units of σ, and the statistic is Page's CUSUM for a decrease (Page 1954),

    S_t = max(0, S_{t−1} + (μ − x_t) / σ − k),

which fires when S_t > h. h is set from k so that, for Gaussian noise of known level, the average run
length between false alarms of a level that never moves is `arl0` observations, by Siegmund's
approximation ARL(k, h) ≈ (exp(2kb) − 2kb − 1) / (2k²), b = h + 1.166 (Siegmund 1985; ARL → b² as k → 0),
and, for the reward test, never below `min_h_per_k` · k = MIN_H_PER_K · k = 2k: one observation alone
fires only below μ − 3kσ (0.25 μ at the default f = 0.5). Where the fall is large against the noise (k ≳
1.4), Siegmund's h falls under 2k, to 0 from k ≈ 5: the Gaussian tail then lets a single observation past
the midpoint fire, and a mean reward of few groups near a bound (p ≥ 0.8 with ≤ 8 prompts) has a far
heavier tail than that (one hard prompt of four halves the step's mean). The floor took false alarms per
500-step flat run there from 0.07-0.97 to 0.00-0.01, bar 4 x 4 rollouts at p 0.8 (0.07 and 0.24 at icc
0.3 and 0.6), while a fall to 0.25x is still found within 20 steps (issue 56; docs/reliability.md). The
false-alarm probability over a run of T observations is then about T / arl0 or less; the real one, with
an estimated reference and binomial rewards, is measured by simulation in
experiments/reward_collapse_fp.py.

Bookkeeping:
- The first W observations fill the reference; nothing fires before.
- While S > 0 (an excursion: evidence of a fall accumulating) the reference is frozen, so a fall cannot
  pull the reference down with it; when S returns to 0 without firing, the excursion's observations join
  the reference (the last W are kept), so the reference tracks a level that rises or drifts slowly.
- On firing the test is "in a drop". From the next observation on, S is capped at h after each update,
  so that leaving the drop needs about h / (shift) observations back above the reference's midpoint
  (1 + f) μ / 2, not as many as the fall lasted. When an update brings S to 0 (before the cap: with h = 0
  that is one observation at or above μ − kσ, never one still below it) the drop is over (recovery): the
  reference is rebuilt from the next W observations, and only then can it fire again. So a long fall is
  one event.
- An observation whose error is not finite (NaN: fewer than two groups, or a metric a log does not have)
  is skipped. A reference whose level is ≤ 0 or whose σ is 0 (every observation the same, no noise) tests
  nothing: a level of 0 cannot fall, and a noiseless one gives no scale; the observation joins the
  reference instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SIEGMUND_OFFSET = 1.166
"""b = h + 1.166 in Siegmund's approximation: the correction for the overshoot of the boundary."""
MIN_H_PER_K = 2.0
"""The reward test's threshold floor in units of the allowance k (module docstring): no lone observation
above μ − 3kσ fires it. The eval test keeps none (0): an evaluation's mean over 64-512 prompts has no such
tail, and one evaluation every 10 steps is slow enough already."""


def siegmund_arl(k: float, h: float) -> float:
    """Average run length of Page's one-sided CUSUM with allowance k and threshold h (both in units of the
    noise's standard deviation) when the mean sits at the reference (Siegmund's approximation)."""
    b = h + SIEGMUND_OFFSET
    if k < 1e-8:
        return b * b
    x = 2 * k * b
    if x > 700:  # beyond float range: no threshold is needed (a large fall in units of a tiny noise)
        return math.inf
    return (math.expm1(x) - x) / (2 * k * k)


def cusum_threshold(k: float, arl0: float) -> float:
    """The threshold h ≥ 0 at which `siegmund_arl(k, h)` equals `arl0`: Newton's method on log ARL in
    b = h + 1.166 (the ARL increases with b), from the asymptotic start b ≈ log(2k² arl0) / (2k), or
    sqrt(arl0) as k → 0; a few steps reach float precision. 0 when even h = 0 exceeds arl0."""
    if siegmund_arl(k, 0.0) >= arl0:
        return 0.0
    small = k < 1e-8
    b = math.sqrt(arl0) if small else max(math.log(2 * k * k * arl0 + 1) / (2 * k), SIEGMUND_OFFSET)
    for _ in range(100):
        arl = siegmund_arl(k, b - SIEGMUND_OFFSET)
        slope = 2 * b if small else math.expm1(2 * k * b) / k  # d ARL / d b
        step = (math.log(arl) - math.log(arl0)) * arl / slope
        b = max(b - step, SIEGMUND_OFFSET)
        if abs(step) <= 1e-13 * b:
            break
    return b - SIEGMUND_OFFSET


@dataclass
class LevelDrop:
    """Page's CUSUM for a fall of a level to `frac` of a trailing reference (module docstring). Its state
    is plain data (lists and floats), so it is saved in checkpoints as it is."""

    frac: float
    """The fall the test is tuned to detect: the level at `frac` x its reference."""
    window: int
    """W: observations in the reference."""
    arl0: float
    """Average run length between false alarms the threshold is set for (observations)."""
    margin: float = 1.0
    """z: the reference level is taken z standard errors of its own mean below μ̂ (a lower bound)."""
    min_h_per_k: float = 0.0
    """The threshold's floor in units of k (MIN_H_PER_K for the reward test; 0: Siegmund's h alone)."""
    ref: list[list[float]] = field(default_factory=list)
    """The reference's last W observations, each [x, s²]."""
    excursion: list[list[float]] = field(default_factory=list)
    """Observations since S left 0 (the last W are enough: they are all that can join the reference)."""
    s: float = 0.0
    in_drop: bool = False

    def reference(self) -> tuple[float, float, float, float] | None:
        """(μ, σ, k, h) of the current reference; None while it is not full or cannot test (level ≤ 0 or
        σ = 0)."""
        if len(self.ref) < self.window:
            return None
        mu = sum(x for x, _ in self.ref) / len(self.ref)
        sigma = math.sqrt(sum(v for _, v in self.ref) / len(self.ref) * (1 + 1 / len(self.ref)))
        if mu <= 0 or sigma == 0:
            return None
        k = (1 - self.frac) * mu / (2 * sigma)
        mu_lo = mu - self.margin * sigma / math.sqrt(len(self.ref))
        return mu_lo, sigma, k, max(cusum_threshold(k, self.arl0), self.min_h_per_k * k)

    def update(self, x: float, se: float) -> bool:
        """Take one observation x with standard error se; True when the test fires (enters a drop)."""
        if not (math.isfinite(x) and math.isfinite(se)):
            return False
        obs = [x, se * se]
        ref = self.reference()
        if ref is None:
            self.ref = (self.ref + [obs])[-self.window :]
            return False
        mu, sigma, k, h = ref
        self.s = max(0.0, self.s + (mu - x) / sigma - k)
        fired = False
        if self.in_drop:
            if self.s == 0.0:  # recovered: the next W observations make a new reference
                self.in_drop, self.ref, self.excursion = False, [], []
            self.s = min(self.s, h)
            return False
        if self.s > h:
            self.in_drop, fired, self.excursion = True, True, []
        elif self.s == 0.0:
            self.ref = (self.ref + self.excursion + [obs])[-self.window :]
            self.excursion = []
        else:
            self.excursion = (self.excursion + [obs])[-self.window :]
        return fired
