"""VCPO's step scale (trainer.ess_step_scale, moe_rl/trainer/ess_scale.py, issue 53) in real RL steps."""

import math

import pytest
import torch

from moe_rl.trainer.distributed import Dist
from moe_rl.trainer.ess_scale import ess_factor, scaled_lr
from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, compose_config


def test_ess_factor_is_vcpos_formula():
    """min(1, ESS/n)^(1/2) (sqrt) and min(1, ESS/n) (linear) of the sequence weights π_old/μ, empty rows
    not counted; 1 when old == sampler."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 5, generator=g) < 0.7
    mask[0] = False
    old = -torch.rand(6, 5, generator=g, dtype=torch.float64)
    mu = old + 0.5 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    w = [math.exp(sum(old[i, t].item() - mu[i, t].item() for t in range(5) if mask[i, t]))
         for i in range(6) if mask[i].any()]
    ratio = sum(w) ** 2 / sum(x * x for x in w) / len(w)
    assert ess_factor(old, mu, mask, "linear", Dist()) == pytest.approx(ratio, rel=1e-12)
    assert ess_factor(old, mu, mask, "sqrt", Dist()) == pytest.approx(math.sqrt(ratio), rel=1e-12)
    assert ess_factor(old, old, mask, "sqrt", Dist()) == 1.0


def test_scaled_lr_restores_every_group_exactly():
    """Inside the block every param group's lr is times the factor; after it, bitwise what it was."""
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [q], "lr": 3e-4}], lr=1e-3)
    with scaled_lr(opt, 0.37):
        assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.37, 3e-4 * 0.37]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 3e-4]


def test_ess_scaling_scales_the_step_and_leaves_the_schedule(warm_overrides):
    """With a sampler that routes unlike the trainer (router-logit noise on the trainer's forwards only, so
    w = π_old/μ is far from 1) and one mini-batch, AdamW's first step under ess_step_scale=linear moves every
    parameter by exactly the logged factor times the unscaled run's step, and the scheduler's lr and the
    optimizer's group lrs after the step equal the unscaled run's."""
    base = [*TINY, *warm_overrides, "objective=grpo", "trainer.mini_batches=1", "trainer.warmup_steps=0",
            "routing.logit_noise=1.0", "routing.noise_scope=trainer", "routing.noise_growth=constant",
            "trainer.grad_clip=null"]
    deltas, lrs, factor, before = [], [], None, []
    for rule in ("off", "linear"):
        ctx, _ = build_context(compose_config([*base, f"trainer.ess_step_scale={rule}"]))
        before = [p.detach().clone() for p in ctx.model.parameters()]  # the same initial weights in both runs
        metrics = rl_step(ctx, 0)
        deltas.append([p.detach() - b for p, b in zip(ctx.model.parameters(), before, strict=True)])
        lrs.append((ctx.scheduler.get_last_lr(), [g["lr"] for g in ctx.optimizer.param_groups]))
        factor = metrics.get("train/ess_lr_factor", factor)
    assert 0 < factor < 0.99, factor  # 1 - factor (1.7% here) of an Adam step (~lr) is far above 2 ulps
    assert lrs[0] == lrs[1]
    moved = [(off, on, w) for off, on, w in zip(*deltas, before, strict=True) if off.abs().max() > 0]
    assert moved
    for off, on, w in moved:  # to two float32 ulps of the weights the deltas were taken from
        ulp = torch.finfo(torch.float32).eps * w.abs().clamp(min=1e-3)
        assert ((on - factor * off).abs() <= 2 * ulp + 1e-4 * (factor * off).abs()).all()
