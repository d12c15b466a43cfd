"""stale_rivals' pre-registered machinery (issue 57): the blind run's pre-registration check, the step-size
rule, and the power simulation's inputs recomputed from replay_staleness's committed table."""

import importlib.util
import math
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from analysis.load import Run
from analysis.runtable import write_table
from moe_rl.records import Entry, write_manifest

ROOT = Path(__file__).resolve().parents[3]


def _module(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prereg = _module("experiments/lib/preregistration.py")
lrs = _module("experiments/stale_rivals_lr.py")
power = _module("experiments/stale_rivals_power.py")
primary = _module("experiments/stale_rivals_primary.py")


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def test_the_blind_run_needs_a_pre_registration_committed_before_its_first_record(tmp_path):
    """Missing, uncommitted, changed since its commit, or committed after an archive its records manifest
    lists or a run of the sweep: one line saying which; committed first and unchanged: no objection."""
    repo, sweep, records = tmp_path / "repo", tmp_path / "repo" / "sweep", tmp_path / "repo" / "records.json"
    repo.mkdir()
    _git(repo, "init", "-q")
    doc = repo / "prereg.md"
    assert "no pre-registration" in prereg.problem(doc, sweep, records)
    doc.write_text("# plan\n")
    assert "not committed" in prereg.problem(doc, sweep, records)
    _git(repo, "add", "prereg.md")
    _git(repo, "commit", "-qm", "plan")
    assert prereg.problem(doc, sweep, records) is None
    write_manifest(records, [Entry("20200101T000000Z.tar.xz", "0" * 64, 0, 0, ["https://x"])])  # packed before
    assert "after the sweep's first record" in prereg.problem(doc, sweep, records)
    write_manifest(records, [Entry("20990101T000000Z.tar.xz", "0" * 64, 0, 0, ["https://x"])])
    run = sweep / "ws0" / "0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    os.utime(run / "metrics.jsonl", (time.time() - 10 * 365 * 86400,) * 2)
    assert "after the sweep's first record" in prereg.problem(doc, sweep, records)
    os.utime(run / "metrics.jsonl")
    assert prereg.problem(doc, sweep, records) is None
    doc.write_text("# plan, changed\n")
    assert "changed since its commit" in prereg.problem(doc, sweep, records)
    assert prereg.main(["check", str(doc), str(sweep), str(records)]) == 1


def _run(preset: str, lr: float, kl: float, seed: int) -> Run:
    rows = [{"step": s, "policy/approx_kl": kl if 10 <= s < 40 else 100.0} for s in range(40)]
    return Run({"objective": {"preset": preset}, "trainer": {"lr": lr}, "seed": seed}, rows, [], f"{preset}-{lr}-{seed}")


def test_the_step_size_rule_takes_the_grid_lr_nearest_grpos_kl_on_a_log_scale():
    """KL over steps 10-39 only (the first steps' 100 is ignored), mean over runs; GSPO's KL 0.004 at 2e-4 is
    nearest GRPO's 0.01 on a log scale, against 0.03 at 4e-4; a tie takes the smaller lr; an edge is flagged."""
    runs = [_run("grpo", 1e-4, 0.01, s) for s in (0, 1)]
    runs += [_run("gspo", lr, kl, 0) for lr, kl in ((1e-4, 0.001), (2e-4, 0.004), (4e-4, 0.03))]
    runs += [_run("vespo_stale", lr, kl, 0) for lr, kl in ((1e-4, 0.005), (2e-4, 0.02))]  # |log 2| each side
    runs += [_run("dppo_tv_sampler", lr, kl, 0) for lr, kl in ((1e-4, 0.02), (2e-4, 0.05))]
    kls = lrs.cell_kls(runs)
    assert kls["grpo", 1e-4] == pytest.approx(0.01)
    got = lrs.choose(kls)
    assert (got["gspo"]["lr"], got["gspo"]["edge"]) == (2e-4, False)
    assert (got["vespo_stale"]["lr"], got["vespo_stale"]["edge"]) == (1e-4, True)
    assert (got["dppo_tv_sampler"]["lr"], got["dppo_tv_sampler"]["edge"]) == (1e-4, True)


def test_the_power_inputs_recompute_from_replay_staleness():
    """σ_b, σ_w and the observed differences in differences quoted in stale_rivals_power.md recompute from
    docs/results/replay_staleness/table.json, and the simulation writes one row per warm-start count and
    scenario."""
    import json

    table = json.loads(power.TABLE.read_text())
    sb, sw, means = power.variance_components(power.per_run(table, "auc"))
    quoted = (ROOT / "docs" / "preregistration" / "stale_rivals_power.md").read_text()
    assert f"σ_b = {sb:.4f}" in quoted and f"σ_w = {sw:.4f}" in quoted
    assert f"observed D: {', '.join(f'{m:+.3f}' for m in means)}" in quoted
    text = power.main(["--sims", "20"])
    assert len(re.findall(r"^\| (8|12|16|20|24) x 3 \|", text, flags=re.M)) == 20
    assert math.isclose(means[0], 0.0393, abs_tol=5e-4)


def _primary_run(arm: str, k: int, w: int, seed: int, y: float, lr: float) -> Run:
    """A 200-step run whose expected-accuracy curve runs from y − 0.01 before the first update to y + 0.01
    after the last: AUC (y − 0.01 + y + 0.01) / 2."""
    preset = primary.ARMS[arm]
    config = {"objective": {"preset": preset}, "routing": {"replay": "old" if arm == "R2" else "off"},
              "rollout": {"staleness": k}, "warmstart": {"build_seed": w, "seed": 0}, "model": {"seed": 0},
              "trainer": {"steps": 200, "lr": lr}, "seed": seed}
    rows = [{"step": 0, "eval/initial/expected_accuracy": y - 0.01}, {"step": 199, "eval/expected_accuracy": y + 0.01}]
    return Run(config=config, rows=rows, events=[], source=f"{arm}/{k}/{w}/{seed}")


def _primary_sweep(skip=()) -> tuple[list, dict]:
    """360 primary runs with y = warm-start level + arm x k effect + noise, and decoys the analysis must skip
    (the step-size stage's warm start 100, GSPO at the shared lr, R3); the AUCs by cell, by hand."""
    rng = np.random.default_rng(7)
    level = rng.normal(0.5, 0.05, 20)
    effect = {("GRPO", 8): -0.05, ("R2", 8): -0.03, ("GSPO", 8): -0.035}
    lrs = {"GRPO": 1e-4, "R2": 1e-4, "GSPO": 2e-4}
    runs, y = [], {}
    for arm in primary.ARMS:
        for k in primary.KS:
            for w in range(20):
                for s in range(3):
                    v = float(level[w] + effect.get((arm, k), 0.0) + rng.normal(0, 0.01))
                    y[arm, k, w, s] = ((v - 0.01) + (v + 0.01)) / 2
                    if (arm, k, w, s) not in skip:
                        runs.append(_primary_run(arm, k, w, s, v, lrs[arm]))
    runs += [_primary_run("GRPO", 8, 100, 0, 0.9, 1e-4), _primary_run("GSPO", 8, 0, 0, 0.9, 1e-4)]
    runs[-1].config["trainer"]["lr"] = 1e-4  # GSPO at the shared lr: a secondary cell
    return runs, y


def test_the_primary_family_is_the_pre_registered_difference_in_differences_with_holm(tmp_path):
    """D_a and D_b per unit, averaged per warm start, Student t over 20 warm starts, Holm over the two:
    against scipy and arithmetic written out here, on a sweep with decoys the analysis must leave out."""
    runs, y = _primary_sweep()
    lrs = primary.arm_lrs({"arms": {"gspo": {"lr": 2e-4}}})
    cells = primary.primary_cells(runs, lrs)
    assert len(cells) == 360
    result = primary.primary(cells)
    e = {arm: np.array([[y[arm, 8, w, s] - y[arm, 0, w, s] for s in range(3)] for w in range(20)]) for arm in primary.ARMS}
    ps = {}
    for name, (a, b) in {"a": ("R2", "GRPO"), "b": ("GSPO", "R2")}.items():
        per_ws = (e[a] - e[b]).mean(axis=1)
        test = sps.ttest_1samp(per_ws, 0.0)
        got = result["contrasts"][name]
        assert got["diff"] == pytest.approx(per_ws.mean(), rel=1e-12, abs=1e-15)
        assert got["p"] == pytest.approx(test.pvalue, rel=1e-9)
        half = sps.t.ppf(0.975, 19) * per_ws.std(ddof=1) / math.sqrt(20)
        assert got["hi"] - got["lo"] == pytest.approx(2 * half, rel=1e-9)
        assert got["warm_starts"] == 20 and got["units"] == 60
        ps[name] = test.pvalue
    low, high = sorted(ps, key=ps.get)
    assert result["contrasts"][low]["p_holm"] == pytest.approx(min(1.0, 2 * ps[low]), rel=1e-9)
    assert result["contrasts"][high]["p_holm"] == pytest.approx(max(min(1.0, 2 * ps[low]), ps[high]), rel=1e-9)
    assert result["missing"] == []


def test_the_primary_stays_blind_until_complete_and_then_names_each_failed_run(tmp_path, capsys):
    """With a run missing it prints counts per cell only and exits 1; with --failed-ok the missing run is
    named and its unit leaves only the contrasts that need its arm (GRPO's: (a), not (b))."""
    runs, _ = _primary_sweep(skip={("GRPO", 8, 3, 1)})
    table = write_table(runs, tmp_path / "runs.parquet")
    step = tmp_path / "step_size.json"
    step.write_text('{"arms": {"gspo": {"lr": 0.0002}}}')
    with pytest.raises(SystemExit) as exit_:
        primary.main([str(table), "--out", str(tmp_path / "out"), "--step-size", str(step)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "blind, 359 of 360" in err and "GRPO k=8: 59/60" in err
    assert "AUC" not in err and not (tmp_path / "out").exists()
    result = primary.main([str(table), "--out", str(tmp_path / "out"), "--step-size", str(step), "--failed-ok"])
    assert result["missing"] == ["GRPO k=8 warm start 3 seed 1"]
    assert result["contrasts"]["a"]["units"] == 59 and result["contrasts"]["b"]["units"] == 60
    assert "missing (failed)" in (tmp_path / "out" / "primary.md").read_text()
