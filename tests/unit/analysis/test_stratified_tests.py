"""The tests stratified by warm start (analysis.stats.exact_stratified, stratified_logrank) against scipy and
against references written out here: every relabelling of the units counted, and the log-rank sums in exact
rational arithmetic."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats as sps

from analysis.stats import exact_stratified, logrank, stratified_logrank


def _relabelling_p(events_a, n_a, events_b, n_b):
    """Two-sided p of S = Σ events in a by brute force: within each stratum every choice of which n_a of its
    units are a's is equally likely under H0 given the margins; P(S = s) = share of joint choices giving s."""
    per_stratum = []
    for x, na, y, nb in zip(events_a, n_a, events_b, n_b, strict=True):
        units = [1] * (x + y) + [0] * (na + nb - x - y)
        per_stratum.append([sum(units[i] for i in chosen) for chosen in itertools.combinations(range(na + nb), na)])
    counts: dict[int, int] = {}
    for combo in itertools.product(*per_stratum):
        counts[sum(combo)] = counts.get(sum(combo), 0) + 1
    total = sum(counts.values())
    p_obs = Fraction(counts[sum(events_a)], total)
    return float(sum(Fraction(c, total) for c in counts.values() if Fraction(c, total) <= p_obs))


def test_exact_stratified_is_fishers_exact_test_for_one_stratum():
    for x, na, y, nb in [(3, 4, 0, 4), (1, 24, 0, 24), (7, 24, 1, 24), (2, 5, 2, 5), (0, 4, 4, 4)]:
        res = exact_stratified([x], [na], [y], [nb])
        ref = sps.fisher_exact([[x, na - x], [y, nb - y]]).pvalue
        assert res.p == pytest.approx(ref, rel=1e-12), (x, na, y, nb)
        assert res.expected_a == pytest.approx(na * (x + y) / (na + nb), rel=1e-12)


@pytest.mark.parametrize(
    "counts",
    [
        ([2, 1, 0], [4, 4, 4], [0, 0, 1], [4, 4, 4]),
        ([3, 0], [4, 3], [1, 2], [4, 4]),
        ([1, 1, 1], [3, 4, 4], [0, 0, 0], [4, 4, 3]),
        ([0, 4], [4, 4], [0, 4], [4, 4]),  # one stratum without events, one where every unit had one
    ],
)
def test_exact_stratified_equals_counting_every_relabelling(counts):
    assert exact_stratified(*counts).p == pytest.approx(_relabelling_p(*counts), rel=1e-12)


def test_stratification_removes_a_confound_that_pooling_reports():
    """Arm a ran mostly on a warm start where everything regresses: pooled, a looks worse (Fisher p < 0.05);
    within each warm start the rates are equal, and the stratified test says so (p = 1)."""
    events_a, n_a, events_b, n_b = [6, 0], [6, 6], [1, 0], [1, 30]
    pooled = sps.fisher_exact([[6, 6], [1, 30]]).pvalue
    assert pooled < 0.001
    assert exact_stratified(events_a, n_a, events_b, n_b).p == pytest.approx(1.0)


def test_exact_stratified_refuses_impossible_counts():
    with pytest.raises(ValueError, match="outside 0..n"):
        exact_stratified([5], [4], [0], [4])
    with pytest.raises(ValueError, match="one count per stratum"):
        exact_stratified([1, 0], [4], [0], [4])
    assert exact_stratified([0, 0], [4, 4], [0, 0], [4, 4]).p == 1.0


def _exact_logrank(strata):
    """(Σ O_a - E_a, Σ V) over strata in rational arithmetic, by the textbook loop over event times."""
    diff, var = Fraction(0), Fraction(0)
    for ta, ea, tb, eb in strata:
        units = [(t, e, True) for t, e in zip(ta, ea, strict=True)] + [(t, e, False) for t, e in zip(tb, eb, strict=True)]
        for t in sorted({u[0] for u in units if u[1]}):
            risk = [u for u in units if u[0] >= t]
            n, n_a = len(risk), sum(u[2] for u in risk)
            d = sum(1 for u in risk if u[0] == t and u[1])
            d_a = sum(1 for u in risk if u[0] == t and u[1] and u[2])
            diff += d_a - Fraction(d * n_a, n)
            if n > 1:
                var += Fraction(d * n_a * (n - n_a) * (n - d), n * n * (n - 1))
    return diff, var


def test_stratified_logrank_sums_each_warm_starts_own_risk_sets():
    strata = [
        ([30, 60, 200, 200], [True, True, False, False], [200, 200, 200, 200], [False] * 4),
        ([200, 200, 200, 200], [False] * 4, [90, 200, 200, 200], [True, False, False, False]),
        ([40, 40, 200, 200], [True, True, False, False], [40, 120, 200, 200], [True, True, False, False]),
    ]
    res = stratified_logrank(strata)
    diff, var = _exact_logrank(strata)
    assert res.chi2 == pytest.approx(float(diff * diff / var), rel=1e-12)
    assert res.p == pytest.approx(math.erfc(math.sqrt(float(diff * diff / var) / 2)), rel=1e-12)
    assert (res.observed_a, res.observed_b, res.n_a, res.n_b) == (4, 3, 12, 12)
    assert res.test == "stratified log-rank test"
    # One stratum is the plain log-rank test (itself checked against scipy in test_seed_statistics.py).
    one = stratified_logrank(strata[2:])
    plain = logrank(*strata[2])
    assert (one.chi2, one.p, one.expected_a) == pytest.approx((plain.chi2, plain.p, plain.expected_a), rel=1e-14)


def test_stratified_logrank_differs_from_pooling_when_strata_differ():
    """Pooled, the early events of stratum 1 (all in a) and the late ones of stratum 2 (all in b) are set
    against one risk set; stratified, each is judged against its own warm start's units."""
    strata = [([10, 20], [True, True], [200, 200], [False, False]),
              ([200, 200, 200], [False] * 3, [150, 160, 200], [True, True, False])]
    pooled = logrank(*(sum((list(s[i]) for s in strata), []) for i in range(4)))
    res = stratified_logrank(strata)
    diff, var = _exact_logrank(strata)
    assert res.chi2 == pytest.approx(float(diff * diff / var), rel=1e-12)
    assert not np.isclose(res.chi2, pooled.chi2)
    assert math.isnan(stratified_logrank([([200], [False], [200], [False])]).p)


def _curve_run(root, preset: str, build_seed: int, seed: int, regress_at: int | None) -> None:
    """A 40-step run evaluated every 10 steps from 0.3: flat at 0.35, or down to 0.1 from `regress_at` on."""
    import json

    import yaml

    name, replay = {"grpo": ("grpo", "off"), "grpo_rr": ("grpo", "old")}[preset]
    cfg = {"objective": {"name": name, "preset": preset}, "routing": {"replay": replay}, "trainer": {"lr": 1e-4},
           "model": {"num_layers": 2, "seed": 0}, "warmstart": {"enabled": True, "build_seed": build_seed, "seed": 0},
           "seed": seed, "experiment": "hand"}  # fmt: skip
    folder = root / f"{preset}-{build_seed}-{seed}"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(40):
        row = {"step": s, "rollout/reward/mean": 0.3, "time/step_s": 1.0, "eval/accuracy": 0.3}
        if s == 0:
            row["eval/initial/expected_accuracy"] = 0.3
        if s % 10 == 9:
            row["eval/expected_accuracy"] = 0.1 if regress_at is not None and s + 1 >= regress_at else 0.35
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text("")
    (folder / "summary.json").write_text(json.dumps({"label": f"{preset} (replay={replay})", "objective": preset,
                                                     "replay": replay, "seed": seed, "experiment": "hand"}))


def test_report_tests_sustained_regression_stratified_by_warm_start(tmp_path):
    """4 warm starts x 3 seeds; GRPO regresses on 3 runs (two on warm start 0), GRPO + R2 on none: the pair's
    table.json entry and report carry the per-warm-start counts and both stratified tests' p."""
    import json

    from analysis.load import load_local
    from analysis.report import write_report

    regress = {(0, 0): 20, (0, 1): 30, (2, 2): 20}
    for w in range(4):
        for s in range(3):
            _curve_run(tmp_path / "sweep", "grpo", w, s, regress.get((w, s)))
            _curve_run(tmp_path / "sweep", "grpo_rr", w, s, None)
    report = write_report(load_local([tmp_path / "sweep"], progress=False), tmp_path / "out", "t", ["sweep"])
    (pair,) = json.loads((tmp_path / "out" / "table.json").read_text())["pairs"]
    reg = pair["regression_by_warm_start"]
    if pair["a"].startswith("grpo_rr"):
        reg = {**reg, "regressed_a": reg["regressed_b"], "regressed_b": reg["regressed_a"]}
    assert (reg["warm_starts"], reg["regressed_a"], reg["n_a"], reg["regressed_b"], reg["n_b"]) == (4, 3, 12, 0, 12)
    assert [(w["warm_start"], w["regressed_a"] + w["regressed_b"]) for w in reg["per_warm_start"]] == [
        (0, 2), (1, 0), (2, 1), (3, 0)]
    assert reg["exact_p"] == pytest.approx(exact_stratified([2, 0, 1, 0], [3] * 4, [0] * 4, [3] * 4).p, rel=1e-12)
    times = {w: ([regress.get((w, s), 40) for s in range(3)], [(w, s) in regress for s in range(3)]) for w in range(4)}
    ref = stratified_logrank([(*times[w], [40] * 3, [False] * 3) for w in range(4)])
    assert reg["logrank_p"] == pytest.approx(ref.p, rel=1e-12)
    # Late expected accuracy (evals at updates >= 10 of 40): 0.1625 after a regression at 20, 0.225 at 30, else 0.35.
    late = pair["clusters"]["late"]
    sign = -1 if pair["a"].startswith("grpo_rr") else 1
    np.testing.assert_allclose([sign * x for x in late["per_warm_start"]],
                               [(-0.1875 - 0.125) / 3, 0, -0.1875 / 3, 0], rtol=1e-12, atol=1e-15)
    text = report.read_text()
    assert "expected acc, last 30 updates" in text
    assert "sustained regression by warm start: " in text and "stratified log-rank test" in text
