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


class _ExpertsWitness:
    """Every whole-model forward's inputs and, per MoE layer, the expert ids its experts module received
    (its `top_k_index` argument): what reaches the experts, whoever chose it, and not a trace the code writes."""

    def __init__(self, model):
        self.calls, self.handles = [], []
        experts = [m.mlp.experts for m in model.model.layers]

        def on_model(module, args, kwargs):
            self.calls.append({"kwargs": dict(kwargs), "grad": torch.is_grad_enabled(), "ids": []})

        def on_experts(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self.calls[-1]["ids"].append(ids.detach().clone())

        self.handles.append(model.register_forward_pre_hook(on_model, with_kwargs=True))
        self.handles += [e.register_forward_pre_hook(on_experts, with_kwargs=True) for e in experts]

    def remove(self):
        for h in self.handles:
            h.remove()


def _free_ids(model, kwargs) -> torch.Tensor:
    """[B, T, L, K] expert ids a free forward of `model` on `kwargs` sends to its experts (sorted over K)."""
    witness = _ExpertsWitness(model)
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        witness.remove()
    return _layout(witness.calls[-1], kwargs)


def _layout(call, kwargs) -> torch.Tensor:
    B, T = kwargs["input_ids"].shape
    return torch.stack([ids.reshape(B, T, -1) for ids in call["ids"]], dim=2).sort(-1).values


@pytest.mark.parametrize("replay", ["rollout", "old"])
def test_under_staleness_r3_forwards_use_the_stale_samplers_experts_and_r2_the_proximal_ones(replay, warm_overrides):
    """At step 2 of a k = 2 run the rollout was sampled by the weights of step 0. A witness on every MoE
    layer's experts module records the ids that reach the experts in the trainer's forwards; each is compared,
    on every position that predicts a response token, with the ids a free forward on the same inputs sends to
    the experts under the step-0 weights (the stale sampler's) and under the step-2 weights (the proximal
    policy's). R3 (replay=rollout): the old-policy and update forwards use exactly the stale sampler's experts.
    R2 (replay=old): the old-policy forward routes freely (the proximal policy's experts) and the update
    forwards replay those. The two references differ on some positions, so each check can fail."""
    ctx, _ = build_context(compose_config(_base(warm_overrides, "rollout.staleness=2", "trainer.steps=3",
                                                f"routing.replay={replay}")))
    recording = _Recording(ctx.sampler)
    ctx.sampler = recording
    stale = ctx.controller.detached_copy(ctx.model).eval()  # the step-0 weights, without the controller's hooks
    rl_step(ctx, 0)
    rl_step(ctx, 1)
    proximal = ctx.controller.detached_copy(ctx.model).eval()
    witness = _ExpertsWitness(ctx.model)
    try:
        rl_step(ctx, 2)
    finally:
        witness.remove()
    roll = recording.rollouts[2]
    assert roll.version == 0
    P, R = roll.prompt_ids_BP.shape[1], roll.response_ids_BR.shape[1]
    rows_BS1 = roll.input_ids_BS[:, :-1]
    trainer = [c for c in witness.calls if c["kwargs"]["input_ids"].shape[1] == P + R - 1]
    old = [c for c in trainer if not c["grad"]]
    updates = [c for c in trainer if c["grad"]]
    assert len(old) >= 1 and len(updates) == ctx.cfg.trainer.mini_batches
    differ = 0
    for call in old + updates:
        kwargs = call["kwargs"]
        got = _layout(call, kwargs)
        want_stale, want_prox = _free_ids(stale, kwargs), _free_ids(proximal, kwargs)
        for b, ids_S in enumerate(kwargs["input_ids"]):
            row = next(i for i in range(len(rows_BS1)) if torch.equal(rows_BS1[i], ids_S))
            at = (P - 1 + torch.nonzero(roll.response_mask_BR[row]).flatten())
            want = want_stale if replay == "rollout" else want_prox
            assert torch.equal(got[b, at], want[b, at]), (replay, "update" if call["grad"] else "old", b)
            differ += int((want_stale[b, at] != want_prox[b, at]).any())
    assert differ > 0, "the stale sampler's experts should differ from the proximal policy's somewhere"
