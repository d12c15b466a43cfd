"""Issue 56's last tracebacks: a launch the processes cannot run, and a run folder that is a file, each
stop in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.errors import LaunchError, one_line
from moe_rl.startup import check_launch, check_world
from moe_rl.train import run_dir_problem
from tests.integration.test_train_loop import TINY, compose_config

REPO = Path(__file__).resolve().parents[3]


def test_launch_errors_are_one_line_errors():
    """rollout.overlap under 2 processes and a batch 3 processes cannot split raise LaunchError, which the
    entry point prints as one line (one_line), and which is still a ValueError for callers that catch one."""
    cfg = compose_config([*TINY, "rollout.staleness=1", "rollout.overlap=true"])
    with pytest.raises(LaunchError, match=r"rollout\.overlap=false") as caught:
        check_launch(cfg, 2)
    assert isinstance(caught.value, ValueError) and "rollout.overlap" in one_line(caught.value)
    with pytest.raises(LaunchError, match="not divisible by the 3 processes"):
        check_world(cfg.trainer, 3)


def test_a_run_folder_that_is_a_file_stops_in_one_line(tmp_path):
    """hydra.run.dir (or a folder above it) that is a file: moe-rl-train exits 2 with one line naming it,
    before Hydra tries to create it (which printed a traceback)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file" in run_dir_problem([f"hydra.run.dir={afile}/run"])
    assert run_dir_problem([f"hydra.run.dir={tmp_path}/new/run", "trainer.steps=1"]) is None
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "moe_rl.train", f"hydra.run.dir={afile}"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"moe-rl-train: invalid config: hydra.run.dir={afile}: {afile} is a file, not a folder; give the run a "
        "folder (hydra.run.dir=...)"]


def test_a_vllm_engine_split_the_processes_cannot_hold_stops_in_one_line(monkeypatch):
    """sampler.engine=vllm with tensor_parallel_size 2 under 3 processes raises LaunchError naming the field
    (vLLM's presence stubbed); 4 processes pass, and the hf engine asks nothing of the launch."""
    import moe_rl.rollout.engines as engines
    monkeypatch.setattr(engines, "require", lambda engine: None)
    with pytest.raises(LaunchError, match=r"sampler\.tensor_parallel_size=2 does not divide the 3 process"):
        engines.check_engine_launch("vllm", 2, 3)
    engines.check_engine_launch("vllm", 2, 4)
    engines.check_engine_launch("hf", 1, 3)
