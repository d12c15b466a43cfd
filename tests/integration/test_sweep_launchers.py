"""Sweeps through Hydra's launcher plugins: configs compose, a tiny sweep runs, a failing job loses no results."""

import json
import os
import subprocess
import sys
import time
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
    [(None, False), ("confirm_sort_long", True), ("confirm_sort_long__gspo_lr2e4", True), ("router_lr_own_lr", True),
     ("stale_rivals", True), ("stale_rivals__lr", True)],
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


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (lock bookkeeping aside) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".moe-rl")}


@pytest.mark.slow
def test_a_sweep_folder_is_owned_like_a_run_folder(tmp_path):
    """Issue 56: a second sweep into the folder of a running sweep, and a fresh sweep into a finished sweep's
    folder, exit 2 in one line before writing anything: the first sweep finishes cleanly (rc 0, no
    failed.json) and its files stay byte for byte; resume=true continues a finished sweep (sittings)."""
    sweep, env = tmp_path / "sweep", {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "moe_rl.train", "-m", *SWEEP, "trainer.steps=3", f"hydra.sweep.dir={sweep}"]
    # four jobs one after another: the first sweep is still running when the second has started up
    first = subprocess.Popen([*cmd, "seed=0,1,2,3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # until the first sweep owns its folder
        if (sweep / ".moe-rl-sweep.owner").exists() or first.poll() is not None:
            break
        time.sleep(0.1)
    second = subprocess.run([*cmd, "seed=5,6"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    lines = [x for x in second.stderr.splitlines() if x.startswith("moe-rl-train:")]
    assert len(lines) == 1 and "in use by another sweep" in lines[0]
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert not list(sweep.rglob("failed.json")) and "seed=5" not in (sweep / "multirun.yaml").read_text()
    before = _tree(sweep)
    again = subprocess.run([*cmd, "seed=0,1,2,3"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a sweep" in again.stderr
    assert _tree(sweep) == before
    resumed = subprocess.run([*cmd, "seed=0,1,2,3", "resume=true"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {k: v for k, v in _tree(sweep).items() if k.endswith(("metrics.jsonl", "summary.json"))} == {
        k: v for k, v in before.items() if k.endswith(("metrics.jsonl", "summary.json"))}
