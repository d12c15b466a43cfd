"""analysis.staleness: steps binned by their staleness, each run's steady state per k, and the growth of the
expert change with k judged over warm starts, against a float64 reference written out here."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from analysis.load import Run, group_runs, varying_fields
from analysis.report import write_report
from analysis.sections import Sweep
from analysis.staleness import format_staleness, staleness_table
from tests.unit.analysis.test_analyze_load_group_report import run_config, run_metrics

RNG = np.random.default_rng(3)
WARM, SEEDS, STEPS, LEVELS = 4, 2, 12, (0, 2, 8)
# The change a run sees at staleness s: 2.5 points per version below 4, then 1 point, plus a warm-start
# offset (so that σ² between is not 0 in the growth contrast) and per-step noise.
WARM_OFFSET = RNG.normal(0, 0.01, size=WARM)


def _change(s: int, w: int, noise: float) -> float:
    return 0.025 * min(s, 4) + 0.01 * max(s - 4, 0) + WARM_OFFSET[w] * (s > 0) + noise


def _run(arm: str, k: int, w: int, seed: int) -> Run:
    """A run of STEPS steps at staleness k: the deterministic sampler's s = t for t < k, then k."""
    config = run_config(arm, seed, 1e-4)
    config["rollout"] = {"staleness": k}
    config["warmstart"] = {"build_seed": w, "seed": 0}
    rows = run_metrics([0.1] * STEPS)
    for t, row in enumerate(rows):
        s = min(t, k)
        row["staleness/mean"] = float(s)
        row["routing/expert_change/vs_sampler"] = _change(s, w, RNG.normal(0, 0.002))
        row["routing/margin/predicted_change_vs_sampler"] = 0.8 * row["routing/expert_change/vs_sampler"]
        row["routing/logit_shift/vs_sampler"] = 0.1 * s
        row["mismatch/logp_abs_diff/mean"] = 0.02 * s + 0.01
    return Run(config=config, rows=rows, events=[], source=f"{arm}{k}{w}{seed}")


def stale_runs() -> list[Run]:
    return [_run(arm, k, w, s) for arm in ("grpo", "grpo_rr") for k in LEVELS for w in range(WARM) for s in range(SEEDS)]


def _sweep(runs: list[Run]) -> Sweep:
    fields = varying_fields(runs)
    return Sweep(runs=runs, fields=fields, groups=group_runs(runs, fields))


def _steady(run: Run, k: int) -> float:
    """The mean over the run's steps at s = k, by hand."""
    return float(np.mean([r["routing/expert_change/vs_sampler"] for r in run.rows if r["staleness/mean"] == k]))


def test_bins_steady_states_and_growth_match_a_float64_reference():
    runs = stale_runs()
    result = staleness_table(_sweep(runs))
    assert result["clustered"]
    arm = "grpo (replay=off)"
    mine = [r for r in runs if r.base_label == arm]

    # Warm-up: s = 3 comes only from the k = 8 runs' step 3; the cell's unit is the warm start.
    per_warm = [np.mean([r.rows[3]["routing/expert_change/vs_sampler"] for r in mine
                         if r.flat["rollout.staleness"] == 8 and r.flat["warmstart.build_seed"] == w])
                for w in range(WARM)]
    cell = result["by_staleness"][arm][3]["change vs sampler"]
    assert cell["mean"] == pytest.approx(np.mean(per_warm), rel=1e-12)
    assert cell["ci95"] == pytest.approx(sps.t.ppf(0.975, WARM - 1) * np.std(per_warm, ddof=1) / math.sqrt(WARM),
                                         rel=1e-9)
    assert cell["n"] == WARM
    assert result["by_staleness"][arm][3]["steps"] == WARM * SEEDS  # one step per k = 8 run
    assert sorted(result["by_staleness"][arm]) == list(range(8))  # the warm-up of the k = 8 runs only
    assert result["by_staleness"][arm][2]["steps"] == WARM * SEEDS  # not the k = 2 runs' steady state

    # By k: each run's steady state (its steps at s = k), averaged per warm start.
    steady8 = [np.mean([_steady(r, 8) for r in mine if r.flat["rollout.staleness"] == 8
                        and r.flat["warmstart.build_seed"] == w]) for w in range(WARM)]
    assert result["by_k"][arm][8]["change vs sampler"]["mean"] == pytest.approx(np.mean(steady8), rel=1e-12)
    assert result["by_k"][arm][2]["log-prob mismatch"]["mean"] == pytest.approx(0.05, rel=1e-12)

    # Growth: k = 8 less k = 2, paired within (warm start, seed), then a t over warm starts.
    growth = {g["arm"]: g for g in result["growth"]}[arm]
    d = np.array([[_steady(r8, 8) - _steady(r2, 2)
                   for s in range(SEEDS)
                   for r8 in mine if (r8.flat["rollout.staleness"], r8.flat["warmstart.build_seed"], r8.seed) == (8, w, s)
                   for r2 in mine if (r2.flat["rollout.staleness"], r2.flat["warmstart.build_seed"], r2.seed) == (2, w, s)]
                  for w in range(WARM)])
    t = sps.ttest_1samp(d.mean(axis=1), 0.0)
    assert (growth["low"], growth["high"]) == (2, 8)
    assert growth["diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert growth["p"] == pytest.approx(t.pvalue, rel=1e-9)
    assert (growth["lo"], growth["hi"]) == pytest.approx(tuple(t.confidence_interval()), rel=1e-9)
    assert growth["diff"] == pytest.approx(0.025 * 4 + 0.01 * 4 - 0.05, abs=0.003)  # 14% at k=8 less 5% at k=2
    assert "distinguishable" in growth["verdict"]

    text = format_staleness(result)
    assert "| grpo (replay=off) | 3 |" in text and "k=8 − k=2" in text


def test_the_report_has_the_section_and_its_figure_only_when_a_run_logged_the_change(tmp_path):
    runs = stale_runs()
    report = write_report(runs, tmp_path / "with", "t", ["x"], permutations=200)
    assert "## Expert change against staleness" in report.read_text()
    assert (tmp_path / "with" / "staleness.png").stat().st_size > 0
    assert "k=8 − k=0" in report.read_text()
    for run in runs:
        for row in run.rows:
            del row["routing/expert_change/vs_sampler"]
    report = write_report(runs, tmp_path / "without", "t", ["x"], permutations=200)
    assert "Expert change against staleness" not in report.read_text()
    assert not (tmp_path / "without" / "staleness.png").exists()
