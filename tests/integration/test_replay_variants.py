"""The two replay variants the field uses: replaying the gates with the experts (routing.replay_gates) and
the routers in float32 under a low-precision model (model.router_dtype)."""

import pytest
import torch

from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, compose_config


def _routers(ctx):
    return [p.detach().clone() for r in ctx.controller.routers for p in r.parameters()]


@pytest.mark.parametrize("preset", ["grpo_rr", "grpo_r3"])
def test_replayed_gates_leave_the_routers_to_the_aux_loss(preset, warm_overrides):
    """With routing.replay_gates the update forwards combine the replayed experts with recorded gates, so
    without a load-balancing loss an RL step leaves every router weight bitwise unchanged while the rest of
    the model trains; with live gates the routers move."""
    base = [*TINY, *warm_overrides, f"objective={preset}", "trainer.lr=1e-2", "trainer.warmup_steps=0",
            "model.router_aux_loss_coef=0", "trainer.sampler_dtype=bfloat16"]
    for gates in (True, False):
        ctx, _ = build_context(compose_config([*base, f"routing.replay_gates={str(gates).lower()}"]))
        before, other = _routers(ctx), ctx.model.get_input_embeddings().weight.detach().clone()
        metrics = rl_step(ctx, 0)
        same = all(torch.equal(a, b) for a, b in zip(before, _routers(ctx), strict=True))
        assert same is gates, gates
        assert not torch.equal(other, ctx.model.get_input_embeddings().weight), "the rest of the model trains"
        assert metrics["ratio/token/max"] >= 1.0


def test_frozen_router_with_replayed_gates_is_total_router_recall(warm_overrides):
    """routing.freeze_router under replay_gates: even with a load-balancing loss, which alone trains the
    routers under replayed gates, an RL step leaves every router weight bitwise unchanged (prime-rl's total
    router recall); without freezing, the aux loss moves them."""
    base = [*TINY, *warm_overrides, "objective=grpo_r3", "trainer.lr=1e-2", "trainer.warmup_steps=0",
            "model.router_aux_loss_coef=0.01", "routing.replay_gates=true"]
    for frozen in (True, False):
        ctx, _ = build_context(compose_config([*base, f"routing.freeze_router={str(frozen).lower()}"]))
        before = _routers(ctx)
        rl_step(ctx, 0)
        assert all(torch.equal(a, b) for a, b in zip(before, _routers(ctx), strict=True)) is frozen, frozen


def test_partial_replay_logs_its_replace_rate_per_layer(warm_overrides):
    """routing.replay_score_ratio under R2 logs routing/replay_replace_rate, pooled (the mean of equal-sized
    layers) and per layer; a ratio of 1 under a fast-moving router replaces some slots, not all."""
    ctx, _ = build_context(compose_config([*TINY, *warm_overrides, "objective=grpo_rr", "trainer.lr=3e-2",
                                           "trainer.warmup_steps=0", "routing.replay_score_ratio=1.0"]))
    metrics = {}
    for step in range(2):
        metrics = rl_step(ctx, step)
    layers = [k for k in metrics if k.startswith("routing/replay_replace_rate/layer_")]
    assert len(layers) == ctx.controller.num_layers
    assert 0 < metrics["routing/replay_replace_rate"] < 1
    assert metrics["routing/replay_replace_rate"] == pytest.approx(sum(metrics[k] for k in layers) / len(layers))


@pytest.mark.parametrize(
    ("overrides", "field_"),
    [
        (["routing.replay_gates=true"], "routing.replay=old or rollout"),
        (["routing.replay_gates=true", "objective=grpo_r3", "sampler.engine=vllm"], "routing.replay_gates=false"),
        (["objective=grpo_rr", "routing.replay_score_ratio=1.5"], "routing.replay_score_ratio"),
        (["objective=grpo", "routing.replay_score_ratio=0.5"], "routing.replay_score_ratio"),
        (["objective=grpo_rr", "routing.replay_score_ratio=0.5", "routing.replay_gates=true"],
         "routing.replay_score_ratio"),
        (["objective=grpo_rr", "routing.freeze_router=true"], "routing.freeze_router"),
        (["trainer.ess_step_scale=cubic"], "trainer.ess_step_scale"),
        (["objective=dppo_topk_tv", "sampler.keep_sampling_mask=true", "sampler.logprobs=processed",
          "sampler.top_p=0.9"], "sampler.keep_sampling_mask"),
    ],
)
def test_replay_gates_refusals_name_the_field(overrides, field_):
    """Gates without replay, a gates replay of vLLM's routes (ids only), partial replay out of [0, 1], without
    replay or with replayed gates, a frozen router without replayed gates, an unknown ESS rule and top-k
    divergences over a renormalised support fail at start-up in one line naming the field."""
    with pytest.raises(ValueError, match=field_):
        compose_config([*TINY, *overrides])


def test_float32_routers_compute_on_float32_inputs_under_a_bfloat16_model():
    """A witness on each router's input and output: with model.router_dtype=float32 the router of a bf16
    policy receives the bf16 hidden states cast to float32 (bf16-representable values, in float32) and its
    logits are exactly W_fp32 · h in float32; the model's hidden states stay bf16 and the router weight's
    gradient is float32. Registering twice keeps one cast."""
    from torch.nn import functional as F

    from moe_rl.routing import float32_routers, routers_of

    ctx, _ = build_context(compose_config([*TINY, "warmstart.enabled=false", "model.dtype=bfloat16",
                                           "model.router_dtype=float32"]))
    float32_routers(ctx.model)  # idempotent: build_context did it already
    seen = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append((args[0], out[0], m.weight)))
             for r in routers_of(ctx.model)]
    ids = ctx.tokenizer(["1+2=", "3+4="], return_tensors="pt").input_ids
    out = ctx.model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    assert len(seen) == ctx.controller.num_layers
    for h_NH, logits_NE, w_EH in seen:
        assert h_NH.dtype == logits_NE.dtype == w_EH.dtype == torch.float32
        assert torch.equal(h_NH.bfloat16().float(), h_NH)  # the bf16 hidden states, cast
        assert torch.equal(logits_NE, F.linear(h_NH.reshape(-1, h_NH.shape[-1]), w_EH))
    assert out.hidden_states[-1].dtype == torch.bfloat16
    assert ctx.model.get_input_embeddings().weight.dtype == torch.bfloat16
    out.logits.float().sum().backward()
    assert all(r.weight.grad.dtype == torch.float32 for r in routers_of(ctx.model))
    assert all(len(r._forward_pre_hooks) == 1 for r in routers_of(ctx.model))


@pytest.mark.parametrize("preset", ["grpo", "grpo_r3"])
def test_float32_routers_in_the_bf16_sampler_copy_train(preset, warm_overrides):
    """Under an fp32 trainer with a bf16 sampler copy (the replay_source setting), model.router_dtype puts the
    copy's routers in float32 (the trained model's are float32 anyway), and an RL step runs and logs the
    mismatch; R3 replays the copy's routing."""
    ctx, _ = build_context(compose_config([*TINY, *warm_overrides, f"objective={preset}",
                                           "trainer.sampler_dtype=bfloat16", "model.router_dtype=float32"]))
    copy_ = ctx.sampler.model
    assert copy_.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(r.weight.dtype == torch.float32 for r in ctx.controller.routers)
    from moe_rl.routing import routers_of

    assert all(r.weight.dtype == torch.float32 for r in routers_of(copy_))
    metrics = rl_step(ctx, 0)
    assert metrics["mismatch/logp_abs_diff/mean"] > 0


@pytest.mark.parametrize(
    ("overrides", "field_"),
    [
        (["model.router_dtype=float16"], "model.router_dtype='float16'"),
        (["model.router_dtype=float32"], "model.router_dtype=float32 has no effect"),
        (["model.router_dtype=float32", "model.dtype=bfloat16", "sampler.engine=vllm"], "sampler.engine=hf"),
        (["model.router_dtype=float32", "model.dtype=bfloat16", "trainer.parallel=fsdp"], "trainer.parallel=ddp"),
    ],
)
def test_router_dtype_refusals_name_the_field(overrides, field_):
    with pytest.raises(ValueError, match=field_.replace("(", r"\(")):
        compose_config([*TINY, *overrides])
