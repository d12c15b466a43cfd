"""analysis.variants: each replay variant against its arm's base, paired by seed, with Holm over the primary
contrasts, against a float64 reference written out here (scipy)."""

import numpy as np
import pytest
from scipy import stats as sps

from analysis.load import Run, group_runs, varying_fields
from analysis.report import write_report
from analysis.sections import Sweep
from analysis.stats import holm
from analysis.variants import format_variants, variant_contrasts
from tests.unit.analysis.test_analyze_load_group_report import run_config, run_metrics

RNG = np.random.default_rng(5)
SEEDS = 5
# mismatch[arm, variant, seed, step]: fp32 routers lower it 5%, replayed gates 10% (R2 and R3 only).
BASE = {"grpo": 0.004, "grpo_rr": 0.004, "grpo_r3": 0.0035}
EFFECT = {"base": 1.0, "fp32 routers": 0.95, "replayed gates": 0.90}


def _run(arm: str, name: str, seed: int) -> Run:
    config = run_config("grpo_rr" if arm == "grpo_r3" else arm, seed, 3e-4)
    if arm == "grpo_r3":
        config["objective"]["preset"], config["routing"]["replay"] = "grpo_r3", "rollout"
    config["model"]["router_dtype"] = "float32" if name == "fp32 routers" else None
    config["routing"]["replay_gates"] = name == "replayed gates"
    rows = run_metrics([0.1] * 6)
    seed_level = BASE[arm] * (1 + 0.05 * (seed - 2))
    for row in rows:
        row["mismatch/logp_abs_diff/mean"] = seed_level * EFFECT[name] * (1 + RNG.normal(0, 0.01))
        row["routing/rollout_vs_old/frac"] = 0.001 * EFFECT[name]
    return Run(config=config, rows=rows, events=[], source=f"{arm}{name}{seed}")


def _runs() -> list[Run]:
    cells = [("grpo", "base"), ("grpo", "fp32 routers")] + [
        (arm, name) for arm in ("grpo_rr", "grpo_r3") for name in EFFECT]
    return [_run(arm, name, s) for arm, name in cells for s in range(SEEDS)]


def test_contrasts_match_a_paired_t_and_holm_written_out():
    runs = _runs()
    fields = varying_fields(runs)
    result = variant_contrasts(Sweep(runs=runs, fields=fields, groups=group_runs(runs, fields)))
    rows = {(r["arm"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {("grpo (replay=off)", "fp32 routers"), ("grpo_rr (replay=old)", "fp32 routers"),
                         ("grpo_rr (replay=old)", "replayed gates"), ("grpo_r3 (replay=rollout)", "fp32 routers"),
                         ("grpo_r3 (replay=rollout)", "replayed gates")}
    ps = []
    for (arm, name), row in rows.items():
        def mean(run):
            return np.mean([r["mismatch/logp_abs_diff/mean"] for r in run.rows])
        pick = {(r.base_label, _name(r), r.seed): r for r in runs}
        a = np.array([mean(pick[arm, name, s]) for s in range(SEEDS)])
        b = np.array([mean(pick[arm, "base", s]) for s in range(SEEDS)])
        t = sps.ttest_rel(a, b)
        m = row["mismatch"]
        assert m["diff"] == pytest.approx((a - b).mean(), rel=1e-12)
        assert m["p"] == pytest.approx(t.pvalue, rel=1e-9)
        assert m["pct"] == pytest.approx(100 * (a - b).mean() / b.mean(), rel=1e-12)
        assert m["pct"] == pytest.approx(100 * (EFFECT[name] - 1), abs=1.0)
        ps.append((row, t.pvalue))
    for (row, _), adjusted in zip(ps, holm([p for _, p in ps]), strict=True):
        assert row["mismatch"]["holm"] == pytest.approx(adjusted, rel=1e-9)
    assert "| grpo_r3 (replay=rollout) | replayed gates | mismatch |" in format_variants(result)


def _name(run: Run) -> str:
    flat = run.flat
    return ("fp32 routers" if flat.get("model.router_dtype") == "float32"
            else "replayed gates" if flat.get("routing.replay_gates") else "base")


def test_the_report_has_the_section_only_when_a_variant_field_varies(tmp_path):
    runs = _runs()
    assert "## Replay variants against their arm's base" in write_report(runs, tmp_path / "a", "t", ["x"],
                                                                       permutations=200).read_text()
    base = [r for r in runs if _name(r) == "base"]
    assert "Replay variants" not in write_report(base, tmp_path / "b", "t", ["x"], permutations=200).read_text()
