"""Fault injection (slow): kill -9 at seeded points, corrupted artifacts, a full disk, a malicious
checkpoint, a failing sweep cell, a killed warm-start builder, an unreachable W&B server.

Each case records what the user saw and what survived; `pytest -m slow tests/integration/test_fault_injection.py
--reliability-report docs/reliability.md` writes that table (see conftest.py).
"""

import hashlib
import io
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from analysis.compare import ComparisonTableCallback, comparison
from moe_rl.errors import RunError, one_line
from moe_rl.trainer.checkpoint import (
    CHECKPOINT,
    CORRUPT,
    MAGIC,
    PREVIOUS,
    TMP,
    CheckpointError,
    read_checkpoint,
)
from moe_rl.trainer.run import train
from moe_rl.warmstart import WarmStartConfig, warm_start_dir
from tests.integration.test_train_loop import TINY, compose_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
STEPS = 6
KILLS = 10

FORKSERVER = r"""
# Imports moe-rl once, then forks one child per request line (a kill point and moe-rl-train's arguments):
# each child is a fresh process as far as the run can tell, without paying the imports again. Nothing
# here runs a torch op before forking, so no thread pool is forked.
import hashlib, io, json, os, signal, sys, traceback
import torch
import moe_rl.trainer.checkpoint as ck
import moe_rl.trainer.checkpointer as cp
import moe_rl.trainer.logging as lg
from moe_rl.train import main

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def plant(point):
    kind, _, arg = point.partition(":")
    at = int(arg.split(",")[0]) if arg else -1
    if kind == "metrics":  # after step k's metrics line, or halfway through writing it
        log = lg.LocalLog.log
        def patched(self, s, metrics):
            if s == at and arg.endswith("half"):
                line = lg.to_json({"step": s, **metrics})
                with self.metrics_path.open("a") as f:
                    f.write(line[: len(line) // 2])
                die()
            log(self, s, metrics)
            if s == at:
                die()
        lg.LocalLog.log = patched
    elif kind == "ckpt":  # inside the write of the checkpoint after step k: a partial temp file, or between renames
        save, frac = cp.save_checkpoint, float(arg.split(",")[2]) if arg.count(",") == 2 else 0.5
        def patched(run_dir, state):
            if state["step"] != at + 1:
                return save(run_dir, state)
            buf = io.BytesIO(); torch.save(state, buf); payload = buf.getvalue()
            data = ck.MAGIC + hashlib.sha256(payload).digest() + payload
            if arg.split(",")[1] == "tmp":
                (run_dir / ck.TMP).write_bytes(data[: int(len(data) * frac)]); die()
            (run_dir / ck.TMP).write_bytes(data); os.replace(run_dir / ck.CHECKPOINT, run_dir / ck.PREVIOUS); die()
        cp.save_checkpoint = patched
    elif kind == "wandb":  # inside W&B's log of step k (its offline writer flushing)
        log = lg.Wandb.log
        def patched(self, metrics, step):
            log(self, metrics, step=step)
            if step == at:
                die()
        lg.Wandb.log = patched
    elif kind == "summary":  # after summary.json is written
        lg.NullSink.summary = lambda self, values: die()

for line in sys.stdin:
    point, log_path, argv = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1); os.dup2(fd, 2)
        code = 0
        try:
            plant(point)
            sys.argv = ["moe-rl-train", *argv]
            main()
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:
            traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _overrides(warm: list[str], run_dir: Path, *extra: str) -> list[str]:
    return ["objective=grpo", *TINY, *warm, f"trainer.steps={STEPS}", "trainer.checkpoint_every=1",
            "logger.wandb=false", *extra, f"hydra.run.dir={run_dir}"]


class _Launcher:
    """Runs moe-rl-train with a planted kill point in a fresh (forked) process; `returncode` as subprocess's."""

    def __init__(self, logs: Path):
        self.logs, self.n = logs, 0
        logs.mkdir(parents=True, exist_ok=True)
        self.server = subprocess.Popen([sys.executable, "-c", FORKSERVER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, cwd=REPO, env=ENV)

    def __call__(self, point: str, args: list[str]) -> subprocess.CompletedProcess:
        self.n += 1
        log = self.logs / f"{self.n}.log"
        self.server.stdin.write(json.dumps([point, str(log), args]) + "\n")
        self.server.stdin.flush()
        code = self.server.stdout.readline()
        assert code, "the fork server died"
        return subprocess.CompletedProcess(args, int(code), "", log.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


def _same_metrics(a: list[dict], b: list[dict]) -> bool:
    a, b = _comparable(a), _comparable(b)
    return [r["step"] for r in a] == [r["step"] for r in b] and all(
        x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def _close(x, y) -> bool:
    if isinstance(x, str) or isinstance(y, str):
        return x == y
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)


def _seen(text: str, tmp_path: Path) -> str:
    """The messages a user saw (moe-rl-train errors and warnings, without the warning's source location),
    each once, with the test's folder shortened to RUN."""
    keep: list[str] = []
    for line in text.splitlines():
        match = re.search(r"(moe-rl-train: .*|(?<=Warning: ).*)", line.strip())
        if match and match.group(1).strip() not in keep:
            keep.append(match.group(1).strip())
    return " / ".join(keep).replace(str(tmp_path), "RUN").replace(str(REPO), "REPO") or "(nothing)"


def _kill_points(seed: int = 0) -> list[str]:
    """KILLS seeded kill points in the order a run reaches them; the last one lands after summary.json."""
    rng = random.Random(seed)
    kinds = ["metrics:{},half", "metrics:{}", "wandb:{}", "ckpt:{},tmp,{:.2f}", "ckpt:{},rename"]
    candidates = [(s, i) for s in range(STEPS) for i in range(len(kinds))]
    chosen = sorted(rng.sample(candidates, KILLS - 1))
    return [kinds[i].format(s, rng.random()) for s, i in chosen] + ["summary"]


def test_kill_9_at_seeded_points_then_resume_matches_uninterrupted_run(tmp_path, warm_overrides, fault_report):
    """Ten SIGKILLs (mid-metrics-line, mid-checkpoint, between renames, in W&B, after the summary), each followed
    by resume=true, leave each step once in metrics.jsonl, equal to an uninterrupted run, and the final summary."""
    cfg = compose_config(_overrides(warm_overrides, tmp_path / "unused")[:-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the launched runs (OMP_NUM_THREADS=1): float sums depend on it
    try:
        train(cfg, tmp_path / "full")
    finally:
        torch.set_num_threads(threads)
    run_dir, seen = tmp_path / "killed", []
    points, launch = _kill_points(), _Launcher(tmp_path / "logs")
    for i, point in enumerate(points):
        extra = ["logger.wandb=true"] if point.startswith("wandb") else []
        proc = launch(point, _overrides(warm_overrides, run_dir, *extra, *(["resume=true"] if i else [])))
        assert proc.returncode == -signal.SIGKILL, f"{point}: {proc.stderr[-2000:]}"
        seen.append(_seen(proc.stderr, tmp_path))
    final = launch("none", _overrides(warm_overrides, run_dir, "resume=true"))
    launch.close()
    assert final.returncode == 0, final.stderr[-2000:]
    assert "already finished" in final.stderr
    assert _same_metrics(_rows(run_dir), _rows(tmp_path / "full"))
    summary = json.loads((run_dir / "summary.json").read_text())
    last = {k: v for k, v in _rows(run_dir)[-1].items() if k != "step" and isinstance(v, float)}
    assert summary["steps_done"] == STEPS and summary["final"].keys() == last.keys()
    fault_report(
        f"kill -9 at {KILLS} seeded points, each then `resume=true` (listed as kill point -> what the next "
        "resume printed)",
        "; ".join(f"{p} -> {m}" for p, m in zip(points, [*seen[1:], _seen(final.stderr, tmp_path)], strict=True)),
        f"metrics.jsonl holds steps 0..{STEPS - 1} once each, equal to an uninterrupted run to 1e-9; summary.json "
        "holds the final metrics",
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_kill_9_in_a_stale_run_then_resume_loses_no_trained_step(tmp_path, warm_overrides, fault_report, overlap):
    """A rollout.staleness=2 run killed -9 after step 3's metrics line resumes from its checkpoint with every
    step logged once. Deterministic: equal to an uninterrupted run (the rollouts sampled ahead were in the
    checkpoint). Overlapped: the in-flight rollouts are sampled again with the restored policy, and it says so."""
    stale = ["rollout.staleness=2", f"rollout.overlap={str(overlap).lower()}"]
    launch = _Launcher(tmp_path / "logs")
    try:
        killed = launch("metrics:3", _overrides(warm_overrides, tmp_path / "killed", *stale))
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        resumed = launch("none", _overrides(warm_overrides, tmp_path / "killed", *stale, "resume=true"))
        full = launch("none", _overrides(warm_overrides, tmp_path / "full", *stale))
    finally:
        launch.close()
    assert resumed.returncode == 0 and full.returncode == 0, resumed.stderr[-2000:] + full.stderr[-2000:]
    rows = _rows(tmp_path / "killed")
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["staleness/max"] <= 2 for r in rows)
    said = "sampled again with the restored policy" in resumed.stderr
    assert said is overlap
    if not overlap:
        assert _same_metrics(rows, _rows(tmp_path / "full"))
    fault_report(
        f"kill -9 after step 3 of a rollout.staleness=2 run ({'overlapped' if overlap else 'deterministic'}), then `resume=true`",
        _seen(resumed.stderr, tmp_path),
        f"metrics.jsonl holds steps 0..{STEPS - 1} once each"
        + ("; the in-flight rollouts were sampled again (staleness <= 2 throughout)" if overlap
           else ", equal to an uninterrupted run to 1e-9 (the rollouts sampled ahead are in the checkpoint)"),
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory, warm_overrides):
    """A finished 3-step run folder (checkpoints after every step) and its config, copied by each case."""
    folder = tmp_path_factory.mktemp("finished")
    cfg = compose_config(["objective=grpo", *TINY, *warm_overrides, "trainer.steps=3", "trainer.checkpoint_every=1",
                          "logger.wandb=false"])
    train(cfg, folder / "run")
    return folder / "run", cfg


def _copy(finished, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    return run_dir


def _train_catching(cfg, run_dir: Path):
    """train(), returning (summary or None, the one-line error or None, the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            summary, error = train(cfg, run_dir), None
        except Exception as err:  # noqa: BLE001 - the case asserts which
            summary, error = None, one_line(err)
            assert error is not None, f"not a one-line error: {err!r}"
    return summary, error, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["latest", "both", "metrics_last_line", "metrics_middle_line", "finished_resume",
                                  "changed_config", "another_runs_previous"])
def test_corrupted_artifact_resumes_or_stops_in_one_line_and_loses_nothing(tmp_path, finished, fault_report, case):
    """Each corruption resumes with a message naming what it fell back from, or stops with one line; rows kept."""
    run_dir = _copy(finished, tmp_path)
    cfg = replace(finished[1], resume=True, trainer=replace(finished[1].trainer, steps=4))
    before = _rows(run_dir)
    if case == "latest":
        _garble(run_dir / CHECKPOINT)
    elif case == "both":
        (run_dir / CHECKPOINT).write_bytes((run_dir / CHECKPOINT).read_bytes()[:1000])
        _garble(run_dir / PREVIOUS)
    elif case == "metrics_last_line":
        text = (run_dir / "metrics.jsonl").read_text()
        (run_dir / "metrics.jsonl").write_text(text + text.splitlines()[-1][:40])
    elif case == "metrics_middle_line":
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        (run_dir / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:30], *lines[2:]]) + "\n")
    elif case == "finished_resume":
        cfg = replace(cfg, trainer=finished[1].trainer)
    elif case == "another_runs_previous":  # checkpoint.prev.pt left by another run (its id), checkpoint.pt garbled
        _write_checkpoint(run_dir / PREVIOUS, {**read_checkpoint(run_dir / PREVIOUS), "run_id": "0123456789ab"})
        _garble(run_dir / CHECKPOINT)
    else:
        cfg = replace(cfg, seed=5, objective=replace(cfg.objective, clip_high=0.5))
    summary_before = (run_dir / "summary.json").read_text()
    summary, error, warned = _train_catching(cfg, run_dir)
    seen = " / ".join([*warned, *([error] if error else [])]).replace(str(tmp_path), "RUN")
    if case == "latest":
        assert summary["steps_done"] == 4 and any("resuming from the previous checkpoint" in w for w in warned)
        assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2, 3] and _rows(run_dir)[:2] == before[:2]
        what, kept = "latest checkpoint garbled", "steps before the previous checkpoint; the run goes on from it"
    elif case == "both":
        assert error and "no usable checkpoint" in error and CHECKPOINT in error and PREVIOUS in error
        assert _rows(run_dir) == before
        what, kept = "both checkpoints truncated/garbled", "metrics.jsonl, events.jsonl and summary.json unchanged"
    elif case == "metrics_last_line":
        assert any("metrics.jsonl: dropping a truncated last line" in w for w in warned)
        assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2, 3] and _rows(run_dir)[:3] == before
        what, kept = "half-written last line of metrics.jsonl", "every complete line; the run goes on"
    elif case == "metrics_middle_line":
        assert error and "metrics.jsonl, line 2: not JSON" in error and "fix or delete that line" in error
        what, kept = "a corrupt line in the middle of metrics.jsonl, on resume", "the folder unchanged"
    elif case == "finished_resume":
        assert (run_dir / "summary.json").read_text() == summary_before and summary["final"]
        assert any("already finished" in w for w in warned)
        what, kept = "`resume=true` on a finished run", "summary.json byte for byte (final metrics intact)"
    elif case == "another_runs_previous":
        assert error and "no usable checkpoint" in error and "checkpoint.prev.pt belongs to another run" in error
        assert _rows(run_dir) == before and not any("resuming from the previous" in w for w in warned)
        what, kept = ("checkpoint.pt garbled, checkpoint.prev.pt another run's (its run id)",
                      "the folder unchanged; the other run's checkpoint is never resumed from")
    else:
        assert error and "objective.clip_high (0.27 -> 0.5), seed (0 -> 5)" in error and _rows(run_dir) == before
        what, kept = "`resume=true` with a changed config (objective, seed)", "the whole folder, .hydra/ included"
    fault_report(what, seen, kept)


def _write_checkpoint(path: Path, state: dict) -> None:
    """`state` as a verified checkpoint file at `path` (save_checkpoint's format, without its rotation)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(MAGIC + hashlib.sha256(buffer.getvalue()).digest() + buffer.getvalue())


def test_resume_past_a_truncated_checkpoint_keeps_the_good_one_through_later_saves(tmp_path, finished, fault_report):
    """A resume that falls back past a truncated checkpoint.pt sets it aside, so the saves after it never rotate it over the good checkpoint.prev.pt."""
    run_dir = _copy(finished, tmp_path)
    (run_dir / CHECKPOINT).write_bytes((run_dir / CHECKPOINT).read_bytes()[:-100])
    cfg = replace(finished[1], resume=True, trainer=replace(finished[1].trainer, steps=4, checkpoint_every=0))
    summary, error, warned = _train_catching(cfg, run_dir)
    assert error is None and summary["steps_done"] == 4 and (run_dir / CORRUPT).is_file()
    assert read_checkpoint(run_dir / PREVIOUS)["step"] == 2 and read_checkpoint(run_dir / CHECKPOINT)["step"] == 4
    fault_report("truncated checkpoint.pt, resumed, then saved again",
                 " / ".join(warned).replace(str(tmp_path), "RUN"),
                 "checkpoint.prev.pt stays the good fallback (the corrupt file is kept aside as checkpoint.corrupt.pt)")


def _pretrained_folder(tmp_path: Path, name: str) -> Path:
    """A tiny Qwen3-MoE saved with save_pretrained (weights and tokenizer), to be damaged by a case."""
    from moe_rl.models import ModelConfig, build_model, build_tokenizer

    folder = tmp_path / name
    tokenizer = build_tokenizer()
    build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=2,
                            top_k=1, expert_ffn_size=32), tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class _Shell:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unloadable_pretrained_folder_is_one_line(tmp_path, monkeypatch, capsys, fault_report):
    """model.pretrained with a garbage config.json or model.safetensors exits 2 at start-up, and a pickled pytorch_model.bin exits 1 when it loads, each in one stderr line naming the folder; no pickle runs."""
    cases = {}
    bad = _pretrained_folder(tmp_path, "config")
    (bad / "config.json").write_text("{ not json")
    cases["garbage `config.json` in a `model.pretrained` folder"] = (bad, 2, "is not a JSON object")
    bad = _pretrained_folder(tmp_path, "safetensors")
    (bad / "model.safetensors").write_bytes(os.urandom(4096))
    cases["garbage `model.safetensors` in a `model.pretrained` folder"] = (bad, 2, "not a readable safetensors file")
    bad = _pretrained_folder(tmp_path, "pickle")
    (bad / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Shell(tmp_path / "MARKER")}, bad / "pytorch_model.bin")
    cases["shell-command pickle as `pytorch_model.bin` in a `model.pretrained` folder"] = (bad, 1, "could not load the model")
    from moe_rl.train import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    capsys.readouterr()  # the saves' progress bars
    for what, (folder, code, says) in cases.items():
        monkeypatch.setattr(sys, "argv", ["moe-rl-train", f"model.pretrained={folder}", "warmstart.enabled=false",
                                          "trainer.steps=1", "logger.wandb=false",
                                          f"hydra.run.dir={tmp_path / ('run-' + folder.name)}"])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
        assert exit_.value.code == code and len(lines) == 1 and says in lines[0] and str(folder) in lines[0], (what, err)
        assert not (tmp_path / ("run-" + folder.name) / "metrics.jsonl").exists()
        fault_report(what, lines[0].replace(str(tmp_path), "DIR"), f"exit status {code}; nothing trained")
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("override, says", [
    ("sampler.temperature=0", "sampler.temperature=0 samples greedily"),
    ("+trainer.stepz=3", "trainer.stepz: no such field"),
])
def test_silently_useless_config_is_refused_at_start_up(tmp_path, monkeypatch, capsys, fault_report, override, says):
    """A config that would run and learn nothing (greedy sampling) or carry an ignored key (Hydra's '+' typo hint) exits 2 in one line, before any run file."""
    from moe_rl.train import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(sys, "argv", ["moe-rl-train", override, f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and says in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    fault_report(f"`{override}`", lines[0], "exit status 2; no run files (metrics, checkpoints)")


def _tool_run(folder: Path, seed: int, rewards: list[float]) -> None:
    """A finished run folder as moe-rl-train leaves it, as far as the tools read it (summary, metrics)."""
    folder.mkdir(parents=True)
    rows = [{"step": i, "rollout/reward/mean": r, "collapse/events": 0.0} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"label": "grpo (replay=off)", "objective": "grpo",
                                                     "replay": "off", "seed": seed}))


def test_compare_and_analyze_name_each_unusable_run_and_table_the_rest(tmp_path, fault_report):
    """moe-rl-compare and moe-rl-analyze over a sweep with empty, missing, malformed and duplicated runs: one warning naming each, a table of the good seeds, no crash."""
    from analysis.cli import main as analyze_main

    sweep = tmp_path / "sweep"
    for seed in (0, 1, 2):
        _tool_run(sweep / str(seed), seed, [0.1 * seed, 0.2 * seed])
    shutil.copytree(sweep / "0", sweep / "0-copy")
    damage = {
        "empty `metrics.jsonl`": ("empty", lambda d: (d / "metrics.jsonl").write_text("")),
        "no `metrics.jsonl`": ("no-metrics", lambda d: (d / "metrics.jsonl").unlink()),
        "`summary.json` holding `{}`": ("summary-obj", lambda d: (d / "summary.json").write_text("{}")),
        "`summary.json` holding `[]`": ("summary-list", lambda d: (d / "summary.json").write_text("[]")),
        "a JSON array as a metrics line": ("array-line", lambda d: (d / "metrics.jsonl").write_text("[1, 2]\n")),
    }
    for name, change in damage.values():
        _tool_run(sweep / name, 7, [0.5])
        change(sweep / name)
    _tool_run(sweep / "no-reward", 3, [0.0])
    (sweep / "no-reward" / "metrics.jsonl").write_text('{"step": 0, "collapse/events": 0.0}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = comparison(sweep)
    said = [str(w.message) for w in caught]
    assert table["grpo (replay=off)"]["seeds"] == [0, 1, 2, 3] and table["grpo (replay=off)"]["n/final reward"] == 3
    for what, (name, _) in damage.items():
        line = next(m for m in said if f"{sweep / name}:" in m)
        fault_report(f"{what}, in `moe-rl-compare`", line.replace(str(tmp_path), "DIR"), "the table of the other runs")
    line = next(m for m in said if "0-copy" in m)
    assert "seed 0" in line and "one seed counts once" in line
    fault_report("a copied run folder (the same seed twice), in `moe-rl-compare`", line.replace(str(tmp_path), "DIR"),
                 "the seed counted once; the table of the other runs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analyze_main([str(sweep), "--out", str(tmp_path / "report"), "--no-progress"])
    said = [str(w.message) for w in caught]
    for what, (name, _) in damage.items():
        line = next(m for m in said if f"{sweep / name}" in m)
        fault_report(f"{what}, in `moe-rl-analyze`", line.replace(str(tmp_path), "DIR"), "the report of the other runs")
    assert sum("0-copy" in m and "one seed counts once" in m for m in said) == 1
    assert "| 4 |" in (tmp_path / "report" / "report.md").read_text()


def test_malicious_checkpoint_does_not_execute(tmp_path, finished, fault_report):
    """A pickle payload in checkpoint.pt (valid checksum) and checkpoint.prev.pt (old format) never runs on resume."""
    run_dir = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"step": 1, "x": Payload()}, buf)
    blob = buf.getvalue()
    (run_dir / CHECKPOINT).write_bytes(MAGIC + hashlib.sha256(blob).digest() + blob)
    (run_dir / PREVIOUS).write_bytes(blob)
    _, error, _ = _train_catching(replace(finished[1], resume=True), run_dir)
    assert error and "could not be loaded safely" in error and not marker.exists()
    fault_report("shell-command pickle in checkpoint.pt and checkpoint.prev.pt", error.replace(str(tmp_path), "RUN"),
                 "nothing executed; the folder is unchanged")


def test_full_disk_fails_in_one_line_and_keeps_previous_checkpoint(tmp_path, finished, fault_report):
    """A checkpoint write into a full disk (/dev/full) stops in one line; the last checkpoint is intact and loads."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    run_dir = _copy(finished, tmp_path)
    before = (run_dir / CHECKPOINT).read_bytes()
    (run_dir / TMP).symlink_to("/dev/full")
    orig = run_dir / TMP

    # load_checkpoint removes a stale temp file on resume; put the full-disk link back after it did.
    cfg = replace(finished[1], resume=True, trainer=replace(finished[1].trainer, steps=4))
    import moe_rl.trainer.logging as lg

    restore = lg.LocalLog.__init__

    def relink(self, run_dir_, resume_step):
        restore(self, run_dir_, resume_step)
        if not orig.is_symlink():
            orig.symlink_to("/dev/full")

    lg.LocalLog.__init__ = relink
    try:
        _, error, _ = _train_catching(cfg, run_dir)
    finally:
        lg.LocalLog.__init__ = restore
    assert error and "No space left on device" in error and "previous checkpoint is intact" in error
    assert (run_dir / CHECKPOINT).read_bytes() == before and not orig.exists()
    fault_report("disk full during a checkpoint write (`/dev/full`)", error.replace(str(tmp_path), "RUN"),
                 "checkpoint.pt byte for byte; no temporary file left")


def test_full_disk_at_the_first_checkpoint_says_there_is_none_to_resume(tmp_path, monkeypatch, fault_report):
    """A full disk at a fresh run's first checkpoint stops in one line that says there is no checkpoint to resume from (not that "the previous checkpoint is intact"), leaving no checkpoint or temporary file."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    import moe_rl.trainer.logging as lg

    run_dir = tmp_path / "run"
    restore = lg.LocalLog.__init__

    def full_disk(self, run_dir_, resume_step):  # once the run has started: the checkpoint's temp file is /dev/full
        restore(self, run_dir_, resume_step)
        (run_dir_ / TMP).symlink_to("/dev/full")

    monkeypatch.setattr(lg.LocalLog, "__init__", full_disk)
    cfg = compose_config(["objective=grpo", *TINY, "warmstart.enabled=false", "trainer.steps=1", "logger.wandb=false"])
    _, error, _ = _train_catching(cfg, run_dir)
    assert error and "No space left on device" in error and "it was the run's first" in error
    assert "previous checkpoint is intact" not in error
    assert not (run_dir / CHECKPOINT).exists() and not (run_dir / TMP).is_symlink()
    fault_report("disk full at a fresh run's first checkpoint", error.replace(str(tmp_path), "RUN"),
                 "no checkpoint (there was none); no temporary file left")


def test_corrupt_warm_start_cache_entry_is_rebuilt(tmp_path, fault_report):
    """A garbled model.safetensors in the warm-start cache is rebuilt with a warning; the run then trains."""
    cfg = compose_config([*TINY, "trainer.steps=1", "logger.wandb=false", "warmstart.target_low=0.0",
                          "warmstart.target_high=1.0", "warmstart.eval_size=8", f"warmstart.cache_dir={tmp_path / 'ws'}"])
    train(cfg, tmp_path / "a")
    entry = Path(json.loads((tmp_path / "a" / "summary.json").read_text())["warmstart_path"])
    _garble(entry / "model.safetensors")
    summary, error, warned = _train_catching(cfg, tmp_path / "b")
    assert error is None and summary["steps_done"] == 1 and any("corrupt or incomplete: rebuilding" in w for w in warned)
    fault_report("garbled `model.safetensors` in the warm-start cache",
                 " / ".join(warned).replace(str(tmp_path), "RUN"), "the entry is rebuilt (same key); the run trains")


def test_sweep_with_one_bad_cell_keeps_the_others_and_exits_non_zero(tmp_path, warm_overrides, fault_report, capfd):
    """A 4-job sweep whose third cell has trainer.lr=nan: three jobs finish and get a table, the bad one leaves failed.json and is named in one line (no traceback), exit != 0."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "moe_rl.train", "-m", "objective=grpo", *TINY, *warm_overrides, "trainer.steps=1", "logger.wandb=false",
            "trainer.lr=1e-4,2e-4,nan,3e-4", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode != 0
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    done = [j for j in jobs if (j / "summary.json").exists()]
    failed = [j for j in jobs if (j / "failed.json").exists()]
    assert len(done) == 3 and [j.name for j in failed] == ["2"]
    assert "trainer.lr=nan" in json.loads((failed[0] / "failed.json").read_text())["error"]
    assert "Traceback" not in proc.stderr and "sweep job 2 failed: ValueError: trainer.lr=nan" in proc.stderr
    table = (sweep / "comparison.md").read_text()
    assert all(f"trainer.lr={lr} | 1 |" in table for lr in ("0.0001", "0.0002", "0.0003")), table
    (sweep / "comparison.md").unlink()  # blind (a pre-registered sweep): counts only, the bad job still named
    with pytest.raises(SystemExit) as stop:
        ComparisonTableCallback(blind=True).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    out, err = capfd.readouterr()
    assert stop.value.code == 1 and "3 run(s) finished (blind" in out and "lr=" not in out
    assert "sweep job 2 failed" in err and not (sweep / "comparison.md").exists()
    fault_report("4-job sweep, one cell with `trainer.lr=nan`",
                 " / ".join(line for line in proc.stderr.splitlines() if line.startswith("moe-rl-train:")),
                 "the 3 good jobs' folders and summaries, and their comparison table; `failed.json` in the bad "
                 "one; exit status 1")


BUILDER = """
import sys
import moe_rl.warmstart as ws
import moe_rl.warmstart.build as build
from moe_rl.models import ModelConfig

acquire = build.acquire_lock
def announced(path):  # tell the test which process holds the lock, the moment it does
    lock = acquire(path)
    print("locked", flush=True)
    return lock
build.acquire_lock = announced
cfg = ws.WarmStartConfig(target_low=0.0, target_high=1.0, eval_size=512, cache_dir=sys.argv[1])
r = ws.warm_start(ModelConfig(), "arithmetic", 1, cfg, seed=0, progress=False)
print("cached" if r.cached else "built", flush=True)
"""


def _first_line(procs: list[subprocess.Popen], timeout_s: float) -> subprocess.Popen:
    """The first of `procs` to write a line to stdout (read unbuffered, so no line hides in a buffer)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([p.stdout for p in procs], [], [], left)
        for p in procs:
            if p.stdout in ready:
                return p
    raise AssertionError(f"no builder took the lock within {timeout_s:.0f} s")


def test_killed_warm_start_builder_leaves_the_other_to_build_one_result(tmp_path, fault_report):
    """Two processes build one warm start; the one holding the lock is SIGKILLed: the other builds it, once, whole."""
    cfg = WarmStartConfig(target_low=0.0, target_high=1.0, eval_size=512, cache_dir=str(tmp_path))
    from moe_rl.models import ModelConfig

    final = warm_start_dir(ModelConfig(), "arithmetic", 1, cfg, 0)
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)], stdout=subprocess.PIPE, bufsize=0,
                              cwd=REPO, env=ENV) for _ in range(2)]
    killed = _first_line(procs, timeout_s=300)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    survivor = next(p for p in procs if p is not killed)
    out = survivor.communicate(timeout=600)[0].decode().split()
    assert survivor.returncode == 0 and out[-1] in ("built", "cached")
    assert (final / "warmstart.json").is_file() and not list(tmp_path.glob(".*.tmp-*"))
    fault_report("two runs build one warm start; the builder is killed -9 mid-build",
                 f"the other process takes the lock and {'builds' if out[-1] == 'built' else 'loads'} the entry",
                 "one complete, checksummed cache entry; no temporary directory left")


def test_unreachable_wandb_server_gives_up_within_the_timeout(tmp_path, fault_report):
    """An online W&B start against a server that does not answer gives up after init_timeout_s with one warning."""
    code = (
        "import sys, time, warnings; from pathlib import Path\n"
        "from moe_rl.trainer.logging import open_wandb\n"
        "t = time.perf_counter()\n"
        "wb = open_wandb(Path(sys.argv[1]), {}, mode='online', project='p', entity=None, group='g', name='n',"
        " tags=[], init_timeout_s=3.0)\n"
        "print(type(wb).__name__, time.perf_counter() - t)\n"
    )
    env = {**ENV, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40, "WANDB_MODE": "online"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)
    name, seconds = proc.stdout.split()
    assert name == "NullSink" and float(seconds) < 30, proc.stderr  # W&B's own default waits 90 s
    warning = next(line for line in proc.stderr.splitlines() if "W&B could not start" in line)
    fault_report("W&B server not answering (`logger.init_timeout_s=3`)",
                 re.sub(r"^.*UserWarning: ", "", warning) + f" (after {float(seconds):.0f} s)",
                 "training goes on with local logs only")


def test_both_checkpoints_corrupt_is_one_line_on_the_console(tmp_path, finished, fault_report):
    """Through moe-rl-train, an unusable checkpoint pair exits 1 with one stderr line naming both files."""
    run_dir = _copy(finished, tmp_path)
    for name in (CHECKPOINT, PREVIOUS):
        (run_dir / name).write_bytes(b"\x00" * 100)
    args = [sys.executable, "-m", "moe_rl.train", "objective=grpo", *TINY, "trainer.steps=3", "trainer.checkpoint_every=1",
            "logger.wandb=false", "resume=true", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=ENV)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "no usable checkpoint" in lines[0], proc.stderr[-2000:]
    assert isinstance(CheckpointError("x"), RunError)
    fault_report("both checkpoints zeroed, through `moe-rl-train resume=true`", lines[0].replace(str(tmp_path), "RUN"),
                 "exit status 1, the folder unchanged")


# --- run folders that protect their data (moe_rl/trainer/folder.py) -------------------------------------

CLI = [sys.executable, "-m", "moe_rl.train", "objective=grpo", *TINY, "warmstart.enabled=false", "logger.wandb=false"]


def _run_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder (relative path -> bytes), .hydra/ included, less the lock's bookkeeping."""
    from moe_rl.trainer.folder import BOOKKEEPING

    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in BOOKKEEPING}


def _stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cli_finished(tmp_path_factory):
    """A 2-step run folder written by moe-rl-train itself (.hydra/ included), checkpoints after every step."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = subprocess.run([*CLI, "trainer.checkpoint_every=1", f"hydra.run.dir={run_dir}"], capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def test_second_run_into_a_locked_folder_exits_in_one_line_and_writes_nothing(tmp_path, fault_report):
    """While a run holds its folder, a second moe-rl-train into it exits 1 in one stderr line naming the holder's pid, and the first run's metrics.jsonl holds each of its steps once, in order."""
    from moe_rl.trainer.folder import OWNER

    run_dir = tmp_path / "run"
    first = subprocess.Popen([*CLI, "trainer.steps=1000", f"hydra.run.dir={run_dir}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / OWNER).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and (run_dir / OWNER).exists(), "the first run never took its folder's lock"
        second = subprocess.run([*CLI, f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300,
                                env=ENV)
        assert first.poll() is None, "the first run ended before the second was refused: not a concurrent case"
    finally:
        first.kill()
        first.wait()
    lines = _stderr_lines(second)
    assert second.returncode == 1 and len(lines) == 1, second.stderr[-2000:]
    assert f"is in use by another run (pid {first.pid})" in lines[0]
    steps = [r["step"] for r in _rows(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
    assert steps == list(range(len(steps)))
    fault_report("a second `moe-rl-train` into the folder of a run in progress (same `hydra.run.dir`)",
                 lines[0].replace(str(tmp_path), "RUN").replace(str(first.pid), "PID"),
                 "the running run's files; its metrics.jsonl holds each step once, in order")


def test_two_runs_started_together_get_folders_of_their_own(tmp_path, fault_report):
    """Two plain moe-rl-train runs started at the same moment (Hydra's default run folder) write two folders, each named with its pid and holding steps 0 and 1 once."""
    procs = [subprocess.Popen(CLI, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
             for _ in range(2)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    folders = sorted((tmp_path / "outputs" / "default").iterdir())
    assert sorted(f.name.rsplit("_", 1)[1] for f in folders) == sorted(str(p.pid) for p in procs)
    assert all([r["step"] for r in _rows(f)] == [0, 1] for f in folders)
    stamps = {f.name.rsplit("_", 1)[0] for f in folders}
    fault_report("two plain `moe-rl-train` runs started at once (default run folder)",
                 "(nothing): each run writes `outputs/default/<time>_<pid>`"
                 + (" (both started in the same second here)" if len(stamps) == 1 else ""),
                 "both runs, each in its own folder with steps 0, 1 once")


def test_fresh_run_into_a_finished_folder_is_refused_and_overwrite_keeps_the_old_run(tmp_path, cli_finished, fault_report):
    """A fresh run into a finished run's folder exits 1 in one line and changes no file; with overwrite=true the old files (checkpoints included) move to overwritten-*/ byte for byte, and the new run's checkpoints are all its own."""
    run_dir = tmp_path / "run"
    shutil.copytree(cli_finished, run_dir)
    before = _run_files(run_dir)
    proc = subprocess.run([*CLI, "trainer.steps=3", f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=600, env=ENV)
    lines = _stderr_lines(proc)
    assert proc.returncode == 1 and len(lines) == 1 and "already holds a run" in lines[0], proc.stderr[-2000:]
    assert "resume=true" in lines[0] and "overwrite=true" in lines[0] and _run_files(run_dir) == before
    over = subprocess.run([*CLI, "trainer.steps=3", "trainer.checkpoint_every=1", "overwrite=true",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=ENV)
    assert over.returncode == 0, over.stderr[-2000:]
    (aside,) = run_dir.glob("overwritten-*")
    moved = {k.removeprefix(f"{aside.name}/"): v for k, v in _run_files(run_dir).items() if k.startswith(aside.name)}
    assert moved == before
    new_id = json.loads((run_dir / "summary.json").read_text())["run_id"]
    assert new_id != json.loads(before["summary.json"])["run_id"]
    assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2]
    assert {read_checkpoint(run_dir / n)["run_id"] for n in (CHECKPOINT, PREVIOUS)} == {new_id}
    fault_report("a fresh run (no `resume`) into a finished run's folder; then the same with `overwrite=true`",
                 lines[0].replace(str(tmp_path), "RUN") + " / then: "
                 + " / ".join(_seen(over.stderr, tmp_path).split(" / ")),
                 "every file, byte for byte; with `overwrite=true` moved into `RUN/run/overwritten-<time>/`, and the "
                 "new run's checkpoints carry only its own run id")


def test_resume_of_a_finished_run_without_checkpoints_changes_nothing(tmp_path, cli_finished, fault_report):
    """A finished run whose checkpoints were deleted (or that moe-rl-archive unpacked), through moe-rl-train
    resume=true: exit 0, nothing trained and every file byte for byte; with a changed seed, refused in one
    line (exit 1), the files again unchanged."""
    run_dir = tmp_path / "run"
    shutil.copytree(cli_finished, run_dir)
    for name in (CHECKPOINT, PREVIOUS):
        (run_dir / name).unlink()
    before = _run_files(run_dir)
    args = [*CLI, "trainer.checkpoint_every=1", "resume=true", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0 and "(its checkpoints are gone): nothing to resume" in proc.stderr, proc.stderr[-2000:]
    assert _run_files(run_dir) == before
    refused = subprocess.run([*args, "seed=5"], capture_output=True, text=True, timeout=600, env=ENV)
    lines = _stderr_lines(refused)
    assert refused.returncode == 1 and len(lines) == 1 and "differs from that of the finished run" in lines[0]
    assert "seed (0 -> 5)" in lines[0] and _run_files(run_dir) == before
    fault_report("`moe-rl-train resume=true` on a finished run whose checkpoints are gone (deleted, or unpacked by "
                 "`moe-rl-archive`); then with seed=5", _seen(proc.stderr, tmp_path) + " / then: "
                 + lines[0].replace(str(tmp_path), "RUN"), "every file of the folder byte for byte; nothing trained")


@pytest.mark.parametrize("case", ["changed_config", "bad_config"])
def test_refused_resume_changes_nothing_on_disk(tmp_path, cli_finished, fault_report, case):
    """Through moe-rl-train, a resume refused for a changed config (exit 1) or a bad value (exit 2) prints one line and leaves every file of the folder, .hydra/ included, byte for byte."""
    run_dir = tmp_path / "run"
    shutil.copytree(cli_finished, run_dir)
    before = _run_files(run_dir)
    assert ".hydra/overrides.yaml" in before and "trainer.checkpoint_every=1" in before[".hydra/overrides.yaml"].decode()
    extra = ["seed=5"] if case == "changed_config" else ["trainer.lr=nan"]
    proc = subprocess.run([*CLI, "trainer.checkpoint_every=1", "trainer.steps=3", "resume=true", *extra,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=ENV)
    lines = _stderr_lines(proc)
    assert proc.returncode == (1 if case == "changed_config" else 2) and len(lines) == 1, proc.stderr[-2000:]
    assert ("resume=true refused" if case == "changed_config" else "trainer.lr=nan") in lines[0]
    assert _run_files(run_dir) == before
    fault_report(f"`moe-rl-train resume=true` refused ({'seed changed' if case == 'changed_config' else 'trainer.lr=nan'})",
                 lines[0].replace(str(tmp_path), "RUN"), "every file of the folder byte for byte, .hydra/ included")


def test_pickle_planted_in_the_warm_start_cache_is_named_as_the_cache_entry(tmp_path, fault_report):
    """A cache entry whose weights were swapped for a shell-command pickle (checksums rewritten to match) stops the run in one line naming the warm-start cache entry, not model.pretrained; the pickle never runs and torch's pickle-protocol warning is not shown."""
    cfg = compose_config([*TINY, "trainer.steps=1", "logger.wandb=false", "warmstart.target_low=0.0",
                          "warmstart.target_high=1.0", "warmstart.eval_size=8", f"warmstart.cache_dir={tmp_path / 'ws'}"])
    train(cfg, tmp_path / "a")
    entry = Path(json.loads((tmp_path / "a" / "summary.json").read_text())["warmstart_path"])
    marker = tmp_path / "pwned"
    (entry / "model.safetensors").unlink()
    torch.save({"x": _Shell(marker)}, entry / "pytorch_model.bin")
    meta = json.loads((entry / "warmstart.json").read_text())
    meta["sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(entry.iterdir())
                      if p.is_file() and p.name != "warmstart.json"}
    (entry / "warmstart.json").write_text(json.dumps(meta))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, error, _ = _train_catching(cfg, tmp_path / "b")
    assert error and error.startswith(f"the warm-start cache entry {entry} (delete it to rebuild it): could not load")
    assert "model.pretrained" not in error and not marker.exists()
    assert not any("pickle protocol" in str(w.message) for w in caught)
    fault_report("a shell-command pickle planted in a warm-start cache entry (checksums rewritten to match)",
                 error.replace(str(tmp_path), "RUN"), "nothing executed; the run stops before any step")
