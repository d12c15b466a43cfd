"""analysis.factorial: each arm's dose effect and the difference in differences, paired within (warm start,
seed) and judged over warm starts, against a float64 reference written out here (numpy and scipy)."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis.factorial import dose_interaction, format_interaction
from analysis.load import Run, group_runs, varying_fields
from analysis.sections import Sweep
from tests.unit.analysis.test_analyze_load_group_report import run_config, run_metrics

RNG = np.random.default_rng(7)
WARM, SEEDS, LEVELS = 4, 3, (1.0, 30.0)
# y[arm, level, warm start, seed]: a warm-start effect, an arm x dose interaction that differs by warm start
# (so that σ² between is not 0), and seed noise.
Y = {(arm, level): np.array([[0.3 + 0.02 * w + (level > 1) * (-0.03 * (arm == "grpo") - 0.01 * w * (arm == "grpo"))
                              + RNG.normal(0, 0.01) for _ in range(SEEDS)] for w in range(WARM)])
     for arm in ("grpo", "grpo_rr") for level in LEVELS}  # fmt: skip


def _run(arm: str, level: float, w: int, seed: int, value: float) -> Run:
    """A run whose expected accuracy is `value` at every eval, so its AUC is exactly `value`."""
    config = run_config(arm, seed, 1e-4)
    config["trainer"]["router_lr_scale"] = level
    config["warmstart"] = {"build_seed": w, "seed": 0}
    rows = run_metrics([0.1] * 4)
    rows[0]["eval/initial/expected_accuracy"] = value
    for row in rows:
        row["eval/expected_accuracy"] = value
    return Run(config=config, rows=rows, events=[], source=f"{arm}{level}{w}{seed}")


def _sweep(runs: list[Run]) -> Sweep:
    fields = varying_fields(runs)
    return Sweep(runs=runs, fields=fields, groups=group_runs(runs, fields))


def _reference(d: np.ndarray) -> dict:
    """Cluster t and one-way ANOVA variance components of per-unit values d[warm start, seed], by hand."""
    m = d.mean(axis=1)
    k, n = d.shape
    t = sps.ttest_1samp(m, 0.0)
    msb = n * ((m - m.mean()) ** 2).sum() / (k - 1)
    msw = ((d - m[:, None]) ** 2).sum() / (k * n - k)
    between = max(0.0, (msb - msw) / n)
    return {"diff": m.mean(), "p": t.pvalue, "ci": t.confidence_interval(), "between": between,
            "icc": between / (between + msw)}


def test_dose_effects_and_the_difference_in_differences_match_a_float64_reference():
    runs = [_run(arm, level, w, s, Y[arm, level][w, s])
            for arm in ("grpo", "grpo_rr") for level in LEVELS for w in range(WARM) for s in range(SEEDS)]
    result = dose_interaction(_sweep(runs))
    assert result["factor"] == "trainer.router_lr_scale" and result["clustered"]
    assert result["outcome"] == "expected-acc AUC"
    rows = {(r["kind"], r["a"], r["b"]): r for r in result["rows"]}
    grpo, rr = "grpo (replay=off)", "grpo_rr (replay=old)"
    e_grpo = Y["grpo", 30.0] - Y["grpo", 1.0]
    e_rr = Y["grpo_rr", 30.0] - Y["grpo_rr", 1.0]
    for key, d in (
        (("dose effect", grpo, None), e_grpo),
        (("dose effect", rr, None), e_rr),
        (("difference in differences", grpo, rr), e_grpo - e_rr),
    ):
        row, ref = rows[key], _reference(d)
        assert row["diff"] == pytest.approx(ref["diff"], rel=1e-12, abs=1e-15), key
        assert row["p"] == pytest.approx(ref["p"], rel=1e-9), key
        assert (row["lo"], row["hi"]) == pytest.approx(tuple(ref["ci"]), rel=1e-9), key
        assert row["var_between"] == pytest.approx(ref["between"], rel=1e-9, abs=1e-15), key
        assert row["icc"] == pytest.approx(ref["icc"], rel=1e-9), key
        assert (row["clusters"], row["runs"], row["level"], row["low"]) == (WARM, WARM * SEEDS, 30.0, 1.0)
    assert rows["difference in differences", grpo, rr]["diff"] < 0  # the dose costs GRPO more, as built
    text = format_interaction(result)
    assert "[grpo (replay=off)] − [grpo_rr (replay=old)], each x30 − x1" in text and "t over warm starts" in text


def test_one_warm_start_pairs_over_seeds_and_says_so():
    """With every run on one warm start, each seed is its own cluster: a paired t over seeds, no ICC."""
    runs = [_run(arm, level, 0, s, Y[arm, level][s % WARM, s % SEEDS])
            for arm in ("grpo", "grpo_rr") for level in LEVELS for s in range(5)]
    result = dose_interaction(_sweep(runs))
    assert not result["clustered"]
    did = next(r for r in result["rows"] if r["kind"] == "difference in differences")
    d = np.array([(Y["grpo", 30.0] - Y["grpo", 1.0] - Y["grpo_rr", 30.0] + Y["grpo_rr", 1.0])[s % WARM, s % SEEDS]
                  for s in range(5)])
    ref = sps.ttest_1samp(d, 0.0)
    assert did["diff"] == pytest.approx(d.mean(), rel=1e-12) and did["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert did["clusters"] == 5 and math.isnan(did["icc"])
    assert "seeds (one warm start)" in format_interaction(result)


def test_no_section_without_a_dose_factor_or_with_one_arm():
    """A sweep that does not vary trainer.router_lr_scale, or runs a single arm, gets no interaction."""
    flat = [_run(arm, 1.0, w, s, 0.3) for arm in ("grpo", "grpo_rr") for w in range(2) for s in range(2)]
    assert dose_interaction(_sweep(flat)) is None
    one_arm = [_run("grpo", level, w, s, 0.3 + level / 100) for level in LEVELS for w in range(2) for s in range(2)]
    assert dose_interaction(_sweep(one_arm)) is None


LRS = (5e-5, 1e-4, 2e-4)
# y[arm, level, lr][warm start, seed]: GRPO's best lr falls from 1e-4 to 5e-5 under the dose, R2's stays at
# 1e-4, and warm start 3 prefers 2e-4 for R2 at x30 (so the two folds choose differently).
Y_LR = {(arm, level, lr): np.array([[0.3 + 0.02 * w
                                     - 40.0 * abs(lr - (5e-5 if arm == "grpo" and level > 1 else 1e-4))
                                     - 0.02 * (level > 1) * (arm == "grpo")
                                     + 0.05 * (arm == "grpo_rr" and level > 1 and lr == 2e-4 and w == 3)
                                     + RNG.normal(0, 0.005) for _ in range(SEEDS)] for w in range(WARM)])
        for arm in ("grpo", "grpo_rr") for level in LEVELS for lr in LRS}  # fmt: skip


def _lr_run(arm: str, level: float, lr: float, w: int, seed: int) -> Run:
    run = _run(arm, level, w, seed, Y_LR[arm, level, lr][w, seed])
    run.config["trainer"]["lr"] = lr
    return run


def test_own_lr_difference_in_differences_is_cross_fitted_over_warm_starts():
    """With a grid of 3 lrs, each (arm, level) is scored on one half of the warm starts at the lr the other
    half chose (alternate warm starts, then swapped): a float64 reference written out with numpy."""
    runs = [_lr_run(arm, level, lr, w, s) for arm in ("grpo", "grpo_rr") for level in LEVELS for lr in LRS
            for w in range(WARM) for s in range(SEEDS)]
    result = dose_interaction(_sweep(runs))
    shared = [r for r in result["rows"] if r["kind"] == "difference in differences"]
    assert sorted(r["lr"] for r in shared) == sorted(LRS)  # one per shared lr: no pair of arms at two lrs
    own = result["own_lr"]
    folds = [([0, 2], [1, 3]), ([1, 3], [0, 2])]
    values, edges = {}, set()  # (arm, level) -> [warm start, seed] at the cross-fitted lr; cells at an edge
    for arm in ("grpo", "grpo_rr"):
        for level in LEVELS:
            v = np.full((WARM, SEEDS), np.nan)
            for i, (tune, score) in enumerate(folds):
                means = [Y_LR[arm, level, lr][tune].mean() for lr in LRS]
                lr = LRS[int(np.argmax(means))]
                got = next(c["lr"] for c in own["folds"][i]["chosen"] if c["arm"].startswith(arm + " ")
                           and c["level"] == level)
                assert got == lr, (arm, level, i)
                if lr in (LRS[0], LRS[-1]):
                    edges.add(f"{arm} (replay={'off' if arm == 'grpo' else 'old'}) x{level:g}")
                v[score] = Y_LR[arm, level, lr][score]
            values[arm, level] = v
    rows = {(r["kind"], r["a"], r["b"]): r for r in own["rows"]}
    e = {arm: values[arm, 30.0] - values[arm, 1.0] for arm in ("grpo", "grpo_rr")}
    for key, d in ((("dose effect", "grpo (replay=off)", None), e["grpo"]),
                   (("difference in differences", "grpo (replay=off)", "grpo_rr (replay=old)"), e["grpo"] - e["grpo_rr"])):
        row, ref = rows[key], _reference(d)
        assert row["diff"] == pytest.approx(ref["diff"], rel=1e-12, abs=1e-15), key
        assert row["p"] == pytest.approx(ref["p"], rel=1e-9), key
        assert (row["lo"], row["hi"]) == pytest.approx(tuple(ref["ci"]), rel=1e-9), key
        assert row["icc"] == pytest.approx(ref["icc"], rel=1e-9), key
        assert row["lr"] == "own" and row["clusters"] == WARM
    assert "grpo (replay=off) x30" in edges  # GRPO's best under the dose is the grid's lowest lr, as built
    assert own["at_edge"] == sorted(edges)
    text = format_interaction(result)
    assert "Each (arm, level) at its own lr, cross-fitted" in text and "At the grid's edge" in text
    assert "| lr |" in text and "at lr own" not in text


def test_own_lr_needs_three_lrs():
    """Two lrs: the shared-lr rows only, no own-lr contrast."""
    runs = [_lr_run(arm, level, lr, w, s) for arm in ("grpo", "grpo_rr") for level in LEVELS for lr in LRS[:2]
            for w in range(WARM) for s in range(SEEDS)]
    result = dose_interaction(_sweep(runs))
    assert "own_lr" not in result and {r["lr"] for r in result["rows"]} == set(LRS[:2])
