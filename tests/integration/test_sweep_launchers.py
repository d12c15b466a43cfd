"""Sweeps through Hydra's launcher plugins: configs compose, a tiny sweep runs, a failing job loses no results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from moe_rl.train import CONF_DIR
from tests.integration.test_train_loop import TINY

SWEEP = [
    *TINY,
    "trainer.steps=1",
    "warmstart.enabled=false",
    "logger.wandb=false",
    "trainer.threads=1",
    "objective=grpo",
]


@pytest.mark.parametrize(
    "launcher, target",
    [
        ("joblib_local", "JoblibLauncher"),
        ("slurm_gpu", "SlurmLauncher"),
        ("joblib", "JoblibLauncher"),
        ("submitit_local", "LocalLauncher"),
        ("submitit_slurm", "SlurmLauncher"),
    ],
)
def test_launcher_configs_compose(launcher, target):
    """Our launcher presets and the plugins' own compose onto the main config."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True
        )
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "slurm_gpu":
        assert (cfg.hydra.launcher.gpus_per_node, cfg.hydra.launcher.tasks_per_node) == (1, 1)


@pytest.mark.parametrize(
    "experiment, blind",
    [(None, False), ("confirm_sort_long", True), ("confirm_sort_long__gspo_lr2e4", True), ("router_lr_own_lr", True)],
)
def test_pre_registered_sweep_is_blind(experiment, blind):
    """The pre-registered sweep's end-of-sweep callback prints counts, not its comparison table; others print it."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        overrides = [f"+experiment={experiment}"] if experiment else []
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.callbacks.comparison.blind is blind


def _sweep(sweep_dir: Path, launcher: list[str], points: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_rl.train",
            "-m",
            *launcher,
            *SWEEP,
            f"objective.clip_low={points}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def _jobs(sweep_dir: Path) -> dict[str, Path]:
    """Job folders by their objective.clip_low override."""
    out = {}
    for overrides in sweep_dir.glob("*/.hydra/overrides.yaml"):
        clip = [line.split("=")[1] for line in overrides.read_text().splitlines() if "clip_low=" in line]
        out[clip[0]] = overrides.parent.parent
    return out


def _check_failed(job: Path) -> None:
    failed = json.loads((job / "failed.json").read_text())
    assert "objective.clip_low=5.0" in failed["error"]
    assert not (job / "summary.json").exists()


@pytest.mark.slow
def test_submitit_local_sweep_runs_two_rank_jobs_and_records_the_failed_one(tmp_path):
    """A submitit_local sweep with 2 tasks per job: the good job trains as 2 ranks (equal parameters on both),
    the job with an invalid value leaves failed.json naming the field, and the sweep exits non-zero."""
    proc = _sweep(
        tmp_path,
        ["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "trainer.dist_timeout_s=120"],
        "0.1,5.0",
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    jobs = _jobs(tmp_path)
    assert set(jobs) == {"0.1", "5.0"}, proc.stderr[-3000:]
    summary = json.loads((jobs["0.1"] / "summary.json").read_text())
    assert summary["steps_done"] == 1 and summary["world_size"] == 2
    assert summary["param_checksum_by_rank"][0] == summary["param_checksum_by_rank"][1]
    _check_failed(jobs["5.0"])


@pytest.mark.slow
def test_joblib_sweep_keeps_good_results_and_records_the_failed_job(tmp_path):
    """A parallel joblib sweep whose middle job has an invalid value runs the other jobs to completion
    (summary.json each), leaves failed.json in the failed job's folder and exits non-zero."""
    proc = _sweep(tmp_path, ["hydra/launcher=joblib_local"], "0.1,5.0,0.2")
    assert proc.returncode != 0, proc.stderr[-3000:]
    jobs = _jobs(tmp_path)
    assert set(jobs) == {"0.1", "5.0", "0.2"}, proc.stderr[-3000:]
    for good in ("0.1", "0.2"):
        summary = json.loads((jobs[good] / "summary.json").read_text())
        assert summary["steps_done"] == 1 and not (jobs[good] / "failed.json").exists()
    _check_failed(jobs["5.0"])
