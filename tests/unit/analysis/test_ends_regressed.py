"""Runs that *end* regressed (issue 57): a sustained regression can be a dip the run recovers from, so the
clustered reports also count runs whose last 30 updates' mean expected accuracy is below 0.8 x their
pre-update value, by warm start, against hand-computed curves."""

import math

import pytest

from analysis.load import Run
from analysis.outcomes import ends_regressed, outcomes_table, regression_time, stratified_ends_test
from analysis.stats import exact_stratified


def _run(curve: list[float], build: int, seed: int, preset: str = "grpo") -> Run:
    """A run evaluated before the first update (curve[0]) and after every 10 updates (curve[1:])."""
    config = {"seed": seed, "objective": {"preset": preset}, "routing": {"replay": "off"},
              "warmstart": {"build_seed": build, "seed": 0}, "model": {"seed": 0}}
    rows = []
    for s in range(10 * (len(curve) - 1)):
        row = {"step": s}
        if s == 0:
            row["eval/initial/expected_accuracy"] = curve[0]
        if (s + 1) % 10 == 0:
            row["eval/expected_accuracy"] = curve[(s + 1) // 10]
        rows.append(row)
    return Run(config, rows, [], f"{preset}-{build}-{seed}")


DIP = [0.5, 0.35, 0.3, 0.45, 0.5, 0.55]  # below 0.4 at updates 10 and 20, then recovers
ENDS = [0.5, 0.45, 0.42, 0.38, 0.36, 0.30]  # below 0.4 from update 30 and stays there
FLAT = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]


def test_a_recovered_dip_is_a_sustained_regression_that_does_not_end_regressed():
    """DIP: sustained at update 10, but its evals of the last 30 updates (20 to 50) average
    (0.3 + 0.45 + 0.5 + 0.55) / 4 = 0.45 ≥ 0.4; ENDS: (0.42 + 0.38 + 0.36 + 0.30) / 4 = 0.365 < 0.4; FLAT
    neither; without a pre-update eval: unknown."""
    assert regression_time(_run(DIP, 0, 0)) == (10.0, True) and ends_regressed(_run(DIP, 0, 0)) == 0.0
    assert regression_time(_run(ENDS, 0, 0)) == (30.0, True) and ends_regressed(_run(ENDS, 0, 0)) == 1.0
    assert ends_regressed(_run(FLAT, 0, 0)) == 0.0
    no_initial = _run(ENDS, 0, 0)
    del no_initial.rows[0]["eval/initial/expected_accuracy"]
    assert math.isnan(ends_regressed(no_initial))


def test_ends_regressed_by_warm_start_counts_and_tests_exactly():
    """Two warm starts: grpo ends regressed in 2/2 and 1/2, R2 in 0/2 and 0/2 (its dips recover): counts per
    warm start, pooled, and the exact stratified p of those counts; the outcomes table counts both outcomes."""
    a = [_run(ENDS, 0, 0), _run(ENDS, 0, 1), _run(ENDS, 1, 0), _run(FLAT, 1, 1)]
    b = [_run(DIP, 0, 0, "grpo_rr"), _run(DIP, 0, 1, "grpo_rr"), _run(FLAT, 1, 0, "grpo_rr"),
         _run(DIP, 1, 1, "grpo_rr")]
    res = stratified_ends_test(a, b)
    assert [(w["warm_start"], w["ended_a"], w["n_a"], w["ended_b"], w["n_b"]) for w in res["per_warm_start"]] == [
        (0, 2, 2, 0, 2), (1, 1, 2, 0, 2)]
    assert (res["ended_a"], res["n_a"], res["ended_b"], res["n_b"], res["warm_starts"]) == (3, 4, 0, 4, 2)
    assert res["exact_p"] == pytest.approx(exact_stratified([2, 1], [2, 2], [0, 0], [2, 2]).p, rel=1e-12)
    table = outcomes_table({"grpo": a, "grpo_rr": b})
    assert (table["grpo"]["regressed"], table["grpo"]["ended_regressed"]) == (3, 3)
    assert (table["grpo_rr"]["regressed"], table["grpo_rr"]["ended_regressed"]) == (3, 0)
