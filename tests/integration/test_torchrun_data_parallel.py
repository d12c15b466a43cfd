"""Data-parallel RL under torchrun (CPU, gloo, 2 processes): ranks agree, 2 processes train as 1, resume, failures.

The multi-process tests are slow (each torchrun start imports torch and transformers twice on a shared
CPU). Tolerance of 2 processes vs 1 (same seed and global batch), measured on CPU over 4 steps at lr
1e-3: identical completions, rewards, clip and expert-change fractions; losses within 5e-5 and gradient
norms within 1.2e-5 (relative); parameters within 3.3e-5 (absolute; Adam amplifies reduction-order noise
in nearly-cancelling gradients). The tests assert 1e-4.
"""

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_rl.config import TrainerConfig
from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout import SamplerConfig, sample
from moe_rl.startup import check_world
from moe_rl.trainer.checkpoint import read_checkpoint
from moe_rl.trainer.distributed import minibatch_rows
from moe_rl.trainer.run import train
from tests.integration.test_train_loop import TINY, comparable, compose_config, read_metrics

TOL = 1e-4
DP = [
    "objective=grpo",
    "trainer.steps=4",
    "trainer.checkpoint_every=1",
    "trainer.lr=1e-3",
    "logger.wandb=false",
    "trainer.dist_timeout_s=60",
]


def test_minibatches_split_evenly_over_ranks():
    """Mini-batches partition the rows, and any rank owning whole runs of M rows holds B / (M W) of each."""
    B, M = 32, 4
    rows_MC = minibatch_rows(B, M, torch.Generator().manual_seed(0))
    assert sorted(rows_MC.flatten().tolist()) == list(range(B))
    for world in (1, 2, 4, 8):
        for rank in range(world):
            lo, hi = rank * B // world, (rank + 1) * B // world
            counts = ((rows_MC >= lo) & (rows_MC < hi)).sum(1)
            assert counts.tolist() == [B // (M * world)] * M


def test_group_minibatches_hold_whole_groups_and_unit_one_is_unchanged():
    """With unit = G every group lies whole in one mini-batch, each holding P / M groups and any rank owning
    whole runs an equal share; unit = 1 draws exactly the rows it always drew."""
    P, G, M = 8, 4, 4
    rows_MC = minibatch_rows(P * G, M, torch.Generator().manual_seed(0), unit=G)
    assert sorted(rows_MC.flatten().tolist()) == list(range(P * G))
    groups_M = [set((rows_MC[j] // G).tolist()) for j in range(M)]
    assert all(len(g) == P // M for g in groups_M) and set().union(*groups_M) == set(range(P))
    for world in (1, 2):
        for rank in range(world):
            lo, hi = rank * P * G // world, (rank + 1) * P * G // world
            assert ((rows_MC >= lo) & (rows_MC < hi)).sum(1).tolist() == [P * G // (M * world)] * M
    order_CM = torch.rand(P * G // M, M, generator=torch.Generator().manual_seed(0)).argsort(dim=1)
    legacy = (order_CM + torch.arange(0, P * G, M).unsqueeze(1)).T
    assert torch.equal(minibatch_rows(P * G, M, torch.Generator().manual_seed(0)), legacy)


def test_sampler_rows_reproduce_the_whole_batch(tokenizer):
    """Sampling two halves of a batch (rows=...) gives the same completions as sampling it whole."""
    model = build_model(ModelConfig(num_layers=2), tokenizer)
    prompts = ["1+2=", "13-1=", "4+4=", "9-5=", "7+7=", "2-8="]
    cfg = SamplerConfig(max_new_tokens=6)
    whole = sample(model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(3))
    halves = [
        sample(model, tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(3), rows=rows)
        for rows in (slice(0, 3), slice(3, 6))
    ]
    assert halves[0].texts + halves[1].texts == whole.texts
    R = [h.logp_BR.shape[1] for h in halves]
    torch.testing.assert_close(
        torch.cat([halves[0].logp_BR[:, : min(R)], halves[1].logp_BR[:, : min(R)]]),
        whole.logp_BR[:, : min(R)],
    )


def test_step_scalars_reduce_by_the_kind_they_carry():
    """The step's own scalars reduce over ranks by the reduction attached to each value (no name list):
    a mean weighted by each rank's rows, tokens or positions (a rank's NaN counts for nothing), the max of
    stage times, the sum of throughputs and byte counts."""
    from moe_rl import reduction as S

    ranks = [
        {"routing/load_cv/mean": S.weighted(1.0, 4.0), "mismatch/logp_abs_diff/mean": S.weighted(1.0, 1.0),
         "routing/entropy/mean": S.weighted(2.0, 2.0), "minibatch/sibling_frac": S.weighted(float("nan"), 4.0),
         "time/step_s": S.Stat("max", (3.0,)), "throughput/tokens_per_s": S.Stat("sum", (10.0,)),
         "routing/replay_cache_bytes": S.Stat("sum", (4.0,))},
        {"routing/load_cv/mean": S.weighted(3.0, 4.0), "mismatch/logp_abs_diff/mean": S.weighted(2.0, 3.0),
         "routing/entropy/mean": S.weighted(4.0, 6.0), "minibatch/sibling_frac": S.weighted(0.5, 4.0),
         "time/step_s": S.Stat("max", (4.0,)), "throughput/tokens_per_s": S.Stat("sum", (20.0,)),
         "routing/replay_cache_bytes": S.Stat("sum", (4.0,))},
    ]
    assert S.values(S.combine(ranks)) == {
        "routing/load_cv/mean": 2.0,
        "mismatch/logp_abs_diff/mean": 1.75,
        "routing/entropy/mean": 3.5,
        "minibatch/sibling_frac": 0.5,
        "time/step_s": 4.0,
        "throughput/tokens_per_s": 30.0,
        "routing/replay_cache_bytes": 8.0,
    }
    assert math.isnan(S.values(S.combine([ranks[0]]))["minibatch/sibling_frac"])


SHARE_KEYS = ("policy/grad_weight/sum", "policy/extreme_grad_weight/sum", "policy/extreme_weight_share")
SIGN_KEYS = tuple(f"ratio/{lv}/{sg}_adv/{ext}" for lv in ("token", "seq") for sg in ("pos", "neg") for ext in ("max", "min"))


def _pooled(name: str) -> dict[str, float]:
    """One objective call on all 8 rows of `weight_batch`: the statistics a reduction must reproduce."""
    from moe_rl.objectives import OBJECTIVES
    from tests.helpers.dp_weight_share_worker import CLIP, weight_batch

    return OBJECTIVES[name](*weight_batch(), **CLIP)[1]


@pytest.mark.parametrize("name", ["cispo", "gmpo", "grpo", "gspo", "gspo_token"])
def test_weight_share_and_sign_extremes_reduce_exactly_over_ranks_and_minibatches(name):
    """Two ranks x two mini-batches reduced as the step reduces them give the extreme-weight share of all
    rows pooled (a ratio of sums, not a mean of shares) and the pooled per-sign ratio extremes, even where
    one rank has no token of a sign (NaN there)."""
    from moe_rl import reduction as S
    from moe_rl.objectives import OBJECTIVES
    from tests.helpers.dp_weight_share_worker import CLIP, rows, weight_batch

    logp_BT, old_BT, adv_B, mask_BT = weight_batch()
    per_mb, shares, per_rank_mb0 = [], [], []
    for j in range(2):
        ms, stats = [], []
        for rank in range(2):
            sl = rows(j, rank, 2)
            _, st = OBJECTIVES[name].compute(OBJECTIVES[name].inputs(logp_BT[sl], old_BT[sl], adv_B[sl], mask_BT[sl], **CLIP))
            stats.append(S.to_floats(st))
            ms.append(S.values(st))
            shares.append(ms[-1]["policy/extreme_weight_share"])
        per_mb.append(S.combine(stats))  # as the step pools a mini-batch over ranks
        per_rank_mb0 = per_rank_mb0 or ms
    got, want = {**S.values(S.over_updates(per_mb)), **S.values(S.extremes(per_mb))}, _pooled(name)
    assert math.isnan(per_rank_mb0[0]["ratio/token/neg_adv/max"])  # rank 0's first rows: no negative advantage
    assert 0 < want["policy/extreme_weight_share"] < 1
    for key in SHARE_KEYS + SIGN_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-12), key
    naive = statistics.fmean(x for x in shares if not math.isnan(x))
    assert abs(naive - want["policy/extreme_weight_share"]) > 1e-3, "the case must tell a ratio of sums apart"


@pytest.mark.slow
def test_weight_share_and_sign_extremes_match_one_process_under_torchrun(tmp_path):
    """torchrun with 2 gloo processes reduces every objective's extreme-weight sums, share and per-sign
    ratio extremes to exactly the 1-process values on the same rows."""
    from tests.helpers.dp_weight_share_worker import step_metrics

    out = tmp_path / "out.json"
    worker = Path(__file__).parents[1] / "helpers" / "dp_weight_share_worker.py"
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    two = json.loads(out.read_text())
    for name, got in two.items():
        one = step_metrics(name, 0, 1, lambda obj: [obj])
        assert 0 < one["policy/extreme_weight_share"] < 1, name
        for key in SHARE_KEYS + SIGN_KEYS:
            assert got[key] == pytest.approx(one[key], rel=1e-12, nan_ok=True), (name, key)


def test_uneven_split_over_ranks_is_refused():
    """A batch that cannot be split into whole groups and equal mini-batch shares names the field."""
    with pytest.raises(ValueError, match="prompts_per_step"):
        check_world(TrainerConfig(prompts_per_step=3), 2)
    with pytest.raises(ValueError, match="mini_batches"):
        check_world(TrainerConfig(prompts_per_step=4, group_size=2, mini_batches=8), 2)
    check_world(TrainerConfig(prompts_per_step=4, group_size=2, mini_batches=4), 1)


def launch_torchrun(run_dir: Path, overrides: list[str], nproc: int = 2, **popen) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "moe_rl.train",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def run_torchrun(run_dir: Path, overrides: list[str], nproc: int = 2) -> dict:
    proc = launch_torchrun(run_dir, overrides, nproc)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(run_dir / "checkpoint.pt")["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_overrides):
    """The same 4-step run with 1 process (in-process) and 2 processes (torchrun)."""
    root = tmp_path_factory.mktemp("dp")
    overrides = [*TINY, *warm_overrides, *DP, "eval.at_start=true"]
    train(compose_config(overrides), root / "one")
    two = run_torchrun(root / "two", overrides)
    return root, overrides, two


CONTINUOUS = ("train/loss", "train/grad_norm", "ratio/token/mean", "policy/approx_kl", "rollout/entropy/mean",
              "policy/grad_weight/sum", "routing/logit_shift/after_one_update", "routing/margin/predicted_change")
DISCRETE = ("clip/token_frac", "routing/expert_change/frac", "routing/expert_change/layer_0",
            "routing/margin/median", "routing/margin/p10", "routing/margin/frac_below_0.1",
            "routing/margin/layer_0")


@pytest.mark.slow
def test_two_processes_keep_ranks_identical_and_match_one_process(runs):
    """After 4 steps both ranks hold bitwise identical parameters, and the 2-process run samples the same
    completions as a 1-process run with the same global batch and seed; losses, gradient norms, token
    ratios agree within 1e-4 and 99% of parameters do (all within 1e-3), step 0's clip and expert-change fractions and router margins
    (pooled over ranks, so exact order statistics) are equal, and so are step 0's per-length ratio
    statistics (summed over ranks: equal to 1e-5, float32 ratios and moments; an empty bin NaN in both) and the pre-update evaluation
    (eval/initial/*)."""
    root, _, two = runs
    assert two["world_size"] == 2
    assert two["param_checksum_by_rank"][0] == two["param_checksum_by_rank"][1]
    one_rows, two_rows = read_metrics(root / "one"), read_metrics(root / "two")
    assert [r["step"] for r in two_rows] == [0, 1, 2, 3]
    for a, b in zip(one_rows, two_rows, strict=True):
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        assert a["rollout/response_len/mean"] == b["rollout/response_len/mean"]
        for key in CONTINUOUS:
            assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), key
    for key in DISCRETE:  # later steps may flip a near-tie once parameters differ by float noise
        assert two_rows[0][key] == pytest.approx(one_rows[0][key], rel=1e-6), key
    for key in ("eval/initial/expected_accuracy", "eval/initial/accuracy_greedy"):  # every rank evaluates all
        assert two_rows[0][key] == pytest.approx(one_rows[0][key], rel=1e-6), key
    length_keys = [k for k in one_rows[0] if k.startswith("length/")]
    assert {k for k in two_rows[0] if k.startswith("length/")} == set(length_keys)
    assert sum(one_rows[0][k] for k in length_keys if k.endswith("/seqs")) > 0
    for key in length_keys:
        a, b = one_rows[0][key], two_rows[0][key]
        # Not bitwise: token_var moved even between two 1-process runs (0.0118393780 vs 0.0118393764), so
        # the float32 ratios differ at rounding before any reduction over ranks, and the cancellation in
        # r1_sq/N − (r1/N)² amplifies that (measured 1.5-1.7e-6 relative against 2 processes).
        assert a == b == "nan" or b == pytest.approx(a, rel=1e-5, abs=1e-9), key
    one, two_p = _params(root / "one"), _params(root / "two")
    init = build_model(
        replace(
            ModelConfig(),
            pretrained=json.loads((root / "one" / "summary.json").read_text())["warmstart_path"],
        )
    ).state_dict()
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    assert moved > 30 * TOL, "the run should move the parameters well beyond the tolerance"
    # AdamW divides by sqrt(v): on a weight whose gradients are near 0, float noise from the reduction order
    # moves the step by up to ~lr, so a few such weights differ by more than TOL (measured: 15 of 1024 in
    # one matrix, at most 1.7e-4, lr 1e-3); a broken data-parallel step would move most weights apart.
    diff = torch.cat([(two_p[k].float() - one[k].float()).abs().flatten() for k in one])
    assert float((diff > TOL).double().mean()) < 0.01 and float(diff.max()) < 10 * TOL


@pytest.mark.slow
def test_two_process_run_resumes_to_the_same_metrics(runs):
    """A 2-process run stopped after 2 steps and resumed (both ranks load the checkpoint) logs what the
    uninterrupted 2-process run logs, and its ranks still agree."""
    assert_stopped_run_resumes(*runs)


def assert_stopped_run_resumes(root: Path, overrides: list[str], two: dict) -> None:
    """The 2-process run of `overrides` stopped after 2 steps and resumed logs what the uninterrupted one in
    root / "two" (whose summary is `two`) logged, and its ranks end as that run's did."""
    cut = root / "cut"
    run_torchrun(cut, [*overrides, "trainer.steps=2"])
    resumed = run_torchrun(cut, [*overrides, "resume=true"])
    assert comparable(read_metrics(cut)) == comparable(read_metrics(root / "two"))
    assert resumed["param_checksum_by_rank"] == two["param_checksum_by_rank"]


@pytest.mark.slow
def test_two_processes_train_on_stale_rollouts_as_one_process_does(tmp_path, warm_overrides):
    """rollout.staleness=1 (deterministic) under torchrun: each rank samples its shard one step ahead, and the
    2-process run logs the 1-process run's rewards, staleness and (within TOL) losses and token ratios for the
    same global batch; its ranks end bitwise identical."""
    overrides = [*TINY, *warm_overrides, *DP, "trainer.steps=3", "rollout.staleness=1", "routing.replay=rollout"]
    train(compose_config(overrides), tmp_path / "one")
    two = run_torchrun(tmp_path / "two", overrides)
    assert two["param_checksum_by_rank"][0] == two["param_checksum_by_rank"][1]
    one_rows, two_rows = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["staleness/max"] for r in two_rows] == [r["staleness/max"] for r in one_rows] == [0, 1, 1]
    for a, b in zip(one_rows, two_rows, strict=True):
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        for key in ("train/loss", "ratio/token/mean", "mismatch/logp_abs_diff/mean"):
            assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), key
    assert two_rows[1]["routing/expert_change/vs_sampler"] == pytest.approx(
        one_rows[1]["routing/expert_change/vs_sampler"], rel=1e-6)


@pytest.mark.slow
def test_fsdp_two_processes_match_one_process(runs):
    """FSDP2 over 2 gloo processes (lock-step sampling, sharded AdamW) trains as the 1-process run does, and
    exports the full (gathered) weights to policy/."""
    root, overrides, _ = runs
    fsdp = root / "fsdp"
    run_torchrun(fsdp, [*overrides, "trainer.steps=2", "trainer.parallel=fsdp"])
    for a, b in zip(read_metrics(root / "one")[:2], read_metrics(fsdp), strict=True):
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        for key in ("train/loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), key
    saved = _params(fsdp)
    assert set(saved) == set(_params(root / "one")), "rank 0 saves the full, unsharded state dict"
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(fsdp / "policy").state_dict()
    assert all(torch.equal(policy[k], saved[k]) for k in saved), "policy/ holds the gathered full weights"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by torchrun, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_pids(launcher: int) -> dict[int, int]:
    """torchrun's worker processes by rank, read from /proc (children and their RANK variable)."""
    pids = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                pids[int(rank[0][5:])] = int(child)
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_failed_rank_ends_the_job_with_a_clear_error(tmp_path, warm_overrides, fault):
    """A rank killed (SIGKILL) or frozen (SIGSTOP) mid-run ends the whole job with a non-zero exit and an
    error naming the failure; frozen, the other rank ends on its own by the 3 s collective timeout (the
    test then kills the frozen one rather than wait out torchrun's fixed 30 s grace)."""
    run_dir = tmp_path / fault
    proc = launch_torchrun(
        run_dir,
        [
            *TINY,
            *warm_overrides,
            *DP,
            "trainer.steps=1000",
            "trainer.checkpoint_every=0",
            "trainer.dist_timeout_s=3",
        ],
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.time() < deadline, "the run never logged a step"
        time.sleep(0.2)
    workers = worker_pids(proc.pid)
    os.kill(workers[1], signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
    t0 = time.time()
    try:
        if fault == "hangs":
            # Rank 0 must end on its own, by the collective timeout. torchrun then waits a fixed 30 s grace
            # for the frozen rank before killing it; do that kill as soon as rank 0 is gone instead.
            while _alive(workers[0]) and time.time() - t0 < 120:
                time.sleep(0.1)
            assert not _alive(workers[0]), "rank 0 did not end after the collective timeout"
            os.kill(workers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        for pid in workers.values():  # never leave a stopped worker behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.time() - t0 < 120
    if fault == "dies":
        assert "rank      : 1" in out and "SIGKILL" in out, out[-3000:]
    else:
        assert "did not answer within trainer.dist_timeout_s=3" in out, out[-3000:]
