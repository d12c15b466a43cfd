"""trainer.router_lr_scale: the routers' own AdamW parameter group at lr x scale."""

from dataclasses import replace

import pytest
import torch

from moe_rl.trainer.checkpoint import read_checkpoint
from moe_rl.trainer.precision import MasterAdamW, router_param_groups
from moe_rl.trainer.run import build_context, train
from tests.integration.test_train_loop import TINY, compose_config, read_metrics, step_parts, update_once

ONE_STEP = ["warmstart.enabled=false", "objective=grpo", "trainer.mini_batches=1", "trainer.lr=1e-3", *TINY]


def _router_ids(ctx) -> set[int]:
    return {id(p) for r in ctx.controller.routers for p in r.parameters()}


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_router_lr_scale_must_be_positive_and_finite(bad):
    """A scale of 0, below 0 or not finite fails at start-up with a ValueError naming the field."""
    with pytest.raises(ValueError, match=r"trainer\.router_lr_scale"):
        compose_config([*TINY, f"trainer.router_lr_scale={bad}"])


def test_scale_one_is_the_single_group_optimizer_of_before_the_option():
    """At scale 1 the optimizer has one parameter group holding model.parameters() in order, as it was built
    before the option existed; at scale 3 the routers' parameters form a second group at 3x the lr."""
    ctx, _ = build_context(compose_config(ONE_STEP))
    (group,) = ctx.optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in ctx.model.parameters()]
    groups = router_param_groups(ctx.model, ctx.controller.routers, 1e-3, 3.0)
    rest, own = groups
    assert {id(p) for p in own["params"]} == _router_ids(ctx) and own["lr"] == pytest.approx(3e-3)
    assert len(rest["params"]) + len(own["params"]) == len(list(ctx.model.parameters()))
    assert "lr" not in rest and len(own["params"]) == len(ctx.controller.routers)


def test_run_with_scale_one_is_bitwise_the_run_without_the_option(tmp_path, warm_overrides):
    """Same seed, trainer.router_lr_scale=1 given or left at its default: identical metrics and final
    parameters, in a run that learns (nonzero gradients) from a warm start."""
    base = compose_config([*TINY, *warm_overrides, "objective=grpo", "logger.wandb=false"])
    train(base, tmp_path / "absent")
    train(replace(base, trainer=replace(base.trainer, router_lr_scale=1.0)), tmp_path / "one")
    strip = [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
             for r in read_metrics(tmp_path / "absent")]  # fmt: skip
    assert all(r["train/grad_norm"] > 0 for r in strip)
    assert strip == [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                     for r in read_metrics(tmp_path / "one")]  # fmt: skip
    a = read_checkpoint(tmp_path / "absent" / "checkpoint.pt")
    b = read_checkpoint(tmp_path / "one" / "checkpoint.pt")
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert len(a["optimizer"]["param_groups"]) == len(b["optimizer"]["param_groups"]) == 1


def _one_update(scale: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]:
    # Random advantages on a fixed rollout: a random policy scores 0 everywhere, which moves nothing.
    ctx, batch, plan, old = step_parts("off", 1e-3, (f"trainer.router_lr_scale={scale}",))
    before = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    update_once(ctx, batch, plan, old, 0)
    after = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    ids = _router_ids(ctx)
    routers = {n for n, p in ctx.model.named_parameters() if id(p) in ids}
    return before, after, routers


def test_scale_ten_moves_the_routers_ten_times_as_far_in_one_adam_step_and_nothing_else_differs():
    """One on-policy Adam step from the same weights and rollout: router weights move 10x as far at scale 10
    (Adam's first step is lr x m/(sqrt(v)+eps), so to eps), every other parameter moves bitwise the same."""
    before1, after1, routers = _one_update(1.0)
    before10, after10, routers10 = _one_update(10.0)
    assert routers == routers10 and routers
    for name in before1:
        assert torch.equal(before1[name], before10[name])
        d1, d10 = after1[name] - before1[name], after10[name] - before10[name]
        if name in routers:
            assert d1.abs().sum() > 0
            torch.testing.assert_close(d10, 10 * d1, rtol=1e-3, atol=1e-7)
        else:
            assert torch.equal(d1, d10), name


def test_master_adamw_keeps_groups_and_the_order_of_its_masters():
    """MasterAdamW over two groups of bf16 parameters: masters follow model_params' order, and the second
    group's first step is 10x the first's for the same gradient."""
    a = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([{"params": [a]}, {"params": [b], "lr": 1e-2}], lr=1e-3)
    assert opt.model_params == [a, b] and [m.dtype for m in opt.master_params] == [torch.float32] * 2
    a.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    b.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    opt.step()
    da, db = 1 - opt.master_params[0], 1 - opt.master_params[1]
    torch.testing.assert_close(db, 10 * da, rtol=1e-5, atol=0)
