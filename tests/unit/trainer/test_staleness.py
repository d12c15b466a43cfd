"""rollout.staleness: the start-up refusals, the two stale samplers' schedules, their checkpoint encoding,
the staleness metrics against a float64 reference, and a sampler copy that reports to no other controller."""

import io
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from moe_rl.errors import RunError
from moe_rl.routing import RoutingTrace
from moe_rl.startup import check_launch
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.run import build_context
from moe_rl.trainer.samplers import Scores, Shard, Stateless
from moe_rl.trainer.stale import OverlapSampler, StaleSampler, decode, encode
from moe_rl.trainer.step_metrics import staleness_metrics
from tests.integration.test_train_loop import TINY, compose_config

BASE = [*TINY, "warmstart.enabled=false", "trainer.steps=6"]


@pytest.mark.parametrize(
    ("overrides", "field_"),
    [
        (["rollout.staleness=-1"], "rollout.staleness=-1"),
        (["rollout.staleness=6"], "rollout.staleness=6 must be below trainer.steps=6"),
        (["rollout.overlap=true"], "rollout.overlap=true"),
        (["rollout.staleness=1", "rollout.sampler_threads=-2"], "rollout.sampler_threads"),
        (["rollout.staleness=1", "trainer.reuse_sampler_logp=true"], "trainer.reuse_sampler_logp=false"),
        (["rollout.staleness=1", "rollout.overlap=true", "trainer.reuse_sampler_logp=true"], "trainer.reuse_sampler_logp"),
        (["rollout.staleness=1", "rollout.overlap=true", "sampler.engine=vllm"], "rollout.overlap=false"),
    ],
)
def test_bad_staleness_configs_fail_at_start_up_naming_the_field(overrides, field_):
    """k < 0, k >= trainer.steps, overlap without k, negative threads, reuse_sampler_logp and vLLM overlap:
    a ValueError whose one line names the field to change."""
    with pytest.raises(ValueError, match=field_.replace(".", r"\.")) as err:
        compose_config([*BASE, *overrides])
    assert "\n" not in str(err.value)


def test_overlap_under_torchrun_is_refused_in_one_line():
    """An overlapped sampler runs in one process: with 2 ranks check_launch names rollout.overlap."""
    cfg = compose_config([*BASE, "rollout.staleness=1", "rollout.overlap=true"])
    check_launch(cfg, 1)
    with pytest.raises(ValueError, match=r"rollout\.overlap=false"):
        check_launch(cfg, 2)


@dataclass
class _Versioned:
    """Holds one tensor, its weights' version."""

    v: torch.Tensor = field(default_factory=lambda: torch.tensor(0))

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, state):
        self.v = state["v"].clone()


@dataclass
class _Counting(Stateless):
    """A sampler whose rollout of step s records (s, the version of the weights it sampled with)."""

    model: _Versioned = field(default_factory=_Versioned)
    calls: list = field(default_factory=list)
    fail_at: int | None = None

    def rollout(self, task, step, shard):
        if step == self.fail_at:
            raise ValueError("reward server unreachable")
        self.calls.append((step, int(self.model.v)))
        return _rollout(step), Scores(torch.zeros(2), torch.zeros(2, dtype=torch.float64))

    def sync(self, model):
        self.model.load_state_dict(model.state_dict())
        return 0.0


def _rollout(step: int):
    from moe_rl.rollout import Rollout

    ids = torch.full((2, 3), step)
    return Rollout(ids, torch.ones(2, 3), ids, torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3),
                   torch.zeros(2, 3), None, [str(step)] * 2)


def test_stale_sampler_hands_step_t_the_rollout_of_version_t_minus_k():
    """With k = 2, step t trains on the rollout sampled at the start of step max(0, t - k), by those weights;
    each step samples one new rollout (the first step k + 1) and at most k + 1 wait at any time."""
    inner, trainer = _Counting(), _Versioned()
    stale = StaleSampler(inner, 2)
    for t in range(6):
        roll, _ = stale.rollout(None, t, Shard())
        assert roll.version == max(0, t - 2) and roll.texts == [str(t)] * 2
        assert len(stale.pending) == 2
        trainer.v = torch.tensor(t + 1)  # the step's updates
        stale.sync(trainer)
    assert inner.calls == [(0, 0), (1, 0), (2, 0)] + [(t + 2, t) for t in range(1, 6)]


def test_stale_sampler_checkpoint_round_trips_through_weights_only_loading():
    """The waiting rollouts survive torch.save / torch.load(weights_only=True) and come back equal."""
    stale = StaleSampler(_Counting(), 2)
    stale.rollout(None, 0, Shard())
    buffer = io.BytesIO()
    torch.save(stale.state_dict(), buffer)
    again = StaleSampler(_Counting(), 2)
    again.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert sorted(again.pending) == [1, 2]
    for s, (roll, scores) in again.pending.items():
        assert torch.equal(scores.rewards_B, stale.pending[s][1].rewards_B)
        want, _ = stale.pending[s]
        assert torch.equal(roll.input_ids_BS, want.input_ids_BS) and roll.version == 0 and roll.texts == want.texts


def test_encode_keeps_a_real_rollout_with_routing_and_logits():
    """A rollout sampled by the tiny model (routing with logits) decodes to equal tensors and fields."""
    from moe_rl.rollout import sample

    ctx, _ = build_context(compose_config(BASE))
    roll = sample(ctx.model, ctx.tokenizer, ["1+2=", "3-1="], ctx.cfg.sampler, generator=torch.Generator().manual_seed(0),
                  controller=ctx.controller, record_logits=True)
    buffer = io.BytesIO()
    torch.save(encode(roll), buffer)
    back = decode(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert back.texts == roll.texts and torch.equal(back.logp_BR, roll.logp_BR)
    assert torch.equal(back.routing.expert_ids_BTLK, roll.routing.expert_ids_BTLK)
    assert torch.equal(back.routing.router_logits_BTLE, roll.routing.router_logits_BTLE)
    assert torch.equal(back.routing.token_digest_B, roll.routing.token_digest_B)


def test_overlap_sampler_bounds_staleness_and_loads_the_pushed_weights():
    """The background sampler samples step s only once version s - k is pushed, with the newest weights it
    has: 0 <= t - version <= k, and the version it reports is the one it loaded."""
    inner, trainer = _Counting(), _Versioned()
    sampler = OverlapSampler(inner, 2, steps=8, threads=1)
    try:
        for t in range(8):
            roll, _ = sampler.rollout(None, t, Shard())
            assert 0 <= t - roll.version <= 2 and roll.texts == [str(t)] * 2
            trainer.v = torch.tensor(t + 1)
            sampler.sync(trainer)
    finally:
        sampler.close()
    assert [s for s, _ in inner.calls] == list(range(8))
    assert all(0 <= s - v <= 2 for s, v in inner.calls)


def test_overlap_sampler_failure_reaches_the_trainer_in_one_line():
    """A rollout that raises on the background thread raises at the trainer's next rollout, naming it."""
    sampler = OverlapSampler(_Counting(fail_at=1), 1, steps=4, threads=1)
    try:
        sampler.rollout(None, 0, Shard())
        sampler.sync(_Versioned())
        with pytest.raises(RunError, match="background sampler .* failed at step 1: reward server unreachable"):
            sampler.rollout(None, 1, Shard())
    finally:
        sampler.close()
    assert not any(t.name == "moe-rl-sampler" and t.is_alive() for t in threading.enumerate())


def _trace(ids, logits=None):
    return RoutingTrace(torch.tensor(ids, dtype=torch.int8), 4, logits)


def test_staleness_metrics_match_a_float64_reference():
    """vs_sampler is 1 - |A∩B|/K per layer over response positions, pooled; the logit shift is Σ of centred
    squared differences there; staleness is the given one."""
    g = torch.Generator().manual_seed(0)
    B, S1, L, K, E, R = 2, 5, 2, 2, 4, 3
    a = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S1 * L)]).view(B, S1, L, K)
    b = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S1 * L)]).view(B, S1, L, K)
    la, lb = torch.randn(B, S1, L, E, generator=g), torch.randn(B, S1, L, E, generator=g)
    mask_BR = torch.tensor([[True, True, False], [True, True, True]])
    resp = torch.cat([torch.zeros(B, S1 - R, dtype=torch.bool), mask_BR], 1)
    batch = Batch(torch.zeros(B, S1 + 1), torch.ones(B, S1 + 1), mask_BR, torch.ones(B, S1, dtype=torch.bool),
                  torch.zeros(B), torch.zeros(B, R), RoutingTrace(a.to(torch.int8), E, la))
    stats, shift = staleness_metrics(batch, RoutingTrace(b.to(torch.int8), E, lb), resp, 3)
    change = torch.zeros(L, dtype=torch.float64)
    for layer in range(L):
        pos = [(i, s) for i in range(B) for s in range(S1) if resp[i, s]]
        change[layer] = sum(1 - len(set(a[i, s, layer].tolist()) & set(b[i, s, layer].tolist())) / K for i, s in pos) / len(pos)
    from moe_rl import reduction as S

    got = S.values(stats)
    assert got["staleness/mean"] == 3.0 and got["staleness/max"] == 3.0
    torch.testing.assert_close(got["routing/expert_change/vs_sampler"], float(change.mean()))
    for layer in range(L):
        torch.testing.assert_close(got[f"routing/expert_change/vs_sampler/layer_{layer}"], float(change[layer]))
    d = lb.double()[resp] - la.double()[resp]
    torch.testing.assert_close(shift[0], float(((d - d.mean(-1, keepdim=True)) ** 2).sum()))
    assert shift[1] == d.numel()


def test_detached_copy_reports_to_no_other_controller():
    """A forward of the detached copy leaves the original controller's open recording empty, while a forward
    of a plain deepcopy (which copies hooks) writes into it: the copy a background sampler uses."""
    import copy

    ctx, _ = build_context(compose_config(BASE))
    ids = ctx.tokenizer("1+2=", return_tensors="pt").input_ids
    for make, reports in ((ctx.controller.detached_copy, False), (copy.deepcopy, True)):
        other = make(ctx.model)
        with torch.no_grad(), ctx.controller.record() as rec:
            other(ids)
        assert bool(rec._ids[0]) is reports, make


@dataclass
class _Slow(_Counting):
    """A _Counting sampler that takes 50 ms per rollout."""

    def rollout(self, task, step, shard):
        time.sleep(0.05)
        return super().rollout(task, step, shard)


def test_a_stale_rollout_carries_its_own_sampling_seconds():
    """Both wrappers time the inner sampler's call and put it on the rollout (Rollout.sample_s), which the
    sampler throughput divides by: the trainer's rollout call samples another step (deterministic) or only
    waits (overlapped: here the rollout was ready, so the wait is far shorter than the sampling)."""
    stale = StaleSampler(_Slow(), 1)
    for t in range(3):
        roll, _ = stale.rollout(None, t, Shard())
        assert 0.05 <= roll.sample_s < 1.0
    sampler = OverlapSampler(_Slow(), 1, steps=3, threads=1)
    try:
        sampler.rollout(None, 0, Shard())
        sampler.sync(_Versioned(torch.tensor(1)))
        time.sleep(0.3)  # step 1's rollout is sampled meanwhile
        started = time.perf_counter()
        roll, _ = sampler.rollout(None, 1, Shard())
        waited = time.perf_counter() - started
    finally:
        sampler.close()
    assert 0.05 <= roll.sample_s < 1.0 and waited < 0.03
