"""False alarms and detection power of the `reward_collapse` and `eval_regression` tests, old rule against
new, by simulation.

    python experiments/reward_collapse_fp.py                 # the tables in docs/reliability.md (1000 seeds), ~13 min
    python experiments/reward_collapse_fp.py --seeds 300     # quicker, noisier (± 0.013 at a rate of 0.05)
    python experiments/reward_collapse_fp.py --full-grid --seeds 400   # false alarms over issue 56's grid

Rewards. Each step's reward is the mean of P x G Bernoulli rewards (P prompts, G = 8 completions each).
Prompts differ in difficulty: each prompt's success probability is drawn fresh every step from a Beta of
mean p whose spread makes the rewards of one group correlate at icc (icc = 0: every reward independent
Bernoulli(p)). The step's standard error is the spread of its group means, sd / sqrt(P), exactly as
`rollout/reward/se` (moe_rl.trainer.step_metrics.rollout_metrics). Every simulated step goes through the
real `CollapseDetector` with the default `CollapseConfig` (entropy 1 and ratios 1, so nothing else fires).

- False alarms: a reward that never moves, 500 steps; the fraction of runs with an event by step 30,
  150 and 500.
- Detection: the true reward falls at step 50 to 0.5x or 0.25x of p and stays there (150 steps in all);
  the fraction of runs whose first event comes 0-9, 0-19 and 0-49 steps after the fall (a run that
  false-alarmed before the fall counts as not detected), and the median delay (> 100: not detected in
  most runs).
- "old" is the rule this test replaced (moe-rl before the CUSUM): after 5 warm-up steps, a 5-step moving
  average below 0.5 x the best full-window average so far.

Expected accuracy. Each evaluation's `eval/expected_accuracy` is the mean over N prompts of per-prompt
probabilities drawn from a Beta of mean p and spread 0.3 (as icc above), drawn afresh at every evaluation,
with its standard error sd / sqrt(N) as the trainer logs it. Fresh draws make evaluations noisier than the
trainer's (which scores the same prompts every time), so the false alarms measured here are an upper
bound. One evaluation before the first update and one every 10 steps: 51 in a 500-step run. Falls come
after the 5th evaluation.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from tqdm import tqdm

from analysis.stats import wilson
from moe_rl.config import CollapseConfig
from moe_rl.trainer.collapse import CollapseDetector

ICCS, PS, BATCHES = (0.0, 0.3, 0.5), (0.1, 0.2, 0.5), ((8, 8), (16, 8))
FA_STEPS, FALL_AT, FALL_STEPS, WITHIN = (30, 150, 500), 50, 150, (10, 20, 50)


def rewards(p, steps, prompts, group, icc, seeds, rng, fall_to=1.0):
    """[seeds, steps] mean rewards and group standard errors (module docstring); the fall at FALL_AT."""
    mult = np.where(np.arange(steps) >= FALL_AT, fall_to, 1.0)[None, :, None]
    shape = (seeds, steps, prompts)
    if icc == 0:
        p_SNP = np.full(shape, p)
    else:
        kappa = 1 / icc - 1
        p_SNP = rng.beta(p * kappa, (1 - p) * kappa, size=shape)
    hits = rng.random((*shape, group)) < (p_SNP * mult)[..., None]
    group_means = hits.mean(-1)
    return group_means.mean(-1), group_means.std(-1, ddof=1) / math.sqrt(prompts)


def first_new(xs, ses) -> float:
    """The step of the CUSUM's first reward_collapse on one run (inf if none)."""
    det = CollapseDetector(CollapseConfig())
    for t, (x, se) in enumerate(zip(xs, ses, strict=True)):
        metrics = {"rollout/reward/mean": x, "rollout/reward/se": se, "rollout/entropy/mean": 1.0,
                   "ratio/token/max": 1.0, "ratio/token/min": 1.0}
        if det.observe(t, metrics):
            return t
    return math.inf


def first_old(xs, warmup=5, window=5, frac=0.5) -> float:
    """The step of the retired rule's first reward_collapse (module docstring; inf if none)."""
    best, recent = -math.inf, []
    for t, x in enumerate(xs):
        recent = (recent + [x])[-window:]
        avg = sum(recent) / len(recent)
        if len(recent) == window:
            best = max(best, avg)
        if t >= warmup and best > 0 and avg < frac * best:
            return t
    return math.inf


def first_eval(xs, ses) -> float:
    """The index of the first eval_regression over one run's evaluations (0 = the initial one; inf if none)."""
    det = CollapseDetector(CollapseConfig())
    for i, (x, se) in enumerate(zip(xs, ses, strict=True)):
        if det.observe_eval(i, {"eval/expected_accuracy": x, "eval/expected_accuracy/se": se}):
            return i
    return math.inf


def detection(first: np.ndarray, fall_at: int, within) -> tuple[list[float], float]:
    delay = np.where(first >= fall_at, first - fall_at, np.inf)
    return [float((delay < w).mean()) for w in within], float(np.median(delay))


def fmt_delay(d: float, cap: int) -> str:
    return f"> {cap}" if not math.isfinite(d) else f"{d:g}"


def reward_tables(seeds: int, seed: int) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    fa = ["| batch | icc | p | old: 30 / 150 / 500 steps | new: 30 / 150 / 500 steps |", "|---|---|---|---|---|"]
    det = ["| batch | icc | p | fall to | old: within 10 / 20 / 50, median delay | new: within 10 / 20 / 50, median delay |",
           "|---|---|---|---|---|---|"]
    cells = [(b, icc, p) for b in BATCHES for icc in ICCS for p in PS]
    for (prompts, group), icc, p in tqdm(cells, desc="reward cells"):
        xs, ses = rewards(p, max(FA_STEPS), prompts, group, icc, seeds, rng)
        new = np.array([first_new(x, s) for x, s in zip(xs, ses, strict=True)])
        old = np.array([first_old(x) for x in xs])
        rate = lambda first: " / ".join(f"{(first < n).mean():.3f}" for n in FA_STEPS)  # noqa: E731
        fa.append(f"| {prompts}x{group} | {icc:g} | {p:g} | {rate(old)} | {rate(new)} |")
        for fall_to in (0.5, 0.25):
            xs, ses = rewards(p, FALL_STEPS, prompts, group, icc, seeds, rng, fall_to)
            cols = []
            for first in (np.array([first_old(x) for x in xs]),
                          np.array([first_new(x, s) for x, s in zip(xs, ses, strict=True)])):
                within, med = detection(first, FALL_AT, WITHIN)
                cols.append(" / ".join(f"{w:.2f}" for w in within) + f", {fmt_delay(med, FALL_STEPS - FALL_AT)}")
            det.append(f"| {prompts}x{group} | {icc:g} | {p:g} | {fall_to:g}x | {cols[0]} | {cols[1]} |")
    return fa, det


def eval_table(seeds: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = ["| prompts | p | false alarms, 51 evaluations | fall to | within 1 / 2 / 5 evaluations, median delay |",
           "|---|---|---|---|---|"]
    kappa = 1 / 0.3 - 1
    for n in (64, 512):
        for p in PS:
            cols = []
            for fall_to in (1.0, 0.5, 0.25):
                mult = np.where(np.arange(51) > 5, fall_to, 1.0)[None, :, None]
                a = rng.beta(p * kappa, (1 - p) * kappa, size=(seeds, 51, n)) * mult
                first = np.array([first_eval(x, s) for x, s in
                                  zip(a.mean(-1), a.std(-1, ddof=1) / math.sqrt(n), strict=True)])
                if fall_to == 1.0:
                    fa = f"{np.isfinite(first).mean():.3f}"
                    continue
                within, med = detection(first, 6, (1, 2, 5))
                cols.append((fall_to, " / ".join(f"{w:.2f}" for w in within) + f", {fmt_delay(med, 45)}"))
            for fall_to, col in cols:
                out.append(f"| {n} | {p:g} | {fa} | {fall_to:g}x | {col} |")
    return out


FULL_PS, FULL_ICCS, FULL_BATCHES = (0.05, 0.1, 0.2, 0.5, 0.8, 0.95), (0.0, 0.3, 0.6), ((4, 4), (8, 4), (8, 8), (16, 8))
"""Issue 56's grid: rewards p from 0.05 to 0.95, rollouts from 4 x 4 up, intra-class correlation 0-0.6."""
STATED_RATE = 0.05


def full_grid_table(seeds: int, seed: int) -> list[str]:
    """False alarms of the current rule per 500-step flat run over the full grid, each with its 95% Wilson
    interval, and whether the stated rate (0.05) holds: "yes", "no" (the interval lies above it) or
    "unclear" (the estimate is above it, the interval is not)."""
    rng = np.random.default_rng(seed)
    out = ["| batch | icc | p | false alarms per 500-step run [95% CI] | at or below 0.05 |", "|---|---|---|---|---|"]
    cells = [(b, icc, p) for b in FULL_BATCHES for icc in FULL_ICCS for p in FULL_PS]
    for (prompts, group), icc, p in tqdm(cells, desc="full grid"):
        xs, ses = rewards(p, 500, prompts, group, icc, seeds, rng)
        k = int(sum(math.isfinite(first_new(x, s)) for x, s in zip(xs, ses, strict=True)))
        lo, hi = wilson(k, seeds)
        verdict = "yes" if k / seeds <= STATED_RATE else ("no" if lo > STATED_RATE else "unclear")
        out.append(f"| {prompts}x{group} | {icc:g} | {p:g} | {k / seeds:.3f} [{lo:.3f}, {hi:.3f}] | {verdict} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-grid", action="store_true",
                        help="only the current rule's false alarms over issue 56's grid (p 0.05-0.95, 4x4 up, icc 0-0.6)")
    args = parser.parse_args()
    if args.full_grid:
        print(f"reward_collapse: false alarms per 500-step flat run, full grid ({args.seeds} seeds each)\n")
        print("\n".join(full_grid_table(args.seeds, args.seed)))
        return
    fa, det = reward_tables(args.seeds, args.seed)
    ev = eval_table(args.seeds, args.seed + 1)
    print(f"reward_collapse: false alarms per run ({args.seeds} seeds each)\n")
    print("\n".join(fa))
    print(f"\nreward_collapse: detection of a fall at step {FALL_AT} ({args.seeds} seeds each)\n")
    print("\n".join(det))
    print(f"\neval_regression ({args.seeds} seeds each)\n")
    print("\n".join(ev))


if __name__ == "__main__":
    main()
