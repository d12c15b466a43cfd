"""Holm's correction and the difference of dose slopes, against references written out here and committed data."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from analysis.drift import trend_differences
from analysis.stats import holm

REPO = Path(__file__).resolve().parents[3]


def _holm_reference(p: list[float]) -> list[float]:
    """Holm by its definition: adj_i = max over the sorted prefix of min(1, (m - j + 1) p_(j)), by loops."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adj = [0.0] * m
    for rank, i in enumerate(order):
        adj[i] = max(min(1.0, (m - r) * p[order[r]]) for r in range(rank + 1))
    return adj


def test_holm_matches_its_definition_and_a_worked_example():
    """Random p-values equal the loop reference; 0.01, 0.04, 0.03, 0.005 (m = 4) give 0.03, 0.06, 0.06, 0.02."""
    rng = np.random.default_rng(4)
    p = list(rng.uniform(0, 0.2, size=9))
    assert holm(p) == pytest.approx(_holm_reference(p), rel=1e-15)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)


def test_holm_leaves_nan_out_of_the_family():
    """A nan p stays nan and does not count in m: [0.02, nan, 0.04] adjusts as the family [0.02, 0.04]."""
    got = holm([0.02, math.nan, 0.04])
    assert math.isnan(got[1]) and got[0] == pytest.approx(0.04) and got[2] == pytest.approx(0.04)


def test_slope_difference_on_committed_noise_dose_is_the_paired_t_of_per_seed_slopes():
    """docs/results/noise_dose: GRPO − GSPO AUC slope difference is the paired t of the committed per-seed
    slopes (loop reference), and equals the verdict table's −0.008 [−0.014, −0.001], p = 0.026."""
    trend = json.loads((REPO / "docs/results/noise_dose/table.json").read_text())["dose_trend"]
    rows = {(r["a"], r["b"], r["outcome"]): r for r in trend_differences(trend)}
    row = rows[("grpo (replay=off)", "gspo (replay=off)", "expected-acc AUC")]
    g = trend["grpo (replay=off)"]["expected-acc AUC"]["per_seed"]
    s = trend["gspo (replay=off)"]["expected-acc AUC"]["per_seed"]
    d = [g[k] - s[k] for k in sorted(g)]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    half = sps.t.ppf(0.975, n - 1) * se
    assert (row["diff"], row["lo"], row["hi"]) == pytest.approx((mean, mean - half, mean + half), rel=1e-10)
    assert row["p"] == pytest.approx(2 * sps.t.sf(abs(mean) / se, n - 1), rel=1e-10)
    assert (round(row["diff"], 3), round(row["lo"], 3), round(row["hi"], 3), round(row["p"], 3)) == (
        -0.008, -0.014, -0.001, 0.026)
    family = [r for r in rows.values() if r["outcome"] == "expected-acc AUC"]
    assert [r["p_holm"] for r in family] == pytest.approx(_holm_reference([r["p"] for r in family]))


def test_slope_difference_pairs_only_seeds_both_arms_ran():
    """A seed only one arm ran is left out: arms with seeds {0,1,2} and {1,2,3} pair on seeds 1 and 2."""
    trend = {"a": {"y": {"per_seed": {"0": 9.0, "1": 1.0, "2": 2.0}}},
             "b": {"y": {"per_seed": {"1": 0.5, "2": 0.0, "3": -9.0}}}}  # fmt: skip
    (row,) = trend_differences(trend)
    assert row["n_a"] == 2 and row["diff"] == pytest.approx(1.25)


def test_verdict_table_holm_column_is_holm_of_its_own_p_values():
    """docs/results.md's verdict table: every "p = X → Holm Y" cell's Y is holm() over all the column's X, to 2 s.f."""
    import re

    text = (REPO / "docs/results.md").read_text()
    table = text.split("## Verdicts", 1)[1].split("\n\n", 2)[1]
    cells = re.findall(r"p = ([0-9.]+) → Holm ([0-9.]+) \|", table)
    assert len(cells) == 15
    adjusted = holm([float(p) for p, _ in cells])
    assert [f"{a:.2g}" for a in adjusted] == [h for _, h in cells]
