"""stale_rivals' pre-registered machinery (issue 57): the blind run's pre-registration check, the step-size
rule, and the power simulation's inputs recomputed from replay_staleness's committed table."""

import importlib.util
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from analysis.load import Run
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
