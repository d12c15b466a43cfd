"""Reliability contracts, checked fast: safe checkpoints, strict outputs, honest analysis, start-up checks.

The whole-run faults (kill -9, corruption through the console, sweeps, concurrency) are in
tests/integration/test_fault_injection.py (slow).
"""

import io
import json
import math
import os
import random
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.compare import comparison, format_table
from moe_rl.errors import RunError, one_line
from moe_rl.trainer.checkpoint import (
    CHECKPOINT,
    CORRUPT,
    MAGIC,
    PREVIOUS,
    TMP,
    CheckpointError,
    config_diff,
    finished_summary,
    finished_without_checkpoint,
    load_checkpoint,
    resume_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from moe_rl.trainer.collapse import CollapseDetector
from moe_rl.trainer.logging import CorruptLogError, read_jsonl, to_json

REPO = Path(__file__).resolve().parents[3]


def _strict_loads(text: str):
    """json.loads that refuses NaN/Infinity, as jq and JSON.parse do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "config": {"seed": 0}, "w": torch.full((3,), float(step)), "rng": rng_state({"g": g})}


# --- checkpoints -------------------------------------------------------------------------------------


def test_checkpoint_round_trip_restores_every_rng_with_weights_only():
    """A checkpoint loads with weights_only=True and restores python, numpy, torch and generator RNGs exactly."""
    g = torch.Generator().manual_seed(7)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    state = rng_state({"g": g})
    expected = (random.random(), np.random.standard_normal(), torch.rand(1).item(), torch.rand(1, generator=g).item())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    random.seed(9), np.random.seed(9), torch.manual_seed(9), g.manual_seed(9)
    set_rng_state(loaded, {"g": g})
    got = (random.random(), np.random.standard_normal(), torch.rand(1).item(), torch.rand(1, generator=g).item())
    assert got == expected


def test_two_checkpoints_kept_and_corrupt_latest_falls_back_with_warning(tmp_path):
    """Saving twice keeps both; a garbled latest resumes from the previous with a warning naming both files."""
    save_checkpoint(tmp_path, _state(1))
    save_checkpoint(tmp_path, _state(2))
    assert load_checkpoint(tmp_path)["step"] == 2
    data = bytearray((tmp_path / CHECKPOINT).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / CHECKPOINT).write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"checksum mismatch.*previous checkpoint .*checkpoint\.prev\.pt \(step 1\)"):
        assert load_checkpoint(tmp_path)["step"] == 1


def test_save_after_a_fallback_keeps_the_good_previous_checkpoint(tmp_path):
    """After a resume falls back past a corrupt checkpoint.pt, the next save does not rotate that file over the good previous one."""
    save_checkpoint(tmp_path, _state(1))
    save_checkpoint(tmp_path, _state(2))
    (tmp_path / CHECKPOINT).write_bytes((tmp_path / CHECKPOINT).read_bytes()[:-10])
    with pytest.warns(RuntimeWarning, match=r"kept as checkpoint\.corrupt\.pt"):
        assert load_checkpoint(tmp_path)["step"] == 1
    save_checkpoint(tmp_path, _state(3))
    assert load_checkpoint(tmp_path)["step"] == 3
    (tmp_path / CHECKPOINT).write_bytes(b"")  # the new one lost too: the good step-1 copy is still there
    with pytest.warns(RuntimeWarning, match=r"\(step 1\)"):
        assert load_checkpoint(tmp_path)["step"] == 1
    assert (tmp_path / CORRUPT).is_file()


@pytest.mark.parametrize("damage", ["truncate", "empty", "old_zip"])
def test_no_usable_checkpoint_is_one_clear_error(tmp_path, damage):
    """Both checkpoints unusable (truncated, empty, or a pre-verification zip) raise CheckpointError naming them."""
    save_checkpoint(tmp_path, _state(1))
    save_checkpoint(tmp_path, _state(2))
    for name in (CHECKPOINT, PREVIOUS):
        path = tmp_path / name
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:100])
        elif damage == "empty":
            path.write_bytes(b"")
        else:
            torch.save(_state(1), path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = one_line(err.value)
    assert message is not None and "\n" not in message and CHECKPOINT in message and PREVIOUS in message
    if damage == "old_zip":
        assert "old-format" in message


class _Payload:
    """Unpickling this runs `touch MARKER`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_in_checkpoint_never_executes(tmp_path):
    """A checkpoint whose pickle runs a shell command is refused, in old and new format, and the command never runs."""
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save({"step": 1, "x": _Payload(marker)}, payload)
    import hashlib

    blob = payload.getvalue()
    (tmp_path / CHECKPOINT).write_bytes(MAGIC + hashlib.sha256(blob).digest() + blob)  # valid checksum
    (tmp_path / PREVIOUS).write_bytes(blob)  # the old, unverified format
    with pytest.raises(CheckpointError, match="could not be loaded safely"):
        load_checkpoint(tmp_path)
    assert not marker.exists()
    assert zipfile.is_zipfile(tmp_path / PREVIOUS)  # the old-format file really was a torch zip


def test_full_disk_keeps_previous_checkpoint_and_leaves_no_temp_file(tmp_path):
    """A checkpoint write hitting ENOSPC (/dev/full) raises a one-line disk error; the last checkpoint is intact."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    save_checkpoint(tmp_path, _state(1))
    before = (tmp_path / CHECKPOINT).read_bytes()
    (tmp_path / TMP).symlink_to("/dev/full")
    with pytest.raises(OSError) as err:
        save_checkpoint(tmp_path, _state(2))
    assert one_line(err.value) and "No space left" in one_line(err.value)
    assert (tmp_path / CHECKPOINT).read_bytes() == before and not (tmp_path / TMP).exists()
    assert load_checkpoint(tmp_path)["step"] == 1


def test_stale_temp_file_is_removed_on_load(tmp_path):
    """A half-written .checkpoint.pt.tmp from a killed save is deleted and never loaded."""
    save_checkpoint(tmp_path, _state(3))
    (tmp_path / TMP).write_bytes(b"half a checkpoint")
    assert load_checkpoint(tmp_path)["step"] == 3 and not (tmp_path / TMP).exists()


def test_kill_between_renames_keeps_the_newest_checkpoint(tmp_path):
    """With checkpoint.pt already moved to .prev and the complete new one still in the temp file, the new one loads."""
    save_checkpoint(tmp_path, _state(1))
    save_checkpoint(tmp_path, _state(2))
    os.replace(tmp_path / CHECKPOINT, tmp_path / TMP)  # prev = step 1, temp = step 2: a kill before the last rename
    assert load_checkpoint(tmp_path)["step"] == 2 and not (tmp_path / TMP).exists()


# --- resume ------------------------------------------------------------------------------------------


def test_config_diff_ignores_only_resume_safe_fields():
    """steps, threads, checkpoint_every and logger fields may change on resume; objective and seed may not."""
    saved = {"seed": 0, "objective": {"name": "gspo"}, "trainer": {"steps": 4, "threads": 1}, "logger": {"wandb": True}}
    same = {"seed": 0, "objective": {"name": "gspo"}, "trainer": {"steps": 9, "threads": 2}, "logger": {"wandb": False}}
    other = {"seed": 5, "objective": {"name": "grpo"}, "trainer": {"steps": 4, "threads": 1}, "logger": {"wandb": True}}
    assert config_diff(saved, same) == []
    assert config_diff(saved, other) == ["objective.name", "seed"]
    # A field added to the schema after the checkpoint: no change at its default, a change otherwise.
    older = {k: v for k, v in saved.items() if k != "seed"}
    assert config_diff(older, same, defaults={"seed": saved["seed"]}) == []
    assert config_diff(older, other, defaults={"seed": saved["seed"]}) == ["objective.name", "seed"]


def test_resume_with_changed_config_is_refused_in_one_line_unless_forced(tmp_path):
    """A different objective and seed are refused naming both fields, Hydra's record is put back; force allows it."""
    state = {**_state(2), "config": {"seed": 0, "objective": {"name": "gspo"}}, "hydra": {"config.yaml": "seed: 0\n"}}
    save_checkpoint(tmp_path, state)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 5\n")  # what Hydra wrote for the resumed job
    changed = {"seed": 5, "objective": {"name": "grpo"}}
    with pytest.raises(RunError, match=r"objective\.name \('gspo' -> 'grpo'\), seed \(0 -> 5\)") as err:
        resume_state(tmp_path, changed, force=False)
    assert "\n" not in str(err.value) and "resume_force=true" in str(err.value)
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "seed: 0\n"
    with pytest.warns(RuntimeWarning, match="resume_force=true"):
        assert resume_state(tmp_path, changed, force=True)["step"] == 2


def test_resume_without_checkpoint_returns_none(tmp_path):
    """resume=true on a folder with no checkpoint has no state to resume (the run then decides, and warns:
    tests/integration/test_train_loop.py)."""
    assert resume_state(tmp_path, {}, force=False) is None


def test_a_finished_run_without_checkpoints_is_recognised_only_with_its_own_config(tmp_path):
    """finished_without_checkpoint: the summary's recorded config stands in for the checkpoint's; a summary
    without one, another run's id, or fewer steps than asked is not a finished run of this config."""
    config = {"seed": 0, "trainer": {"steps": 4, "lr": 1e-4}, "eval": {"every": math.inf}}
    summary = {"run_id": "a", "steps_done": 4, "stopped_on_collapse": None, "config": config}
    (tmp_path / "summary.json").write_text(to_json(summary))
    assert finished_without_checkpoint(tmp_path, config, 4, force=False, run_id="a")["run_id"] == "a"
    assert finished_without_checkpoint(tmp_path, config, 8, force=False) is None  # more steps: not finished
    assert finished_without_checkpoint(tmp_path, config, 4, force=False, run_id="b") is None
    other = {**config, "trainer": {"steps": 4, "lr": 2e-4}}
    with pytest.raises(RunError, match=r"trainer\.lr \(0\.0001 -> 0\.0002\)"):
        finished_without_checkpoint(tmp_path, other, 4, force=False)
    assert finished_without_checkpoint(tmp_path, other, 4, force=True) is not None
    (tmp_path / "summary.json").write_text(to_json({k: v for k, v in summary.items() if k != "config"}))
    with pytest.raises(RunError, match="records no config"):
        finished_without_checkpoint(tmp_path, config, 4, force=False)


def test_finished_run_is_recognised_only_when_summary_matches_checkpoint(tmp_path):
    """A summary at the checkpoint's step with all steps done (or stopped on collapse) means nothing to resume."""
    (tmp_path / "summary.json").write_text(json.dumps({"steps_done": 4, "stopped_on_collapse": None}))
    assert finished_summary(tmp_path, {"step": 4}, steps=4) is not None
    assert finished_summary(tmp_path, {"step": 4}, steps=8) is None  # more steps asked for: continue
    assert finished_summary(tmp_path, {"step": 3}, steps=4) is None  # summary of an older session
    (tmp_path / "summary.json").write_text(json.dumps({"steps_done": 2, "stopped_on_collapse": {"step": 1}}))
    assert finished_summary(tmp_path, {"step": 2}, steps=4) is not None


# --- run folders ------------------------------------------------------------------------------------


def test_fallback_never_loads_another_runs_checkpoint(tmp_path):
    """Given the folder's run id, a corrupt checkpoint.pt does not fall back to a checkpoint.prev.pt of another run: one error names both."""
    save_checkpoint(tmp_path, {**_state(4), "run_id": "old"})
    save_checkpoint(tmp_path, {**_state(1), "run_id": "new"})
    assert load_checkpoint(tmp_path, "new")["step"] == 1
    (tmp_path / CHECKPOINT).write_bytes((tmp_path / CHECKPOINT).read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"checkpoint\.prev\.pt belongs to another run \(id old, this folder's run is new\)") as err:
        load_checkpoint(tmp_path, "new")
    assert "checksum mismatch" in str(err.value) and "\n" not in str(err.value)
    with pytest.warns(RuntimeWarning, match=r"\(step 4\)"):  # without an id (a folder from before ids): the old rule
        assert load_checkpoint(tmp_path)["step"] == 4


def test_fresh_start_into_a_run_folder_is_refused_and_overwrite_moves_it_aside(tmp_path):
    """A folder holding a run refuses a fresh start naming its files and both ways out, changing nothing; overwrite=true moves every file (Hydra's open log copied) into overwritten-*/ and deletes none; resume=true and an empty folder pass."""
    from moe_rl.trainer.folder import FolderHoldsRunError, check_fresh_start

    assert check_fresh_start(tmp_path, resume=False, overwrite=False) is None  # nothing there yet
    for name, text in {"metrics.jsonl": "{}\n", "summary.json": "{}", "train.log": "log", ".hydra/config.yaml": "seed: 0\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    save_checkpoint(tmp_path, _state(1))
    before = _tree(tmp_path)
    with pytest.raises(FolderHoldsRunError) as err:
        check_fresh_start(tmp_path, resume=False, overwrite=False)
    message = one_line(err.value)
    assert message and "metrics.jsonl, summary.json, checkpoint.pt" in message and "resume=true" in message
    assert "overwrite=true" in message and _tree(tmp_path) == before
    assert check_fresh_start(tmp_path, resume=True, overwrite=False) is None and _tree(tmp_path) == before
    aside = check_fresh_start(tmp_path, resume=False, overwrite=True)
    assert aside.parent == tmp_path and aside.name.startswith("overwritten-")
    assert {k.removeprefix(f"{aside.name}/"): v for k, v in _tree(tmp_path).items() if k.startswith(aside.name)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([aside.name, "train.log"])
    assert check_fresh_start(tmp_path, resume=False, overwrite=False) is None  # the moved run no longer counts


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_locked_folder_is_refused_in_one_line_naming_the_holder(tmp_path):
    """While one holder has a run folder's lock, a second claim raises FolderInUseError naming the holder's pid; after release it succeeds."""
    from moe_rl.trainer.folder import FolderInUseError, folder_lock

    with folder_lock(tmp_path):
        with pytest.raises(FolderInUseError, match=rf"is in use by another run \(pid {os.getpid()}\)"), folder_lock(tmp_path):
            pass
    with folder_lock(tmp_path):
        pass


def test_overwrite_with_resume_is_refused_at_start_up():
    """overwrite=true with resume=true (two opposite wishes) is a ValueError naming both fields."""
    from tests.integration.test_train_loop import compose_config

    with pytest.raises(ValueError, match=r"overwrite=true .* resume=true"):
        compose_config(["overwrite=true", "resume=true"])


# --- outputs -----------------------------------------------------------------------------------------


def test_outputs_are_strict_json_with_nan_and_inf_as_strings():
    """to_json writes nested NaN/inf as "nan"/"inf"/"-inf" strings, which strict parsers accept."""
    text = to_json({"a": math.nan, "events": [{"value": math.inf, "threshold": -math.inf}], "ok": 1.5}, indent=2)
    assert _strict_loads(text) == {"a": "nan", "events": [{"value": "inf", "threshold": "-inf"}], "ok": 1.5}


def test_truncated_last_line_dropped_with_warning_and_corrupt_middle_line_named(tmp_path):
    """A cut-off last JSONL line is dropped with a warning naming the file; a bad earlier line raises naming file and line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rollout/rew')
    with pytest.warns(RuntimeWarning, match=r"metrics\.jsonl: dropping a truncated last line 3"):
        assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(CorruptLogError, match=r"metrics\.jsonl, line 2: not JSON"):
        read_jsonl(path)


def test_nonfinite_updates_make_one_event_per_step_naming_quantities():
    """Three skipped mini-batches in one step give one nonfinite event counting each quantity; the next step none."""
    from moe_rl.config import CollapseConfig

    det = CollapseDetector(CollapseConfig())
    det.nonfinite(3, math.nan, "train/loss")
    det.nonfinite(3, math.inf, "train/grad_norm")
    det.nonfinite(3, math.nan, "train/loss")
    metrics = {"ratio/token/max": 1.0, "ratio/token/min": 1.0, "rollout/reward/mean": 0.5,
               "rollout/entropy/mean": 1.0}
    new = det.observe(3, metrics)
    assert [(e.step, e.kind, e.detail) for e in new] == [(3, "nonfinite", {"train/loss": 2, "train/grad_norm": 1})]
    assert math.isnan(new[0].value)
    assert det.observe(4, metrics) == []


@pytest.mark.parametrize("objective, fires_on", [("grpo", "token"), ("cispo", "token"), ("gspo", "seq"),
                                                 ("gspo_token", "seq"), ("gmpo", "seq")])
def test_ratio_blowup_watches_the_ratio_the_objective_uses(objective, fires_on):
    """A token ratio of 1e4 inside sequences whose ratio stays near 1 is a blow-up for token-ratio objectives
    only; a sequence ratio of 1e4 is one for sequence-ratio objectives only."""
    from moe_rl.config import CollapseConfig
    from moe_rl.objectives import OBJECTIVES

    base = {"rollout/reward/mean": 0.5, "rollout/entropy/mean": 1.0}
    for level in ("token", "seq"):
        other = "seq" if level == "token" else "token"
        det = CollapseDetector(CollapseConfig(), ratio=OBJECTIVES[objective].ratio)
        metrics = {**base, **_extremes(level, 1e4, 0.5), **_extremes(other, 1.2, 0.9)}
        kinds = [e.kind for e in det.observe(0, metrics)]
        assert kinds == (["ratio_blowup"] if level == fires_on else []), (objective, level)
    assert "ratio" not in CollapseDetector(CollapseConfig(), ratio="seq").state_dict()


def _extremes(level: str, hi: float, lo: float, pos=(None, None), neg=(None, None)) -> dict[str, float]:
    """`ratio/<level>/{max,min}` and the per-sign extremes (pos/neg: (max, min); None = the overall one)."""
    out = {f"ratio/{level}/max": hi, f"ratio/{level}/min": lo}
    for sign, (mx, mn) in (("pos", pos), ("neg", neg)):
        out[f"ratio/{level}/{sign}_adv/max"] = hi if mx is None else mx
        out[f"ratio/{level}/{sign}_adv/min"] = lo if mn is None else mn
    return out


@pytest.mark.parametrize(
    "extremes, detail",
    [
        (_extremes("token", 5e3, 0.5, pos=(1.1, 0.5), neg=(5e3, 0.6)), {"high": 5e3, "high/neg_adv": 5e3}),
        (_extremes("token", 5e3, 0.5, pos=(5e3, 0.5), neg=(2.0, 0.6)), {"high": 5e3, "high/pos_adv": 5e3}),
        (_extremes("token", 2.0, 1e-5, pos=(2.0, 1e-5), neg=(1.5, 0.1)), {"low": 1e-5, "low/pos_adv": 1e-5}),
        (_extremes("token", 2e3, 1e-6, pos=(1.5, 1e-6), neg=(2e3, 1e-4)),
         {"high": 2e3, "high/neg_adv": 2e3, "low": 1e-6, "low/pos_adv": 1e-6, "low/neg_adv": 1e-4}),
        # only zero-advantage tokens crossed; no sign of one side present at all (NaN)
        (_extremes("token", 5e3, 0.5, pos=(2.0, 0.5), neg=(float("nan"), float("nan"))), {"high": 5e3}),
    ],
)
def test_ratio_blowup_says_which_side_and_advantage_sign_crossed(extremes, detail):
    """A ratio_blowup event's detail names each side beyond the thresholds and each side-and-sign cell that
    crossed with its extreme; value is the high extreme when it crossed; the per-cell counts follow."""
    from moe_rl.config import CollapseConfig
    from moe_rl.trainer.collapse import blowup_counts, counts_by_kind

    det = CollapseDetector(CollapseConfig(), ratio="token")
    metrics = {"rollout/reward/mean": 0.5, "rollout/entropy/mean": 1.0, **extremes, **_extremes("seq", 1.0, 1.0)}
    (event,) = det.observe(0, metrics)
    assert (event.kind, event.detail) == ("ratio_blowup", detail)
    assert event.value == detail.get("high", detail.get("low"))
    assert counts_by_kind(det.events)["collapse/kind/ratio_blowup"] == 1.0
    assert blowup_counts(det.events) == {
        f"collapse/ratio_blowup/{cell}": float(cell.replace("_", "/", 1) in detail)
        for cell in ("high_neg_adv", "low_pos_adv", "high_pos_adv", "low_neg_adv")
    }


def _fake_run(folder: Path, label: str, seed: int, rewards: list[float], *, summary: bool = True) -> None:
    """A run folder as moe-rl-train writes it (summary.json, metrics.jsonl)."""
    folder.mkdir(parents=True)
    rows = [{"step": i, "rollout/reward/mean": r, "collapse/events": 0.0} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(to_json(r) + "\n" for r in rows))
    if summary:
        (folder / "summary.json").write_text(to_json({"label": label, "seed": seed}))


def test_compare_skips_broken_runs_by_name_and_counts_seeds_honestly(tmp_path):
    """Runs without summary or with a corrupt line are skipped with warnings naming them; a NaN seed is not counted."""
    _fake_run(tmp_path / "0", "grpo (replay=off)", 0, [0.2, 0.4])
    _fake_run(tmp_path / "1", "grpo (replay=off)", 1, [math.nan, math.nan])
    _fake_run(tmp_path / "2", "grpo (replay=off)", 2, [0.1], summary=False)
    _fake_run(tmp_path / "3", "grpo (replay=off)", 3, [0.1, 0.1, 0.1])
    lines = (tmp_path / "3" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "3" / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = comparison(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    assert f"{tmp_path / '2'}: no summary.json" in messages and f"{tmp_path / '3'}: " in messages
    assert "line 2" in messages
    row = table["grpo (replay=off)"]
    assert row["seeds"] == [0, 1] and row["n/final reward"] == 1 and row["final reward"] == pytest.approx(0.3)
    assert "(1 of 2 seeds)" in format_table(table)


@pytest.mark.parametrize("command", ["moe-rl-compare", "moe-rl-analyze"])
def test_missing_sweep_path_fails_in_one_line(tmp_path, command):
    """moe-rl-compare and moe-rl-analyze on a path that does not exist exit non-zero with one line naming it."""
    import subprocess
    import sys

    module = {"moe-rl-compare": "analysis.compare", "moe-rl-analyze": "analysis.cli"}[command]
    extra = ["--out", str(tmp_path / "out")] if command == "moe-rl-analyze" else []
    proc = subprocess.run([sys.executable, "-m", module, str(tmp_path / "nope"), *extra], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "nope: no such folder" in lines[0], proc.stderr


def test_analyze_loader_skips_run_without_summary_with_warning(tmp_path):
    """load_local warns naming a run folder with metrics but no summary.json, and loads the others."""
    from analysis.load import load_local

    _fake_run(tmp_path / "good", "grpo (replay=off)", 0, [0.2])
    _fake_run(tmp_path / "killed", "grpo (replay=off)", 1, [0.2], summary=False)
    (tmp_path / "good" / "summary.json").write_text(to_json({"objective": "grpo", "replay": "off", "seed": 0}))
    with pytest.warns(RuntimeWarning, match=f"skipping {tmp_path / 'killed'}: no summary.json"):
        runs = load_local([tmp_path], progress=False)
    assert [r.source for r in runs] == [str(tmp_path / "good")]


# --- start-up validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        ("trainer.lr=inf", "trainer.lr"),
        ("trainer.lr=nan", "trainer.lr"),
        ("sampler.temperature=nan", "sampler.temperature"),
        ("objective.clip_high=nan", "objective.clip_high"),
        ("warmstart.lr=-inf", "warmstart.lr"),
        ("model.pretrained=/nonexistent/model", "model.pretrained"),
        ("logger.init_timeout_s=0", "logger.init_timeout_s"),
    ],
)
def test_non_finite_floats_and_bad_paths_are_refused_naming_the_field(override, field):
    """NaN/inf floats and a pretrained path that does not exist raise ValueError naming the field, before any compute."""
    from tests.integration.test_train_loop import compose_config

    with pytest.raises(ValueError, match=rf"^{field.replace('.', chr(92) + '.')}="):
        compose_config([override])


def test_pretrained_folder_without_model_is_refused(tmp_path):
    """A pretrained folder that exists but holds no config.json is refused naming the field."""
    from tests.integration.test_train_loop import compose_config

    with pytest.raises(ValueError, match="model.pretrained=.*no model"):
        compose_config([f"model.pretrained={tmp_path}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    """trainer.device=cuda without CUDA fails check_machine (run before any compute) naming trainer.device."""
    from moe_rl.startup import check_machine
    from tests.integration.test_train_loop import compose_config

    cfg = compose_config(["trainer.device=cuda"])  # composes and validates: a config for a GPU machine
    with pytest.raises(ValueError, match=r"trainer\.device='cuda': CUDA is not available"):
        check_machine(cfg)


def test_infinite_ratio_max_is_allowed():
    """collapse.ratio_max=inf (ratio blow-up never fires) is meaningful and accepted."""
    from tests.integration.test_train_loop import compose_config

    assert compose_config(["collapse.ratio_max=inf"]).collapse.ratio_max == math.inf


def test_reusing_processed_logprobs_under_top_p_is_refused_naming_the_fields():
    """trainer.reuse_sampler_logp=true with processed log-probs at top_p < 1 (not π_old) is refused naming both fields and the two ways out; raw, the keep mask or top_p=1 pass."""
    from tests.integration.test_train_loop import compose_config

    base = ["trainer.reuse_sampler_logp=true", "sampler.top_p=0.9"]
    with pytest.raises(ValueError, match=r"^trainer\.reuse_sampler_logp=true with sampler\.logprobs=processed") as err:
        compose_config([*base, "sampler.logprobs=processed"])
    assert "sampler.logprobs=raw" in str(err.value) and "sampler.keep_sampling_mask=true" in str(err.value)
    for ok in (["sampler.logprobs=raw"], ["sampler.logprobs=processed", "sampler.keep_sampling_mask=true"],
               ["sampler.logprobs=processed", "sampler.top_p=1.0"]):
        assert compose_config([*base, *ok]).trainer.reuse_sampler_logp
