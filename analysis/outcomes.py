"""Outcomes over a whole run from its expected-accuracy curve: the area under it and the time to regression.

The curve is `eval/expected_accuracy` (moe_rl.trainer.evaluate: the teacher-forced probability of the
canonical answer, free of sampling noise) against the number of updates done: the policy before the
first update (`eval/initial/expected_accuracy` in step 0's row) at 0, and the evaluation logged in the
row of RL step s at s + 1.

| quantity | per run |
|---|---|
| expected-acc AUC | trapezoid area under the curve divided by its span in updates (last - first eval), so it is the run's mean expected accuracy over training; nan with fewer than two evals |
| gain | expected accuracy at the last eval minus before the first update (does the policy still learn?); nan without a pre-update eval |
| late expected accuracy | mean expected accuracy over the evals of the last `LATE` (30) updates (`late_expected`): where the run ended up |
| time to regression | the first eval (in updates) at which expected accuracy is below `REGRESSION_FRAC` (0.8) x its value before the first update and stays below at the next eval too (*sustained*, two evals in a row); censored at the last eval when that never happens; unknown (left out) without a pre-update eval |
| ends regressed | the late expected accuracy (above) is below `REGRESSION_FRAC` x the pre-update value: the run *ends* regressed, where a sustained regression can be a dip it recovers from (`ends_regressed`); unknown without a pre-update eval |

Across two arms: the AUC difference a - b, paired by seed when both ran the same seeds (paired t, else
Welch; analysis.pairs.outcome_difference), and the log-rank test of time to regression
(analysis.stats.logrank; it treats the arms' runs as independent samples, ignoring the pairing by seed).
Runs that predate `eval/expected_accuracy` have neither: the comparisons leave them out, and leave the
rows out when no run has them. A run without a pre-update eval (`eval.at_start=false`) has an AUC over
its own evals but no regression time. A run stopped early (`collapse.stop_on_collapse`) averages over
its shorter span: compare AUCs of runs with equal spans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from analysis.clusters import warm_start_id
from analysis.load import Run
from analysis.sections import Section, Sweep
from analysis.stats import ExactStratified, MeanCI, exact_stratified, logrank, mean_ci, stratified_logrank

KEY = "eval/expected_accuracy"
INITIAL_KEY = "eval/initial/expected_accuracy"
REGRESSION_FRAC = 0.8
"""A run has regressed when expected accuracy falls below this fraction of its pre-update value."""
SUSTAINED = 2
"""Consecutive evals below the threshold that make a regression sustained."""


def expected_curve(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(updates done, expected accuracy) at every eval of the run, the pre-update eval first when logged."""
    updates, values = [], []
    if run.rows and math.isfinite(_get(run.rows[0], INITIAL_KEY)):
        updates.append(0.0)
        values.append(_get(run.rows[0], INITIAL_KEY))
    for row in run.rows:
        if math.isfinite(_get(row, KEY)):
            updates.append(float(row["step"]) + 1)
            values.append(_get(row, KEY))
    return np.array(updates, dtype=np.float64), np.array(values, dtype=np.float64)


def _get(row: dict, key: str) -> float:
    value = row.get(key, math.nan)
    return float(value) if isinstance(value, int | float) else math.nan


def auc(run: Run) -> float:
    """Trapezoid area under the expected-accuracy curve over its span in updates, divided by that span."""
    t, v = expected_curve(run)
    if t.size < 2:
        return math.nan
    return float(np.sum((t[1:] - t[:-1]) * (v[1:] + v[:-1]) / 2) / (t[-1] - t[0]))


def gain(run: Run) -> float:
    """Expected accuracy at the last eval minus the pre-update value; nan without a pre-update eval."""
    t, v = expected_curve(run)
    return float(v[-1] - v[0]) if t.size >= 2 and t[0] == 0.0 else math.nan


LATE = 30
"""Updates at the end of a run whose evals `late_expected` averages."""


def late_expected(run: Run, last: int = LATE) -> float:
    """Mean expected accuracy over the evals of the run's last `last` updates (updates >= the last eval's
    - `last`): where the run ended up, less noisy than its last eval alone; nan without evals."""
    t, v = expected_curve(run)
    return float(v[t >= t[-1] - last].mean()) if t.size else math.nan


def regression_time(run: Run, frac: float = REGRESSION_FRAC, sustained: int = SUSTAINED) -> tuple[float, bool]:
    """(updates, True) at the first of `sustained` consecutive evals below frac x the pre-update value;
    (last eval's updates, False) when censored; (nan, False) without a pre-update eval."""
    t, v = expected_curve(run)
    if t.size == 0 or t[0] != 0:
        return math.nan, False
    below = v < frac * v[0]
    for i in range(1, t.size - sustained + 1):
        if below[i : i + sustained].all():
            return float(t[i]), True
    return float(t[-1]), False


def ends_regressed(run: Run, frac: float = REGRESSION_FRAC, last: int = LATE) -> float:
    """1.0 when the mean expected accuracy over the run's last `last` updates is below frac x the pre-update
    value (the run ends regressed), 0.0 when not, nan without a pre-update eval."""
    t, v = expected_curve(run)
    if t.size == 0 or t[0] != 0:  # the runs regression_time counts, so the two share a denominator
        return math.nan
    return float(v[t >= t[-1] - last].mean() < frac * v[0])


def regression_test(a: list[Run], b: list[Run]) -> dict[str, Any]:
    """Log-rank test of time to regression, a vs b, over the runs that have a pre-update eval: the
    chi-square, p, observed and expected regressions per arm, and each run's (seed, time, regressed)."""
    ta, tb = [(r.seed, *regression_time(r)) for r in a], [(r.seed, *regression_time(r)) for r in b]
    res = logrank([x[1] for x in ta], [x[2] for x in ta], [x[1] for x in tb], [x[2] for x in tb])
    return {
        "chi2": res.chi2, "p": res.p, "test": res.test,
        "regressed_a": res.observed_a, "expected_a": res.expected_a, "n_a": res.n_a,
        "regressed_b": res.observed_b, "expected_b": res.expected_b, "n_b": res.n_b,
        "per_seed_a": [{"seed": s, "updates": t, "regressed": e} for s, t, e in ta],
        "per_seed_b": [{"seed": s, "updates": t, "regressed": e} for s, t, e in tb],
    }  # fmt: skip


def _strata(a: list[Run], b: list[Run], value: Callable[[Run], Any]) -> tuple[dict[tuple, tuple[list, list]], list]:
    """Each warm start's ([a's values], [b's values]) of `value(run)` (None: the run is left out), and the
    warm starts where both arms have runs, in a fixed order."""
    strata: dict[tuple, tuple[list, list]] = {}
    for arm, runs in enumerate((a, b)):
        for run in runs:
            if (x := value(run)) is not None:
                strata.setdefault(warm_start_id(run), ([], []))[arm].append(x)
    return strata, sorted((w for w, (ra, rb) in strata.items() if ra and rb), key=repr)


def stratified_regression_test(a: list[Run], b: list[Run]) -> dict[str, Any]:
    """Sustained regression, a vs b, stratified by warm start (analysis.clusters.warm_start_id), over the runs
    with a pre-update eval: the exact conditional test that the arms regress at one rate within every warm
    start (analysis.stats.exact_stratified) and the stratified log-rank test of time to regression; per warm
    start, its build seed and each arm's regressed and evaluated runs."""
    strata, keys = _strata(a, b, lambda r: x if math.isfinite((x := regression_time(r))[0]) else None)
    counts = [(sum(e for _, e in strata[w][0]), len(strata[w][0]), sum(e for _, e in strata[w][1]), len(strata[w][1]))
              for w in keys]  # fmt: skip
    exact = exact_stratified(*zip(*counts, strict=True)) if counts else None
    rank = stratified_logrank([([t for t, _ in ra], [e for _, e in ra], [t for t, _ in rb], [e for _, e in rb])
                               for ra, rb in (strata[w] for w in keys)])  # fmt: skip
    return {
        "warm_starts": len(keys),
        "regressed_a": sum(c[0] for c in counts), "n_a": sum(c[1] for c in counts),
        "regressed_b": sum(c[2] for c in counts), "n_b": sum(c[3] for c in counts),
        "exact_p": exact.p if exact else math.nan, "exact_test": ExactStratified.test,
        "logrank_chi2": rank.chi2, "logrank_p": rank.p, "logrank_test": rank.test,
        "per_warm_start": [{"warm_start": w[0], "regressed_a": c[0], "n_a": c[1], "regressed_b": c[2], "n_b": c[3]}
                           for w, c in zip(keys, counts, strict=True)],
    }  # fmt: skip


def stratified_ends_test(a: list[Run], b: list[Run]) -> dict[str, Any]:
    """Runs that end regressed (`ends_regressed`), a vs b, stratified by warm start, over the runs with a
    pre-update eval: the exact conditional test that the arms end regressed at one rate within every warm
    start (analysis.stats.exact_stratified); per warm start, each arm's ended-regressed and evaluated runs."""
    strata, keys = _strata(a, b, lambda r: int(e) if math.isfinite(e := ends_regressed(r)) else None)
    counts = [(sum(strata[w][0]), len(strata[w][0]), sum(strata[w][1]), len(strata[w][1])) for w in keys]
    exact = exact_stratified(*zip(*counts, strict=True)) if counts else None
    return {
        "warm_starts": len(keys),
        "ended_a": sum(c[0] for c in counts), "n_a": sum(c[1] for c in counts),
        "ended_b": sum(c[2] for c in counts), "n_b": sum(c[3] for c in counts),
        "exact_p": exact.p if exact else math.nan, "exact_test": ExactStratified.test,
        "per_warm_start": [{"warm_start": w[0], "ended_a": c[0], "n_a": c[1], "ended_b": c[2], "n_b": c[3]}
                           for w, c in zip(keys, counts, strict=True)],
    }  # fmt: skip


def has_expected(runs: list[Run]) -> bool:
    """Whether any of the runs logged `eval/expected_accuracy`."""
    return any(KEY in row for r in runs for row in r.rows)


def format_regression(row: dict[str, Any]) -> str:
    """One cell: "regressed 2/5 vs 0/5, χ² = 2.3, p = 0.13 (log-rank)", or n/a."""
    if row["n_a"] == 0 or row["n_b"] == 0:
        return "n/a (no pre-update expected-accuracy eval)"
    p = (f"χ² = {row['chi2']:.3g}, p = {row['p']:.3g}" if math.isfinite(row["p"])
         else "untestable: no regression while both arms were at risk")
    return f"regressed {row['regressed_a']}/{row['n_a']} vs {row['regressed_b']}/{row['n_b']}, {p} (log-rank)"


def outcomes_table(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per group: the expected-acc AUC (mean over seeds, 95% CI half-width, n), seeds regressed among those
    with a pre-update eval, and every seed's AUC and (updates, regressed) under "per_seed"."""
    table = {}
    for label, runs in groups.items():
        aucs, gains, times = [auc(r) for r in runs], [gain(r) for r in runs], [regression_time(r) for r in runs]
        ends = [ends_regressed(r) for r in runs]
        ci, g = mean_ci(aucs), mean_ci(gains)
        known = [e for t, e in times if math.isfinite(t)]
        table[label] = {
            "seeds": [r.seed for r in runs], "auc": ci.mean, "auc_ci95": ci.half, "auc_n": ci.n,
            "gain": g.mean, "gain_ci95": g.half, "gain_n": g.n,
            "regressed": sum(known), "with_initial_eval": len(known),
            "ended_regressed": int(sum(e for e in ends if math.isfinite(e))),
            "per_seed": {"seed": [r.seed for r in runs], "auc": aucs, "gain": gains,
                         "regression_updates": [t for t, _ in times],
                         "regressed": [e for _, e in times], "ended_regressed": ends},
        }  # fmt: skip
    return table


def format_outcomes(table: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per group."""
    lines = ["| run | seeds | expected-acc AUC | gain (last − pre-update) | seeds with sustained regression "
             "| at updates | seeds that end regressed |", "|---" * 7 + "|"]
    for label, row in table.items():
        ps = row["per_seed"]
        at = ", ".join(f"{t:g} (seed {s})" for s, t, e in zip(ps["seed"], ps["regression_updates"], ps["regressed"],
                                                              strict=True) if e)  # fmt: skip
        reg = f"{row['regressed']}/{row['with_initial_eval']}" if row["with_initial_eval"] else "n/a"
        ended = f"{row['ended_regressed']}/{row['with_initial_eval']}" if row["with_initial_eval"] else "n/a"
        lines.append(f"| {label} | {len(row['seeds'])} | {MeanCI(row['auc'], row['auc_ci95'], row['auc_n']).format(3)} "
                     f"| {MeanCI(row['gain'], row['gain_ci95'], row['gain_n']).format(3)} | {reg} | {at or '–'} "
                     f"| {ended} |")
    return "\n".join(lines) + (
        f"\n\nAUC: trapezoid area under `{KEY}` against updates done (the pre-update eval at 0), over its span: the "
        f"run's mean expected accuracy; gain: the last eval's value minus the pre-update one; both mean ± 95% CI "
        f"over seeds. Sustained regression: below {REGRESSION_FRAC:g} x "
        f"the pre-update value at {SUSTAINED} evals in a row (n/a without a pre-update eval), which a run can "
        f"recover from; ends regressed: the mean over the evals of its last {LATE} updates is below "
        f"{REGRESSION_FRAC:g} x the pre-update value."
    )


CAPTION = (
    "Teacher-forced expected accuracy (`eval/expected_accuracy`) against updates done, the pre-update eval "
    f"at 0; the dotted line of each color is {REGRESSION_FRAC:g} x that group's mean pre-update value."
)


def plot_expected_accuracy(groups: dict[str, list[Run]], out_dir: Path) -> Path:
    """Mean expected-accuracy curve over seeds with its 95% t band per group, against updates done."""
    from analysis.figures import BAND, aggregate_columns  # here: analysis.pairs imports this module
    from analysis.plotting import band_plot, finish, group_colors, plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, color in group_colors(groups).items():
        curves = [dict(zip(*expected_curve(r), strict=True)) for r in groups[label]]
        x = np.array(sorted(set().union(*curves)), dtype=np.float64)
        if x.size == 0:
            continue
        values_RC = np.array([[c.get(t, np.nan) for t in x] for c in curves], dtype=np.float64)
        _, mean, lo, hi = aggregate_columns(values_RC)
        band_plot(ax, x, mean, lo, hi, color, label)
        if x[0] == 0:
            ax.axhline(REGRESSION_FRAC * mean[0], color=color, linestyle=":", linewidth=1)
    ax.set(xlabel="updates done (RL steps)", ylabel=KEY)
    ax.grid(alpha=0.3)
    return finish(fig, [ax], out_dir / "expected_accuracy.png", f"Expected accuracy (band: {BAND})")


def outcomes_section(sweep: Sweep) -> tuple[dict[str, list[Run]], dict[str, dict[str, Any]]] | None:
    """The groups (which the figure draws) and their outcomes table; None when the table is empty."""
    table = outcomes_table(sweep.groups)
    return (sweep.groups, table) if table else None


SECTION = Section(
    name="outcomes",
    heading="Expected accuracy over training",
    applies=lambda sweep: has_expected(sweep.runs),
    compute=outcomes_section,
    markdown=lambda r: format_outcomes(r[1]),
    json=lambda r: {"outcomes": r[1]},
    figures=lambda r, out_dir: {"expected_accuracy": (plot_expected_accuracy(r[0], out_dir), CAPTION)},
)
