"""Statistics over seeds (analysis.stats, analysis.pairs) against hand-computed values and scipy, on synthetic runs."""

import math

import numpy as np
import pytest
from scipy import stats as sps
from test_analysis import _config, _metrics, _write_run

from analysis.cli import parse_args
from analysis.figures import aggregate
from analysis.load import Run, group_runs
from analysis.pairs import comparable_pairs, compare_pair, format_pairs
from analysis.report import collapse_table, format_collapse, format_summary, summary_table
from analysis.stats import ema, mean_ci, ols_slope, paired_t, permutation_p, rate_difference, verdict, welch
from moe_rl.trainer.compare import comparison, format_table

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
    rows = _metrics([0.1] * len(rewards), collapse)
    for step, row in enumerate(rows):
        row["rollout/reward/mean"] = rewards[step]
        row["ratio/token/var"] = 0.01
        if step in dict(eval_acc):
            row["eval/accuracy"] = dict(eval_acc)[step]
    return Run(config=_config(preset, seed, 1e-4), rows=rows, events=[], source=f"{preset}{seed}")


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
        rows = _metrics(clip)
        rows[0]["eval/accuracy"] = 0.25 * seed
        _write_run(tmp_path / f"s{seed}", _config("grpo", seed, 1e-4), rows)
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
            rows = _metrics([0.1, 0.2, 0.3, 0.4])
            for step in (1, 3):
                rows[step]["eval/accuracy"] = acc + 0.1 * seed + 0.01 * step
                rows[step]["eval/accuracy_greedy"] = acc
            _write_run(tmp_path / "sweep" / f"{preset}{seed}", _config(preset, seed, 1e-4), rows)
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
    assert (out / "pairs_table.md").read_text().startswith("**Warning:**")


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
