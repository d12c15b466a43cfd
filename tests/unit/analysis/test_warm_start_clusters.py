"""analysis.clusters: warm starts as clusters, against float64 references written out here."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps

from analysis.clusters import (
    CLUSTERED,
    ONE,
    PER_SEED,
    cluster_contrast,
    detect_design,
    variance_components,
)
from analysis.load import load_local
from analysis.report import write_report


def _anova_reference(groups: list[list[float]]) -> tuple[float, float, float]:
    """One-way random-effects ANOVA estimator by explicit loops in float64 (Searle et al. 1992, 3.6)."""
    k = len(groups)
    n = [len(g) for g in groups]
    total = sum(n)
    means = [sum(g) / len(g) for g in groups]
    grand = sum(sum(g) for g in groups) / total
    ssb = sum(n[i] * (means[i] - grand) ** 2 for i in range(k))
    ssw = sum((x - means[i]) ** 2 for i in range(k) for x in groups[i])
    msb, msw = ssb / (k - 1), ssw / (total - k)
    n0 = (total - sum(x * x for x in n) / total) / (k - 1)
    between = max(0.0, (msb - msw) / n0)
    return between, msw, between / (between + msw)


def test_variance_components_match_the_written_out_anova_on_unbalanced_clusters():
    """Unbalanced clusters (2-5 values): σ² between, σ² within and ICC equal the loop reference to 1e-12."""
    rng = np.random.default_rng(3)
    groups = [list(0.5 * rng.normal() + rng.normal(size=n)) for n in (2, 3, 5, 4, 3)]
    got = variance_components(groups)
    ref = _anova_reference(groups)
    assert ref[0] > 0  # the case tests the untruncated formula
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)


def test_variance_between_is_truncated_at_zero_when_clusters_agree_more_than_chance():
    """Cluster means closer than the within spread implies: MSB < MSW, so σ² between is 0 and the ICC 0."""
    groups = [[-1.0, 1.0], [-1.1, 1.1], [-0.9, 0.9]]  # every cluster mean is exactly 0
    between, within, icc = variance_components(groups)
    assert between == 0.0 and icc == 0.0
    assert within == pytest.approx((2 + 2 * 1.21 + 2 * 0.81) / 3, rel=1e-12)


@pytest.mark.parametrize("icc_true", [0.0, 0.3, 0.8])
def test_icc_recovers_a_known_icc_in_a_synthetic_design(icc_true):
    """d_ij = u_i + e_ij, Var u = ICC, Var e = 1 - ICC, 4000 clusters x 3: the estimate is within 0.04 (~4 SE)."""
    rng = np.random.default_rng(7)
    u = rng.normal(scale=math.sqrt(icc_true), size=4000)
    groups = [list(ui + rng.normal(scale=math.sqrt(1 - icc_true), size=3)) for ui in u]
    between, within, icc = variance_components(groups)
    assert icc == pytest.approx(icc_true, abs=0.04)
    assert between == pytest.approx(icc_true, abs=0.05)
    assert within == pytest.approx(1 - icc_true, abs=0.05)


def test_cluster_contrast_is_a_t_interval_over_warm_start_means_of_paired_differences():
    """Pairs by seed within a warm start, averages per warm start, then a t over warm starts (loop reference)."""
    a = {("w", 0): {0: 0.50, 1: 0.55, 2: 0.52}, ("w", 1): {0: 0.40, 1: 0.47}, ("w", 2): {3: 0.61, 4: 0.58},
         ("w", 3): {0: 0.30, 1: 0.36, 2: 0.33}}  # fmt: skip
    b = {("w", 0): {0: 0.45, 1: 0.50, 2: 0.49}, ("w", 1): {0: 0.41, 1: 0.43}, ("w", 2): {3: 0.52, 4: 0.57},
         ("w", 3): {0: 0.31, 1: 0.30, 2: 0.34, 9: 0.9}}  # seed 9 has no partner: left out
    c = cluster_contrast(a, b)
    diffs = [[a[w][s] - b[w][s] for s in sorted(a[w]) if s in b[w]] for w in sorted(a)]
    means = [sum(d) / len(d) for d in diffs]
    k = len(means)
    est = sum(means) / k
    sd = math.sqrt(sum((m - est) ** 2 for m in means) / (k - 1))
    t = est / (sd / math.sqrt(k))
    half = sps.t.ppf(0.975, k - 1) * sd / math.sqrt(k)
    assert c.warm_starts == 4 and c.runs == 10
    assert c.diff == pytest.approx(est, rel=1e-12)
    assert (c.lo, c.hi) == pytest.approx((est - half, est + half), rel=1e-12)
    assert c.p == pytest.approx(2 * sps.t.sf(abs(t), k - 1), rel=1e-10)
    np.testing.assert_allclose((c.var_between, c.var_within, c.icc), _anova_reference(diffs), rtol=1e-12)


def _run(root: Path, preset: str, build_seed, seed: int, acc: float) -> None:
    name, replay = {"grpo": ("grpo", "off"), "gspo": ("gspo", "off")}[preset]
    cfg = {"objective": {"name": name, "preset": preset}, "routing": {"replay": replay}, "trainer": {"lr": 1e-4},
           "model": {"num_layers": 2, "seed": 0}, "warmstart": {"enabled": True, "build_seed": build_seed, "seed": 0},
           "seed": seed, "experiment": "hand"}  # fmt: skip
    folder = root / f"{preset}-{build_seed}-{seed}"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, "rollout/reward/mean": acc, "clip/token_frac": 0.1, "ratio/token/var": 0.01 * (s + 1), "ratio/token/within_seq_var": 0.001, "rollout/response_len/mean": 3.0 + s,
             "routing/expert_change/frac": 0.01, "time/step_s": 1.0, "eval/accuracy": acc} for s in range(3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text("")
    summary = {"label": f"{preset} (replay={replay})", "objective": preset, "replay": replay, "seed": seed,
               "experiment": "hand"}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_report_detects_clustered_design_and_judges_contrast_over_warm_starts(tmp_path):
    """4 warm starts x 3 RL seeds: build_seed does not split groups, and the report's cluster row equals cluster_contrast."""
    rng = np.random.default_rng(0)
    a, b = {}, {}
    for w in range(4):
        effect = 0.02 + 0.03 * rng.normal()
        for s in range(3):
            base = 0.4 + 0.05 * w + 0.01 * rng.normal()
            acc_b = base + 0.01 * rng.normal()
            acc_a = acc_b + effect + 0.005 * rng.normal()
            _run(tmp_path / "sweep", "grpo", w, s, acc_a)
            _run(tmp_path / "sweep", "gspo", w, s, acc_b)
            a.setdefault(("k", w), {})[s], b.setdefault(("k", w), {})[s] = acc_a, acc_b
    runs = load_local([tmp_path / "sweep"], progress=False)
    design = detect_design(runs)
    assert (design.kind, design.warm_starts, design.seeds_per_warm_start) == (CLUSTERED, 4, (3, 3, 3, 3))
    report = write_report(runs, tmp_path / "out", "t", ["sweep"])
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    assert set(table["summary"]) == {"grpo (replay=off)", "gspo (replay=off)"}
    (pair,) = table["pairs"]
    row, ref = pair["clusters"]["outcome"], cluster_contrast(a, b)
    assert row["warm_starts"] == 4 and row["runs"] == 12
    np.testing.assert_allclose([row["diff"], row["lo"], row["hi"], row["p"], row["icc"]],
                               [ref.diff, ref.lo, ref.hi, ref.p, ref.icc], rtol=1e-12)  # fmt: skip
    assert pair["outcome_diff"]["n_a"] == 12  # the unit-level paired t still pairs (warm start, seed)
    text = report.read_text()
    assert "4 warm starts x 3 RL seeds" in text and "Warm starts as clusters" in text and "ICC" in text


def test_single_warm_start_sweep_is_labelled_conditional_and_per_seed_builds_are_named(tmp_path):
    """build_seed shared: "conditional on one warm start", no cluster rows; build_seed null: one warm start per seed."""
    for s in range(3):
        _run(tmp_path / "one", "grpo", 0, s, 0.4 + 0.01 * s)
        _run(tmp_path / "one", "gspo", 0, s, 0.41 + 0.02 * s)
        _run(tmp_path / "own", "grpo", None, s, 0.4 + 0.01 * s)
        _run(tmp_path / "own", "gspo", None, s, 0.41 + 0.02 * s)
    one = load_local([tmp_path / "one"], progress=False)
    own = load_local([tmp_path / "own"], progress=False)
    assert detect_design(one).kind == ONE and detect_design(own).kind == PER_SEED
    report = write_report(one, tmp_path / "out", "t", ["one"])
    assert "conditional on one warm start" in report.read_text()
    assert json.loads((tmp_path / "out" / "table.json").read_text())["pairs"][0]["clusters"] is None


@pytest.mark.slow
def test_real_tiny_sweep_over_build_seeds_is_read_as_clusters(tmp_path, warm_cache):
    """A real moe-rl-train sweep, 2 warm starts (build_seed 0, 1) x 2 RL seeds x GRPO, GSPO: moe-rl-analyze
    reads the design from the runs' .hydra configs, keeps one group per objective and gives a cluster row."""
    import subprocess
    import sys

    from tests.unit.analysis.test_analyze_load_group_report import SWEEP

    repo = Path(__file__).resolve().parents[3]
    sweep, out = tmp_path / "sweep", tmp_path / "out"
    train = [sys.executable, "-m", "moe_rl.train", "-m", *SWEEP, "warmstart.build_seed=0,1",
             f"warmstart.cache_dir={warm_cache}", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    subprocess.run(train, cwd=repo, check=True, capture_output=True, text=True, timeout=1200)
    runs = load_local([sweep], progress=False)
    design = detect_design(runs)
    assert (design.kind, design.warm_starts, design.seeds_per_warm_start) == (CLUSTERED, 2, (2, 2))
    analyze = [sys.executable, "-m", "analysis.cli", str(sweep), "--out", str(out), "--no-progress"]
    subprocess.run(analyze, cwd=repo, check=True, capture_output=True, text=True, timeout=300)
    table = json.loads((out / "table.json").read_text())
    assert set(table["summary"]) == {"grpo (replay=off)", "gspo (replay=off)"}
    (pair,) = table["pairs"]
    row = pair["clusters"]["outcome"]
    assert (row["warm_starts"], row["runs"]) == (2, 4) and row["verdict"].startswith("no verdict possible")
    assert sorted(pair["per_seed"]["a"]["warm_start"]) == [0, 0, 1, 1]
    assert "2 warm starts x 2 RL seeds" in (out / "report.md").read_text()


def test_dose_trend_over_warm_starts_keys_units_and_judges_their_slopes_over_warm_starts(tmp_path):
    """4 warm starts x 2 seeds, GRPO at σ 0 and 0.4 against GRPO + R2: each (warm start, seed) gets its own
    slope (no seed's runs merge across warm starts), and "over_warm_starts" is the t over warm-start means."""
    import yaml as _yaml

    from analysis.drift import dose_trend
    from analysis.load import group_runs, varying_fields

    slope_of = {w: -0.5 - 0.2 * w for w in range(4)}  # Δ acc per unit of change, per warm start
    root = tmp_path / "sweep"
    for w in range(4):
        for s in range(2):
            for preset, replay, sigma, change in (("grpo_rr", "old", 0.0, 0.0), ("grpo", "off", 0.0, 0.0),
                                                  ("grpo", "off", 0.4, 0.1 + 0.02 * s)):  # fmt: skip
                acc = 0.5 + 0.01 * s + 0.1 * w + (slope_of[w] * change + 0.003 * s if preset == "grpo" else 0.0)
                cfg = {"objective": {"name": "grpo", "preset": preset}, "routing": {"replay": replay, "logit_noise": sigma},
                       "trainer": {"lr": 1e-4}, "model": {"seed": 0}, "seed": s, "experiment": "hand",
                       "warmstart": {"enabled": True, "build_seed": w, "seed": 0}}  # fmt: skip
                folder = root / f"{preset}-{sigma}-{w}-{s}"
                (folder / ".hydra").mkdir(parents=True)
                (folder / ".hydra" / "config.yaml").write_text(_yaml.safe_dump(cfg))
                rows = [{"step": i, "rollout/reward/mean": acc, "routing/expert_change/after_one_update": change,
                         "eval/accuracy": acc} for i in range(2)]  # fmt: skip
                (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                (folder / "summary.json").write_text(json.dumps({"objective": preset, "replay": replay, "seed": s}))
    runs = load_local([root], progress=False)
    fields = varying_fields(runs)
    assert fields == ["routing.logit_noise"]
    trend = dose_trend(group_runs(runs, fields))["grpo (replay=off)"]["final eval acc"]
    assert len(trend["per_seed"]) == 8 and trend["slope"].n_a == 8
    units = {}
    for w in range(4):
        for s in range(2):
            change = 0.1 + 0.02 * s
            units[(w, s)] = slope_of[w] * change / (change / 0.1)  # per 10 points; the seed's offset cancels
    means = [sum(units[(w, s)] for s in range(2)) / 2 for w in range(4)]
    over = trend["over_warm_starts"]
    assert over["warm_starts"] == 4 and over["diff"] == pytest.approx(sum(means) / 4, rel=1e-9)
    k, m = 4, sum(means) / 4
    half = sps.t.ppf(0.975, k - 1) * math.sqrt(sum((x - m) ** 2 for x in means) / (k - 1) / k)
    assert (over["lo"], over["hi"]) == pytest.approx((m - half, m + half), rel=1e-9)
