"""Statistics over seeds (analysis.stats, analysis.pairs) against hand-computed values and scipy, on synthetic runs."""

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis.cli import parse_args
from analysis.compare import comparison, format_table
from analysis.figures import aggregate
from analysis.load import Run, group_runs, load_local
from analysis.outcomes import auc, expected_curve, has_expected, regression_time
from analysis.pairs import comparable_pairs, compare_pair, format_pairs
from analysis.report import collapse_table, format_collapse, format_summary, summary_table, write_report
from analysis.stats import (
    ema,
    logrank,
    mean_ci,
    ols_slope,
    one_sample_t,
    paired_t,
    permutation_p,
    rate_difference,
    slope_over_seeds,
    verdict,
    welch,
)
from tests.helpers.report_text import section
from tests.unit.analysis.test_analyze_load_group_report import run_config, run_metrics, write_run

T_2 = 4.302652729749464  # t_{2, 0.975}, from printed tables
T_4 = 2.7764451051977987  # t_{4, 0.975}


def _mean_diff_abs(u, v, axis):
    return np.abs(np.mean(u, axis=axis) - np.mean(v, axis=axis))


# --- analysis.stats --------------------------------------------------------------------------------


def test_mean_ci_is_the_student_t_interval():
    """mean_ci gives mean ± t_{n-1,0.975} s/sqrt(n) (hand values), drops NaN from n, and has no interval for one seed."""
    ci = mean_ci([1.0, 2.0, 3.0, math.nan])
    assert (ci.mean, ci.n) == (2.0, 3) and ci.half == pytest.approx(T_2 / math.sqrt(3), rel=1e-12)
    ci = mean_ci([0.2, 0.4, 0.4, 0.6, 0.9])  # mean 0.5, s^2 = 0.28 / 4
    assert ci.mean == pytest.approx(0.5, rel=1e-12)
    assert ci.half == pytest.approx(T_4 * math.sqrt(0.07 / 5), rel=1e-12)
    assert (ci.lo, ci.hi) == pytest.approx((0.5 - ci.half, 0.5 + ci.half), rel=1e-12)
    one = mean_ci([0.7, math.inf])
    assert (one.mean, one.n) == (0.7, 1) and math.isnan(one.half) and one.format() == "0.7 ± –"
    assert mean_ci([]).format() == "n/a"


def test_welch_matches_scipy_and_hand_degrees_of_freedom():
    """welch(a, b): diff of means, Welch–Satterthwaite dof (50/17 by hand here), CI and p equal scipy's ttest_ind(equal_var=False)."""
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0]  # variances 1 and 4: se^2 = 5/3, dof = (5/3)^2 / (1/18 + 16/18)
    d = welch(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    assert d.diff == -2.0 and (d.n_a, d.n_b) == (3, 3)
    assert ref.df == pytest.approx(50 / 17, rel=1e-12)
    half = sps.t.ppf(0.975, 50 / 17) * math.sqrt(5 / 3)
    assert (d.lo, d.hi) == pytest.approx((-2 - half, -2 + half), rel=1e-12)
    assert (d.lo, d.hi) == pytest.approx(tuple(ref.confidence_interval()), rel=1e-10)
    assert d.p == pytest.approx(ref.pvalue, rel=1e-10) and 0.05 < d.p < 0.5
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, 7), rng.normal(1, 3, 5)
    assert welch(x, y).p == pytest.approx(sps.ttest_ind(x, y, equal_var=False).pvalue, rel=1e-10)


def test_welch_without_two_values_or_variance_gives_no_p():
    """One seed in a group, or no variance in either, gives p = nan and a 'no verdict' sentence, never p = 0 or 1."""
    single = welch([0.5], [0.1, 0.2])
    assert single.diff == pytest.approx(0.35) and math.isnan(single.p) and math.isnan(single.lo)
    flat = welch([0.5] * 6, [0.2] * 6)
    assert flat.diff == pytest.approx(0.3) and math.isnan(flat.p)
    assert verdict(flat).startswith("no verdict possible: no variation")


def test_permutation_p_exact_by_hand_and_against_scipy():
    """3 collapsed vs 3 clean seeds: only 2 of the C(6,3) = 20 splits are as extreme, p = 0.1; a 5 vs 6 split equals scipy's exact permutation test of |diff|."""
    assert permutation_p([1, 1, 1], [0, 0, 0]) == (pytest.approx(0.1, rel=1e-12), "exact")
    x, y = [1, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0]
    ref = sps.permutation_test(
        (x, y), _mean_diff_abs, permutation_type="independent", n_resamples=10**6, alternative="greater"
    )
    p, kind = permutation_p(x, y)
    assert kind == "exact" and p == pytest.approx(ref.pvalue, rel=1e-12) and 0.1 < p < 0.5


def test_permutation_p_random_is_seeded_and_near_exact():
    """Above the split budget the test samples splits from its seed: same seed same p, p > 0, and within 4 SE of the exact p."""
    x, y = [1] * 7 + [0] * 3, [0] * 8 + [1] * 2  # C(20, 10) = 184756 splits
    exact, _ = permutation_p(x, y, permutations=200_000)
    p, kind = permutation_p(x, y, permutations=4000, seed=3)
    assert kind == "4000 random splits" and permutation_p(x, y, permutations=4000, seed=3)[0] == p
    assert abs(p - exact) < 4 * math.sqrt(exact * (1 - exact) / 4000)
    # 2 of 184756 splits are as extreme: seed 1 draws none of them in 100, and p is 1 / 101, not 0
    assert permutation_p([5.0] * 10, [0.0] * 10, permutations=100, seed=1)[0] == pytest.approx(1 / 101)


def test_rate_difference_interval_matches_newcombe_1998():
    """The collapse-rate CI is Newcombe's method 10: his published examples 56/70 - 48/80 = [0.0524, 0.3339] and 0/10 - 0/10 = [-0.2775, 0.2775]."""
    d = rate_difference([1] * 56 + [0] * 14, [1] * 48 + [0] * 32, permutations=500)
    assert d.diff == pytest.approx(0.2, rel=1e-12)
    assert (round(d.lo, 4), round(d.hi, 4)) == (0.0524, 0.3339)
    zero = rate_difference([0] * 10, [0] * 10, permutations=500)
    assert (round(zero.lo, 4), round(zero.hi, 4), zero.p) == (-0.2775, 0.2775, 1.0)


def test_verdict_words():
    """Below 5 seeds per group there is no verdict; from 5, p < 0.05 reads 'distinguishable' and p >= 0.05 'not distinguishable'."""
    assert verdict(welch([0.1, 0.2, 0.3, 0.4], [0.9, 1.0, 1.1, 1.2, 1.3])).startswith(
        "no verdict possible: 4 seed(s)"
    )
    far = welch([0.1, 0.2, 0.3, 0.2, 0.1], [0.9, 1.0, 1.1, 1.0, 0.9])
    assert verdict(far).startswith("distinguishable from noise at 5% (Welch t-test, p = ")
    near = welch([0.1, 0.3, 0.2, 0.25, 0.15], [0.12, 0.28, 0.22, 0.2, 0.18])
    assert near.p > 0.05 and verdict(near).startswith("not distinguishable from noise at 5%")


def test_ema_by_hand():
    """ema: s_0 = x_0, s_t = w s_(t-1) + (1 - w) x_t, NaN steps skipped (state kept); w = 0 is the identity; w outside [0, 1) raises."""
    np.testing.assert_allclose(
        ema([1.0, math.nan, 3.0, 5.0], 0.5), [1.0, math.nan, 2.0, 3.5], rtol=1e-15, equal_nan=True
    )
    np.testing.assert_allclose(ema([math.nan, 2.0, 4.0], 0.75), [math.nan, 2.0, 2.5], equal_nan=True)
    np.testing.assert_array_equal(ema([0.3, 0.1], 0.0), [0.3, 0.1])
    with pytest.raises(ValueError, match="smoothing weight"):
        ema([1.0], 1.0)


# --- tables, pairs and figures on synthetic runs ---------------------------------------------------


def _run(preset: str, seed: int, rewards: list[float], eval_acc: dict[int, float] = (), collapse=0.0) -> Run:
    """A Run whose reward follows `rewards`, with eval rows at the steps of `eval_acc`."""
    rows = run_metrics([0.1] * len(rewards), collapse)
    for step, row in enumerate(rows):
        row["rollout/reward/mean"] = rewards[step]
        row["ratio/token/var"] = 0.01
        if step in dict(eval_acc):
            row["eval/accuracy"] = dict(eval_acc)[step]
    return Run(config=run_config(preset, seed, 1e-4), rows=rows, events=[], source=f"{preset}{seed}")


def test_summary_table_gives_t_ci_and_last_eval_accuracy():
    """Per group the summary cells are mean ± t CI over seeds (hand values); final eval acc is the last eval row's value; the column is left out without eval."""
    runs = [
        _run("grpo", s, [0.0, r], {0: 0.0, 1: acc})
        for s, r, acc in [(0, 0.1, 0.2), (1, 0.2, 0.4), (2, 0.3, 0.9)]
    ]
    table = summary_table(group_runs(runs))["grpo (replay=off)"]
    assert table["final eval acc"] == pytest.approx(0.5, rel=1e-12)  # mean of 0.2, 0.4, 0.9
    sd = math.sqrt(((0.3) ** 2 + 0.1**2 + 0.4**2) / 2)
    assert table["ci95"]["final eval acc"] == pytest.approx(T_2 * sd / math.sqrt(3), rel=1e-12)
    assert table["final reward"] == pytest.approx(0.1, rel=1e-12)  # last-5-step means 0.05, 0.1, 0.15
    assert table["ci95"]["final reward"] == pytest.approx(T_2 * 0.05 / math.sqrt(3), rel=1e-12)
    assert table["n"]["final eval acc"] == 3
    markdown = format_summary({"g": table})
    assert "final eval acc" in markdown and f"0.5 ± {T_2 * sd / math.sqrt(3):.2g}" in markdown
    assert "Student t" in markdown
    without = format_summary(summary_table(group_runs([_run("grpo", 0, [0.1, 0.2])])))
    assert "final eval acc" not in without and "final reward" in without


def test_collapse_table_fraction_has_wilson_interval():
    """The collapse fraction's 95% CI is Wilson's score interval: [0, 0.2775] for 0 of 10 seeds (Newcombe 1998), [0.0945, 0.9055] for 1 of 2."""
    clean = [_run("grpo", s, [0.1]) for s in range(10)]
    half = [_run("gspo", 0, [0.1], collapse=1.0), _run("gspo", 1, [0.1])]
    table = collapse_table(group_runs(clean + half))
    assert [round(x, 4) for x in table["grpo (replay=off)"]["frac_ci95"]] == [0.0, 0.2775]
    assert [round(x, 4) for x in table["gspo (replay=off)"]["frac_ci95"]] == [0.0945, 0.9055]
    assert "| gspo (replay=off) | 2 | 1 | 0.50 | [0.09, 0.91] |" in format_collapse(table)


def test_pairs_compare_eval_accuracy_paired_or_welch_and_collapse_with_permutation():
    """A pair's outcome is final eval accuracy when every run has it, else final reward; it is a paired t-test
    when both groups ran the same seeds and Welch's otherwise (each equal to scipy); collapse rates are
    compared by exact permutation."""
    acc_a, acc_b = [0.8, 0.7, 0.9, 0.85, 0.75], [0.2, 0.3, 0.25, 0.1, 0.35]
    a = [_run("grpo", s, [0.5, 0.5], {1: v}, collapse=float(s < 4)) for s, v in enumerate(acc_a)]
    b = [_run("gspo", s, [0.1, 0.4], {1: v}) for s, v in enumerate(acc_b)]
    pair = compare_pair(a, b)
    assert pair["outcome"] == "final eval accuracy"
    out = pair["outcome_diff"]
    assert out["diff"] == pytest.approx(np.mean(acc_a) - np.mean(acc_b), rel=1e-12)
    assert out["p"] == pytest.approx(sps.ttest_rel(acc_a, acc_b).pvalue, rel=1e-10)
    assert out["test"] == "paired t-test" and out["verdict"].startswith("distinguishable from noise at 5%")
    for run in b:
        run.config["seed"] += 10  # other seeds: nothing to pair
    welch_out = compare_pair(a, b)["outcome_diff"]
    assert welch_out["p"] == pytest.approx(sps.ttest_ind(acc_a, acc_b, equal_var=False).pvalue, rel=1e-10)
    assert welch_out["test"] == "Welch t-test"
    rate = pair["collapse_diff"]
    assert pair["collapse_rate"] == {"a": 0.8, "b": 0.0} and rate["diff"] == pytest.approx(0.8)
    assert rate["p"] == pytest.approx(12 / 252, rel=1e-12)  # of C(10,5) splits, 6 put all 4 ones in a, 6 none
    assert rate["test"] == "permutation test, exact" and rate["verdict"].startswith("distinguishable")
    b[0].rows[1].pop("eval/accuracy")
    fallback = compare_pair(a, b)
    assert fallback["outcome"] == "final reward" and fallback["outcome_diff"]["diff"] == pytest.approx(0.25)


def test_pairs_only_within_a_setting_and_warn_below_five_seeds():
    """Groups are paired only when their swept fields agree (no lr confound), and a pair with < 5 seeds carries a warning and no verdict."""
    runs = [_run("grpo", 0, [0.1]), _run("gspo", 0, [0.2]), _run("grpo", 1, [0.1])]
    runs[2].config["trainer"]["lr"] = 3e-4
    groups = group_runs(runs)
    assert comparable_pairs(groups, ["trainer.lr"]) == [
        ("grpo (replay=off) lr=0.0001", "gspo (replay=off) lr=0.0001")
    ]
    text = format_pairs([{"a": "x", "b": "y", **compare_pair([runs[0]], [runs[1]])}])
    assert (
        text.startswith("**Warning:** 1 of 1 pairs have fewer than 5 seeds") and "no verdict possible" in text
    )


def test_curve_band_is_t_ci_of_per_seed_ema():
    """aggregate gives the mean and t CI over seeds at each step; with smoothing each seed is EMA'd first (so the mean is the EMA of the mean)."""
    runs = [_run("grpo", s, r) for s, r in enumerate([[0.0, 0.2, 0.4], [0.2, 0.4, 0.4], [0.4, 0.0, 0.1]])]
    reward = lambda r: r.series("rollout/reward/mean")  # noqa: E731
    steps, mean, lo, hi = aggregate(runs, reward)
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(mean, [0.2, 0.2, 0.3], rtol=1e-12)
    np.testing.assert_allclose(
        hi - mean, T_2 * np.array([0.2, 0.2, math.sqrt(0.03)]) / math.sqrt(3), rtol=1e-12
    )
    np.testing.assert_allclose(mean - lo, hi - mean, rtol=1e-12)
    _, smooth_mean, smooth_lo, _ = aggregate(runs, reward, smooth=0.5)
    np.testing.assert_allclose(smooth_mean, ema(mean, 0.5), rtol=1e-12)
    per_seed = np.array([ema(reward(r), 0.5) for r in runs])
    np.testing.assert_allclose(smooth_lo[2], mean_ci(per_seed[:, 2]).lo, rtol=1e-12)


def test_compare_table_cells_are_mean_plus_minus_ci(tmp_path):
    """moe-rl-compare's cells read 'mean ± CI half-width' over seeds (hand values), with an eval column only when runs logged eval/accuracy."""
    for seed, clip in enumerate([[0.1, 0.3], [0.2, 0.4], [0.3, 0.5]]):
        rows = run_metrics(clip)
        rows[0]["eval/accuracy"] = 0.25 * seed
        write_run(tmp_path / f"s{seed}", run_config("grpo", seed, 1e-4), rows)
    table = comparison(tmp_path)["grpo (replay=off)"]
    assert table["clip frac"] == pytest.approx(0.3) and table["final eval acc"] == pytest.approx(0.25)
    assert table["ci95"]["clip frac"] == pytest.approx(T_2 * 0.1 / math.sqrt(3), rel=1e-12)
    text = format_table({"grpo (replay=off)": table})
    assert f"| 0.3 ± {T_2 * 0.1 / math.sqrt(3):.2g} |" in text and "final eval acc" in text
    assert "Student t" in text


def test_cli_rejects_bad_smoothing_and_permutations(tmp_path):
    """moe-rl-analyze stops with a usage error naming --smooth outside [0, 1) or --permutations < 1."""
    for bad in (["--smooth", "1"], ["--smooth", "-0.1"], ["--permutations", "0"]):
        with pytest.raises(SystemExit) as err:
            parse_args([str(tmp_path), "--out", str(tmp_path / "o"), *bad])
        assert err.value.code == 2
    assert parse_args([str(tmp_path), "--out", "o", "--smooth", "0.9"]).smooth == 0.9


def test_analyze_cli_with_eval_runs_smooths_and_reports_pairs(tmp_path):
    """moe-rl-analyze --smooth/--permutations on runs with eval rows: an eval figure, the smoothing stated, and a pairs table with its verdicts in report.md and table.json."""
    import json

    from analysis.cli import main as analyze_main

    for seed in range(2):
        for preset, acc in (("grpo", 0.3), ("gspo", 0.6)):
            rows = run_metrics([0.1, 0.2, 0.3, 0.4])
            for step in (1, 3):
                rows[step]["eval/accuracy"] = acc + 0.1 * seed + 0.01 * step
                rows[step]["eval/accuracy_greedy"] = acc
            write_run(tmp_path / "sweep" / f"{preset}{seed}", run_config(preset, seed, 1e-4), rows)
    out = tmp_path / "out"
    analyze_main([str(tmp_path / "sweep"), "--out", str(out), "--smooth", "0.5", "--permutations", "50"])
    text = (out / "report.md").read_text()
    assert "(eval_accuracy.png)" in text and (out / "eval_accuracy.png").stat().st_size > 10_000
    assert "smoothed per seed by an EMA of weight 0.5" in text
    [pair] = json.loads((out / "table.json").read_text())["pairs"]
    assert (pair["a"], pair["b"], pair["outcome"]) == (
        "grpo (replay=off)",
        "gspo (replay=off)",
        "final eval accuracy",
    )
    assert pair["outcome_diff"]["diff"] == pytest.approx(-0.3, rel=1e-12)
    assert "## Pairwise differences" in text and "no verdict possible: 2 seed(s)" in text
    assert not (out / "pairs_table.md").exists()  # report.md holds the table
    pairs = section(text, "Pairwise differences")
    assert pairs.index("**Warning:**") < pairs.index("\n|")  # the warning comes before the table


def test_paired_t_and_ols_slope_match_scipy():
    """paired_t equals scipy's ttest_rel (mean, p, t interval) and drops pairs with a non-finite side;
    ols_slope equals scipy's linregress with a t interval of n - 2 dof."""
    a, b = [0.61, 0.55, 0.40, 0.72, 0.50, math.nan], [0.58, 0.50, 0.41, 0.65, 0.44, 0.3]
    d = paired_t(a, b)
    ref = sps.ttest_rel(a[:5], b[:5])
    diffs = np.subtract(a[:5], b[:5])
    half = sps.t.ppf(0.975, 4) * diffs.std(ddof=1) / math.sqrt(5)
    assert (d.n_a, d.test) == (5, "paired t-test") and d.p == pytest.approx(ref.pvalue)
    assert (d.lo, d.hi) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    with pytest.raises(ValueError, match="aligned"):
        paired_t([1.0, 2.0], [1.0])
    x, y = [0.0, 0.02, 0.05, 0.1, 0.2, 0.2], [0.5, 0.52, 0.47, 0.45, 0.41, 0.44]
    s, fit = ols_slope(x, y), sps.linregress(x, y)
    half = sps.t.ppf(0.975, 4) * fit.stderr
    assert (s.diff, s.lo, s.hi, s.p) == pytest.approx((fit.slope, fit.slope - half, fit.slope + half, fit.pvalue))


# --- time to regression, expected-accuracy AUC, per-seed dose slopes ------------------------------

# Freireich et al. (1963) remission times in weeks, 6-MP vs placebo (Kleinbaum & Klein, Survival Analysis,
# ch. 2: O_1 = 9, E_1 = 19.25, log-rank chi-square 16.79). Events first, then the censored times.
MP_TIMES = [6, 6, 6, 7, 10, 13, 16, 22, 23, 6, 9, 10, 11, 17, 19, 20, 25, 32, 32, 34, 35]
MP_EVENTS = [True] * 9 + [False] * 12
PLACEBO_TIMES = [1, 1, 2, 2, 3, 4, 4, 5, 5, 8, 8, 8, 8, 11, 11, 12, 12, 15, 17, 22, 23]


def test_logrank_matches_the_textbook_leukemia_example_and_scipy():
    """logrank on Freireich's 6-MP trial gives the textbook O_1 = 9, E_1 = 19.25, chi-square 16.79, and
    scipy.stats.logrank's p-value."""
    res = logrank(MP_TIMES, MP_EVENTS, PLACEBO_TIMES, [True] * 21)
    assert (res.observed_a, res.observed_b, res.n_a, res.n_b) == (9, 21, 21, 21)
    assert res.expected_a == pytest.approx(19.25, abs=0.005) and res.chi2 == pytest.approx(16.79, abs=0.005)
    assert res.expected_a + res.expected_b == pytest.approx(30, rel=1e-12)
    censored = sps.CensoredData(uncensored=MP_TIMES[:9], right=MP_TIMES[9:])
    ref = sps.logrank(censored, sps.CensoredData(uncensored=PLACEBO_TIMES))
    assert res.chi2 == pytest.approx(ref.statistic**2, rel=1e-10) and res.p == pytest.approx(ref.pvalue, rel=1e-10)


def test_logrank_equals_hand_computation_with_ties_and_censoring():
    """Two small samples by hand in float64: E_a and the hypergeometric variance (tie factor (n - d)/(n - 1)),
    chi2 = (O_a - E_a)² / V, p = erfc(sqrt(chi2 / 2)); a unit censored at an event time is still at risk."""
    # a: 1 (event), 3 (censored); b: 2, 4 (events). Times 1, 2, 4: E_a = 2/4 + 1/3 + 0, V = 1/4 + 2/9 + 0.
    res = logrank([1, 3], [True, False], [2, 4], [True, True])
    assert res.expected_a == pytest.approx(5 / 6, rel=1e-14) and res.chi2 == pytest.approx(1 / 17, rel=1e-14)
    assert res.p == pytest.approx(math.erfc(math.sqrt(1 / 34)), rel=1e-14)
    # Ties: at t = 2, 3 events among 5 at risk (3 in a): E += 9/5, V += 3 (3/5)(2/5)(2/4); at t = 3, 1 of 2.
    res = logrank([2, 2, 5], [True, True, False], [2, 3], [True, True])
    assert res.expected_a == pytest.approx(2.3, rel=1e-14) and res.chi2 == pytest.approx(0.09 / 0.61, rel=1e-12)
    # Censored at 3 while the other arm has an event at 3: still at risk there (n = 3, n_a = 1: E_a = 1/3, not 0).
    assert logrank([3], [False], [3, 4], [True, True]).expected_a == pytest.approx(1 / 3, rel=1e-14)
    none = logrank([5, 6], [False, False], [5], [False])
    assert math.isnan(none.chi2) and math.isnan(none.p) and none.observed_a == 0


def test_one_sample_t_and_slope_over_seeds_match_scipy():
    """slope_over_seeds fits one least-squares slope per seed (hand values) and t-tests their mean against 0
    (scipy ttest_1samp); a seed with one distinct x has no slope and does not count in n."""
    x = {0: [0.0, 1.0, 2.0], 1: [0.0, 2.0], 2: [1.0, 3.0, 5.0], 3: [1.0, 1.0]}
    y = {0: [1.0, 0.5, 0.0], 1: [0.2, 0.0], 2: [0.9, 0.9, 0.1], 3: [0.4, 0.2]}
    d, slopes = slope_over_seeds(x, y)
    hand = [-0.5, -0.1, sps.linregress(x[2], y[2]).slope]
    assert [slopes[s] for s in (0, 1, 2)] == pytest.approx(hand, rel=1e-12) and math.isnan(slopes[3])
    ref = sps.ttest_1samp(hand, 0.0)
    assert (d.n_a, d.test) == (3, "one-sample t-test over per-seed slopes")
    assert d.diff == pytest.approx(np.mean(hand), rel=1e-12) and d.p == pytest.approx(ref.pvalue, rel=1e-10)
    assert (d.lo, d.hi) == pytest.approx(tuple(ref.confidence_interval()), rel=1e-10)
    assert one_sample_t([0.1, 0.3, math.nan]).p == pytest.approx(sps.ttest_1samp([0.1, 0.3], 0).pvalue, rel=1e-10)


def _expected_run(preset: str, seed: int, initial: float | None, evals: dict[int, float], steps: int = 6) -> Run:
    """A Run with eval/initial/expected_accuracy in step 0's row (unless None) and eval/expected_accuracy at `evals`."""
    run = _run(preset, seed, [0.1] * steps)
    if initial is not None:
        run.rows[0]["eval/initial/expected_accuracy"] = initial
    for step, value in evals.items():
        run.rows[step]["eval/expected_accuracy"] = value
    return run


def test_auc_and_sustained_regression_by_hand():
    """AUC is the trapezoid area under expected accuracy vs updates (pre-update eval at 0, step s's eval at
    s + 1) over its span; regression is the first of two evals in a row below 0.8 x the pre-update value,
    censored at the last eval otherwise, unknown without a pre-update eval."""
    run = _expected_run("grpo", 0, 0.5, {1: 0.7, 3: 0.3})  # points (0, .5), (2, .7), (4, .3)
    t, v = expected_curve(run)
    assert t.tolist() == [0, 2, 4] and v.tolist() == [0.5, 0.7, 0.3]
    assert auc(run) == pytest.approx((2 * 0.6 + 2 * 0.5) / 4, rel=1e-14)
    assert regression_time(run) == (4.0, False)  # one eval below 0.4: not sustained, censored at 4
    dips = _expected_run("grpo", 0, 0.5, {0: 0.39, 1: 0.45, 2: 0.3, 3: 0.35, 4: 0.2})
    assert regression_time(dips) == (3.0, True)  # 0.39 alone does not count; 0.3 then 0.35 does
    no_initial = regression_time(_expected_run("grpo", 0, None, {0: 0.1, 1: 0.1}))
    assert math.isnan(no_initial[0]) and no_initial[1] is False
    old = _run("grpo", 0, [0.1, 0.2])  # predates eval/expected_accuracy
    assert math.isnan(auc(old)) and math.isnan(regression_time(old)[0]) and not has_expected([old])


def test_gain_is_the_last_eval_less_the_pre_update_one_and_the_table_averages_it_over_seeds():
    """gain = expected accuracy at the last eval - before the first update (nan without the pre-update eval);
    the outcomes table gives its mean and t-interval over seeds."""
    from analysis.outcomes import format_outcomes, gain, outcomes_table

    runs = [_expected_run("grpo", s, 0.5, {1: 0.7, 3: 0.3 + 0.1 * s}) for s in range(3)]  # gains -0.2, -0.1, 0
    assert [gain(r) for r in runs] == pytest.approx([-0.2, -0.1, 0.0], abs=1e-15)
    assert math.isnan(gain(_expected_run("grpo", 0, None, {0: 0.1, 1: 0.2})))
    (row,) = outcomes_table({"grpo": runs}).values()
    assert row["gain"] == pytest.approx(-0.1, abs=1e-15)
    assert row["gain_ci95"] == pytest.approx(sps.t.ppf(0.975, 2) * 0.1 / np.sqrt(3), rel=1e-12)
    assert "| -0.1 ± 0.25 |" in format_outcomes({"grpo": row})  # 3 significant digits


def test_pairs_add_paired_auc_and_logrank_only_when_runs_have_expected_accuracy():
    """compare_pair adds the paired AUC difference (scipy ttest_rel) and the log-rank test of time to regression
    (equal to logrank on the hand times), keeps every seed's values, and leaves both out for old runs."""
    a = [_expected_run("grpo", s, 0.5, {1: 0.3, 3: 0.2, 5: 0.1 + 0.01 * s}) for s in range(5)]  # regress at 2
    b = [_expected_run("gspo", s, 0.5, {1: 0.5 + 0.02 * s, 3: 0.6, 5: 0.35}) for s in range(5)]  # never
    pair = compare_pair(a, b)
    auc_a, auc_b = [auc(r) for r in a], [auc(r) for r in b]
    assert pair["auc_diff"]["p"] == pytest.approx(sps.ttest_rel(auc_a, auc_b).pvalue, rel=1e-10)
    assert pair["auc_diff"]["test"] == "paired t-test"
    reg, ref = pair["regression"], logrank([2] * 5, [True] * 5, [6] * 5, [False] * 5)
    assert (reg["regressed_a"], reg["regressed_b"]) == (5, 0) and reg["p"] == pytest.approx(ref.p, rel=1e-12)
    assert pair["per_seed"]["a"]["seed"] == list(range(5)) and pair["per_seed"]["a"]["auc"] == auc_a
    text = format_pairs([{"a": "x", "b": "y", **pair}])
    assert "expected-acc AUC" in text and "time to sustained regression" in text and "regressed 5/5 vs 0/5" in text
    old = compare_pair([_run("grpo", s, [0.1, 0.2]) for s in range(2)], [_run("gspo", s, [0.1, 0.3]) for s in range(2)])
    assert old["auc_diff"] is None and old["regression"] is None and "auc" not in old["per_seed"]["a"]
    assert "expected-acc AUC" not in format_pairs([{"a": "x", "b": "y", **old}]).split("\n\n")[0]


def test_report_table_json_keeps_per_seed_values(tmp_path):
    """table.json's summary, collapse, pairs and expected-accuracy tables hold every seed's value, so each mean
    re-derives from them; the report gets an expected-accuracy section."""
    root = tmp_path / "sweep"
    for s in range(3):
        for preset, final in (("grpo", 0.2), ("gspo", 0.6)):
            rows = run_metrics([0.1, 0.2, 0.3])
            rows[0]["eval/initial/expected_accuracy"] = 0.5
            rows[1]["eval/expected_accuracy"], rows[2]["eval/expected_accuracy"] = final + 0.01 * s, final
            write_run(root / f"{preset}{s}", run_config(preset, s, 1e-4), rows)
    text = write_report(load_local([root], progress=False), tmp_path / "out", "t", [str(root)]).read_text()
    saved = json.loads((tmp_path / "out" / "table.json").read_text())
    summary = saved["summary"]["grpo (replay=off)"]
    assert summary["per_seed"]["seed"] == [0, 1, 2]
    assert np.mean(summary["per_seed"]["final expected acc"]) == pytest.approx(summary["final expected acc"])
    assert summary["final expected acc"] == pytest.approx(0.2)
    assert saved["collapse"]["grpo (replay=off)"]["per_seed"] == {"seed": [0, 1, 2], "events": [0.0, 0.0, 0.0]}
    outcomes = saved["outcomes"]["grpo (replay=off)"]
    assert outcomes["per_seed"]["regressed"] == [True] * 3 and outcomes["per_seed"]["regression_updates"] == [2.0] * 3
    assert np.mean(outcomes["per_seed"]["auc"]) == pytest.approx(outcomes["auc"], rel=1e-12)
    assert saved["pairs"][0]["per_seed"]["b"]["auc"] == saved["outcomes"]["gspo (replay=off)"]["per_seed"]["auc"]
    assert "## Expected accuracy over training" in text and "| grpo (replay=off) | 3 |" in text
    assert "![expected_accuracy](expected_accuracy.png)" in text
    assert (tmp_path / "out" / "expected_accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_analyze_cli_pair_compares_groups_across_a_swept_field_and_names_an_unknown_label(tmp_path):
    """--pair A B adds the pair A vs B although lr differs (each objective at its own lr), paired by seed,
    without repeating a pair the sweep already compares; a label that is no group stops the command with a
    message that names it and lists the groups."""
    import json

    from analysis.cli import main as analyze_main

    for seed in range(2):
        for preset, lr, acc in (("grpo", 1e-4, 0.3), ("gspo", 1e-4, 0.5), ("gspo", 2e-4, 0.6)):
            rows = run_metrics([0.1, 0.2, 0.3, 0.4])
            rows[3]["eval/accuracy"] = acc + 0.1 * seed
            write_run(tmp_path / "sweep" / f"{preset}{lr}_{seed}", run_config(preset, seed, lr), rows)
    out = tmp_path / "out"
    own, shared = "gspo (replay=off) lr=0.0002", "grpo (replay=off) lr=0.0001"
    analyze_main([str(tmp_path / "sweep"), "--out", str(out), "--permutations", "50",
                  "--pair", own, shared, "--pair", shared, "gspo (replay=off) lr=0.0001"])
    pairs = {(p["a"], p["b"]): p for p in json.loads((out / "table.json").read_text())["pairs"]}
    assert sorted(pairs) == sorted([(shared, "gspo (replay=off) lr=0.0001"), (own, shared)])
    assert pairs[own, shared]["outcome_diff"]["diff"] == pytest.approx(0.3, rel=1e-12)
    assert pairs[own, shared]["outcome_diff"]["test"] == "paired t-test"
    with pytest.raises(SystemExit, match=r"--pair: no group 'gspo lr=2e-4'; the groups are 'grpo"):
        analyze_main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o2"), "--pair", "gspo lr=2e-4", shared])
    assert not (tmp_path / "o2" / "report.md").exists()
    # issue 56: a group against itself compared nothing, silently; now it is one line, before any work
    with pytest.raises(SystemExit, match=r"a group against itself compares nothing"):
        analyze_main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o3"), "--pair", shared, shared])
    assert not (tmp_path / "o3" / "report.md").exists()
