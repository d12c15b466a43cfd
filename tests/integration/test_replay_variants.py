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


@pytest.mark.parametrize(
    ("overrides", "field_"),
    [
        (["routing.replay_gates=true"], "routing.replay=old or rollout"),
        (["routing.replay_gates=true", "objective=grpo_r3", "sampler.engine=vllm"], "routing.replay_gates=false"),
    ],
)
def test_replay_gates_refusals_name_the_field(overrides, field_):
    """Gates without replay, and a gates replay of vLLM's routes (ids only), fail at start-up in one line."""
    with pytest.raises(ValueError, match=field_):
        compose_config([*TINY, *overrides])
