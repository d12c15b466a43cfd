"""The RL-step benchmark: its matmul accounting is exact, and the script runs on a tiny config and writes its outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

from floor import MatmulLog, floor_seconds  # noqa: E402

TINY = ["--prompts", "2", "--group", "2", "--new-tokens", "4", "--mini-batches", "2", "--steps", "1"]
TINY += ["--threads", "1", "--layers", "2"]


def _run(tmp_path, *extra):
    out = tmp_path / "rl.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(BENCH / "rl_step.py"), *TINY, *extra, "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=900, capture_output=True)
    return out, json.loads(out.read_text())


def test_matmul_log_counts_forward_and_backward_flops():
    """A linear layer's forward is 2mkn FLOPs and its backward twice that; a bmm counts its batch."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    with MatmulLog() as log:
        torch.nn.functional.linear(x, w).sum().backward()
    assert log.flops == 3 * (2 * 3 * 4 * 5)
    with MatmulLog() as log:
        torch.bmm(torch.randn(6, 2, 3), torch.randn(6, 3, 7))
    assert log.flops == 2 * 6 * 2 * 3 * 7 and log.shapes == {(6, 2, 3, 7, torch.float32): 1}
    f = floor_seconds(log, reps=2)
    assert f["floor_s"] > 0 and f["matmul_calls"] == 1


def test_matmul_log_counts_grouped_mm_per_group():
    """grouped_mm experts are counted group by group, forward and the weight gradient alike."""
    x = torch.randn(7, 8, requires_grad=True)  # the CPU kernel needs 16-byte strides
    w = torch.randn(3, 8, 4, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # groups of 2, 0 and 5 rows
    with MatmulLog() as log:
        out = torch.nn.functional.grouped_mm(x, w, offs=offs)
        out.backward(torch.randn(out.shape))  # a dense gradient (the kernel rejects expanded strides)
    # forward 2*7*4*5; backward: input grad (7x5 @ 5x4) and weight grads (4 x rows_g @ rows_g x 5)
    assert log.flops == 3 * 2 * 7 * 8 * 4


def test_rl_step_benchmark_writes_every_section(tmp_path):
    """Tiny run: each condition's stages are positive and add up, overhead ratios and floor are reported."""
    out, report = _run(tmp_path)
    for name in ("default", "reuse_sampler_logp", "eager_experts", "replay_old"):
        s = report["stages"][name]
        assert s["step_s"] > 0 and s["sampler_tokens_per_s"] > 0 and s["train_tokens_per_s"] > 0
        assert s["sample_s"] + s["old_forward_s"] + s["train_s"] <= s["step_s"] * 1.0001
    assert (
        report["stages"]["reuse_sampler_logp"]["old_forward_s"] < report["stages"]["default"]["old_forward_s"]
    )
    o = report["overheads"]
    assert all(o[k] > 0 for k in ("sampler_record_ratio", "old_forward_record_ratio", "train_replay_ratio"))
    assert o["replay_cache_bytes_per_token"] == 2 * 2  # 2 layers x top-2 uint8 ids
    assert report["floor"]["flops"] > 0 and report["floor_distance"] > 0
    assert "| default |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_rl_step_benchmark_trl_side_by_side_and_scaling(tmp_path):
    """With TRL installed: paired step times and ratios, identical GSPO/GRPO losses, scaling table and plot."""
    pytest.importorskip("trl")
    out, report = _run(tmp_path, "--trl", "--scaling", "--no-floor", "--conditions", "default")
    t, secs = report["trl"], report["trl"]["seconds"]
    assert set(secs) == {"trl", "default", "reuse_sampler_logp"} and all(len(v) == 1 for v in secs.values())
    for name in ("default", "reuse_sampler_logp"):
        assert t["ratio"][name] == [secs["trl"][0] / secs[name][0]]
    for name in ("gspo", "grpo"):
        assert t["losses"][name]["abs_diff"] <= 1e-6 * max(1.0, abs(t["losses"][name]["trl"]))
    assert t["losses"]["gspo"]["trl"] != t["losses"]["grpo"]["trl"]  # the two objectives really differ
    assert set(report["scaling"]) == {"group", "new_tokens", "layers", "experts"}
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_async_throughput_benchmark_runs_its_blocks_in_abba_order(tmp_path):
    """Tiny run of the overlap-vs-sync benchmark: blocks in the order sync, overlap, overlap, sync (TRL left
    out), the overlapped blocks split the cores, and each ratio is of the conditions' mean throughputs."""
    out = tmp_path / "async.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(BENCH / "async_throughput.py"), "--only", "tiny", "--steps", "1", "--prompts", "2",
           "--new-tokens", "4", "--no-trl", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=900, capture_output=True)
    m = json.loads(out.read_text())["models"]["tiny"]
    assert [b["condition"] for b in m["blocks"]] == ["sync", "overlap", "overlap", "sync"]
    assert all(b["seconds"] > 0 and b["steps"] == 1 for b in m["blocks"])
    assert all(b["sampler_threads"] >= 1 for b in m["blocks"] if b["condition"] == "overlap")
    c = m["conditions"]
    assert c["sync"]["steps_per_hour"] == pytest.approx(
        sum(3600 / b["seconds"] for b in m["blocks"] if b["condition"] == "sync") / 2, rel=1e-12)
    assert m["ratio"]["overlap/sync"] == pytest.approx(c["overlap"]["steps_per_hour"] / c["sync"]["steps_per_hour"])
    assert c["overlap"]["samples_per_hour"] == pytest.approx(16 * c["overlap"]["steps_per_hour"])
    assert "| tiny | overlap/sync |" in out.with_suffix(".md").read_text()
