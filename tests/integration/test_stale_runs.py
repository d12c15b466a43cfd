"""Whole runs under rollout.staleness: which weights sampled what, resume, the overlapped sampler, and k = 0."""

import dataclasses

import pytest
import torch

from moe_rl.trainer.run import build_context, train
from moe_rl.trainer.samplers import PolicySampler
from moe_rl.trainer.stale import OverlapSampler, StaleSampler
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, comparable, compose_config, cut_and_uncut, read_metrics


def _base(warm: list[str], *extra: str) -> list[str]:
    return [*TINY, *warm, "objective=grpo", "trainer.lr=1e-2", "trainer.warmup_steps=0", "logger.wandb=false", *extra]


class _Recording:
    """Passes the sampler's calls through, keeping each step's rollout."""

    def __init__(self, sampler):
        self.sampler, self.rollouts = sampler, {}

    def rollout(self, task, step, shard):
        out = self.sampler.rollout(task, step, shard)
        self.rollouts[step] = out[0]
        return out

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_step_t_trains_on_what_the_weights_of_step_t_minus_k_sample(warm_overrides):
    """With k = 2, step t's rollout is bitwise what the sampler draws for step t with the weights of the start
    of step max(0, t - 2), its version, and not what this step's own weights draw."""
    ctx, _ = build_context(compose_config(_base(warm_overrides, "rollout.staleness=2", "trainer.steps=5")))
    assert isinstance(ctx.sampler, StaleSampler) and isinstance(ctx.sampler.inner, PolicySampler)
    inner, recording = ctx.sampler.inner, _Recording(ctx.sampler)
    ctx.sampler = recording
    weights = []
    for t in range(5):
        weights.append({k: v.clone() for k, v in ctx.model.state_dict().items()})
        metrics = rl_step(ctx, t)
        assert metrics["staleness/mean"] == metrics["staleness/max"] == min(t, 2)
        assert 0 <= metrics["routing/expert_change/vs_sampler"] <= 1
    assert (metrics["routing/expert_change/vs_sampler"] > 0) and metrics["mismatch/logp_abs_diff/mean"] > 1e-3
    differ = 0
    for t, roll in recording.rollouts.items():
        assert roll.version == max(0, t - 2)
        ctx.model.load_state_dict(weights[roll.version])
        again, _ = inner.rollout(ctx.task, t, ctx.shard)
        assert torch.equal(again.input_ids_BS, roll.input_ids_BS) and torch.equal(again.logp_BR, roll.logp_BR), t
        ctx.model.load_state_dict(weights[t])
        own, _ = inner.rollout(ctx.task, t, ctx.shard)
        differ += not torch.equal(own.logp_BR, roll.logp_BR)
    assert differ >= 2, "the stale rollouts should differ from what each step's own weights sample"


def test_deterministic_stale_run_resumes_bit_exactly(tmp_path, warm_overrides):
    """A k = 2 run stopped after 3 steps and resumed to 5 logs the same metrics as one never interrupted:
    the rollouts sampled ahead are in the checkpoint."""
    cfg = compose_config(_base(warm_overrides, "rollout.staleness=2", "trainer.steps=3", "trainer.checkpoint_every=1"))
    cut, uncut = cut_and_uncut(cfg, 5, tmp_path)
    assert [r["staleness/max"] for r in uncut] == [0, 1, 2, 2, 2]
    assert comparable(cut) == comparable(uncut)


def test_overlapped_run_bounds_staleness_and_logs_the_decoupled_objective(tmp_path, warm_overrides):
    """An overlapped k = 2 run trains every step on rollouts at most 2 versions old, logs the sampler's
    mismatch diagnostics (the behaviour-to-proximal weights) and stops its background thread at the end."""
    cfg = compose_config(_base(warm_overrides, "rollout.staleness=2", "rollout.overlap=true", "trainer.steps=5",
                               "objective=grpo_tis"))
    summary = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(5)) and summary["steps_done"] == 5
    assert all(0 <= r["staleness/max"] <= 2 for r in rows) and rows[-1]["staleness/max"] > 0
    assert all("rollout_is/ess" in r and "routing/margin/predicted_change_vs_sampler" in r for r in rows)
    assert rows[-1]["mismatch/logp_abs_diff/mean"] > 1e-3
    import threading

    assert not any(t.name == "moe-rl-sampler" and t.is_alive() for t in threading.enumerate())


def test_overlapped_sampler_is_a_copy_and_every_sampler_kind_wraps(warm_overrides):
    """Overlap samples with a detached fp32 copy (never the trained model itself); a bf16 sampler copy is
    wrapped as it is; staleness 0 leaves the sampler unwrapped, its metrics without staleness/*."""
    ctx, _ = build_context(compose_config(_base(warm_overrides, "rollout.staleness=1", "rollout.overlap=true")))
    assert isinstance(ctx.sampler, OverlapSampler) and ctx.sampler.inner.model is not ctx.model
    assert next(ctx.sampler.inner.model.parameters()).dtype == torch.float32
    ctx, _ = build_context(compose_config(_base(warm_overrides, "rollout.staleness=1", "trainer.sampler_dtype=bfloat16")))
    assert next(ctx.sampler.inner.model.parameters()).dtype == torch.bfloat16
    ctx, _ = build_context(compose_config(_base(warm_overrides)))
    assert isinstance(ctx.sampler, PolicySampler)
    assert not any(k.startswith("staleness/") for k in rl_step(ctx, 0))


@pytest.mark.parametrize("replay", ["old", "rollout"])
def test_replay_under_staleness(replay, warm_overrides):
    """R2 and R3 run on stale rollouts; the stale sampler's routing differs from the proximal policy's free
    choice there (what R3 replays away), and the log-prob mismatch the rollout corrections see is > 0."""
    ctx, _ = build_context(compose_config(_base(warm_overrides, "rollout.staleness=1", "trainer.steps=3",
                                                f"routing.replay={replay}")))
    rows = [rl_step(ctx, t) for t in range(3)]
    assert rows[-1]["staleness/max"] == 1
    assert rows[-1]["routing/expert_change/vs_sampler"] > 0 and rows[-1]["routing/rollout_vs_old/frac"] > 0
    assert rows[-1]["mismatch/logp_abs_diff/mean"] > 1e-4


def test_staleness_changes_which_config_resumes(tmp_path, warm_overrides):
    """rollout.staleness changes the numbers, so a resume with another k is refused; sampler_threads is free."""
    from moe_rl.errors import RunError

    cfg = compose_config(_base(warm_overrides, "rollout.staleness=1", "trainer.steps=2", "trainer.checkpoint_every=1"))
    train(cfg, tmp_path / "run")
    more = dataclasses.replace(cfg, resume=True, trainer=dataclasses.replace(cfg.trainer, steps=3))
    other = dataclasses.replace(more, rollout=dataclasses.replace(cfg.rollout, staleness=2))
    with pytest.raises((RunError, ValueError), match="rollout.staleness"):
        train(other, tmp_path / "run")
    threads = dataclasses.replace(more, rollout=dataclasses.replace(cfg.rollout, sampler_threads=1))
    assert train(threads, tmp_path / "run")["steps_done"] == 3
