"""Provenance in every run (moe_rl/provenance.py), the warning when a comparison mixes provenances, and
the reproducibility it stands for: same config, same provenance, bitwise the same metrics."""

import json
import platform
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from analysis.compare import read_runs
from analysis.load import load_local
from moe_rl.provenance import FIELDS, provenance, provenance_mismatch
from moe_rl.trainer.run import train
from tests.helpers.wandb_offline import run_config
from tests.integration.test_train_loop import TINY, compose_config

REPO = Path(__file__).resolve().parents[3]


def test_provenance_records_versions_commit_cpu_kernels_threads_and_device():
    """provenance() holds every field, each equal to what this process reports (torch's version, ISA, threads; git's HEAD)."""
    record = provenance("cpu")
    assert tuple(record) == FIELDS
    assert record["torch"] == torch.__version__ and record["python"] == platform.python_version()
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and record["cpu"]
    assert record["threads"] == torch.get_num_threads() and record["device"] == "cpu"
    assert record["moe_rl"] and record["transformers"] and record["datasets"]
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert record["git_commit"] == head.strip() and isinstance(record["git_dirty"], bool)


def test_mismatch_is_one_line_naming_each_differing_field_and_its_values():
    """Equal records give no warning; records differing in torch and threads give one line naming both with their values, and counts runs with no record."""
    a = provenance("cpu")
    assert provenance_mismatch([a, dict(a)]) is None and provenance_mismatch([None, None]) is None
    b = {**a, "torch": "0.0.1", "threads": 99}
    line = provenance_mismatch([a, b, None])
    assert "\n" not in line and f"torch (0.0.1, {a['torch']})" in line and f"threads ({a['threads']}, 99)" in line
    assert "1 of 3 runs record no provenance" in line and "cpu_capability" not in line


def _run_folder(path: Path, seed: int, origin: dict) -> None:
    """A finished run folder as the tools read it (summary with provenance, one metrics row)."""
    path.mkdir(parents=True)
    summary = {"label": "grpo (replay=off)", "objective": "grpo", "replay": "off", "seed": seed,
               "provenance": origin}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward/mean": 0.5}) + "\n")


@pytest.mark.parametrize("tool", ["moe-rl-compare", "moe-rl-analyze"])
def test_compare_and_analyze_warn_once_when_runs_differ_in_provenance(tmp_path, tool):
    """Two seeds run under different torch kernels (cpu_capability) draw one warning naming the field; equal provenance draws none."""
    a = provenance("cpu")
    _run_folder(tmp_path / "same" / "0", 0, a)
    _run_folder(tmp_path / "same" / "1", 1, a)
    _run_folder(tmp_path / "mixed" / "0", 0, a)
    _run_folder(tmp_path / "mixed" / "1", 1, {**a, "cpu_capability": "NOT_" + a["cpu_capability"]})
    read = read_runs if tool == "moe-rl-compare" else lambda d: load_local([d], progress=False)
    for case in ("same", "mixed"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(read(tmp_path / case)) == 2
        said = [str(w.message) for w in caught if "differ in" in str(w.message)]
        assert len(said) == (case == "mixed")
        if said:
            assert "cpu_capability" in said[0] and "torch (" not in said[0]


def test_two_identical_runs_are_bitwise_equal_and_record_their_provenance(tmp_path):
    """Same config, same thread count, one machine: every metric of every step is bitwise equal; each run's summary and W&B config carry the same provenance."""
    cfg = compose_config(["objective=grpo", *TINY, "warmstart.enabled=false", "trainer.threads=1", "trainer.steps=3"])
    threads = torch.get_num_threads()
    try:
        summaries = [train(cfg, tmp_path / name) for name in ("a", "b")]
    finally:
        torch.set_num_threads(threads)
    rows = [[json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in "ab"]
    timing = ("time/", "throughput/")
    same = [[{k: v for k, v in r.items() if not k.startswith(timing)} for r in run] for run in rows]
    assert len(same[0]) == 3 and same[0] == same[1]
    origin = [s["provenance"] for s in summaries]
    assert origin[0] == origin[1] and origin[0]["threads"] == 1 and tuple(origin[0]) == FIELDS
    for name, record in zip("ab", origin, strict=True):
        assert json.loads((tmp_path / name / "summary.json").read_text())["provenance"] == record
        assert run_config(tmp_path / name)["provenance"] == record


@pytest.mark.parametrize("tool", ["moe-rl-compare", "moe-rl-analyze"])
def test_console_tools_print_the_provenance_warning_as_one_line(tmp_path, tool):
    """On the console, the tools' warning is one stderr line "<tool>: RuntimeWarning: ...", with no Python source location or source line."""
    import sys

    a = provenance("cpu")
    _run_folder(tmp_path / "sweep" / "0", 0, a)
    _run_folder(tmp_path / "sweep" / "1", 1, {**a, "threads": a["threads"] + 1})
    module = {"moe-rl-compare": "analysis.compare", "moe-rl-analyze": "analysis.cli"}[tool]
    extra = ["--out", str(tmp_path / "out"), "--no-progress"] if tool == "moe-rl-analyze" else []
    proc = subprocess.run([sys.executable, "-m", module, str(tmp_path / "sweep"), *extra], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: RuntimeWarning: the runs differ in threads"), proc.stderr
